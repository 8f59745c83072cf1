"""A paged KV cache: fixed-size blocks in one pool per layer, and a block table per slot.

Memory is the pool, a budget in blocks, rather than slots x the longest possible
sample, and a decode step reads only the blocks its slots hold. This module is the
device side, pure functions over `PagedCache`; the host side, which blocks are free
and which slot holds which, is `generation.blocks`.

Shapes: S slots, L layers, K kv heads, H query heads, E head dim, N blocks in the pool,
Z tokens per block, M block-table columns (the most blocks one slot may hold), B
prompts, P their padded length, J = ceil(P / Z) blocks of a padded prompt. What a
decode step's attention reads is static (`Reads`, chosen by `step_reads`): the first
table columns of every slot, enough for the fullest (on GPU the Pallas kernel, which
skips the blocks past each slot's length; elsewhere a dense `window` gathered once per
run of steps), or, on a CPU, the blocks of all slots laid end to end
(`ragged_attention`), whichever costs less for the tables at hand: the first when the
slots hold about as many blocks each, the second for a long tail, so that the work
follows the tokens in flight.

Slot s's token at position p lives in block `tables_SM[s, p // Z]`, at offset `p % Z`.
A table entry N (one past the pool) means no block: a write there is dropped, a read
is clamped into the pool and masked by length. Each layer's pool is [K, N, Z, E], the
layout `jax.experimental.pallas.ops.gpu.paged_attention` reads.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from async_rl import models

_NEG_INF = -1e30
# The Pallas kernel's split of a slot's blocks into parallel partitions, and the most
# blocks it loads per step (the kernel's defaults); Triton's dot wants >= 16 keys a step.
_K_SPLITS, _PAGES_PER_STEP, _MIN_KEYS_PER_STEP = 16, 8, 16


@struct.dataclass
class PagedCache:
  """The KV blocks of every layer and the block tables of the slots.

  `k` and `v` hold L arrays [K, N, Z, E] (one buffer per layer, as `models.init_cache`,
  so that a donated layer's scatter updates it in place); `tables_SM` (int32) lists
  slot s's blocks in position order, N where it holds none.
  """
  k: tuple
  v: tuple
  tables_SM: jax.Array

  @property
  def num_blocks(self) -> int:
    return self.k[0].shape[1]

  @property
  def block_size(self) -> int:
    return self.k[0].shape[2]


def init_cache(cfg, *, num_slots: int, num_blocks: int, block_size: int,
               max_blocks: int) -> PagedCache:
  """A zeroed pool of `num_blocks` blocks; every slot's table empty (all N)."""
  shape = (cfg.n_kv_heads, num_blocks, block_size, cfg.head_dim)
  zeros = lambda: tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers))
  return PagedCache(k=zeros(), v=zeros(),
                    tables_SM=jnp.full((num_slots, max_blocks), num_blocks, jnp.int32))


