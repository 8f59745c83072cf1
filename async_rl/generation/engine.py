"""A generation engine with JetStream's `Engine` interface over a paged KV cache.

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

The KV cache is a pool of `kv_blocks` blocks of `kv_block_size` tokens
(`generation.paged`): memory is that budget, not slots x `max_target_length`. Which
blocks a slot holds is the caller's to decide (the pool's `Scheduler` keeps a
`blocks.SlotBlocks`): `insert`, `insert_samples` and `extend` take the slot's blocks and
`generate_chunk` the block tables of the slots to decode. The pools lead with the kv
heads, the axis tensor parallelism splits (`sharding.kv_pool_sharding`); a prefill's
cache splits the same way (`sharding.prefix_cache_sharding`).

`generate` is JetStream's one decode step (its orchestrator ends requests on the
host); the generator pool's `generate_chunk` runs `steps_per_call` steps in one jitted
loop, and a slot stops inside it at a stop id or its token budget. Its attention reads
only the blocks that hold the live slots' positions, within a static size that is a
power of two (`decoding`, a `paged.Decoding`), so a step's cost follows the tokens in
flight, not the longest allowed sequence. The keys of a draw depend only on
(seed, sample index, position), so a chunk draws the tokens that as many single steps
would.

Compilation is bounded: prefill and insert compile once per length bucket (powers of
two from 16, then `max_target_length`), prefill_many's batched prefill and
insert_samples once per bucket a prompt can take and prefix size (1 or
`PREFILL_ROWS` prompts), extend once per bucket a prompt can take, generate_chunk once
per attention read (`decode_buckets`), generate once. Slot indices, blocks, sample
counts and extension lengths are traced, so filling different slots never recompiles.

The attention kernels are those of the devices of the engine's mesh
(`models.attention.kernels_for`), chosen once here, and so is the `paged.Decoding`
unless the builder passes one (the CPU's, `cpu.PagedDecoding`). A CPU-only variant
(`cpu.SlotGroupEngine`) splits the slots among several of these engines, one per core;
nothing here depends on either.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from async_rl import models, sharding
from async_rl.generation import decode_state as ds, paged, sampling as sampling_lib
from async_rl.generation.blocks import table_row
from async_rl.generation.decode_state import ChunkTokens, DecodeState, Prefix, ResultTokens
from async_rl.generation.sampling import SlotSampling
from async_rl.models.attention import kernels_for

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
  """Prefill, insert and batched decode of one model over S slots and a paged KV cache.

  Args:
    cfg: the model config.
    max_concurrent_decodes: S, the number of slots.
    max_prefill_length: longest prompt accepted from users.
    max_target_length: T, the longest sequence: prompt plus completion never exceed
      it. Re-prefilling a sequence (retract, resuming a preempted sample) may use
      prefill lengths up to T.
    steps_per_call: decode steps per `generate_chunk` call.
    kv_blocks: N, the blocks of the KV pool; 0: enough for every slot at length T
      (S x `max_blocks`). At least `max_blocks`, so that one sequence of T fits.
    kv_block_size: Z, tokens per block.
    mesh: devices of this engine; defaults to the first local device.
    param_sharding: a sharding (or pytree prefix of shardings) for the params on
      `mesh`; defaults to fully replicated.
    kernels: the attention kernels (`models.attention.KERNELS`); defaults to those of
      the mesh's devices.
    decoding: how decode steps read the paged cache (`paged.Decoding`); defaults to the
      core's for `kernels` (`paged.for_kernels`).
  """

  def __init__(self, cfg, *, max_concurrent_decodes: int, max_prefill_length: int,
               max_target_length: int, steps_per_call: int = 8, kv_blocks: int = 0,
               kv_block_size: int = 16, mesh: Mesh | None = None, param_sharding=None,
               kernels: str | None = None, decoding: paged.Decoding | None = None):
    if max_concurrent_decodes < 1:
      raise ValueError(f"max_concurrent_decodes must be >= 1, got {max_concurrent_decodes}")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    if not 1 <= max_prefill_length < max_target_length:
      raise ValueError(f"need 1 <= max_prefill_length ({max_prefill_length}) < "
                       f"max_target_length ({max_target_length})")
    if kv_block_size < 1:
      raise ValueError(f"kv_block_size must be >= 1, got {kv_block_size}")
    max_blocks = -(-max_target_length // kv_block_size)
    if kv_blocks and kv_blocks < max_blocks:
      raise ValueError(f"kv_blocks ({kv_blocks}) must hold one sequence of max_target_length "
                       f"({max_target_length} tokens: {max_blocks} blocks of {kv_block_size}), "
                       "or be 0 (every slot at full length)")
    self.cfg = cfg
    self._num_slots = max_concurrent_decodes
    self._max_prefill_length = max_prefill_length
    self._max_target_length = max_target_length
    self.steps_per_call = steps_per_call
    self.block_size, self.max_blocks = kv_block_size, max_blocks
    self.num_blocks = kv_blocks or max_concurrent_decodes * max_blocks
    self.prefill_buckets = prefill_buckets(max_target_length)
    # The buckets a prompt of at most max_prefill_length tokens can take.
    self.prompt_buckets = tuple(b for b in self.prefill_buckets if b < max_prefill_length) + (
        next(b for b in self.prefill_buckets if b >= max_prefill_length),)
    if mesh is None:
      mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    self._mesh = mesh
    self.kernels = kernels or kernels_for(mesh.devices.flat)
    self.decoding = decoding or paged.for_kernels(self.kernels)
    self.decode_buckets = self.decoding.buckets(max_concurrent_decodes, max_blocks,
                                                kv_block_size)
    replicated = NamedSharding(mesh, PartitionSpec())
    self._param_sharding = replicated if param_sharding is None else param_sharding
    init = functools.partial(ds.init_decode_state, cfg=cfg, num_slots=max_concurrent_decodes,
                             num_blocks=self.num_blocks, block_size=kv_block_size,
                             max_blocks=max_blocks)
    # The KV pools split over kv heads; the rest of the state is replicated.
    pools = lambda shapes: tuple(sharding.kv_pool_sharding(x.shape, mesh) for x in shapes)
    abstract = jax.eval_shape(init).cache
    state_sharding = ds.DecodeState(
        cache=paged.PagedCache(k=pools(abstract.k), v=pools(abstract.v), tables_SM=replicated),
        tokens_S=replicated, positions_S=replicated, sampling_S=replicated, end_S=replicated)
    # A prefill's cache splits as the pools do; the rest of the Prefix is replicated.
    kv = sharding.prefix_cache_sharding((1, cfg.n_kv_heads, 1, cfg.head_dim), mesh)
    prefix_sharding = Prefix(cache={"k": kv, "v": kv}, logits_BV=replicated,
                             lengths_B=replicated, starts_B=replicated, tokens_B=replicated,
                             logp_B=replicated, sampling_B=replicated)
    T = max_target_length
    self._split_fn = jax.jit(models.split_layers)
    self._prefill_fn = jax.jit(functools.partial(ds.prefill, cfg=cfg, kernels=self.kernels),
                               out_shardings=(prefix_sharding, replicated))
    # Donating the decode state lets XLA update the KV pools in place.
    self._insert_fn = jax.jit(functools.partial(ds.insert, max_len=T), donate_argnums=(1,),
                              out_shardings=state_sharding)
    self._insert_samples_fn = jax.jit(functools.partial(ds.insert_samples, max_len=T),
                                      donate_argnums=(1,), out_shardings=state_sharding)
    self._draw_fn = jax.jit(ds.draw, out_shardings=replicated)
    self._extend_fn = jax.jit(functools.partial(ds.extend, cfg=cfg, max_len=T,
                                                decoding=self.decoding),
                              donate_argnums=(1,), out_shardings=(state_sharding, replicated))
    self._generate_fn = jax.jit(functools.partial(ds.generate, cfg=cfg, decoding=self.decoding),
                                donate_argnums=(1,), out_shardings=(state_sharding, replicated))
    self._generate_chunk_fn = jax.jit(
        functools.partial(ds.generate_chunk, cfg=cfg, steps=steps_per_call,
                          decoding=self.decoding),
        static_argnames="reads", donate_argnums=(1,), out_shardings=(state_sharding, replicated))
    self._init_fn = jax.jit(init, out_shardings=state_sharding)
    self._state_sharding = state_sharding

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

  @property
  def num_pools(self) -> int:
    """Block pools: this engine has one, which every slot draws from."""
    return 1

  def pool_of(self, slot: int) -> int:
    """The block pool slot `slot` draws from; `insert`'s blocks are that pool's."""
    return 0

  @property
  def kv_cache_bytes(self) -> int:
    """Bytes of the KV pools: 2 (k and v) x L x N x Z x K x E in the model's dtype."""
    c = self.cfg
    return (2 * c.n_layers * self.num_blocks * self.block_size * c.n_kv_heads * c.head_dim
            * jnp.dtype(c.dtype).itemsize)

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

  def abstract_params(self, params):
    """The shapes and shardings `load_params` gives params shaped like `params` (arrays or
    `jax.ShapeDtypeStruct`s); nothing is allocated."""
    on_engine = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             params, jax.tree.broadcast(self._param_sharding, params))
    split = self._split_fn.lower(on_engine).compile()
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        jax.eval_shape(models.split_layers, params), split.output_shardings)

  def lower_prefill(self, params, length: int) -> jax.stages.Lowered:
    """`prefill` of one sequence of `length` tokens (a prefill bucket), lowered for
    `params` in the serving layout (`abstract_params` will do)."""
    sampling = _stack([SlotSampling.create(sampling_lib.SamplingParams(), seed=0, index=0)])
    one = np.ones(1, np.int32)
    return self._prefill_fn.lower(params, np.zeros((1, length), np.int32), one, one, sampling)

  def abstract_decode_state(self) -> DecodeState:
    """The shapes and shardings of `init_decode_state`'s state; nothing is allocated."""
    abstract = jax.eval_shape(self._init_fn)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, jax.tree.broadcast(self._state_sharding, abstract))

  def lower_generate_chunk(self, params, reads: paged.Reads) -> jax.stages.Lowered:
    """`generate_chunk` reading `reads` (one of `decode_buckets`) over this engine's
    decode state, lowered as `lower_prefill`."""
    tables_SM = np.zeros((self._num_slots, self.max_blocks), np.int32)
    return self._generate_chunk_fn.lower(params, self.abstract_decode_state(), tables_SM,
                                         reads=reads)

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

  def _row(self, blocks) -> np.ndarray:
    return table_row(blocks, self.num_blocks, self.max_blocks)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
             blocks: Sequence[int]) -> DecodeState:
    """Puts the (first) prompt of `prefix` into `slot`, which holds `blocks` (enough for
    the prompt; positions after it are written by decoding); the old `decode_state` is
    donated (unusable after)."""
    return self._insert_fn(prefix, decode_state, np.int32(slot), self._row(blocks))

  def insert_samples(self, prefix: Prefix, decode_state: DecodeState, rows: Sequence[int],
                     slots: Sequence[int], samplings: Sequence[SlotSampling],
                     blocks: Sequence[Sequence[int]], shared: Sequence[int]
                     ) -> tuple[DecodeState, ResultTokens]:
    """Puts new samples of the prompts of `prefix` into slots: sample i, of prompt
    `rows[i]`, goes to `slots[i]`, which holds `blocks[i]`, and draws its first token
    with `samplings[i]` (the draw `prefill` would make with it). The first `shared[i]`
    of its blocks are the prompt's full blocks, written by an earlier insert (they are
    not written again). Returns the new state (the old one is donated) and the first
    tokens, row i for sample i.

    Two device calls whatever the number of samples; the arrays are padded to S rows
    so that neither recompiles for another count.
    """
    n, S = len(slots), self._num_slots
    if not 1 <= n <= S:
      raise ValueError(f"insert_samples takes 1 to {S} slots, got {n}")
    rows_S, slots_S, shared_S = (np.zeros(S, np.int32) for _ in range(3))
    rows_S[:n], slots_S[:n], shared_S[:n] = rows, slots, shared
    tables_SM = np.stack([self._row(b) for b in blocks] + [self._row([])] * (S - n))
    sampling_S = _stack([*samplings, *[samplings[0]] * (S - n)])
    first = self._draw_fn(prefix.logits_BV, prefix.lengths_B, rows_S, sampling_S)
    state = self._insert_samples_fn(prefix, decode_state, rows_S, slots_S, first.tokens_S,
                                    sampling_S, tables_SM, shared_S, np.int32(n))
    return state, first

  def extend(self, params, decode_state: DecodeState, slot: int, tokens, start: int,
             sampling: SlotSampling, blocks: Sequence[int]) -> tuple[DecodeState, ResultTokens]:
    """Continues the sample held in `slot`, whose cache holds positions before
    `start`: writes the K/V of `tokens` (the slot's last token, not yet fed, then the
    new ones) at positions `start ..` and draws the next token with `sampling`.
    `blocks` are the slot's blocks, which must hold those positions. Returns the new
    state (the old one is donated) and that token (S = 1).

    `tokens` are padded to a prefill bucket, so this compiles once per bucket.
    """
    padded, count = self.pad_tokens(tokens)
    if start + count >= self.max_target_length:
      raise ValueError(f"extending to {start + count} tokens leaves no room in the cache "
                       f"of {self.max_target_length}")
    return self._extend_fn(params, decode_state, padded, np.int32(count), np.int32(slot),
                           np.int32(start), sampling, self._row(blocks))

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    """One decode step over all slots and their whole tables; the old `decode_state`
    is donated."""
    return self._generate_fn(params, decode_state)

  def generate_chunk(self, params, decode_state: DecodeState,
                     tables_SM: np.ndarray) -> tuple[DecodeState, ChunkTokens]:
    """Up to `steps_per_call` decode steps of the live slots in one device call; the old
    `decode_state` is donated.

    `tables_SM` [S, M] lists the blocks of the slots to decode (N: no block), each
    enough for the positions the chunk writes; other slots' rows are empty, and they do
    not decode. What attention reads is one of `decode_buckets` that holds the tables
    (`decoding.reads`).
    """
    return self._generate_chunk_fn(
        params, decode_state, tables_SM,
        reads=self.decoding.reads(tables_SM, self.num_blocks, self.block_size))

  def warmup(self, params) -> None:
    """Compiles every call the pool makes: prefill and insert for every bucket,
    prefill_many, insert_samples and extend for every bucket a prompt can take (one
    and `PREFILL_ROWS` prompts), generate, and generate_chunk for every attention read.

    `params` go through `load_params` first, as the pool's do: compiled code is
    specific to the shardings of its inputs, so warming up on params placed
    differently would not cover the pool's calls.
    """
    params = self.load_params(params)
    state = self.init_decode_state()
    sampling = SlotSampling.create(sampling_lib.SamplingParams(), seed=0, index=0)
    every = list(range(self.max_blocks))
    for bucket in self.prefill_buckets:
      prefix, _ = self.prefill(params=params, padded_tokens=np.zeros(bucket, np.int32),
                               true_length=1, sampling=sampling)
      state = self.insert(prefix, state, 0, every)
      if bucket in self.prompt_buckets:
        ((rows, _), *_) = self.prefill_many(
            params=params, prompts=[np.zeros(bucket, np.int32)] * PREFILL_ROWS,
            samplings=[sampling] * PREFILL_ROWS)
        for p in (prefix, rows):
          state, _ = self.insert_samples(p, state, [0], [0], [sampling], [every], [0])
        state, _ = self.extend(params, state, 0,
                               np.zeros(min(bucket, self.max_prefill_length), np.int32), 0,
                               sampling, every)
    state, result = self.generate(params, state)
    for reads in self.decode_buckets:
      # Tables that `reads` holds: its blocks, row by row.
      held_SM = np.arange(self._num_slots * self.max_blocks).reshape(-1, self.max_blocks)
      if reads.layout == "columns":
        held_SM = held_SM % self.max_blocks
      tables_SM = np.where(held_SM < reads.blocks, held_SM % self.num_blocks,
                           self.num_blocks).astype(np.int32)
      state, chunk = self._generate_chunk_fn(params, state, tables_SM, reads=reads)
    jax.block_until_ready((result, chunk))
