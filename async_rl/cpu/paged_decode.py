"""How decode steps read the paged cache on a CPU (`PagedDecoding`), chosen by the
builder for an engine on CPU devices; the core engine reads through `paged.Decoding`.

Two ways to read, whichever costs less for the block tables at hand (`PagedDecoding.reads`):
the first table columns of every slot, gathered once per decode chunk into a dense
`window` that every step decodes on as `models.decode` does, its new positions written
back at the end (`write_back`), so a step is the dense cache's, without a gather per
step and layer; or the blocks of all slots laid end to end (`ragged_attention`), so that
the work follows the tokens in flight. The first costs less when the slots hold about as
many blocks each, the second for a long tail.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from async_rl import models
from async_rl.generation import paged
from async_rl.generation.paged import Reads

_NEG_INF = -1e30


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


# What a listed block costs on a CPU beyond its multiply-adds, as a factor: its gathers
# of queries and lengths and its mask (fitted to decode chunks of 16, 32 and 64 slots).
_LIST_OVERHEAD = 1.5


def _list_costs_less(listed: int, columns: int, slots: int, block_size: int) -> bool:
  """`PagedDecoding.reads`' cost model: reading `listed` blocks end to end costs less than
  `columns` table columns of each of `slots` slots."""
  return (_LIST_OVERHEAD * listed * (2 * block_size + slots)
          < 2 * slots * columns * block_size)


@dataclasses.dataclass(frozen=True)
class PagedDecoding:
  """The CPU's `paged.Decoding`: table columns through a dense `window`, or the blocks of
  all slots laid end to end (`ragged_attention`), whichever costs less."""

  def buckets(self, num_slots: int, max_blocks: int, block_size: int) -> tuple[Reads, ...]:
    """A list of P blocks is taken only when its fullest row could hold min(P, M) of
    them and the list costs less than that row's columns, so longer lists are left
    out."""
    powers = paged.powers_of_two
    return tuple(Reads("ragged", p) for p in powers(num_slots * max_blocks) if _list_costs_less(
        p, paged.bucket(min(p, max_blocks), max_blocks), num_slots, block_size)) + tuple(
            Reads("columns", b) for b in powers(max_blocks))

  def reads(self, tables_SM: np.ndarray, num_blocks: int, block_size: int) -> Reads:
    """The bucket of the columns of the fullest row, or, when it costs less, the bucket
    of the blocks of all rows together (a block that several rows share, a prompt's,
    counts once per row).

    The cost model counts multiply-adds per query element: reading C columns of S slots
    costs 2 S C Z (scores and values), reading P blocks end to end P (2 Z + S), their
    per-slot softmax reductions over the list adding S per block, and half as much again
    for the list's gathers and masks. It picks the faster of the two in both regimes of
    BENCHMARKS.md: slots of about one length (the columns) and a long tail (the list).
    """
    S, M = tables_SM.shape
    columns = paged.column_reads(tables_SM, num_blocks)
    held = int(np.sum(tables_SM < num_blocks))
    ragged = Reads("ragged", paged.bucket(held, S * M))
    if _list_costs_less(ragged.blocks, columns.blocks, S, block_size):
      return ragged
    return columns

  def decoder(self, params, cfg, cache: paged.PagedCache, reads: Reads):
    """`paged.decoder`'s contract: columns on the `window`, a list with
    `ragged_attention` on the pools."""
    if reads.layout == "columns":
      step = functools.partial(models.decode, params, cfg)
      return window(cache, reads.blocks), step, functools.partial(write_back, cache)
    if reads.layout == "ragged":
      return paged.decoder(params, cfg, cache, reads=reads, attend=ragged_attention)
    raise ValueError(f"{self} does not read {reads}")


def window(cache: paged.PagedCache, columns: int) -> dict:
  """The blocks of the first `columns` table columns of every slot, gathered into a dense
  cache of `columns` Z positions per slot (`models.init_cache`'s layout: k and v, L
  arrays [S, K, columns Z, E]). Past a slot's blocks it holds some other block, which
  attention masks by position."""
  def gather(pages_KNZE):
    K, N, Z, E = pages_KNZE.shape
    blocks_SC = jnp.minimum(cache.tables_SM[:, :columns], N - 1)
    return jnp.swapaxes(pages_KNZE[:, blocks_SC], 0, 1).reshape(-1, K, columns * Z, E)
  return {"k": tuple(map(gather, cache.k)), "v": tuple(map(gather, cache.v))}


def write_back(cache: paged.PagedCache, dense: dict, start_S, count_S,
               steps: int) -> paged.PagedCache:
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
