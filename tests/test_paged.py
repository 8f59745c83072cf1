"""The paged KV cache: paged decode == dense decode, with a group's prompt blocks
shared; only live blocks matter; the Pallas kernel (interpreted) == the XLA path and
lowers for CUDA; one compile per bucket; the block allocator's bookkeeping."""

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from async_rl import models
from async_rl.config import model_preset
from async_rl.cpu import paged_decode
from async_rl.generation import decode_state as ds, paged, sampling
from async_rl.generation.engine import Engine
from async_rl.generation.blocks import BlockAllocator, OutOfBlocks, SlotBlocks
from conftest import compiles, two_layer_model

# The decode steps compared below run the same ops on both caches; what differs is the
# number of masked positions each softmax and reduction runs over (T = 64 dense, the
# bucket paged), which XLA may sum in another order: float32 rounding, a few ulps of
# values of order 1, compounded through the layers.
_TOL = dict(atol=1e-5, rtol=1e-5)


_dense_decode = jax.jit(models.decode, static_argnums=1)
_paged_decode = jax.jit(paged.decode, static_argnames=("cfg", "reads", "decoding"))
CPU = paged_decode.PagedDecoding()


def _cfg(**kw):
  return two_layer_model(61, **kw)


def _shuffle(allocator, seed):
  """Makes `allocator` hand its blocks out in a random order (tables not contiguous)."""
  blocks = allocator.allocate(allocator.num_blocks)
  allocator.free(list(np.random.default_rng(seed).permutation(blocks)))
  return allocator


