"""The staleness gate: how many new prompt groups may start generating (AReaL Eq. 3).

Plain Python and not thread-safe: its owner (the `ParameterServer`) calls it under
its lock.
"""

import dataclasses
from typing import Optional

_COUNTERS = ("version", "running", "accepted", "rejected", "lost")


@dataclasses.dataclass
class StalenessGate:
  """Counts prompt groups and bounds how far generation may run ahead of training.

  With B = `batch_groups`, η = `max_staleness` and trainer version v,

    capacity = min(max_concurrent - running, (η + v + 1) * B - (accepted + running))

  and a new group may start only while capacity > 0; η = None drops the second term.
  The trainer consumes B groups per version, so the second term lets at most
  (η + 1) * B groups beyond those already trained be running or accepted at once:
  generation runs at most η versions ahead of training, in aggregate. (The strict
  per-token bound is the buffer's job.)

  Counters, in groups: `running` started and not finished; `accepted` finished and
  admitted for training (buffered or trained); `rejected` finished or dropped and
  never to be trained, which frees its capacity; `lost` started and never to
  finish: running on a rollout worker that died (`write_off`), or in flight or
  buffered when the checkpoint being resumed was taken (`rebase`).
  """
  max_staleness: Optional[int]
  batch_groups: int
  max_concurrent: int
  version: int = 0
  running: int = 0
  accepted: int = 0
  rejected: int = 0
  lost: int = 0

  def __post_init__(self):
    if self.max_staleness is not None and self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
    if self.batch_groups < 1:
      raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
    if self.max_concurrent < 1:
      raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
    for name in _COUNTERS:
      if getattr(self, name) < 0:
        raise ValueError(f"gate counter {name} must be >= 0, got {getattr(self, name)}")

  def capacity(self, generator_version: Optional[int] = None) -> int:
    """Groups that may still start now (AReaL Eq. 3); never negative in valid use.

    With `generator_version` (the weights the new group will be sampled with), the
    window is that of min(v, generator_version): a generator that has not yet applied
    the newest weights may not start the groups they open up, or its tokens would
    arrive already too stale (with η = 0 every such group would be dropped).
    """
    free = self.max_concurrent - self.running
    if self.max_staleness is None:
      return free
    version = self.version if generator_version is None else min(self.version,
                                                                 generator_version)
    window = (self.max_staleness + version + 1) * self.batch_groups
    return min(free, window - (self.accepted + self.running))

  def acquire(self, generator_version: Optional[int] = None) -> bool:
    """Starts one group if capacity allows; returns whether it did."""
    if self.capacity(generator_version) <= 0:
      return False
    self.running += 1
    return True

  def finish_accepted(self) -> None:
    """A running group finished and was admitted for training."""
    self._finish()
    self.accepted += 1

  def finish_rejected(self) -> None:
    """A running group finished but will not be trained; frees its capacity."""
    self._finish()
    self.rejected += 1

  def drop_accepted(self, n: int = 1) -> None:
    """`n` accepted groups were dropped before training (too stale); frees capacity.

    Without this, every group dropped from the buffer would hold its place in the
    window forever, and after (η + 1) * B drops nothing could start again.
    """
    if not 0 <= n <= self.accepted:
      raise ValueError(f"cannot drop {n} accepted groups: {self.accepted} are accepted")
    self.accepted -= n
    self.rejected += n

  def write_off(self, n: int) -> None:
    """`n` running groups will never finish (their worker died); frees their capacity."""
    if not 0 <= n <= self.running:
      raise ValueError(f"cannot write off {n} groups: {self.running} are running")
    self.running -= n
    self.lost += n

  def set_version(self, version: int) -> None:
    """Moves to trainer version `version` (never backwards)."""
    if version < self.version:
      raise ValueError(f"gate version may not decrease: {self.version} -> {version}")
    self.version = version

  def _finish(self):
    if self.running == 0:
      raise ValueError("a group finished, but no group is running (acquire first)")
    self.running -= 1

  def rebase(self, consumed: int) -> None:
    """Re-bases the counters after a restore, when nothing survives but training.

    A checkpoint holds the trained params and these counters, not the groups then
    in flight or waiting in the buffer: on resume those are gone. So `running` is 0
    and `accepted` becomes `consumed`, the groups whose updates the restored params
    hold; the difference is added to `lost`. The window is then exactly that of a
    run that had trained `consumed` groups and started nothing else: the lost
    groups' capacity is free again.

    Args:
      consumed: groups trained into the restored params, at most `accepted`.
    """
    if not 0 <= consumed <= self.accepted:
      raise ValueError(f"rebase: consumed must lie in [0, accepted={self.accepted}], "
                       f"got {consumed}")
    self.lost += self.running + self.accepted - consumed
    self.running = 0
    self.accepted = consumed

  def state_dict(self) -> dict[str, int]:
    """The counters and version (not the configuration), as plain ints."""
    return {name: getattr(self, name) for name in _COUNTERS}

  @classmethod
  def from_state_dict(cls, state: dict[str, int], *, max_staleness: Optional[int],
                      batch_groups: int, max_concurrent: int) -> "StalenessGate":
    """A gate with `state`'s counters, exactly as saved (call `rebase` to resume)."""
    missing = sorted(set(_COUNTERS) - set(state))
    if missing:
      raise ValueError(f"gate state is missing {missing}")
    return cls(max_staleness=max_staleness, batch_groups=batch_groups,
               max_concurrent=max_concurrent, **{k: int(state[k]) for k in _COUNTERS})
