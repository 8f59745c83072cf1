"""A paged KV cache: fixed-size blocks in one pool per layer, and a block table per slot.

Memory is the pool, a budget in blocks, rather than slots x the longest possible
sample, and a decode step reads only the blocks its slots hold. This module is the
device side, pure functions over `PagedCache`; the host side, which blocks are free
and which slot holds which, is `generation.blocks`.

Shapes: S slots, L layers, K kv heads, H query heads, E head dim, N blocks in the pool,
Z tokens per block, M block-table columns (the most blocks one slot may hold), B
prompts, P their padded length, J = ceil(P / Z) blocks of a padded prompt. What a
decode step's attention reads is static (`Reads`), and how it reads is the engine's
`Decoding`, chosen where the engine is built from the devices it runs on: here
`ColumnDecoding`, the first table columns of every slot, enough for the fullest,
through the Pallas kernel on GPUs (which skips the blocks past each slot's length) or
plain XLA elsewhere (`xla_attention`); `cpu.PagedDecoding` is the CPU's.

Slot s's token at position p lives in block `tables_SM[s, p // Z]`, at offset `p % Z`.
A table entry N (one past the pool) means no block: a write there is dropped, a read
is clamped into the pool and masked by length. Each layer's pool is [K, N, Z, E], the
layout `jax.experimental.pallas.ops.gpu.paged_attention` reads.
"""

import dataclasses
from typing import Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from async_rl import models
from async_rl.models import attention

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
  (layout "columns") or, on a CPU (`cpu.PagedDecoding`), `blocks` blocks of all slots
  laid end to end ("ragged")."""
  layout: str
  blocks: int


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


def xla_attention(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S, *, blocks):
  """Plain XLA over the first `blocks` columns, on any backend: each slot's blocks
  gathered into `blocks` Z positions, those at or past `lengths_S[s]` masked."""
  S, H, E = q_SHE.shape
  K, N, Z, _ = k_KNZE.shape
  blocks_SC = jnp.minimum(tables_SM[:, :blocks], N - 1)
  # Gathered by block, so each kv head's blocks stay on the device that holds the head.
  k_SKTE, v_SKTE = (jnp.swapaxes(x[:, blocks_SC], 0, 1).reshape(S, K, blocks * Z, E)
                    for x in (k_KNZE, v_KNZE))
  scores = jnp.einsum("skqe,skte->skqt", q_SHE.reshape(S, K, H // K, E), k_SKTE,
                      preferred_element_type=jnp.float32) * (E ** -0.5)
  mask_ST = jnp.arange(blocks * Z)[None, :] < lengths_S[:, None]
  scores = jnp.where(mask_ST[:, None, None], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_SKTE.dtype)
  return jnp.einsum("skqt,skte->skqe", probs, v_SKTE).reshape(S, H, E).astype(q_SHE.dtype)


def decoder(params, cfg, cache: PagedCache, *, reads: Reads, attend):
  """(kv, step, finish) for decode steps over `cache` with fixed tables, whose attention
  in every layer and step is `attend(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S,
  blocks=reads.blocks)` (`pallas_attention`, `xla_attention`, ...) over the pools;
  `reads` (static) must hold every live slot's blocks.

  `step(kv, tokens_S, positions_S) -> (logits [S, V] float32, kv)` is `models.decode`'s
  step, one token per slot written at `positions_S` and attending to positions <= it
  (slots past their table, idle, write nowhere); `finish(kv, start_S, count_S, steps)`
  is the updated cache, where slot s wrote positions `start_S[s]` onwards in its first
  `count_S[s]` of at most `steps` (static) steps. A `Decoding`'s `decoder` has this
  contract.
  """
  def step(pools, tokens_S, positions_S):
    def attend_layer(q_S1HE, k_S1KE, v_S1KE, pages):
      k_KNZE = write_token(pages[0], k_S1KE[:, 0], cache.tables_SM, positions_S)
      v_KNZE = write_token(pages[1], v_S1KE[:, 0], cache.tables_SM, positions_S)
      out_SHE = attend(q_S1HE[:, 0], k_KNZE, v_KNZE, cache.tables_SM, positions_S + 1,
                       blocks=reads.blocks)
      return out_SHE[:, None], (k_KNZE, v_KNZE)

    return models.decode_layers(params, cfg, pools, tokens_S, positions_S, attend_layer)

  def finish(pools, *_):  # the steps wrote into the pools
    k, v = zip(*pools)
    return cache.replace(k=tuple(k), v=tuple(v))

  return tuple(zip(cache.k, cache.v)), step, finish


class Decoding(Protocol):
  """How decode steps read the paged cache: the engine's choice (`Engine(decoding=)`),
  hashable, as it is a static argument of the decode programs."""

  def buckets(self, num_slots: int, max_blocks: int, block_size: int) -> tuple[Reads, ...]:
    """Every value `reads` can take for S slots of M table columns and blocks of Z tokens;
    the last reads every column of every table."""

  def reads(self, tables_SM: np.ndarray, num_blocks: int, block_size: int) -> Reads:
    """What a decode chunk reads for the block tables `tables_SM` (host, [S, M]) of a pool
    of `num_blocks` blocks of `block_size` tokens: one of `buckets`, holding the tables."""

  def decoder(self, params, cfg, cache: PagedCache, reads: Reads):
    """(kv, step, finish) for decode steps reading `reads`, as `decoder`'s."""


