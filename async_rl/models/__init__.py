"""Decoder-only transformers as pure functions of a params pytree.

Every function takes the model's shape and numerics as `cfg`, a `config.ModelConfig`.
"""

from async_rl.models.transformer import (abstract_params, decode, decode_layers, forward,
                                         hidden, init_cache, init_params, prefill,
                                         split_layers, unembed)
