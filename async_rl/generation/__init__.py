"""Generation: a JetStream-API engine over the KV cache and a generator pool."""

from async_rl.generation.decode_state import ChunkTokens, DecodeState, Prefix, ResultTokens
from async_rl.generation.engine import Engine, prefill_buckets
from async_rl.generation.pool import UPDATE_MODES, GeneratorPool
from async_rl.generation.request import FINISH_REASONS, Request
from async_rl.generation.sampling import SamplingParams, SlotSampling, sample
