"""Token sampling with per-slot temperature, top-k, top-p and greedy decoding.

Every slot of the decode batch carries its own sampling parameters as arrays, so one
compiled decode step serves requests with different settings; the stop ids and the
token budget travel with them, so a decode loop can end a sample on the device.

Randomness: the key for the token at sequence position p of sample i of a request
with seed s is `fold_in(fold_in(key(s), i), p)`. It depends on nothing else (not the
slot, not the other requests in the batch, not how many times the sequence was
re-prefilled), so a fixed seed reproduces the same samples under any batching.

Log-probs: the recorded behaviour log-prob of a token is `policy.token_logp` of the
logits that sampled it, i.e. the log-prob under softmax(logits / temperature)
renormalised over the top-k / top-p support it was drawn from (`policy.support`, the
one function the sampler and the trainer both truncate with). With
`SamplingParams.truncated_logp` False it is the log-prob under the full softmax
instead (for comparison); `SamplingParams.logp_truncation` names the truncation the
log-probs are taken under, which the trajectory records for the trainer. Greedy
decoding (temperature 0) records the log-prob at temperature 1.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from async_rl.generation import noise
from async_rl.policy import support, token_logp

_SEED_LIMIT = 2 ** 32
MAX_STOP_IDS = 32  # Stop ids live in a fixed-width per-slot array (padded with -1).


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
      (the stop token is part of the completion); at most `MAX_STOP_IDS`.
    seed: PRNG seed in [0, 2**32); None lets the pool draw one.
    truncated_logp: record the log-prob under the truncated distribution the token
      is drawn from; False: under the full softmax (for comparison).
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 256
  stop_token_ids: Sequence[int] = ()
  seed: int | None = None
  truncated_logp: bool = True

  def __post_init__(self):
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    if not np.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"sampling.temperature must be finite and >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0 (0 disables), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
    if len(self.stop_token_ids) > MAX_STOP_IDS:
      raise ValueError(f"sampling.stop_token_ids holds at most {MAX_STOP_IDS} ids, got "
                       f"{len(self.stop_token_ids)}")
    if self.max_new_tokens < 1:
      raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.seed is not None and not 0 <= self.seed < _SEED_LIMIT:
      raise ValueError(f"sampling.seed must be in [0, 2**32), got {self.seed}")

  @property
  def logp_truncation(self) -> tuple[int, float]:
    """(top_k, top_p) of the distribution the recorded log-probs are taken under."""
    return (self.top_k, self.top_p) if self.truncated_logp else (0, 1.0)


@struct.dataclass
class SlotSampling:
  """Sampling parameters of one slot (scalars) or of all slots (leading S axis).

  `seed` and `index` (the sample's index within its request) define the sample's
  random stream; see the module docstring. `stop_ids` ([MAX_STOP_IDS], then [S,
  MAX_STOP_IDS]) are the stop token ids padded with -1, which no token matches.
  `truncated_logp` is `SamplingParams.truncated_logp`.
  """
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  index: jax.Array
  max_new_tokens: jax.Array
  stop_ids: jax.Array
  truncated_logp: jax.Array

  @classmethod
  def create(cls, params: SamplingParams, seed: int, index: int) -> "SlotSampling":
    stop_ids = np.full(MAX_STOP_IDS, -1, np.int32)
    stop_ids[:len(params.stop_token_ids)] = params.stop_token_ids
    return cls(temperature=np.float32(params.temperature), top_k=np.int32(params.top_k),
               top_p=np.float32(params.top_p), seed=np.uint32(seed), index=np.uint32(index),
               max_new_tokens=np.int32(params.max_new_tokens), stop_ids=stop_ids,
               truncated_logp=np.bool_(params.truncated_logp))

  @classmethod
  def zeros(cls, num_slots: int) -> "SlotSampling":
    return cls(temperature=np.zeros(num_slots, np.float32), top_k=np.zeros(num_slots, np.int32),
               top_p=np.ones(num_slots, np.float32), seed=np.zeros(num_slots, np.uint32),
               index=np.zeros(num_slots, np.uint32),
               max_new_tokens=np.zeros(num_slots, np.int32),
               stop_ids=np.full((num_slots, MAX_STOP_IDS), -1, np.int32),
               truncated_logp=np.ones(num_slots, np.bool_))


def argmax(x_SV):
  """`jnp.argmax` over the last axis (the first index of the maximum), as a max and a
  min: XLA:CPU runs argmax's paired (value, index) reduction element by element, a
  large share of a decode step. A row holding NaN, which has no maximum to match,
  gives its last index."""
  V = x_SV.shape[-1]
  is_max_SV = x_SV == jnp.max(x_SV, axis=-1, keepdims=True)
  return jnp.min(jnp.where(is_max_SV, jnp.arange(V, dtype=jnp.int32), V - 1), axis=-1)


def sample(logits_SV, sampling_S: SlotSampling, positions_S):
  """Draws one token per slot; returns (tokens_S int32, logp_S float32).

  `positions_S` are the sequence positions the drawn tokens will occupy (they key
  the random stream). The log-prob follows the module docstring's convention.
  """
  greedy_S = sampling_S.temperature == 0
  temperature_S = jnp.where(greedy_S, 1.0, sampling_S.temperature)
  scaled_SV = logits_SV.astype(jnp.float32) / temperature_S[:, None]
  # Sorting the vocabulary costs more than the rest of sampling (and on a CPU more
  # than a small model's decode step), so it is skipped when no slot truncates; a
  # slot's draw is the same either way, since its support is then every token.
  keep_SV = jax.lax.cond(jnp.any((sampling_S.top_k > 0) | (sampling_S.top_p < 1)),
                         jax.vmap(support), lambda x, *_: jnp.ones(x.shape, bool),
                         scaled_SV, sampling_S.top_k, sampling_S.top_p)
  # Gumbel-max, as `jax.random.categorical` draws (the same tokens), with jax's noise
  # written out (`noise`) and its argmax as two plain reductions.
  gumbel_SV = noise.gumbel(sampling_S.seed, sampling_S.index, positions_S, scaled_SV.shape[-1])
  drawn_S = argmax(jnp.where(keep_SV, scaled_SV, -jnp.inf) + gumbel_SV)
  tokens_S = jnp.where(greedy_S, argmax(logits_SV), drawn_S).astype(jnp.int32)
  keep_SV |= ~sampling_S.truncated_logp[:, None]
  return tokens_S, token_logp(logits_SV, tokens_S, temperature_S[:, None], keep_SV)
