"""The training buffer: strict per-token staleness admission, oldest groups out first.

Plain Python and not thread-safe: its owner (the `ParameterServer`) calls it under
its lock.
"""

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Optional

import numpy as np

from async_rl.config import ON_STALE
from async_rl.rl.errors import VersionError
from async_rl.trajectory import Group, staleness_counts

# Samples by completion length: offered, admitted, dropped (at offer or while
# waiting), handed to the trainer; and "trained_tokens", the tokens those trained
# samples of each length kept in the loss.
LENGTH_KINDS = ("generated", "admitted", "dropped", "trained", "trained_tokens")
_COUNTERS = ("admitted", "dropped", "admitted_stale", "trained", "trained_stale",
             "masked_tokens")


class AdmissionBuffer:
  """Admitted groups waiting for the trainer, each token within the staleness bound.

  A group is stale at trainer version v when one of the tokens it would train (a
  policy token in its loss mask) has a version below v - η (η = None: never).
  Staleness is checked when a group is offered and again whenever the version
  moves (`purge`), and `on_stale` says what happens to a stale group:

    "drop"         it is dropped (the default);
    "mask_tokens"  its tokens older than v - η leave the loss mask, so that long
                   samples, whose first tokens are the oldest, still train on their
                   recent part; a group left with no token to train is dropped;
    "admit"        it is kept as it is, and counted.

  So with "drop" or "mask_tokens" no token handed to the trainer breaks the bound.

  Groups leave oldest first: by `min_version`, then by ticket (the order in which
  they were started). Taking the group closest to its staleness deadline first is
  what keeps drops fewest, and the ticket makes the order independent of when each
  group happened to finish.

  Counters, in groups unless said: `admitted` into the buffer; `dropped` as stale,
  when offered or while waiting; `admitted_stale` admitted although stale ("admit",
  or "mask_tokens" with some tokens masked); `trained` handed to the trainer;
  `trained_stale` handed over with a trained token staler than η ("admit" only);
  `masked_tokens` policy tokens of trained groups masked out as too stale.
  `staleness_hist[k]` counts the trained tokens of staleness k, and
  `length_hist[kind][n]` the samples of n policy tokens that were generated
  (offered), admitted, dropped and trained, and the tokens such trained samples kept
  in the loss ("trained_tokens").
  """

  def __init__(self, max_staleness: Optional[int], on_stale: str = "drop"):
    if on_stale not in ON_STALE:
      raise ValueError(f"on_stale must be one of {ON_STALE}, got {on_stale!r}")
    self.max_staleness = max_staleness
    self.on_stale = on_stale
    for name in _COUNTERS:
      setattr(self, name, 0)
    self.staleness_hist: list[int] = []
    self.length_hist: dict[str, list[int]] = {kind: [] for kind in LENGTH_KINDS}
    self._heap: list[tuple[int, int, Group]] = []

  def __len__(self):
    return len(self._heap)

  def is_stale(self, group: Group, version: int) -> bool:
    oldest = _oldest_trained(group)
    return (self.max_staleness is not None and oldest is not None
            and version - oldest > self.max_staleness)

  def offer(self, group: Group, version: int, ticket: int) -> bool:
    """Admits `group` at trainer version `version` or drops it; returns whether admitted.

    `ticket` orders groups of equal `min_version` (see the class docstring).

    Raises:
      VersionError: if `group` holds a token newer than `version` (params that were
        never published), or one in its loss without a version; nothing changes then.
    """
    check_versions([group], newest=version, oldest=None,
                   where=f"offered at published version {version}")
    _count_lengths(self.length_hist["generated"], [group])
    stale = self.is_stale(group, version)
    kept = self._admissible(group, version)
    if kept is None:
      self.dropped += 1
      _count_lengths(self.length_hist["dropped"], [group])
      return False
    self.admitted += 1
    self.admitted_stale += stale
    _count_lengths(self.length_hist["admitted"], [group])
    heapq.heappush(self._heap, (group.min_version, ticket, kept))
    return True

  def purge(self, version: int) -> list[int]:
    """Applies `on_stale` to the buffered groups at `version`; returns the tickets it
    dropped."""
    if self.on_stale == "admit" or self.max_staleness is None:
      return []
    kept, dropped = [], []
    for min_version, ticket, group in self._heap:
      admissible = self._admissible(group, version)
      if admissible is None:
        dropped.append(ticket)
        _count_lengths(self.length_hist["dropped"], [group])
      else:
        kept.append((min_version, ticket, admissible))
    heapq.heapify(kept)
    self._heap = kept
    self.dropped += len(dropped)
    return dropped

  def take(self, n: int, version: int) -> list[tuple[int, Group]]:
    """Removes and returns the `n` oldest `(ticket, group)`s, to be trained at `version`."""
    if not 0 <= n <= len(self._heap):
      raise ValueError(f"cannot take {n} groups from a buffer of {len(self._heap)}")
    taken = [heapq.heappop(self._heap)[1:] for _ in range(n)]
    groups = [group for _, group in taken]
    self.trained += n
    self.trained_stale += sum(self.is_stale(group, version) for group in groups)
    if self.on_stale == "mask_tokens" and self.max_staleness is not None:
      self.masked_tokens += sum(_count_older(t, version - self.max_staleness)
                                for g in groups for t in g.trajectories)
    counts = staleness_counts(groups, version)
    _grow(self.staleness_hist, len(counts))
    for k, c in enumerate(counts):
      self.staleness_hist[k] += int(c)
    _count_lengths(self.length_hist["trained"], groups)
    _count_lengths(self.length_hist["trained_tokens"], groups, trained_tokens=True)
    return taken

  def clear(self) -> int:
    """Forgets every buffered group (a restore); returns how many there were."""
    n = len(self._heap)
    self._heap.clear()
    return n

  def state_dict(self) -> dict:
    """The counters and histograms as plain ints and lists (not the buffered groups)."""
    return {**{name: getattr(self, name) for name in _COUNTERS},
            "staleness_hist": list(self.staleness_hist),
            "length_hist": {k: list(v) for k, v in self.length_hist.items()}}

  def load_state_dict(self, state: dict) -> None:
    """Restores the counters and histograms; the buffer itself is left empty."""
    missing = sorted(set(_COUNTERS + ("staleness_hist", "length_hist")) - set(state))
    if missing:
      raise ValueError(f"buffer state is missing {missing}")
    if set(state["length_hist"]) != set(LENGTH_KINDS):
      raise ValueError(f"buffer state's length_hist must have keys {LENGTH_KINDS}")
    counters = {name: int(state[name]) for name in _COUNTERS}
    hist = [int(c) for c in state["staleness_hist"]]
    lengths = {k: [int(c) for c in state["length_hist"][k]] for k in LENGTH_KINDS}
    for name, value in counters.items():
      setattr(self, name, value)
    self.staleness_hist, self.length_hist = hist, lengths
    self.clear()

  def _admissible(self, group: Group, version: int) -> Optional[Group]:
    """`group` as it may be trained at `version` under `on_stale`, or None to drop it."""
    if not self.is_stale(group, version) or self.on_stale == "admit":
      return group
    if self.on_stale == "drop":
      return None
    masked = _mask_older(group, version - self.max_staleness)
    return masked if _oldest_trained(masked) is not None else None


