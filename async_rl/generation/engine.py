"""A generation engine with JetStream's `Engine` interface over the model's KV cache.

The method and argument names follow `jetstream.engine.engine_api.Engine`
(`prefill(*, params, padded_tokens, true_length)`, `insert(prefix, decode_state,
slot)`, `generate(params, decode_state)`, `init_decode_state`, `load_params`,
`max_concurrent_decodes`, `max_prefill_length`, `samples_per_slot`, `mesh`), so an
adapter can present it as a real JetStream engine. Differences are deliberate:
sampling parameters, seed, stop ids and token budget included, travel with each
request (`prefill(..., sampling=)`) and live in the decode state as per-slot arrays,
instead of a `sampler` callable and an `rng` argument; results carry log-probs
(`ResultTokens` here is ours, not JetStream's packed array); `insert_samples` puts
several samples of one prefilled prompt into slots in one call, each drawing its own
first token, so a prompt is prefilled once for all its samples. `existing_prefix`
(prefix caching) is not supported.

`generate` is JetStream's one decode step, for JetStream's orchestrator, which ends
requests on the host. `generate_chunk`, which the generator pool uses, runs
`steps_per_call` steps in one jitted loop, so the host is visited once per chunk: a
slot stops inside the loop when it emits a stop id or reaches its token budget or the
cache end, and the loop exits early once no slot is live. Sampling keys depend only
on (seed, sample index, position), so a chunk draws exactly the tokens that as many
single steps would.

Compilation is bounded: prefill, insert and insert_samples compile once per length
bucket (powers of two from 16, then `max_target_length`), generate, generate_chunk
and the first-token draw of insert_samples once. Slot indices and sample counts are
traced, so filling different slots never recompiles.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from async_rl import models
from async_rl.generation import sampling as sampling_lib
from async_rl.generation.sampling import SlotSampling

_MIN_BUCKET = 16


@struct.dataclass
class Prefix:
  """A prefilled prompt, ready to be inserted into a slot.

  `cache` holds k and v of shape [L, 1, P, K, E] for the padded prompt; `logits_V`
  are the logits after the last real token (kept so more samples of the same
  prompt can be drawn by `insert_samples` without recomputing the prompt); `token` and
  `logp` are the first generated token, which sits at position `length`. `start` is
  the position of the sample's first generated token, its prompt length: `length`
  less the tokens of a re-prefilled sample that were generated before.
  """
  cache: dict
  logits_V: jax.Array
  length: jax.Array
  start: jax.Array
  token: jax.Array
  logp: jax.Array
  sampling: SlotSampling


@struct.dataclass
class DecodeState:
  """Everything one decode step transforms, for all S slots.

  `tokens_S` is each slot's last generated token, not yet fed to the model;
  `positions_S` its sequence position. The cache holds k and v of shape
  [L, S, T, K, E]. An idle slot sits at position T, where decoding writes nothing.
  `end_S` is one past the position of a slot's last allowed token (prompt length
  plus `max_new_tokens`, capped by T); `generate_chunk` advances only live slots
  (see `_live`).
  """
  cache: dict
  tokens_S: jax.Array
  positions_S: jax.Array
  sampling_S: SlotSampling
  end_S: jax.Array


@struct.dataclass
class ResultTokens:
  """Tokens emitted by one prefill (S = 1), one `insert_samples` (row i for its sample
  i) or one decode step, with their log-probs and the sequence positions they occupy."""
  tokens_S: jax.Array
  logp_S: jax.Array
  positions_S: jax.Array


@struct.dataclass
class ChunkTokens:
  """Tokens emitted by one `generate_chunk` call, T = `steps_per_call` per slot.

  Slot s emitted `tokens_ST[s, :count_S[s]]` (a slot stops for good within a chunk,
  so what it emits is a prefix of the steps); `steps` is how many steps the loop
  ran, at most T.
  """
  tokens_ST: jax.Array
  logp_ST: jax.Array
  count_S: jax.Array
  steps: jax.Array


def _draw(logits_V, length, sampling_N):
  """Draws N tokens at position `length` from the same logits, one per sampling row."""
  N, V = sampling_N.seed.shape[0], logits_V.shape[0]
  positions_N = jnp.full(N, length)
  tokens_N, logp_N = sampling_lib.sample(jnp.broadcast_to(logits_V, (N, V)), sampling_N,
                                         positions_N)
  return ResultTokens(tokens_N, logp_N, positions_N)


def _first_token(logits_V, length, sampling):
  """Draws the token at position `length`; returns the Prefix fields it sets and the
  result. `sampling` is passed through so the Prefix holds device arrays either way."""
  result = _draw(logits_V, length, jax.tree.map(lambda x: x[None], sampling))
  fields = dict(token=result.tokens_S[0], logp=result.logp_S[0], sampling=sampling)
  return fields, result


def _prefill(params, tokens_P, length, generated, sampling, *, cfg):
  logits_1PV, cache = models.prefill(params, cfg, tokens_P[None], length[None])
  logits_V = jax.lax.dynamic_index_in_dim(logits_1PV[0], length - 1, keepdims=False)
  fields, result = _first_token(logits_V, length, sampling)
  prefix = Prefix(cache=cache, logits_V=logits_V, length=length, start=length - generated,
                  **fields)
  return prefix, result


def _insert(prefix, state, slot):
  cache = jax.tree.map(
      lambda c, p: jax.lax.dynamic_update_slice(c, p.astype(c.dtype), (0, slot, 0, 0, 0)),
      state.cache, prefix.cache)
  sampling_S = jax.tree.map(lambda a, x: a.at[slot].set(x), state.sampling_S, prefix.sampling)
  end = jnp.minimum(prefix.start + prefix.sampling.max_new_tokens, state.cache["k"].shape[2])
  return DecodeState(cache=cache, tokens_S=state.tokens_S.at[slot].set(prefix.token),
                     positions_S=state.positions_S.at[slot].set(prefix.length),
                     sampling_S=sampling_S, end_S=state.end_S.at[slot].set(end))


def _insert_samples(prefix, state, slots_S, tokens_S, sampling_S, count):
  """`_insert` of the first `count` rows: sample i, with first token `tokens_S[i]`
  drawn under `sampling_S[i]`, goes to slot `slots_S[i]`. Only `count` copies of the
  prompt's cache are written, however many slots there are."""

  def insert_one(i, state):
    sample = prefix.replace(token=tokens_S[i], sampling=jax.tree.map(lambda x: x[i], sampling_S))
    return _insert(sample, state, slots_S[i])

  return jax.lax.fori_loop(0, count, insert_one, state)


