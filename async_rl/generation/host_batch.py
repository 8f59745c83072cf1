"""The host's view of the decode batch: which sample each slot holds, what it has
produced, and the device results not yet read.

The device decodes a chunk of up to k steps per call and ends samples inside it (see
`Engine.generate_chunk`), so the host needs a chunk's tokens only to refill the
slots it freed: the pool reads chunk t-1 before dispatching chunk t when samples are
queued, and after it otherwise. A slot whose sample finished mid-chunk idles for the
rest of that chunk (at most k - 1 steps); `wasted_slot_steps` counts those steps. A
result is credited to a slot only if the slot still holds the sample it held at
dispatch.

A sample of a `hold_slot` request that ends on a stop id leaves its slot held: its
cache stays, nothing decodes there and no new sample takes it, until the pool
continues it (`take_held`), frees it (`drop_held`) or evicts it (`evict`, oldest
first). The slot's device state needs no change for that: a stopped slot is not live.
"""

import dataclasses
import itertools
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from async_rl.generation.decode_state import ChunkTokens, Prefix, ResultTokens
from async_rl.generation.request import Request, SlotHandle
from async_rl.generation.sampling import SlotSampling
from async_rl.trajectory import Trajectory


# Handle keys are unique in the process, so that handles from several pools never meet
# (`replicas.ReplicatedPool` routes by them).
_HANDLE_KEYS = itertools.count()


@dataclasses.dataclass(eq=False)
class Job:
  """A request in flight: its future, its finished samples and its shared prefix."""
  request: Request
  prompt_P: np.ndarray
  seed: int
  future: Future
  samples: list
  unstarted: int
  prefix: tuple[Prefix, int] | None = None  # A Prefix and the row of this prompt.
  prefix_version: int = -1
  aborted: bool = False
  done: bool = False
  handle: SlotHandle | None = None  # The held slot this job continues (`extend`).