class _Both:
  """One workload on a dense cache and on a paged one: prompts of random lengths in
  groups of 3, 1 and 2 samples (a group shares its prompt's full blocks), then decode
  steps of random tokens; slot S - 1 stays idle. Attention reads as `layout` says, or
  as the CPU's `PagedDecoding` chooses when it is None."""

  T = 64
  GROUPS = (3, 1, 2)

  def __init__(self, block_size, seed, layout=None):
    self.layout = layout
    self.cfg = cfg = _cfg(qk_norm=True)
    self.params = models.init_params(cfg, jax.random.key(seed))
    self.rng = rng = np.random.default_rng(seed)
    self.Z, self.M, self.S = block_size, self.T // block_size, sum(self.GROUPS) + 1
    self.lengths_B = rng.integers(1, 21, len(self.GROUPS))
    tokens_BP = rng.integers(0, cfg.vocab_size, (len(self.GROUPS), 20)).astype(np.int32)
    _, prompt = models.prefill(self.params, cfg, tokens_BP, self.lengths_B)
    self.dense = models.init_cache(cfg, self.S, self.T)
    self.slot_blocks = SlotBlocks([0] * self.S, num_blocks=48, block_size=block_size,
                                        max_blocks=self.M)
    self.allocator = _shuffle(self.slot_blocks.allocators[0], seed)
    self.blocks = self.slot_blocks.blocks
    self.cache = paged.init_cache(cfg, num_slots=self.S, num_blocks=48, block_size=block_size,
                                  max_blocks=self.M)
    self.positions_S, slot = np.full(self.S, self.T, np.int32), 0
    for row, samples in enumerate(self.GROUPS):
      length, record = int(self.lengths_B[row]), {}
      for _ in range(samples):
        shared = self.slot_blocks.assign(slot, length, (record, length))
        self.dense = jax.tree.map(lambda c, p: c.at[slot, :, :p.shape[2]].set(p[row]),
                                  self.dense, prompt)
        self.cache = paged.insert(self.cache, prompt, row, slot, self.slot_blocks.row(slot),
                                  shared)
        self.positions_S[slot] = length
        slot += 1
    self.live = slot

  def grow(self):
    """Gives each live slot the block its next position needs; returns what attention
    reads for the tables."""
    for s in range(self.live):
      assert self.slot_blocks.grow(s, self.positions_S[s] + 1)
    tables_SM = self.slot_blocks.table(range(self.live))
    self.cache = self.cache.replace(tables_SM=jnp.asarray(tables_SM))
    return self.reads(self.layout)

  def reads(self, layout):
    """The smallest reads of `layout` that hold the tables (None: the CPU's choice)."""
    tables_SM = np.asarray(self.cache.tables_SM)
    if layout is None:
      return CPU.reads(tables_SM, 48, self.Z)
    if layout == "columns":  # also the Pallas kernel's static size
      return paged.Reads(layout, paged.bucket(max(len(b) for b in self.blocks), self.M))
    return paged.Reads(layout, paged.bucket(sum(len(b) for b in self.blocks), self.S * self.M))

  def step(self):
    tokens_S = self.rng.integers(0, self.cfg.vocab_size, self.S).astype(np.int32)
    reads = self.grow()
    # A copy: on CPU a jitted call may read a NumPy argument in place, after this
    # method has gone on to advance the positions.
    positions_S = jnp.array(self.positions_S)
    dense_SV, self.dense = _dense_decode(self.params, self.cfg, self.dense, tokens_S,
                                         positions_S)
    paged_SV, self.cache = _paged_decode(self.params, self.cfg, self.cache, tokens_S,
                                         positions_S, reads=reads, decoding=CPU)
    self.positions_S[:self.live] += 1
    return dense_SV[:self.live], paged_SV[:self.live]

  def read_back(self, layer, name):
    """Slot s's paged keys (or values) at its written positions, as [K, p, E] each."""
    pages = np.asarray(getattr(self.cache, name)[layer])
    return [np.stack([pages[:, self.blocks[s][p // self.Z], p % self.Z]
                      for p in range(self.positions_S[s])], axis=1)
            for s in range(self.live)]


@pytest.mark.parametrize("block_size, seed, layout", [
    (4, 0, None), (4, 1, "columns"), (4, 1, "ragged"), (16, 2, None)])
def test_paged_decode_equals_dense_decode(block_size, seed, layout):
  both = _Both(block_size, seed, layout)
  # The group's 3 samples hold its prompt's full blocks once, and each its own last one.
  full = int(both.lengths_B[0]) // block_size
  assert both.blocks[0][:full] == both.blocks[1][:full] == both.blocks[2][:full]
  assert all(both.allocator.refcount(b) == 3 for b in both.blocks[0][:full])
  own = [b for blocks in both.blocks[:3] for b in blocks[full:]]
  assert len(set(own)) == len(own) == 3 * (int(both.lengths_B[0]) % block_size > 0)
  for _ in range(12):
    dense_SV, paged_SV = both.step()
    np.testing.assert_allclose(paged_SV, dense_SV, **_TOL)
  for layer in range(both.cfg.n_layers):
    for name in ("k", "v"):
      dense = np.asarray(both.dense[name][layer])
      for s, kv_KpE in enumerate(both.read_back(layer, name)):
        np.testing.assert_allclose(kv_KpE, dense[s, :, :both.positions_S[s]], **_TOL)


@pytest.mark.parametrize("layout", ["columns", "ragged"])
def test_only_live_blocks_matter(layout):
  """Reading more, and garbage in every block no slot holds, change nothing."""
  both = _Both(4, seed=3, layout=layout)
  for _ in range(3):
    both.step()
  reads = both.grow()
  largest = paged.Reads(layout, both.M if layout == "columns" else both.S * both.M)
  assert reads.blocks < largest.blocks
  tokens_S = jnp.arange(both.S, dtype=jnp.int32)
  step = lambda cache, reads: _paged_decode(both.params, both.cfg, cache, tokens_S,
                                            both.positions_S, reads=reads,
                                            decoding=CPU)[0][:both.live]
  reference = step(both.cache, reads)
  held = [b for b in range(48) if both.allocator.refcount(b)]
  garbage = lambda pages: pages.at[:, np.setdiff1d(np.arange(48), held)].set(1e3)
  noisy = both.cache.replace(k=tuple(map(garbage, both.cache.k)),
                             v=tuple(map(garbage, both.cache.v)))
  np.testing.assert_allclose(step(noisy, reads), reference, **_TOL)
  np.testing.assert_allclose(step(both.cache, largest), reference, **_TOL)
  # Reading short of the live slots' blocks does change their logits: the test can fail.
  short = paged.Reads(layout, reads.blocks // 2)
  assert not np.allclose(step(both.cache, short), reference, **_TOL)


def test_idle_and_blockless_slots_write_nowhere():
  Z, M, N = 4, 3, 8
  pages_KNZE = jnp.arange(2 * N * Z * 5, dtype=jnp.float32).reshape(2, N, Z, 5)
  tables_SM = jnp.array([[5, 2, N], [1, N, N], [6, N, N]], jnp.int32)
  new_SKE = -jnp.ones((3, 2, 5))
  # Slot 0 writes position 6 (block 2, offset 2); slot 1's column 1 has no block; slot 2
  # is idle, past its table.
  out = paged.write_token(pages_KNZE, new_SKE, tables_SM, jnp.array([6, 5, M * Z]))
  expected = np.array(pages_KNZE)
  expected[:, 2, 2] = -1
  np.testing.assert_array_equal(out, expected)


def test_insert_writes_the_prompt_and_skips_shared_blocks():
  cfg = _cfg()
  Z, N, M = 4, 10, 4
  rng = np.random.default_rng(4)
  prompt = {name: tuple(jnp.asarray(rng.normal(size=(2, 2, 10, 8)), jnp.float32)
                        for _ in range(cfg.n_layers)) for name in ("k", "v")}
  cache = paged.init_cache(cfg, num_slots=2, num_blocks=N, block_size=Z, max_blocks=M)
  cache = paged.insert(cache, prompt, 1, 0, jnp.array([7, 3, 9, N], jnp.int32), 0)
  # Another row, so that a write to the two shared blocks would show.
  cache = paged.insert(cache, prompt, 0, 1, jnp.array([7, 3, 4, N], jnp.int32), 2)
  np.testing.assert_array_equal(cache.tables_SM, [[7, 3, 9, N], [7, 3, 4, N]])
  for name in ("k", "v"):
    pages = np.asarray(getattr(cache, name)[1])
    # Each row's 10 positions in 3 blocks of 4, the last 2 positions padding.
    row0, row1 = (np.pad(np.asarray(prompt[name][1][b]), ((0, 0), (0, 2), (0, 0)))
                  .reshape(2, 3, Z, 8) for b in (0, 1))
    for j, block in enumerate([7, 3, 9]):
      np.testing.assert_array_equal(pages[:, block], row1[:, j])
    np.testing.assert_array_equal(pages[:, 4], row0[:, 2])
    untouched = [b for b in range(N) if b not in (7, 3, 9, 4)]
    assert not pages[:, untouched].any()


def _random_pages(seed, S, H, K, E, N, Z, M):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(S, H, E)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(K, N, Z, E)), jnp.float32) for _ in range(2))
  lengths_S = rng.integers(1, M * Z + 1, S).astype(np.int32)
  allocator = _shuffle(BlockAllocator(N, Z), seed)
  tables_SM = np.stack([allocator.table(allocator.allocate(allocator.blocks_for(n)), M)
                        for n in lengths_S])
  return q, k, v, jnp.asarray(tables_SM), jnp.asarray(lengths_S)