def _live(state: DecodeState) -> jax.Array:
  """Bool [S]: the slots whose sample goes on, i.e. whose last token is not a stop id
  and is not at the last allowed position. Idle slots (position T) are not live."""
  stopped_S = jnp.any(state.tokens_S[:, None] == state.sampling_S.stop_ids, axis=1)
  return (state.positions_S + 1 < state.end_S) & ~stopped_S


def _generate(params, state, *, cfg):
  logits_SV, cache = models.decode(params, cfg, state.cache, state.tokens_S, state.positions_S)
  # Idle slots stay parked at position T (past the cache end) instead of counting up.
  positions_S = jnp.minimum(state.positions_S + 1, state.cache["k"].shape[2])
  tokens_S, logp_S = sampling_lib.sample(logits_SV, state.sampling_S, positions_S)
  new_state = state.replace(cache=cache, tokens_S=tokens_S, positions_S=positions_S)
  return new_state, ResultTokens(tokens_S, logp_S, positions_S)


def _generate_chunk(params, state, *, cfg, steps):
  S, T = state.tokens_S.shape[0], state.cache["k"].shape[2]

  def cond(carry):
    step, state, _ = carry
    return (step < steps) & jnp.any(_live(state))

  def body(carry):
    step, state, (tokens_TS, logp_TS) = carry
    live_S = _live(state)
    # A stopped slot writes nowhere and keeps its token and position, so it stays
    # stopped until `insert` gives the slot a new sample.
    write_S = jnp.where(live_S, state.positions_S, T)
    logits_SV, cache = models.decode(params, cfg, state.cache, state.tokens_S, write_S)
    positions_S = jnp.where(live_S, state.positions_S + 1, state.positions_S)
    tokens_S, logp_S = sampling_lib.sample(logits_SV, state.sampling_S, positions_S)
    state = state.replace(cache=cache, tokens_S=jnp.where(live_S, tokens_S, state.tokens_S),
                          positions_S=positions_S)
    return step + 1, state, (tokens_TS.at[step].set(tokens_S), logp_TS.at[step].set(logp_S))

  start_S = state.positions_S
  out = (jnp.zeros((steps, S), jnp.int32), jnp.zeros((steps, S), jnp.float32))
  ran, state, (tokens_TS, logp_TS) = jax.lax.while_loop(cond, body, (0, state, out))
  return state, ChunkTokens(tokens_ST=tokens_TS.T, logp_ST=logp_TS.T,
                            count_S=state.positions_S - start_S, steps=ran)


