"""Decoder-only transformers as pure functions of a params pytree."""

from async_rl.models.config import ModelConfig, PRESETS, preset
from async_rl.models.transformer import (cache_len, decode, forward, hidden, init_cache,
                                         init_params, prefill, split_layers, unembed)
