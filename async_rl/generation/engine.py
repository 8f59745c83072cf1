"""A generation engine with JetStream's `Engine` interface over the model's KV cache.

The method and argument names follow `jetstream.engine.engine_api.Engine`
(`prefill(*, params, padded_tokens, true_length)`, `insert(prefix, decode_state,
slot)`, `generate(params, decode_state)`, `init_decode_state`, `load_params`,
`max_concurrent_decodes`, `max_prefill_length`, `samples_per_slot`, `mesh`), so an
adapter can present it as a real JetStream engine. Differences are deliberate:
sampling parameters, seed, stop ids and token budget included, travel with each
request (`prefill(..., sampling=)`) and live in the decode state as per-slot arrays,
instead of a `sampler` callable and an `rng` argument; results carry log-probs
(`ResultTokens` here is ours, not JetStream's packed array); a Prefix may hold
several prompts (`prefill_many`), and `insert_samples` puts any number of samples of
them into slots in one call, each drawing its own first token, so a prompt is
prefilled once for all its samples. `existing_prefix` (prefix caching) is not
supported.

`generate` is JetStream's one decode step (its orchestrator ends requests on the
host); the generator pool's `generate_chunk` runs `steps_per_call` steps in one jitted
loop, and a slot stops inside it at a stop id, its token budget or the cache end. The
keys of a draw depend only on (seed, sample index, position), so a chunk draws the
tokens that as many single steps would.

Compilation is bounded: prefill and insert compile once per length bucket (powers of
two from 16, then `max_target_length`), prefill_many's batched prefill and
insert_samples once per bucket a prompt can take and prefix size (1 or
`PREFILL_ROWS` prompts), extend once per bucket a prompt can take, generate and
generate_chunk once. Slot indices, sample counts and extension lengths are traced, so
filling different slots never recompiles.

A CPU-only variant (`cpu.SlotGroupEngine`) splits the slots among several of these
engines, one per core; nothing here depends on it.
"""

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from async_rl import models, sharding
from async_rl.generation import decode_state as ds, sampling as sampling_lib
from async_rl.generation.decode_state import ChunkTokens, DecodeState, Prefix, ResultTokens
from async_rl.generation.sampling import SlotSampling

_MIN_BUCKET = 16
PREFILL_ROWS = 8  # Prompts per batched prefill call (`Engine.prefill_many`).