def _init_decode_state(*, cfg, num_slots, max_len):
  return DecodeState(cache=models.init_cache(cfg, num_slots, max_len),
                     tokens_S=jnp.zeros(num_slots, jnp.int32),
                     positions_S=jnp.full(num_slots, max_len, jnp.int32),
                     sampling_S=jax.tree.map(jnp.asarray, SlotSampling.zeros(num_slots)),
                     end_S=jnp.zeros(num_slots, jnp.int32))


def prefill_buckets(max_length: int) -> tuple[int, ...]:
  """Padded prefill lengths: powers of two from 16 below `max_length`, then `max_length`."""
  buckets, b = [], _MIN_BUCKET
  while b < max_length:
    buckets.append(b)
    b *= 2
  return tuple(buckets) + (max_length,)


class Engine:
  """Prefill, insert and batched decode of one model over S KV-cache slots.

  Args:
    cfg: the model config.
    max_concurrent_decodes: S, the number of slots.
    max_prefill_length: longest prompt accepted from users.
    max_target_length: T, the cache length: prompt plus completion never exceed it.
      Re-prefilling a sequence (retract) may use prefill lengths up to T.
    steps_per_call: decode steps per `generate_chunk` call.
    mesh: devices of this engine; defaults to the first local device.
    param_sharding: a sharding (or pytree prefix of shardings) for the params on
      `mesh`; defaults to fully replicated.
  """

  def __init__(self, cfg: models.ModelConfig, *, max_concurrent_decodes: int,
               max_prefill_length: int, max_target_length: int, steps_per_call: int = 8,
               mesh: Mesh | None = None, param_sharding=None):
    if max_concurrent_decodes < 1:
      raise ValueError(f"max_concurrent_decodes must be >= 1, got {max_concurrent_decodes}")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    if not 1 <= max_prefill_length < max_target_length:
      raise ValueError(f"need 1 <= max_prefill_length ({max_prefill_length}) < "
                       f"max_target_length ({max_target_length})")
    self.cfg = cfg
    self._num_slots = max_concurrent_decodes
    self._max_prefill_length = max_prefill_length
    self._max_target_length = max_target_length
    self.steps_per_call = steps_per_call
    self.prefill_buckets = prefill_buckets(max_target_length)
    if mesh is None:
      mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    self._mesh = mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    self._param_sharding = replicated if param_sharding is None else param_sharding
    self._prefill_fn = jax.jit(functools.partial(_prefill, cfg=cfg), out_shardings=replicated)
    # Donating the decode state lets XLA update the KV cache in place.
    self._insert_fn = jax.jit(_insert, donate_argnums=(1,), out_shardings=replicated)
    self._insert_samples_fn = jax.jit(_insert_samples, donate_argnums=(1,),
                                      out_shardings=replicated)
    self._draw_fn = jax.jit(_draw, out_shardings=replicated)
    self._generate_fn = jax.jit(functools.partial(_generate, cfg=cfg), donate_argnums=(1,),
                                out_shardings=replicated)
    self._generate_chunk_fn = jax.jit(
        functools.partial(_generate_chunk, cfg=cfg, steps=steps_per_call), donate_argnums=(1,),
        out_shardings=replicated)
    self._init_fn = jax.jit(functools.partial(_init_decode_state, cfg=cfg,
                                              num_slots=max_concurrent_decodes,
                                              max_len=max_target_length),
                            out_shardings=replicated)

  @property
  def max_concurrent_decodes(self) -> int:
    return self._num_slots

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def max_target_length(self) -> int:
    return self._max_target_length

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  def load_params(self, params):
    """A copy of `params` on this engine's devices and sharding.

    Never aliases the input, so the caller may donate or delete its buffers.
    """
    return jax.device_put(params, self._param_sharding, may_alias=False)

  def init_decode_state(self) -> DecodeState:
    return self._init_fn()

  def pad_tokens(self, tokens) -> tuple[np.ndarray, int]:
    """Right-pads `tokens` with zeros to the smallest bucket; returns (padded, length)."""
    n = len(tokens)
    if not 1 <= n <= self.max_target_length:
      raise ValueError(f"sequence length {n} outside [1, {self.max_target_length}]")
    bucket = next(b for b in self.prefill_buckets if b >= n)
    padded = np.zeros(bucket, np.int32)
    padded[:n] = tokens
    return padded, n

  def prefill(self, *, params, padded_tokens, true_length: int, sampling: SlotSampling,
              generated: int = 0) -> tuple[Prefix, ResultTokens]:
    """Runs a padded prompt and draws its first generated token with `sampling`.

    `generated` is how many of the `true_length` tokens a re-prefilled sample
    generated before; they count against `sampling.max_new_tokens`.
    """
    return self._prefill_fn(params, padded_tokens, np.int32(true_length), np.int32(generated),
                            sampling)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Puts `prefix` into `slot`; the old `decode_state` is donated (unusable after)."""
    return self._insert_fn(prefix, decode_state, np.int32(slot))

  def insert_samples(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int],
                     samplings: Sequence[SlotSampling]) -> tuple[DecodeState, ResultTokens]:
    """Puts samples of `prefix` into `slots`, sample i drawing its first token with
    `samplings[i]` (the draw `prefill` would make with it); returns the new state (the
    old one is donated) and the first tokens, row i for sample i.

    Two device calls whatever the number of samples; the arrays are padded to S rows
    so that neither recompiles for another count."""
    n, S = len(slots), self._num_slots
    if not 1 <= n <= S:
      raise ValueError(f"insert_samples takes 1 to {S} slots, got {n}")
    slots_S = np.zeros(S, np.int32)
    slots_S[:n] = slots
    sampling_S = jax.tree.map(lambda *x: np.stack(x), *samplings, *[samplings[0]] * (S - n))
    first = self._draw_fn(prefix.logits_V, prefix.length, sampling_S)
    state = self._insert_samples_fn(prefix, decode_state, slots_S, first.tokens_S, sampling_S,
                                    np.int32(n))
    return state, first

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    """One decode step over all slots; the old `decode_state` is donated."""
    return self._generate_fn(params, decode_state)

  def generate_chunk(self, params,
                     decode_state: DecodeState) -> tuple[DecodeState, ChunkTokens]:
    """Up to `steps_per_call` decode steps of the live slots in one device call;
    the old `decode_state` is donated."""
    return self._generate_chunk_fn(params, decode_state)

  def warmup(self, params) -> None:
    """Compiles prefill, insert and insert_samples for every bucket, the draw of
    insert_samples, generate and generate_chunk.

    `params` go through `load_params` first, as the pool's do: compiled code is
    specific to the shardings of its inputs, so warming up on params placed
    differently would not cover the pool's calls.
    """
    params = self.load_params(params)
    state = self.init_decode_state()
    sampling = SlotSampling.create(sampling_lib.SamplingParams(), seed=0, index=0)
    for bucket in self.prefill_buckets:
      prefix, _ = self.prefill(params=params, padded_tokens=np.zeros(bucket, np.int32),
                               true_length=1, sampling=sampling)
      state = self.insert(prefix, state, 0)
      state, _ = self.insert_samples(prefix, state, [0], [sampling])
    state, result = self.generate(params, state)
    state, chunk = self.generate_chunk(params, state)
    jax.block_until_ready((result, chunk))
