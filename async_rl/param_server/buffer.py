"""The training buffer: strict per-token staleness admission, oldest groups out first.

Plain Python and not thread-safe: its owner (the `ParameterServer`) calls it under
its lock.
"""

import heapq
import itertools
from typing import Optional

from async_rl.trajectory import Group, staleness_counts

_COUNTERS = ("admitted", "dropped", "admitted_stale", "trained", "trained_stale")


class AdmissionBuffer:
  """Admitted groups waiting for the trainer, with the strict bound of DESIGN.md.

  A group is stale at trainer version v when one of its generated tokens has a
  version below v - η, i.e. when `v - group.min_version > η` (η = None: never).
  Staleness is checked when a group is offered and again whenever the version
  moves (`purge`): a stale group is dropped, or with `admit_stale` kept and counted,
  so with `admit_stale=False` no group handed to the trainer breaks the bound.

  Groups leave oldest first: by `min_version`, then by admission order. Taking the
  group closest to its staleness deadline first is what keeps drops fewest, and
  all stale groups then sit at the front, where `purge` finds them.

  Counters, in groups: `admitted` into the buffer; `dropped` as stale, when offered
  or while waiting; `admitted_stale` admitted although stale (`admit_stale` only);
  `trained` handed to the trainer; `trained_stale` handed over although stale (only
  with `admit_stale`). `staleness_hist[k]` counts the trained generated tokens of
  staleness k.
  """

  def __init__(self, max_staleness: Optional[int], admit_stale: bool):
    self.max_staleness = max_staleness
    self.admit_stale = admit_stale
    self.admitted = self.dropped = self.admitted_stale = 0
    self.trained = self.trained_stale = 0
    self.staleness_hist: list[int] = []
    self._heap: list[tuple[int, int, Group]] = []
    self._order = itertools.count()

  def __len__(self):
    return len(self._heap)

  def is_stale(self, group: Group, version: int) -> bool:
    return self.max_staleness is not None and version - group.min_version > self.max_staleness

  def offer(self, group: Group, version: int) -> bool:
    """Admits `group` at trainer version `version` or drops it; returns whether admitted.

    Raises:
      ValueError: if `group` holds a token newer than `version` (params that were
        never published); nothing changes then.
    """
    if group.max_version > version:
      raise ValueError(f"group {group.prompt_id!r} holds tokens of version "
                       f"{group.max_version}, newer than the published version {version}")
    stale = self.is_stale(group, version)
    if stale and not self.admit_stale:
      self.dropped += 1
      return False
    self.admitted += 1
    self.admitted_stale += stale
    heapq.heappush(self._heap, (group.min_version, next(self._order), group))
    return True

  def purge(self, version: int) -> int:
    """Drops the groups that are stale at `version` (none with `admit_stale`); returns how many."""
    if self.admit_stale or self.max_staleness is None:
      return 0
    n = 0
    while self._heap and self.is_stale(self._heap[0][2], version):
      heapq.heappop(self._heap)
      n += 1
    self.dropped += n
    return n

  def take(self, n: int, version: int) -> list[Group]:
    """Removes and returns the `n` oldest groups, to be trained at `version`."""
    if not 0 <= n <= len(self._heap):
      raise ValueError(f"cannot take {n} groups from a buffer of {len(self._heap)}")
    groups = [heapq.heappop(self._heap)[2] for _ in range(n)]
    self.trained += n
    self.trained_stale += sum(self.is_stale(group, version) for group in groups)
    counts = staleness_counts(groups, version)
    if len(counts) > len(self.staleness_hist):
      self.staleness_hist += [0] * (len(counts) - len(self.staleness_hist))
    for k, c in enumerate(counts):
      self.staleness_hist[k] += int(c)
    return groups

  def clear(self) -> int:
    """Forgets every buffered group (a restore); returns how many there were."""
    n = len(self._heap)
    self._heap.clear()
    return n

  def state_dict(self) -> dict:
    """The counters and histogram as plain ints and a list (not the buffered groups)."""
    return {**{name: getattr(self, name) for name in _COUNTERS},
            "staleness_hist": list(self.staleness_hist)}

  def load_state_dict(self, state: dict) -> None:
    """Restores the counters and histogram; the buffer itself is left empty."""
    missing = sorted(set(_COUNTERS + ("staleness_hist",)) - set(state))
    if missing:
      raise ValueError(f"buffer state is missing {missing}")
    counters = {name: int(state[name]) for name in _COUNTERS}
    hist = [int(c) for c in state["staleness_hist"]]
    for name, value in counters.items():
      setattr(self, name, value)
    self.staleness_hist = hist
    self.clear()