@dataclasses.dataclass(frozen=True)
class ColumnDecoding:
  """The `Decoding` that reads the first table columns of every slot, enough for the
  fullest (`bucket`), through `attend` (as `decoder` calls it) in every layer and step."""
  attend: Callable

  def buckets(self, num_slots: int, max_blocks: int, block_size: int) -> tuple[Reads, ...]:
    return tuple(Reads("columns", b) for b in powers_of_two(max_blocks))

  def reads(self, tables_SM: np.ndarray, num_blocks: int, block_size: int) -> Reads:
    return column_reads(tables_SM, num_blocks)

  def decoder(self, params, cfg, cache: PagedCache, reads: Reads):
    if reads.layout != "columns":
      raise ValueError(f"{self} reads table columns, not {reads}")
    return decoder(params, cfg, cache, reads=reads, attend=self.attend)


def for_kernels(kernels: str) -> ColumnDecoding:
  """The core's `Decoding` for the attention kernels of the engine's devices
  (`models.attention.kernels_for`): "gpu" the Pallas kernel, "xla" `xla_attention`."""
  if kernels not in attention.KERNELS:
    raise ValueError(f"kernels must be one of {attention.KERNELS}, got {kernels!r}")
  return ColumnDecoding(pallas_attention if kernels == "gpu" else xla_attention)


def decode(params, cfg, cache: PagedCache, tokens_S, positions_S, *, reads: Reads,
           decoding: Decoding):
  """`models.decode` on a paged cache: one step of `decoding.decoder`; returns
  (logits [S, V] float32, updated cache)."""
  kv, step, finish = decoding.decoder(params, cfg, cache, reads)
  logits_SV, kv = step(kv, tokens_S, positions_S)
  return logits_SV, finish(kv, positions_S, jnp.ones_like(positions_S), 1)


def bucket(live_blocks: int, max_blocks: int) -> int:
  """The table columns a decode step reads when no slot holds more than `live_blocks`
  blocks: the next power of two, at most `max_blocks`, so that the step compiles at most
  log2(M) + 1 times."""
  return min(max_blocks, 1 << max(live_blocks - 1, 0).bit_length())


def powers_of_two(limit: int) -> tuple[int, ...]:
  """The values `bucket` takes below `limit`, then `limit`."""
  return tuple(b for b in (1 << i for i in range(limit.bit_length())) if b < limit) + (limit,)


def column_reads(tables_SM: np.ndarray, num_blocks: int) -> Reads:
  """The bucket of the table columns of the fullest row of `tables_SM` (host, [S, M])."""
  held_S = np.sum(tables_SM < num_blocks, axis=1)
  return Reads("columns", bucket(int(held_S.max()), tables_SM.shape[1]))
