"""Token sampling with per-slot temperature, top-k, top-p and greedy decoding.

Every slot of the decode batch carries its own sampling parameters as arrays, so one
compiled decode step serves requests with different settings.

Randomness: the key for the token at sequence position p of sample i of a request
with seed s is `fold_in(fold_in(key(s), i), p)`. It depends on nothing else (not the
slot, not the other requests in the batch, not how many times the sequence was
re-prefilled), so a fixed seed reproduces the same samples under any batching.

Log-probs: the recorded behaviour log-prob of a token is `policy.token_logp` of the
logits that sampled it, i.e. the log-prob under softmax(logits / temperature) over
the *full* vocabulary. With top-k / top-p the token is drawn from the truncated
distribution, but the recorded log-prob is still the full-softmax one (as AReaL
does), so the trainer's recomputation of the same quantity agrees to float rounding.
Greedy decoding (temperature 0) records the log-prob at temperature 1.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from async_rl.policy import token_logp

_SEED_LIMIT = 2 ** 32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample one request; validated on construction.

  Attributes:
    temperature: softmax temperature; 0 means greedy (argmax).
    top_k: keep only the k most likely tokens; 0 disables.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p
      (applied after top-k); 1 disables.
    max_new_tokens: generation stops with reason "length" after this many tokens.
    stop_token_ids: generation stops with reason "stop" after emitting any of these
      (the stop token is part of the completion).
    seed: PRNG seed in [0, 2**32); None lets the pool draw one.
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 256
  stop_token_ids: Sequence[int] = ()
  seed: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    if not np.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"sampling.temperature must be finite and >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0 (0 disables), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 1:
      raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.seed is not None and not 0 <= self.seed < _SEED_LIMIT:
      raise ValueError(f"sampling.seed must be in [0, 2**32), got {self.seed}")


@struct.dataclass
class SlotSampling:
  """Sampling parameters of one slot (scalars) or of all slots (leading S axis).

  `seed` and `index` (the sample's index within its request) define the sample's
  random stream; see the module docstring.
  """
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  index: jax.Array

  @classmethod
  def create(cls, params: SamplingParams, seed: int, index: int) -> "SlotSampling":
    return cls(temperature=np.float32(params.temperature), top_k=np.int32(params.top_k),
               top_p=np.float32(params.top_p), seed=np.uint32(seed), index=np.uint32(index))

  @classmethod
  def zeros(cls, num_slots: int) -> "SlotSampling":
    return cls(temperature=np.zeros(num_slots, np.float32), top_k=np.zeros(num_slots, np.int32),
               top_p=np.ones(num_slots, np.float32), seed=np.zeros(num_slots, np.uint32),
               index=np.zeros(num_slots, np.uint32))


def _truncate(scaled_V, top_k, top_p):
  """Masks `scaled_V` to its top-k, then to the top-p nucleus of what remains."""
  V = scaled_V.shape[-1]
  sorted_V = jnp.sort(scaled_V)[::-1]
  rank_V = jnp.arange(V)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  in_k_V = rank_V < k
  probs_V = jax.nn.softmax(jnp.where(in_k_V, sorted_V, -jnp.inf))
  # A token is in the nucleus if the mass strictly before it is below top_p, so the
  # most likely token is always kept and the kept set is a prefix of the ranking.
  keep_V = in_k_V & (jnp.cumsum(probs_V) - probs_V < top_p)
  threshold = sorted_V[jnp.sum(keep_V) - 1]
  return jnp.where(scaled_V >= threshold, scaled_V, -jnp.inf)


def _sample_row(logits_V, sampling, position):
  greedy = sampling.temperature == 0
  temperature = jnp.where(greedy, 1.0, sampling.temperature)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(sampling.seed), sampling.index),
                           position)
  masked_V = _truncate(logits_V.astype(jnp.float32) / temperature, sampling.top_k,
                       sampling.top_p)
  token = jnp.where(greedy, jnp.argmax(logits_V), jax.random.categorical(key, masked_V))
  return token.astype(jnp.int32), temperature


def sample(logits_SV, sampling_S: SlotSampling, positions_S):
  """Draws one token per slot; returns (tokens_S int32, logp_S float32).

  `positions_S` are the sequence positions the drawn tokens will occupy (they key
  the random stream). The log-prob follows the module docstring's convention.
  """
  tokens_S, temperature_S = jax.vmap(_sample_row)(logits_SV, sampling_S, positions_S)
  return tokens_S, token_logp(logits_SV, tokens_S, temperature_S[:, None])