def _dense_reference(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S):
  """Attention of each slot over its own positions, from the blocks read one by one."""
  S, H, E = q_SHE.shape
  K = k_KNZE.shape[0]
  out = np.zeros((S, H, E))
  for s in range(S):
    n = int(lengths_S[s])
    keys = [np.asarray(k_KNZE)[:, tables_SM[s, p // k_KNZE.shape[2]], p % k_KNZE.shape[2]]
            for p in range(n)]
    vals = [np.asarray(v_KNZE)[:, tables_SM[s, p // k_KNZE.shape[2]], p % k_KNZE.shape[2]]
            for p in range(n)]
    k_KnE, v_KnE = np.stack(keys, 1), np.stack(vals, 1)
    for h in range(H):
      scores = k_KnE[h // (H // K)] @ np.asarray(q_SHE[s, h], np.float64) * E ** -0.5
      p = np.exp(scores - scores.max())
      out[s, h] = p @ v_KnE[h // (H // K)] / p.sum()
  return out


@pytest.mark.parametrize("Z, M, columns", [(4, 8, 8), (16, 2, 2)])
def test_ragged_xla_and_interpreted_pallas_attention_equal_the_reference(Z, M, columns):
  q, k, v, tables_SM, lengths_S = _random_pages(5, S=3, H=4, K=2, E=8, N=32, Z=Z, M=M)
  reference = _dense_reference(q, k, v, tables_SM, lengths_S)
  # float32 dot products of 8 terms and softmax over at most 32 positions against a
  # float64 reference.
  tol = dict(atol=2e-6, rtol=2e-6)
  # The blocks of all slots together, padded up to a larger static size.
  held = int(np.sum(np.asarray(tables_SM) < 32))
  for blocks in (held, held + 5):
    ragged = paged_decode.ragged_attention(q, k, v, tables_SM, lengths_S, blocks=blocks)
    np.testing.assert_allclose(ragged, reference, **tol)
  xla = paged.xla_attention(q, k, v, tables_SM, lengths_S, blocks=columns)
  np.testing.assert_allclose(xla, reference, **tol)
  pallas = paged.pallas_attention(q, k, v, tables_SM, lengths_S, blocks=columns,
                                  interpret=True)
  # The kernel's online softmax rescales once per step of blocks.
  np.testing.assert_allclose(pallas, reference, **tol)


def test_ragged_attention_reads_only_each_slots_blocks_up_to_its_length():
  q, k, v, tables_SM, lengths_S = _random_pages(7, S=4, H=4, K=2, E=8, N=32, Z=4, M=8)
  # Slot 3 holds no block (idle): zeros, not NaN. Slot 1 holds more blocks than its
  # length reaches: the extra ones are not read.
  tables_SM = np.asarray(tables_SM).copy()
  tables_SM[3] = 32
  lengths_S = np.asarray(lengths_S).copy()
  lengths_S[1] = 5
  garbage_k = k.at[:, tables_SM[1, 2:]].set(1e3)
  out = paged_decode.ragged_attention(q, garbage_k, v, tables_SM, lengths_S, blocks=32)
  reference = _dense_reference(q[:3], k, v, tables_SM[:3], lengths_S[:3])
  np.testing.assert_allclose(out[:3], reference, atol=2e-6, rtol=2e-6)
  np.testing.assert_array_equal(out[3], 0)


def test_interpreted_pallas_decode_step_equals_the_xla_step():
  both = _Both(4, seed=6)
  for _ in range(2):
    both.step()
  both.grow()
  tokens_S = jnp.arange(both.S, dtype=jnp.int32)
  run = lambda decoding, reads: paged.decode(both.params, both.cfg, both.cache, tokens_S,
                                             both.positions_S, reads=reads, decoding=decoding)
  xla_SV, xla_cache = run(CPU, both.reads("ragged"))
  pallas_SV, pallas_cache = run(
      paged.ColumnDecoding(functools.partial(paged.pallas_attention, interpret=True)),
      both.reads("columns"))
  np.testing.assert_allclose(pallas_SV[:both.live], xla_SV[:both.live], **_TOL)
  jax.tree.map(functools.partial(np.testing.assert_allclose, **_TOL), pallas_cache, xla_cache)


@pytest.mark.usefixtures("gpu_target")
def test_pallas_decode_step_lowers_for_cuda():
  """The decode step with the Triton kernel in every layer compiles to a CUDA module
  without a GPU (bfloat16, the tiny preset's head dim of 32)."""
  cfg = model_preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
  params = jax.eval_shape(lambda: models.split_layers(models.init_params(cfg, jax.random.key(0))))
  cache = jax.eval_shape(lambda: paged.init_cache(cfg, num_slots=8, num_blocks=64,
                                                  block_size=16, max_blocks=32))
  ints = jax.ShapeDtypeStruct((8,), jnp.int32)
  step = jax.jit(functools.partial(paged.decode, cfg=cfg, reads=paged.Reads("columns", 4),
                                   decoding=paged.for_kernels("gpu")))
  lowered = step.trace(params, cache=cache, tokens_S=ints,
                       positions_S=ints).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert re.findall(r'name = "(paged_attention\w*)"', text) == [
      "paged_attention_block_h_16_pages_per_compute_block_4"]
  assert "@__gpu$xla.gpu.triton" in text
  assert len(re.findall(r"call @paged_attention\(", text)) == cfg.n_layers


@pytest.mark.parametrize("kernels", [None, "gpu"])
def test_the_engine_traces_the_kernels_it_is_built_with(kernels):
  """By default those of its mesh's devices, here CPUs: plain XLA; built with "gpu", the
  Pallas kernels in prefill and decode, on this CPU-only host all the same."""
  cfg = model_preset("tiny")
  engine = Engine(cfg, max_concurrent_decodes=2, max_prefill_length=16, max_target_length=64,
                  kernels=kernels)
  gpu = kernels == "gpu"
  assert engine.decoding == paged.for_kernels("gpu" if gpu else "xla")
  params = jax.eval_shape(lambda: models.split_layers(models.init_params(cfg, jax.random.key(0))))
  sampling_1 = jax.tree.map(lambda x: np.asarray(x)[None], sampling.SlotSampling.create(
      sampling.SamplingParams(), seed=0, index=0))
  one = np.ones(1, np.int32)
  prefill = jax.make_jaxpr(functools.partial(ds.prefill, cfg=cfg, kernels=engine.kernels))(
      params, np.zeros((1, 16), np.int32), one, one, sampling_1)
  tables_SM = np.zeros((2, engine.max_blocks), np.int32)
  chunk = jax.make_jaxpr(functools.partial(
      ds.generate_chunk, cfg=cfg, steps=2, reads=engine.decode_buckets[0],
      decoding=engine.decoding))(params, engine.abstract_decode_state(), tables_SM)
  for jaxpr in (prefill, chunk):
    assert ("pallas_call" in str(jaxpr)) == gpu


def test_decode_compiles_once_per_bucket():
  both = _Both(4, seed=7)
  # A function of its own: jit wrappers of one function share their compile cache.
  step = jax.jit(lambda cache, tokens_S, positions_S, reads: paged.decode(
      both.params, both.cfg, cache, tokens_S, positions_S, reads=reads, decoding=CPU),
                 static_argnames="reads", donate_argnums=0)
  sizes = []
  four, eight = paged.Reads("ragged", 4), paged.Reads("ragged", 8)
  with compiles("<lambda>") as programs:
    for reads in (four, four, eight, four, eight, paged.Reads("columns", 8)):
      tokens_S = jnp.asarray(both.rng.integers(0, 61, both.S), jnp.int32)
      _, both.cache = step(both.cache, tokens_S, jnp.array(both.positions_S), reads)
      both.positions_S[:both.live] += 1
      sizes.append(len(programs))
  assert sizes == [1, 1, 2, 2, 2, 3]


def test_bucket_is_the_next_power_of_two_up_to_the_table():
  assert [paged.bucket(n, 64) for n in (0, 1, 2, 3, 4, 5, 33, 64)] == [1, 1, 2, 4, 4, 8, 64, 64]
  assert paged.bucket(40, 48) == 48


def test_step_reads_hold_the_tables_and_take_one_of_the_step_buckets():
  buckets = CPU.buckets(6, 16, 16)
  # A list of 64 blocks or more costs more than 6 rows of 16 columns: never taken.
  assert [r.blocks for r in buckets if r.layout == "ragged"] == [1, 2, 4, 8, 16, 32]
  assert [r.blocks for r in buckets if r.layout == "columns"] == [1, 2, 4, 8, 16]
  assert buckets[-1] == paged.Reads("columns", 16)  # every column of every table
  rng = np.random.default_rng(0)
  for _ in range(50):
    held_S = rng.integers(0, 17, 6)
    tables_SM = np.where(np.arange(16)[None] < held_S[:, None], 3, 20)
    reads = CPU.reads(tables_SM, 20, 16)
    # Listed: the blocks of all rows together, a shared block once per row (more than
    # the pool's 20 when the rows share).
    need = held_S.max() if reads.layout == "columns" else held_S.sum()
    assert reads in buckets and reads.blocks >= need


def test_step_reads_take_columns_for_even_slots_and_the_list_for_a_long_tail():
  S, M, N, Z = 64, 256, 64 * 256, 16
  # 64 slots of 5 blocks each: 64 x 8 columns cost less than a list of 512 blocks with
  # its per-slot softmax over the list.
  even = np.where(np.arange(M)[None] < 5, 0, N).repeat(S, axis=0)
  assert CPU.reads(even, N, Z) == paged.Reads("columns", 8)
  # One slot at 120 blocks, the rest at 5: 64 x 128 columns against a list of 512.
  tail = even.copy()
  tail[0, :120] = 0
  assert CPU.reads(tail, N, Z) == paged.Reads("ragged", 512)


def test_allocator_errors_leave_it_unchanged():
  allocator = BlockAllocator(4, 16)
  a = allocator.allocate(3)
  with pytest.raises(OutOfBlocks, match="2 blocks asked for, 1 of 4 free"):
    allocator.allocate(2)
  assert allocator.num_free == 1
  allocator.free(a[:1])
  with pytest.raises(ValueError, match=f"block {a[0]} freed 1 times but held 0"):
    allocator.free([a[1], a[0]])
  with pytest.raises(ValueError, match=f"block {a[1]} freed 2 times but held 1"):
    allocator.free([a[1], a[1]])
  with pytest.raises(ValueError, match="is free; only allocated blocks can be shared"):
    allocator.share([a[1], a[0]])
  with pytest.raises(ValueError, match="is not a block of a pool of 4"):
    allocator.free([4])
  assert allocator.num_free == 2
  assert [allocator.refcount(b) for b in a] == [0, 1, 1]
  with pytest.raises(ValueError, match="do not fit"):
    allocator.table(a, 2)
  np.testing.assert_array_equal(allocator.table(a[1:], 3), [a[1], a[2], 4])


@pytest.mark.parametrize("length, samples, shared, total", [(40, 3, 2, 5), (32, 3, 2, 2),
                                                            (5, 4, 0, 4), (0, 2, 0, 0)])
def test_a_group_shares_its_full_prompt_blocks(length, samples, shared, total):
  slot_blocks = SlotBlocks([0] * 4, num_blocks=8, block_size=16, max_blocks=4)
  allocator, record = slot_blocks.allocators[0], {}
  assert [slot_blocks.assign(s, length, (record, length)) for s in range(samples)] == [
      0] + [shared] * (samples - 1)
  group = slot_blocks.blocks[:samples]
  assert allocator.num_free == 8 - total
  assert all(g[:shared] == group[0][:shared] for g in group)
  assert all(allocator.refcount(b) == samples for b in group[0][:shared])
  own = [b for g in group for b in g[shared:]]
  assert len(set(own)) == len(own) == total - shared
  assert all(allocator.refcount(b) == 1 for b in own)
  for s in range(samples):
    slot_blocks.release(s)
  assert allocator.num_free == slot_blocks.num_free == 8


def test_a_prompt_is_shared_only_while_held_and_within_its_pool():
  # Slots 0 and 2 draw from pool 0, slots 1 and 3 from pool 1, 6 blocks of 4 each.
  slot_blocks = SlotBlocks([0, 1, 0, 1], num_blocks=6, block_size=4, max_blocks=6)
  record = {}
  prompt = (record, 9)  # 2 full blocks and a partial one
  assert slot_blocks.assign(0, 12, prompt) == 0
  assert slot_blocks.assign(1, 10, prompt) == 0  # the other pool writes its own
  assert slot_blocks.assign(2, 11, prompt) == 2
  assert slot_blocks.blocks[2][:2] == slot_blocks.blocks[0][:2] == list(record[0][0])
  assert slot_blocks.num_free == 12 - 4 - 3
  # Pool 1 has 3 blocks left: not enough for 16 positions, and nothing changes.
  assert slot_blocks.assign(3, 16) is None and slot_blocks.blocks[3] == []
  assert slot_blocks.grow(1, 20) and len(slot_blocks.blocks[1]) == 5
  assert not slot_blocks.grow(3, 8) and slot_blocks.blocks[3] == []
  with pytest.raises(ValueError, match="already holds"):
    slot_blocks.assign(1, 4)
  with pytest.raises(ValueError, match="do not fit"):
    slot_blocks.grow(3, 25)
  tables_SM = slot_blocks.table([0, 1])
  np.testing.assert_array_equal(tables_SM[0, :3], slot_blocks.blocks[0])
  np.testing.assert_array_equal(tables_SM[1, :5], slot_blocks.blocks[1])
  assert (tables_SM[0, 3:] == 6).all() and tables_SM[1, 5] == 6 and (tables_SM[2:] == 6).all()
  # Once every holder let go, the record no longer names held blocks: a new sample of
  # the prompt allocates (and writes) them again, even if the same blocks come back.
  slot_blocks.release(0)
  slot_blocks.release(2)
  assert slot_blocks.assign(2, 9, prompt) == 0
  assert slot_blocks.assign(0, 9, prompt) == 2


class AllocatorMachine(RuleBasedStateMachine):
  """Random allocate / share / free sequences against a model of who holds what: no
  block is lost or handed out twice, every count is exact, and a record of blocks and
  serials is held exactly while a holder of that hand-out is left."""

  N = 12

  def __init__(self):
    super().__init__()
    self.allocator = BlockAllocator(self.N, 4)
    self.holders = []  # (blocks, serials) per holder
    self.gone = []  # the records of hand-outs every holder let go of

  @rule(n=st.integers(0, 14))
  def allocate(self, n):
    free_before = self.allocator.num_free
    if n > free_before:
      with pytest.raises(OutOfBlocks):
        self.allocator.allocate(n)
      return
    blocks = self.allocator.allocate(n)
    held = {b for h, _ in self.holders for b in h}
    assert len(set(blocks)) == n and not held & set(blocks)
    self.holders.append((blocks, self.allocator.serials(blocks)))

  @precondition(lambda self: self.holders)
  @rule(data=st.data())
  def share(self, data):
    blocks, serials = data.draw(st.sampled_from(self.holders))
    self.allocator.share(blocks)
    self.holders.append((list(blocks), serials))

  @precondition(lambda self: self.holders)
  @rule(data=st.data())
  def free(self, data):
    i = data.draw(st.integers(0, len(self.holders) - 1))
    blocks, serials = self.holders.pop(i)
    self.allocator.free(blocks)
    if blocks and all(s != serials for _, s in self.holders):
      self.gone.append((blocks, serials))

  @precondition(lambda self: self.allocator.num_free)
  @rule(data=st.data())
  def free_a_free_block_fails(self, data):
    held = {b for h, _ in self.holders for b in h}
    free = sorted(set(range(self.N)) - held)
    with pytest.raises(ValueError, match="double free"):
      self.allocator.free([data.draw(st.sampled_from(free))])

  @invariant()
  def counts_are_exact(self):
    counts = np.zeros(self.N, int)
    for h, _ in self.holders:
      np.add.at(counts, h, 1)
    assert [self.allocator.refcount(b) for b in range(self.N)] == list(counts)
    assert self.allocator.num_free == int((counts == 0).sum())

  @invariant()
  def records_are_held_exactly_while_held(self):
    assert all(self.allocator.still_held(*h) for h in self.holders)
    assert not any(self.allocator.still_held(*g) for g in self.gone)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
