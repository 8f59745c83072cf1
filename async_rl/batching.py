"""Dynamic micro-batching: length-aware allocation and packing into bucketed shapes.

Host-side numpy. `ffd_allocate` groups sequences under a token budget (AReaL
Algorithm 1); `pack` lays an allocation out as packed rows with segment ids and
positions; `pack_dynamic` chooses a row length per batch, does both and pads to a
small fixed set of shapes so the jitted train step compiles a bounded number of times.
"""

import math
from collections.abc import Collection, Sequence as SequenceOf
from typing import Optional

import numpy as np
from flax import struct

from async_rl.trajectory import Trajectory


def ffd_allocate(lengths: SequenceOf[int], max_tokens_per_mb: int,
                 min_groups: int = 1) -> list[list[int]]:
  """Groups sequence indices so no group holds more than `max_tokens_per_mb` tokens.

  First-fit-decreasing after AReaL (Fu et al. 2025, Algorithm 1): indices are taken
  by length, longest first (ties: lower index first); each goes to the group that
  fits it and holds the fewest sequences (ties: the earliest-created group), or
  opens a new group when none fits. Choosing the group with the fewest sequences
  rather than the first or tightest fit spreads short sequences over the groups.

  If that yields fewer than `min_groups` groups, the allocation is redone starting
  from `min_groups` empty groups: the longest `min_groups` sequences then land one
  per group and the rest fill in by the same rule, so every group is non-empty when
  there are at least `min_groups` sequences. With fewer sequences than that, each
  sequence gets its own group and empty lists pad the result up to `min_groups`
  (so `ffd_allocate([], b)` is `[[]]`).

  Args:
    lengths: token count of each sequence.
    max_tokens_per_mb: token budget of one group.
    min_groups: the least number of groups returned.

  Returns:
    Lists of indices into `lengths`; each index appears exactly once. Deterministic.

  Raises:
    ValueError: if a sequence alone exceeds the budget, or on invalid arguments.
  """
  if max_tokens_per_mb < 1:
    raise ValueError(f"max_tokens_per_mb must be >= 1, got {max_tokens_per_mb}")
  if min_groups < 0:
    raise ValueError(f"min_groups must be >= 0, got {min_groups}")
  lengths = [int(n) for n in lengths]
  for i, n in enumerate(lengths):
    if n < 0:
      raise ValueError(f"sequence {i} has negative length {n}")
    if n > max_tokens_per_mb:
      raise ValueError(f"sequence {i} has length {n}, over the budget of "
                       f"max_tokens_per_mb={max_tokens_per_mb} tokens")
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  groups = _fewest_fit(order, lengths, max_tokens_per_mb, num_open=0)
  if len(groups) < min_groups:
    groups = _fewest_fit(order, lengths, max_tokens_per_mb, num_open=min_groups)
  return groups


def _fewest_fit(order, lengths, budget, num_open):
  groups = [[] for _ in range(num_open)]
  totals = [0] * num_open
  for i in order:
    best = None
    for g, total in enumerate(totals):
      fits = total + lengths[i] <= budget
      if fits and (best is None or len(groups[g]) < len(groups[best])):
        best = g
    if best is None:
      groups.append([])
      totals.append(0)
      best = len(groups) - 1
    groups[best].append(i)
    totals[best] += lengths[i]
  return groups


@struct.dataclass
class PackedBatch:
  """Trajectories packed as M micro-batches of R rows of T tokens; all fields [M, R, T].

  Only what the train step reads. Position convention: position p of a row holds
  token p and the quantities of predicting token p from the tokens before it in its
  segment, so `behav_logp` and `advantages` at a loss-mask position belong to that
  token.

  Attributes:
    tokens: int32 token ids, 0 on padding.
    positions: int32 position of the token within its sequence, 0..len-1; 0 on
      padding.
    segment_ids: int32 1, 2, 3, ... for the sequences of a row in order; 0 on
      padding.
    loss_mask: float32, 1 on the trajectories' loss-mask tokens, 0 elsewhere.
    behav_logp: float32 behaviour-policy log-prob, 0 off the mask.
    advantages: float32 the trajectory's advantage, 0 off the mask.
    versions: int32 version of each loss-mask token, -1 elsewhere; only packed
      (`with_versions`) for the trainer (the log-linear proximal estimate and the
      step's mismatch metrics), None otherwise.
    ref_logp: float32 reference-policy log-prob, 0 off the mask; set by the trainer
      (not packed) when the KL penalty is in the loss, None otherwise.
    top_k, top_p: int32 and float32 truncation each loss-mask token's behaviour
      log-prob is taken under (its trajectory's `top_k` / `top_p`), 0 and 1
      elsewhere; packed only when a trajectory is truncated, None otherwise (the
      log-probs are then of the full softmax, at no cost for truncation).
  """
  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  loss_mask: np.ndarray
  behav_logp: np.ndarray
  advantages: np.ndarray
  versions: Optional[np.ndarray] = None
  ref_logp: Optional[np.ndarray] = None
  top_k: Optional[np.ndarray] = None
  top_p: Optional[np.ndarray] = None