def length_summary(hist: list[int]) -> dict[str, float]:
  """Mean, 10th/50th/90th percentile and max of the lengths counted in `hist`."""
  counts = np.asarray(hist, np.int64)
  total = int(counts.sum())
  if not total:
    return {"n": 0}
  cum = np.cumsum(counts)
  quantile = {f"p{q}": int(np.searchsorted(cum, q / 100 * total)) for q in (10, 50, 90)}
  return {"n": total, "mean": float(np.arange(counts.size) @ counts / total), **quantile,
          "max": int(np.flatnonzero(counts)[-1])}


def check_versions(groups: Sequence[Group], *, newest: int, oldest: Optional[int],
                   where: str) -> None:
  """Raises `VersionError` unless every token in the loss of `groups` carries a version
  in [`oldest`, `newest`] (`oldest` None: any tagged version, >= 0), naming the first
  sample and token that does not. Generated tokens are the only ones in a loss, and
  each carries the version that produced it (-1: none)."""
  low = 0 if oldest is None else max(oldest, 0)
  for group in groups:
    for i, t in enumerate(group.trajectories):
      v_T = np.where(np.asarray(t.loss_mask_T, bool), t.versions_T, low)
      bad_T = (v_T < low) | (v_T > newest)
      if bad_T.any():
        j = int(np.flatnonzero(bad_T)[0])
        made = ("carries no version" if v_T[j] < 0
                else f"was made by version {v_T[j]}")
        raise VersionError(
            f"{where}: token {j} of sample {i} of group {group.prompt_id!r} {made}, outside "
            f"[{low}, {newest}] ({int(bad_T.sum())} such tokens in that sample): the "
            f"version protocol is broken; nothing is trained on it")


def _trained_versions(traj) -> np.ndarray:
  return traj.versions_T[np.asarray(traj.loss_mask_T, bool) & (traj.versions_T >= 0)]


def _oldest_trained(group: Group) -> Optional[int]:
  versions = [v for v in map(_trained_versions, group.trajectories) if v.size]
  return int(min(v.min() for v in versions)) if versions else None


def _count_older(traj, oldest: int) -> int:
  return int(np.count_nonzero((traj.versions_T >= 0) & (traj.versions_T < oldest)))


def _mask_older(group: Group, oldest: int) -> Group:
  """`group` with its tokens of version below `oldest` out of the loss mask."""
  trajectories = []
  for t in group.trajectories:
    keep_T = np.asarray(t.loss_mask_T, bool) & ~((t.versions_T >= 0) & (t.versions_T < oldest))
    trajectories.append(dataclasses.replace(t, loss_mask_T=keep_T)
                        if not np.array_equal(keep_T, t.loss_mask_T) else t)
  return Group(group.prompt_id, tuple(trajectories))


def _grow(hist, size):
  if size > len(hist):
    hist += [0] * (size - len(hist))


def _count_lengths(hist, groups, trained_tokens=False):
  """Counts each sample at its length: once, or as its number of trained tokens."""
  for group in groups:
    for t in group.trajectories:
      n = t.num_policy_tokens
      _grow(hist, n + 1)
      hist[n] += _trained_versions(t).size if trained_tokens else 1