@dataclasses.dataclass(eq=False)
class _Occupant:
  job: Job
  index: int
  sampling: SlotSampling
  cache_version: int  # The params that computed the slot's whole cache.
  tokens: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Held:
  """A held slot: its handle, the sample's whole sequence and its cache's version."""
  handle: SlotHandle
  tokens_T: np.ndarray
  cache_version: int


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
    self.held: dict[int, Held] = {}  # By slot, oldest first.
    self._max_len = max_target_length
    self._on_done = on_done
    # (first tokens, the (slot, occupant) of each row, version), per device result.
    self._first: list[tuple[ResultTokens, list[tuple[int, _Occupant]], int]] = []
    self._chunk: tuple[ChunkTokens, list, int] | None = None
    self.calls = self.steps = self.step_tokens = self.wasted_slot_steps = 0
    self.generated_tokens = 0

  def num_active(self) -> int:
    return sum(s is not None for s in self.slots)

  def free_slots(self) -> list[int]:
    return [i for i, s in enumerate(self.slots) if s is None and i not in self.held]

  def occupied(self) -> list[tuple[int, _Occupant]]:
    return [(i, s) for i, s in enumerate(self.slots) if s is not None]

  def occupy(self, entries: list[tuple[int, Job, int, SlotSampling]], first: ResultTokens,
             version: int) -> None:
    """Records, for each (slot, job, index, sampling) of `entries`, that the slot now
    holds sample `index` of `job`; entry i's first token is row i of `first`
    (produced by params `version`)."""
    owners = []
    for slot, job, index, sampling in entries:
      self.slots[slot] = _Occupant(job, index, sampling, version)
      owners.append((slot, self.slots[slot]))
    self._first.append((first, owners, version))

  def restart(self, slot: int, first: ResultTokens, version: int) -> None:
    """Records the next token of a re-prefilled slot (retract)."""
    self.slots[slot].cache_version = version
    self._first.append((first, [(slot, self.slots[slot])], version))

  def add_chunk(self, result: ChunkTokens, version: int) -> None:
    """Registers a dispatched decode chunk (produced by params `version`); `flush`
    reads it."""
    owners = list(self.slots)
    self.flush()
    self._chunk = (result, owners, version)

  def flush(self) -> None:
    """Reads every pending device result and appends its tokens to their samples."""
    first, self._first = self._first, []
    chunk, self._chunk = self._chunk, None
    if not first and chunk is None:
      return
    first_host, chunk_host = jax.device_get(([r for r, _, _ in first],
                                             chunk[0] if chunk else None))
    # First tokens go first: a slot admitted before the pending chunk is in both.
    for (_, owners, version), r in zip(first, first_host):
      for row, (slot, owner) in enumerate(owners):
        if self.slots[slot] is owner:
          self._emit(slot, r.tokens_S[row:row + 1].tolist(), r.logp_S[row:row + 1].tolist(),
                     version)
    if chunk is not None:
      self._read_chunk(chunk_host, *chunk[1:])

  def _read_chunk(self, chunk: ChunkTokens, owners: list, version: int) -> None:
    steps, count_S = int(chunk.steps), chunk.count_S
    # A chunk dispatched before the host read that all its slots had finished runs
    # no step and costs only the dispatch; it is not counted as a call.
    self.calls += steps > 0
    self.steps += steps
    self.wasted_slot_steps += int(np.sum(np.where(count_S > 0, steps - count_S, 0)))
    for slot, owner in enumerate(owners):
      count = int(count_S[slot])
      if count and owner is not None and self.slots[slot] is owner:
        self._emit(slot, chunk.tokens_ST[slot, :count].tolist(),
                   chunk.logp_ST[slot, :count].tolist(), version)
        self.step_tokens += count

  def release(self, job: Job) -> None:
    """Finishes the job's in-flight samples as "aborted"; call after `flush`."""
    for slot, s in self.occupied():
      if s.job is job:
        self._finish(slot, "aborted")

  def take_held(self, handle: SlotHandle) -> Held | None:
    """Stops holding `handle`'s slot and returns what it held; None if the slot is
    no longer held for it (evicted, released)."""
    held = self.held.get(handle.slot)
    if held is None or held.handle != handle:
      return None
    return self.held.pop(handle.slot)

  def drop_held(self, handle: SlotHandle) -> None:
    """Frees `handle`'s slot if it is still held for it."""
    self.take_held(handle)

  def evict(self, count: int) -> int:
    """Frees up to `count` held slots, oldest first; returns how many."""
    evicted = list(self.held)[:count]
    for slot in evicted:
      del self.held[slot]
    return len(evicted)

  def _emit(self, slot: int, tokens: list, logp: list, version: int) -> None:
    # The device stops a sample at its first stop id or at its length limit, so only
    # the last of `tokens` can end it.
    s = self.slots[slot]
    s.tokens.extend(tokens)
    s.logp.extend(logp)
    s.versions.extend([version] * len(tokens))
    self.generated_tokens += len(tokens)
    params = s.job.request.sampling
    if tokens[-1] in params.stop_token_ids:
      self._finish(slot, "stop")
    elif (len(s.tokens) >= params.max_new_tokens
          or len(s.job.prompt_P) + len(s.tokens) >= self._max_len):
      self._finish(slot, "length")

  def _finish(self, slot: int, reason: str) -> None:
    s, self.slots[slot] = self.slots[slot], None
    metadata = {"request_id": s.job.request.request_id, "index": s.index}
    if reason == "stop" and s.job.request.hold_slot:
      tokens_T = np.concatenate([s.job.prompt_P, np.asarray(s.tokens, np.int32)])
      handle = SlotHandle(slot, next(_HANDLE_KEYS), len(tokens_T))
      self.held[slot] = Held(handle, tokens_T, s.cache_version)
      metadata["slot"] = handle
    s.job.samples[s.index] = Trajectory.from_completion(
        s.job.prompt_P, s.tokens, s.logp, s.versions, reason, metadata=metadata)
    if all(x is not None for x in s.job.samples):
      self._on_done(s.job)