def pack(trajs: SequenceOf[Trajectory], advantages_N, groups: SequenceOf[SequenceOf[int]], *,
         rows_per_mb: int, row_len: int, with_versions: bool = False) -> PackedBatch:
  """Packs an allocation: group g becomes row g; rows m*R..(m+1)*R-1 form micro-batch m.

  Each row holds its group's trajectories concatenated in order, then padding up to
  `row_len`; trajectory i's loss-mask tokens get advantage `advantages_N[i]`. Empty
  rows pad the row count to a multiple of `rows_per_mb`; an empty group gives an
  empty row. The truncation fields are packed when a trajectory is truncated.

  Raises:
    ValueError: if a group holds more than `row_len` tokens, or on invalid arguments.
  """
  if rows_per_mb < 1 or row_len < 1:
    raise ValueError(f"rows_per_mb and row_len must be >= 1, got {rows_per_mb}, {row_len}")
  if len(advantages_N) != len(trajs):
    raise ValueError(f"need one advantage per trajectory, got {len(advantages_N)} for "
                     f"{len(trajs)}")
  num_mb = -(-len(groups) // rows_per_mb)
  shape = (num_mb * rows_per_mb, row_len)
  tokens = np.zeros(shape, np.int32)
  positions = np.zeros(shape, np.int32)
  segment_ids = np.zeros(shape, np.int32)
  loss_mask = np.zeros(shape, np.float32)
  behav_logp = np.zeros(shape, np.float32)
  advantages = np.zeros(shape, np.float32)
  versions = np.full(shape, -1, np.int32)
  truncated = any(trajs[i].truncated for group in groups for i in group)
  top_k = np.zeros(shape, np.int32)
  top_p = np.ones(shape, np.float32)
  for r, group in enumerate(groups):
    total = sum(len(trajs[i]) for i in group)
    if total > row_len:
      raise ValueError(f"group {r} holds {total} tokens, over row_len={row_len}")
    start = 0
    for segment, i in enumerate(group, start=1):
      traj = trajs[i]
      span = slice(start, start + len(traj))
      mask_T = traj.loss_mask_T
      tokens[r, span] = traj.tokens_T
      positions[r, span] = np.arange(len(traj))
      segment_ids[r, span] = segment
      loss_mask[r, span] = mask_T
      behav_logp[r, span] = np.where(mask_T, traj.logp_T, 0.0)
      advantages[r, span] = np.where(mask_T, advantages_N[i], 0.0)
      versions[r, span] = np.where(mask_T, traj.versions_T, -1)
      top_k[r, span] = np.where(mask_T, traj.top_k, 0)
      top_p[r, span] = np.where(mask_T, traj.top_p, 1.0)
      start = span.stop
  to_mrt = lambda x: x.reshape(num_mb, rows_per_mb, row_len)
  return PackedBatch(
      tokens=to_mrt(tokens), positions=to_mrt(positions),
      segment_ids=to_mrt(segment_ids), loss_mask=to_mrt(loss_mask),
      behav_logp=to_mrt(behav_logp), advantages=to_mrt(advantages),
      versions=to_mrt(versions) if with_versions else None,
      top_k=to_mrt(top_k) if truncated else None, top_p=to_mrt(top_p) if truncated else None)


def default_row_buckets(max_tokens_per_mb: int, smallest: int = 64,
                        longest: Optional[int] = None) -> tuple[int, ...]:
  """Row lengths max, max/2, max/4, ... down to `smallest`, and `longest`; multiples of 8.

  Halving keeps a row's padding under half its length once a row holds its longest
  sequence; rows as short as the sequences keep attention (which grows with the row
  length) cheap. `longest`, the longest sequence a run can produce (a trainer passes
  `generation.max_prompt_len + generation.max_new_tokens`), adds the row that one such
  sequence fills: in a batch that holds one, rows of that length carry no padding
  (a workload whose sequences are all 80 tokens long gets rows of 80 instead of 128,
  or three to a row of 256). It is dropped when over the max. Each length is rounded up to a multiple of 8, to suit the accelerator's tiling.
  Only the lengths a run meets are compiled. Duplicates (for a small max) are dropped.
  """
  if max_tokens_per_mb < 1 or smallest < 1:
    raise ValueError(f"max_tokens_per_mb and smallest must be >= 1, got "
                     f"{max_tokens_per_mb} and {smallest}")
  if longest is not None and longest < 1:
    raise ValueError(f"longest must be >= 1, got {longest}")
  round8 = lambda n: -(-n // 8) * 8
  buckets, k = {round8(max_tokens_per_mb)}, 1
  while -(-max_tokens_per_mb // 2**k) >= smallest:
    buckets.add(round8(-(-max_tokens_per_mb // 2**k)))
    k += 1
  if longest is not None and longest <= max_tokens_per_mb:
    buckets.add(round8(longest))
  return tuple(sorted(buckets))


def rows_per_mb(row_len: int, *, max_tokens_per_mb: int, num_shards: int) -> int:
  """The most rows R of `row_len` a micro-batch takes: `max_tokens_per_mb // row_len`
  (at least 1) per shard."""
  return num_shards * max(1, max_tokens_per_mb // row_len)


def row_counts(row_len: int, *, max_tokens_per_mb: int, num_shards: int) -> tuple[int, ...]:
  """Every R `pack_dynamic` may pick for rows of `row_len`: per shard, the eighths of
  the most (`rows_per_mb`) rounded up, so at most 8 shapes per row length compile."""
  most = rows_per_mb(row_len, max_tokens_per_mb=max_tokens_per_mb, num_shards=1)
  return tuple(sorted({num_shards * -(-k * most // 8) for k in range(1, 9)}))


def _balanced_rows(num_rows: int, num_mb: int, counts: SequenceOf[int]) -> int:
  """The fewest of `counts` rows per micro-batch that hold `num_rows` in `num_mb`."""
  return next(r for r in counts if r * num_mb >= num_rows)


def pack_dynamic(trajs: SequenceOf[Trajectory], advantages_N, *, max_tokens_per_mb: int,
                 num_shards: int, row_buckets: SequenceOf[int],
                 attention_len: float = math.inf, with_versions: bool = False,
                 num_parts: int = 1, compiled: Collection[tuple[int, int, int]] = (),
                 reuse_slack: float = 0.0) -> PackedBatch:
  """Packs into [M, R, T] with T one of `row_buckets`, chosen per batch.

  For each bucket T that holds the longest sequence, `ffd_allocate` fills rows of T
  tokens (at least `num_shards` rows). A micro-batch holds at most `rows_per_mb(T)`
  rows, so each of the `num_shards` batch shards (data x fsdp) holds at most
  `max_tokens_per_mb` tokens of it (or one row, if T is longer). The real
  micro-batches are the fewest that hold the rows, rounded up to a multiple of
  `num_parts` (the equal parts the train step shares them out in: its
  `micro_batch_multiple`) as far as there are rows for them, and R the fewest rows
  that spread the rows over them (`row_counts`: an eighth of the most per shard at a
  time). So 64 rows under a most of 12 run as 6 x 11 rows, not 6 x 12, and no part
  gets fewer real micro-batches than another. M is then
  rounded up to a power of two, so the train step sees O(#buckets x 8 x log M)
  shapes. The chosen T has the least estimated cost: executed slots (real
  micro-batches x R x T) times `1 + T / attention_len`, the share causal attention
  adds to a row of length T
  (`models.flops.attention_break_even_len`; the default counts slots only); ties go
  to the shorter rows.

  `compiled` names the [M, R, T] shapes the train step already compiled (a trainer
  passes those it has run): the batch takes the cheapest of them that holds it (its
  real micro-batches, counted as above, at most M) when that costs at most
  `reuse_slack` more than its cheapest shape, since on a CPU a compile costs several
  steps. The warm start, which knows its batches in advance, packs them all into one
  shape (`sft._one_shape`, with `reuse_slack` = inf).

  Rows are dealt to the micro-batches longest first in snake order, so real
  micro-batches differ in token count by at most the longest row; all-empty padding
  micro-batches come last (the train step skips them, and its strided minibatches
  share them out; `pad_micro_batches` makes M a multiple of their count). Advantages
  and `with_versions` are as in `pack`.

  Raises:
    ValueError: if no bucket holds the longest sequence, or on invalid arguments.
  """
  if num_shards < 1 or max_tokens_per_mb < 1 or num_parts < 1:
    raise ValueError(f"num_shards, max_tokens_per_mb and num_parts must be >= 1, got "
                     f"{num_shards}, {max_tokens_per_mb} and {num_parts}")
  if reuse_slack < 0:
    raise ValueError(f"reuse_slack must be >= 0, got {reuse_slack}")
  lengths = [len(t) for t in trajs]
  longest = max(lengths, default=0)
  fitting = [b for b in sorted(set(row_buckets)) if b >= longest]
  if not fitting:
    raise ValueError(f"no row bucket in {tuple(sorted(row_buckets))} holds a sequence of "
                     f"{longest} tokens")
  best, reuse = None, None
  for row_len in fitting:
    groups = ffd_allocate(lengths, row_len, min_groups=num_shards)
    weight = row_len * (1 + row_len / attention_len)
    counts = row_counts(row_len, max_tokens_per_mb=max_tokens_per_mb, num_shards=num_shards)
    num_mb = _real_micro_batches(len(groups), counts[-1], num_parts)
    R = _balanced_rows(len(groups), num_mb, counts)
    if best is None or num_mb * R * weight < best[0]:
      best = num_mb * R * weight, row_len, R, num_mb, 1 << (num_mb - 1).bit_length(), groups
    for M_c, R_c, T_c in compiled:
      if T_c != row_len or R_c not in counts:
        continue
      n = _real_micro_batches(len(groups), R_c, num_parts)
      if n <= M_c and (reuse is None or n * R_c * weight < reuse[0]):
        reuse = n * R_c * weight, row_len, R_c, n, M_c, groups
  if reuse is not None and reuse[0] <= best[0] * (1 + reuse_slack):
    best = reuse
  _, row_len, R, num_mb, padded_mb, groups = best
  return pack(trajs, advantages_N,
              _deal(groups, [sum(lengths[i] for i in g) for g in groups], R, num_mb,
                    padded_mb),
              rows_per_mb=R, row_len=row_len, with_versions=with_versions)


def _real_micro_batches(num_rows, rows_per_mb, num_parts):
  """The fewest micro-batches of `rows_per_mb` that hold the rows, rounded up to a
  multiple of `num_parts` as far as there are rows."""
  num_mb = -(-num_rows // rows_per_mb)
  return min(-(-num_mb // num_parts) * num_parts, num_rows)


def _deal(groups, totals, R, num_mb, padded_mb):
  """Rows in micro-batch order: snake-dealt longest first over `num_mb` micro-batches of
  R rows, then empty micro-batches up to `padded_mb`."""
  rows_of_mb = [[] for _ in range(num_mb)]
  for k, g in enumerate(sorted(range(len(groups)), key=lambda g: (-totals[g], g))):
    lap, j = divmod(k, num_mb)
    rows_of_mb[j if lap % 2 == 0 else num_mb - 1 - j].append(groups[g])
  rows = []
  for mb_rows in rows_of_mb + [[]] * (padded_mb - num_mb):
    rows += mb_rows + [[]] * (R - len(mb_rows))
  return rows


def pad_micro_batches(batch: PackedBatch, multiple: int) -> PackedBatch:
  """Appends empty micro-batches until M is a multiple of `multiple` (PPO minibatches)."""
  if multiple < 1:
    raise ValueError(f"multiple must be >= 1, got {multiple}")
  M = batch.tokens.shape[0]
  extra = -M % multiple
  if not extra:
    return batch
  padded = {}
  for name in PackedBatch.__dataclass_fields__:
    x = getattr(batch, name)
    if x is not None:
      fill = {"versions": -1, "top_p": 1}.get(name, 0)
      padded[name] = np.concatenate([x, np.full((extra, *x.shape[1:]), fill, x.dtype)])
  return batch.replace(**padded)