def _stack(samplings):
  return jax.tree.map(lambda *x: np.stack(x), *samplings)


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

  def __init__(self, cfg, *, max_concurrent_decodes: int, max_prefill_length: int,
               max_target_length: int, steps_per_call: int = 8, mesh: Mesh | None = None,
               param_sharding=None):
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
    # The buckets a prompt of at most max_prefill_length tokens can take.
    self.prompt_buckets = tuple(b for b in self.prefill_buckets if b < max_prefill_length) + (
        next(b for b in self.prefill_buckets if b >= max_prefill_length),)
    if mesh is None:
      mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    self._mesh = mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    self._param_sharding = replicated if param_sharding is None else param_sharding
    self._split_fn = jax.jit(models.split_layers)
    self._prefill_fn = jax.jit(functools.partial(ds.prefill, cfg=cfg), out_shardings=replicated)
    # Donating the decode state lets XLA update the KV cache in place.
    self._insert_fn = jax.jit(ds.insert, donate_argnums=(1,), out_shardings=replicated)
    self._insert_samples_fn = jax.jit(ds.insert_samples, donate_argnums=(1,),
                                      out_shardings=replicated)
    self._draw_fn = jax.jit(ds.draw, out_shardings=replicated)
    self._extend_fn = jax.jit(functools.partial(ds.extend, cfg=cfg), donate_argnums=(1,),
                              out_shardings=replicated)
    self._generate_fn = jax.jit(functools.partial(ds.generate, cfg=cfg), donate_argnums=(1,),
                                out_shardings=replicated)
    self._generate_chunk_fn = jax.jit(
        functools.partial(ds.generate_chunk, cfg=cfg, steps=steps_per_call), donate_argnums=(1,),
        out_shardings=replicated)
    self._init_fn = jax.jit(functools.partial(ds.init_decode_state, cfg=cfg,
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
    """A copy of `params` on this engine's devices and sharding, in the serving layout.

    Never aliases the input, so the caller may donate or delete its buffers. Device
    arrays from other devices (a trainer's) move device to device
    (`sharding.reshard`), then split into one dict per layer on the device
    (`models.split_layers`), which decoding reads without slicing.
    """
    return self._split_fn(sharding.reshard(params, self._param_sharding))

  def init_decode_state(self) -> DecodeState:
    """Every slot idle."""
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
    generated before; they count against `sampling.max_new_tokens`. The Prefix holds
    this one prompt (B = 1).
    """
    return self._prefill_fn(params, np.asarray(padded_tokens)[None],
                            np.array([true_length], np.int32), np.array([generated], np.int32),
                            _stack([sampling]))

  def prefill_many(self, *, params, prompts: Sequence, samplings: Sequence[SlotSampling]
                   ) -> list[tuple[Prefix, int]]:
    """Prefills prompts of at most `max_prefill_length` tokens, prompt i drawing its
    first token with `samplings[i]`; returns each prompt's (Prefix, row).

    Prompts of one length bucket are prefilled together, `PREFILL_ROWS` per call
    (fewer rows than half that go one by one, as padding rows cost compute).
    """
    padded = [self.pad_tokens(p) for p in prompts]
    refs = [None] * len(prompts)
    for bucket in {len(tokens) for tokens, _ in padded}:
      rows = [i for i, (tokens, _) in enumerate(padded) if len(tokens) == bucket]
      while 2 * len(rows) >= PREFILL_ROWS:
        group, rows = rows[:PREFILL_ROWS], rows[PREFILL_ROWS:]
        full = group + group[:1] * (PREFILL_ROWS - len(group))
        prefix, _ = self._prefill_fn(
            params, np.stack([padded[i][0] for i in full]),
            np.array([padded[i][1] for i in full], np.int32), np.zeros(len(full), np.int32),
            _stack([samplings[i] for i in full]))
        for row, i in enumerate(group):
          refs[i] = (prefix, row)
      for i in rows:
        refs[i] = (self.prefill(params=params, padded_tokens=padded[i][0],
                                true_length=padded[i][1], sampling=samplings[i])[0], 0)
    return refs

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Puts the (first) prompt of `prefix` into `slot`; the old `decode_state` is
    donated (unusable after)."""
    return self._insert_fn(prefix, decode_state, np.int32(slot))

  def insert_samples(self, prefix: Prefix, decode_state: DecodeState, rows: Sequence[int],
                     slots: Sequence[int], samplings: Sequence[SlotSampling]
                     ) -> tuple[DecodeState, ResultTokens]:
    """Puts new samples of the prompts of `prefix` into slots: sample i, of prompt
    `rows[i]`, goes to `slots[i]` and draws its first token with `samplings[i]` (the
    draw `prefill` would make with it). Returns the new state (the old one is
    donated) and the first tokens, row i for sample i.

    Two device calls whatever the number of samples; the arrays are padded to S rows
    so that neither recompiles for another count.
    """
    n, S = len(slots), self._num_slots
    if not 1 <= n <= S:
      raise ValueError(f"insert_samples takes 1 to {S} slots, got {n}")
    rows_S, slots_S = np.zeros(S, np.int32), np.zeros(S, np.int32)
    rows_S[:n], slots_S[:n] = rows, slots
    sampling_S = _stack([*samplings, *[samplings[0]] * (S - n)])
    first = self._draw_fn(prefix.logits_BV, prefix.lengths_B, rows_S, sampling_S)
    state = self._insert_samples_fn(prefix, decode_state, rows_S, slots_S, first.tokens_S,
                                    sampling_S, np.int32(n))
    return state, first

  def extend(self, params, decode_state: DecodeState, slot: int, tokens, start: int,
             sampling: SlotSampling) -> tuple[DecodeState, ResultTokens]:
    """Continues the sample held in `slot`, whose cache holds positions before
    `start`: writes the K/V of `tokens` (the slot's last token, not yet fed, then the
    new ones) at positions `start ..` and draws the next token with `sampling`.
    Returns the new state (the old one is donated) and that token (S = 1).

    `tokens` are padded to a prefill bucket, so this compiles once per bucket.
    """
    padded, count = self.pad_tokens(tokens)
    if start + count >= self.max_target_length:
      raise ValueError(f"extending to {start + count} tokens leaves no room in the cache "
                       f"of {self.max_target_length}")
    return self._extend_fn(params, decode_state, padded, np.int32(count), np.int32(slot),
                           np.int32(start), sampling)

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    """One decode step over all slots; the old `decode_state` is donated."""
    return self._generate_fn(params, decode_state)

  def generate_chunk(self, params,
                     decode_state: DecodeState) -> tuple[DecodeState, ChunkTokens]:
    """Up to `steps_per_call` decode steps of the live slots in one device call; the old
    `decode_state` is donated."""
    return self._generate_chunk_fn(params, decode_state)

  def warmup(self, params) -> None:
    """Compiles every call the pool makes: prefill and insert for every bucket,
    prefill_many, insert_samples and extend for every bucket a prompt can take (one
    and `PREFILL_ROWS` prompts), generate and generate_chunk.

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
      if bucket in self.prompt_buckets:
        ((rows, _), *_) = self.prefill_many(
            params=params, prompts=[np.zeros(bucket, np.int32)] * PREFILL_ROWS,
            samplings=[sampling] * PREFILL_ROWS)
        for p in (prefix, rows):
          state, _ = self.insert_samples(p, state, [0], [0], [sampling])
        state, _ = self.extend(params, state, 0,
                               np.zeros(min(bucket, self.max_prefill_length), np.int32), 0,
                               sampling)
    state, result = self.generate(params, state)
    state, chunk = self.generate_chunk(params, state)
    jax.block_until_ready((result, chunk))
