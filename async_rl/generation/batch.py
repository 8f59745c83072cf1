"""The host's view of the decode batch: which sample each slot holds, what it has
produced, and the device results not yet read.

Decode step t is dispatched before the tokens of step t-1 are read, so the host's
bookkeeping overlaps the device's work. The price is that a sample which finished
at step t-1 also occupies its slot in step t; that step's token for it is dropped
by checking that the slot still holds the same sample it held at dispatch.
"""

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from async_rl.generation.engine import Prefix, ResultTokens
from async_rl.generation.request import Request
from async_rl.generation.sampling import SlotSampling
from async_rl.trajectory import Trajectory


@dataclasses.dataclass(eq=False)
class Job:
  """A request in flight: its future, its finished samples and its shared prefix."""
  request: Request
  prompt_P: np.ndarray
  seed: int
  future: Future
  samples: list
  unstarted: int
  prefix: Prefix | None = None
  prefix_version: int = -1
  aborted: bool = False
  done: bool = False


@dataclasses.dataclass(eq=False)
class _Occupant:
  job: Job
  index: int
  sampling: SlotSampling
  tokens: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)


class HostBatch:
  """Tracks the S slots on the host and turns device results into samples.

  Args:
    num_slots: S.
    max_target_length: the cache length; a sample stops ("length") when its prompt
      plus completion reach it.
    on_done: called with a job once all its samples are finished.
  """

  def __init__(self, num_slots: int, max_target_length: int, on_done: Callable[[Job], None]):
    self.slots: list[_Occupant | None] = [None] * num_slots
    self._max_len = max_target_length
    self._on_done = on_done
    self._first: list[tuple[int, _Occupant, ResultTokens, int]] = []
    self._step: tuple[ResultTokens, list, int] | None = None
    self.steps = self.step_tokens = self.generated_tokens = 0

  def num_active(self) -> int:
    return sum(s is not None for s in self.slots)

  def free_slots(self) -> list[int]:
    return [i for i, s in enumerate(self.slots) if s is None]

  def occupied(self) -> list[tuple[int, _Occupant]]:
    return [(i, s) for i, s in enumerate(self.slots) if s is not None]

  def occupy(self, slot: int, job: Job, index: int, sampling: SlotSampling,
             first: ResultTokens, version: int) -> None:
    """Records that `slot` now holds sample `index` of `job`, whose first token is
    in `first` (produced by params `version`)."""
    self.slots[slot] = _Occupant(job, index, sampling)
    self._first.append((slot, self.slots[slot], first, version))

  def restart(self, slot: int, first: ResultTokens, version: int) -> None:
    """Records the next token of a re-prefilled slot (retract)."""
    self._first.append((slot, self.slots[slot], first, version))

  def add_step(self, result: ResultTokens, version: int) -> None:
    """Registers a dispatched decode step, then reads the results before it."""
    owners = list(self.slots)
    self.flush()
    self._step = (result, owners, version)

  def flush(self) -> None:
    """Reads every pending device result and appends its tokens to their samples."""
    first, self._first = self._first, []
    step, self._step = self._step, None
    if not first and step is None:
      return
    first_host, step_host = jax.device_get(([r for _, _, r, _ in first],
                                            step[0] if step else None))
    # First tokens go first: a slot admitted before the pending step is in both.
    for (slot, owner, _, version), r in zip(first, first_host):
      if self.slots[slot] is owner:
        self._emit(slot, r.tokens_S[0], r.logp_S[0], version)
    if step is not None:
      _, owners, version = step
      emitted = 0
      for slot, owner in enumerate(owners):
        if owner is not None and self.slots[slot] is owner:
          self._emit(slot, step_host.tokens_S[slot], step_host.logp_S[slot], version)
          emitted += 1
      self.steps += 1
      self.step_tokens += emitted

  def release(self, job: Job) -> None:
    """Finishes the job's in-flight samples as "aborted"; call after `flush`."""
    for slot, s in self.occupied():
      if s.job is job:
        self._finish(slot, "aborted")

  def _emit(self, slot: int, token, logp, version: int) -> None:
    s = self.slots[slot]
    s.tokens.append(int(token))
    s.logp.append(float(logp))
    s.versions.append(version)
    self.generated_tokens += 1
    params = s.job.request.sampling
    if int(token) in params.stop_token_ids:
      self._finish(slot, "stop")
    elif (len(s.tokens) >= params.max_new_tokens
          or len(s.job.prompt_P) + len(s.tokens) >= self._max_len):
      self._finish(slot, "length")

  def _finish(self, slot: int, reason: str) -> None:
    s, self.slots[slot] = self.slots[slot], None
    s.job.samples[s.index] = Trajectory.from_completion(
        s.job.prompt_P, s.tokens, s.logp, s.versions, reason,
        metadata={"request_id": s.job.request.request_id, "index": s.index})
    if all(x is not None for x in s.job.samples):
      self._on_done(s.job)