def write_token(pages_KNZE, new_SKE, tables_SM, positions_S):
  """Writes slot s's key (or value) `new_SKE[s]` at `positions_S[s]` into its block.

  A slot whose position is past its table (an idle slot) or whose column there holds
  no block writes nowhere.
  """
  N, Z = pages_KNZE.shape[1], pages_KNZE.shape[2]
  block_S = jnp.take_along_axis(tables_SM, (positions_S // Z)[:, None], axis=1, mode="fill",
                                fill_value=N)[:, 0]
  new_KSE = jnp.swapaxes(new_SKE, 0, 1).astype(pages_KNZE.dtype)
  return pages_KNZE.at[:, block_S, positions_S % Z].set(new_KSE, mode="drop")


def insert(cache: PagedCache, prompt, row, slot, table_M, shared) -> PagedCache:
  """Gives `slot` the block table `table_M` and writes prompt `row` into its blocks.

  `prompt` is the cache `models.prefill` returns (k and v, L arrays [B, K, P, E]). The
  first `shared` blocks are skipped: they are the prompt's full blocks, which another
  sample of the group holds too and has written already (`SlotBlocks.assign`). The
  blocks past the prompt's length get the prefill's padding; the decode step
  overwrites a position before attention reads it.
  """
  N, Z = cache.num_blocks, cache.block_size
  P = prompt["k"][0].shape[2]
  J, M = -(-P // Z), table_M.shape[0]
  blocks_J = jnp.pad(table_M[:J], (0, max(J - M, 0)), constant_values=N)
  blocks_J = jnp.where(jnp.arange(J) < shared, N, blocks_J)

  def put(pages_KNZE, prompt_BKPE):
    K, E = prompt_BKPE.shape[1], prompt_BKPE.shape[3]
    row_KPE = jax.lax.dynamic_index_in_dim(prompt_BKPE, row, axis=0, keepdims=False)
    row_KJZE = jnp.pad(row_KPE, ((0, 0), (0, J * Z - P), (0, 0))).reshape(K, J, Z, E)
    return pages_KNZE.at[:, blocks_J].set(row_KJZE.astype(pages_KNZE.dtype), mode="drop")

  return cache.replace(k=tuple(map(put, cache.k, prompt["k"])),
                       v=tuple(map(put, cache.v, prompt["v"])),
                       tables_SM=cache.tables_SM.at[slot].set(table_M))


class Reads(NamedTuple):
  """What a decode step's attention reads (static): `blocks` table columns of every slot
  (layout "columns") or `blocks` blocks of all slots laid end to end ("ragged")."""
  layout: str
  blocks: int


def ragged_attention(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S, *, blocks):
  """Plain XLA over the blocks that hold the slots' positions, all slots' laid end to
  end: the work follows the tokens in flight, not the longest slot.

  Slot s reads the first min(ceil(lengths_S[s] / Z), its table's blocks) of its blocks;
  `blocks` (static) must hold them all together (the rest is padding, masked). Each
  block's scores are taken against its slot's queries, and the softmax over a slot's
  blocks is reduced with one-hot matmuls over the list, which on a CPU cost less than
  scatters.
  """
  S, H, E = q_SHE.shape
  K, N, Z, _ = k_KNZE.shape
  M = tables_SM.shape[1]
  counts_S = jnp.minimum(-(-lengths_S // Z), jnp.sum(tables_SM < N, axis=1))
  ends_S = jnp.cumsum(counts_S)
  # Entry p of the list is column col_P[p] of slot slot_P[p]'s table.
  p_P = jnp.arange(blocks)
  slot_P = jnp.minimum(jnp.searchsorted(ends_S, p_P, side="right"), S - 1)
  col_P = jnp.clip(p_P - (ends_S - counts_S)[slot_P], 0, M - 1)
  valid_P = p_P < ends_S[-1]
  block_P = jnp.minimum(tables_SM[slot_P, col_P], N - 1)
  # The gather indexes blocks only, so each kv head's blocks stay on the device that
  # holds the head: under tensor parallelism (pools split over kv heads) nothing of the
  # pool or of the gathered blocks is replicated.
  k_KPZE, v_KPZE = k_KNZE[:, block_P], v_KNZE[:, block_P]
  q_KPQE = jnp.swapaxes(q_SHE.reshape(S, K, H // K, E), 0, 1)[:, slot_P]
  scores = jnp.einsum("kpqe,kpze->kpqz", q_KPQE, k_KPZE,
                      preferred_element_type=jnp.float32) * (E ** -0.5)
  mask_PZ = ((col_P[:, None] * Z + jnp.arange(Z)[None, :] < lengths_S[slot_P][:, None])
             & valid_P[:, None])
  scores = jnp.where(mask_PZ[None, :, None], scores, _NEG_INF)
  own_SP = (slot_P[None, :] == jnp.arange(S)[:, None]) & valid_P[None, :]
  max_KSQ = jnp.max(jnp.where(own_SP[None, :, :, None], jnp.max(scores, -1)[:, None], _NEG_INF),
                    axis=2)
  probs = jnp.exp(scores - max_KSQ[:, slot_P][..., None])
  own_SP = own_SP.astype(jnp.float32)
  sum_KSQ = jnp.einsum("sp,kpq->ksq", own_SP, jnp.sum(probs, -1))
  out_KPQE = jnp.einsum("kpqz,kpze->kpqe", probs.astype(v_KPZE.dtype), v_KPZE,
                        preferred_element_type=jnp.float32)
  out_KSQE = jnp.einsum("sp,kpqe->ksqe", own_SP, out_KPQE)
  # A slot with no block (idle) gets zeros, not 0 / 0.
  out_KSQE = out_KSQE / jnp.where(sum_KSQ > 0, sum_KSQ, 1)[..., None]
  return jnp.swapaxes(out_KSQE, 0, 1).reshape(S, H, E).astype(q_SHE.dtype)


def pallas_attention(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S, *, blocks,
                     interpret: bool = False):
  """The Pallas (Triton) paged decode kernel over the first `blocks` columns; `interpret`
  runs it on any backend.

  The kernel splits a slot's blocks into up to 16 partitions that run in parallel, each
  in steps of a few blocks, and skips the steps past a slot's length. It pads each kv
  head's query heads up to its 16-row tile itself. It takes no softmax scale, so the
  queries are scaled first. Keys per step are at least 16 (Triton's smallest dot), so
  the table is padded with clamped columns, which the lengths mask, when `blocks` is
  too few. The head dim must be at least 16 on a GPU.
  """
  # Imported here: the Pallas GPU modules add half a second to every CPU process.
  from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
  E = q_SHE.shape[-1]
  N, Z = k_KNZE.shape[1], k_KNZE.shape[2]
  per_step = max(-(-_MIN_KEYS_PER_STEP // Z), min(_PAGES_PER_STEP, blocks))
  splits = max(1, min(_K_SPLITS, blocks // per_step))
  n = -(-blocks // (per_step * splits)) * per_step * splits
  tables_Sn = jnp.minimum(tables_SM[:, :blocks], N - 1)
  tables_Sn = jnp.pad(tables_Sn, ((0, 0), (0, n - tables_Sn.shape[1])), constant_values=N - 1)
  lengths_S = jnp.minimum(lengths_S, blocks * Z).astype(jnp.int32)
  q_SHE = (q_SHE * E ** -0.5).astype(q_SHE.dtype)
  return pallas_paged.paged_attention(q_SHE, k_KNZE, v_KNZE, tables_Sn, lengths_S,
                                      pages_per_compute_block=per_step, k_splits=splits,
                                      interpret=interpret)


def attention(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S, *, reads: Reads):
  """Decode attention of each slot to its first `lengths_S[s]` positions, in the blocks
  its table lists, reading what `reads` says: on GPU the Pallas kernel over
  `reads.blocks` table columns, elsewhere `ragged_attention` over `reads.blocks` blocks
  laid end to end (off GPU, table columns are read through a dense `window`: `decoder`).

  Returns [S, H, E] in the queries' dtype.
  """
  on_gpu = jax.default_backend() == "gpu"
  if reads.layout != ("columns" if on_gpu else "ragged"):
    raise ValueError(f"{reads} is not read by `attention` on {jax.default_backend()}")
  attend = pallas_attention if on_gpu else ragged_attention
  return attend(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S, blocks=reads.blocks)


def step_reads(tables_SM: np.ndarray, num_blocks: int, block_size: int) -> Reads:
  """What a decode chunk reads for the block tables `tables_SM` (host, [S, M]) of a pool
  of `num_blocks` blocks of `block_size` tokens: the bucket of the columns of the
  fullest row, or, on a CPU when it costs less, the bucket of the blocks of all rows
  together (a block that several rows share, a prompt's, counts once per row).

  The cost model counts multiply-adds per query element: reading C columns of S slots
  costs 2 S C Z (scores and values), reading P blocks end to end P (2 Z + S), their
  per-slot softmax reductions over the list adding S per block, and half as much again
  for the list's gathers and masks. On a CPU it picks the
  faster of the two in both regimes of BENCHMARKS.md: slots of about one length (the
  columns) and a long tail (the list).
  """
  S, M = tables_SM.shape
  held_S = np.sum(tables_SM < num_blocks, axis=1)
  columns = Reads("columns", bucket(int(held_S.max()), M))
  ragged = Reads("ragged", bucket(int(held_S.sum()), S * M))
  if jax.default_backend() != "gpu" and _list_costs_less(ragged.blocks, columns.blocks, S,
                                                         block_size):
    return ragged
  return columns


# What a listed block costs on a CPU beyond its multiply-adds, as a factor: its gathers
# of queries and lengths and its mask (fitted to decode chunks of 16, 32 and 64 slots).
_LIST_OVERHEAD = 1.5


def _list_costs_less(listed: int, columns: int, slots: int, block_size: int) -> bool:
  """`step_reads`' cost model: reading `listed` blocks end to end costs less than
  `columns` table columns of each of `slots` slots."""
  return (_LIST_OVERHEAD * listed * (2 * block_size + slots)
          < 2 * slots * columns * block_size)


def step_buckets(num_slots: int, max_blocks: int, block_size: int) -> tuple[Reads, ...]:
  """Every value `step_reads` can take for S slots, M columns and blocks of Z tokens; the
  last reads every column of every table. A list of P blocks is taken only when its
  fullest row could hold min(P, M) of them and the list costs less than that row's
  columns, so longer lists are left out."""
  def powers(limit):
    return tuple(b for b in (1 << i for i in range(limit.bit_length())) if b < limit) + (limit,)
  columns = tuple(Reads("columns", b) for b in powers(max_blocks))
  if jax.default_backend() == "gpu":
    return columns
  return tuple(Reads("ragged", p) for p in powers(num_slots * max_blocks) if _list_costs_less(
      p, bucket(min(p, max_blocks), max_blocks), num_slots, block_size)) + columns


def window(cache: PagedCache, columns: int) -> dict:
  """The blocks of the first `columns` table columns of every slot, gathered into a dense
  cache of `columns` Z positions per slot (`models.init_cache`'s layout: k and v, L
  arrays [S, K, columns Z, E]). Past a slot's blocks it holds some other block, which
  attention masks by position."""
  def gather(pages_KNZE):
    K, N, Z, E = pages_KNZE.shape
    blocks_SC = jnp.minimum(cache.tables_SM[:, :columns], N - 1)
    return jnp.swapaxes(pages_KNZE[:, blocks_SC], 0, 1).reshape(-1, K, columns * Z, E)
  return {"k": tuple(map(gather, cache.k)), "v": tuple(map(gather, cache.v))}


def write_back(cache: PagedCache, dense: dict, start_S, count_S, steps: int) -> PagedCache:
  """Writes positions `start_S[s]` .. `start_S[s] + count_S[s] - 1` of each slot's
  `window` back into its blocks: the ones its decode steps wrote, at most `steps`
  (static) per slot. Other positions of the window hold what the blocks hold."""
  N, Z = cache.num_blocks, cache.block_size
  positions_SI = start_S[:, None] + jnp.arange(steps)[None, :]
  block_SI = jnp.take_along_axis(cache.tables_SM, positions_SI // Z, axis=1, mode="fill",
                                 fill_value=N)
  block_SI = jnp.where(jnp.arange(steps)[None, :] < count_S[:, None], block_SI, N)
  slots_S1 = jnp.arange(start_S.shape[0])[:, None]

  def put(pages_KNZE, dense_SKTE):
    at_SI = jnp.minimum(positions_SI, dense_SKTE.shape[2] - 1)
    new_KSIE = jnp.moveaxis(dense_SKTE[slots_S1, :, at_SI], 2, 0)
    return pages_KNZE.at[:, block_SI, positions_SI % Z].set(new_KSIE.astype(pages_KNZE.dtype),
                                                            mode="drop")
  return cache.replace(k=tuple(map(put, cache.k, dense["k"])),
                       v=tuple(map(put, cache.v, dense["v"])))


def decoder(params, cfg, cache: PagedCache, *, reads: Reads, attend=None):
  """(kv, step, finish) for decode steps over `cache` with fixed tables, reading as
  `reads` (static: `step_reads`) says, which must hold every live slot's blocks:
  `step(kv, tokens_S, positions_S) -> (logits [S, V] float32, kv)` is `models.decode`'s
  step, one token per slot written at `positions_S` and attending to positions <= it
  (slots past their table, idle, write nowhere); `finish(kv, start_S, count_S, steps)`
  is the updated cache, where slot s wrote positions `start_S[s]` onwards in its first
  `count_S[s]` of at most `steps` (static) steps.

  Off GPU, table columns are gathered once into a dense `window` that every step decodes
  on as `models.decode` does, and `finish` writes back the positions written: a decode
  step is then the dense cache's, without a gather per step and layer. Otherwise each
  step reads the pools in every layer, with `attention`, or with `attend` when given
  (one of its implementations, called with `blocks=reads.blocks`).
  """
  if attend is None and reads.layout == "columns" and jax.default_backend() != "gpu":
    step = functools.partial(models.decode, params, cfg)
    return window(cache, reads.blocks), step, functools.partial(write_back, cache)

  def step(pools, tokens_S, positions_S):
    def attend_layer(q_S1HE, k_S1KE, v_S1KE, pages):
      k_KNZE = write_token(pages[0], k_S1KE[:, 0], cache.tables_SM, positions_S)
      v_KNZE = write_token(pages[1], v_S1KE[:, 0], cache.tables_SM, positions_S)
      args = (q_S1HE[:, 0], k_KNZE, v_KNZE, cache.tables_SM, positions_S + 1)
      out_SHE = (attention(*args, reads=reads) if attend is None
                 else attend(*args, blocks=reads.blocks))
      return out_SHE[:, None], (k_KNZE, v_KNZE)

    return models.decode_layers(params, cfg, pools, tokens_S, positions_S, attend_layer)

  def finish(pools, *_):  # the steps wrote into the pools
    k, v = zip(*pools)
    return cache.replace(k=tuple(k), v=tuple(v))

  return tuple(zip(cache.k, cache.v)), step, finish


def decode(params, cfg, cache: PagedCache, tokens_S, positions_S, *, reads: Reads,
           attend=None):
  """`models.decode` on a paged cache: one step of `decoder`; returns (logits [S, V]
  float32, updated cache)."""
  kv, step, finish = decoder(params, cfg, cache, reads=reads, attend=attend)
  logits_SV, kv = step(kv, tokens_S, positions_S)
  return logits_SV, finish(kv, positions_S, jnp.ones_like(positions_S), 1)


def bucket(live_blocks: int, max_blocks: int) -> int:
  """The table columns a decode step reads when no slot holds more than `live_blocks`
  blocks: the next power of two, at most `max_blocks`, so that the step compiles at most
  log2(M) + 1 times."""
  return min(max_blocks, 1 << max(live_blocks - 1, 0).bit_length())
