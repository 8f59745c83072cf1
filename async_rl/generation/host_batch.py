"""The host's view of the decode batch: which sample each slot holds, which KV blocks,
what it has produced, and the device results not yet read.

The device decodes a chunk of up to k steps per call and ends samples inside it (see
`Engine.generate_chunk`), so the host needs a chunk's tokens only to refill the
slots it freed: the pool reads chunk t-1 before dispatching chunk t when samples are
waiting, and after it otherwise. A slot whose sample finished mid-chunk idles for the
rest of that chunk (at most k - 1 steps); `wasted_slot_steps` counts those steps. A
result is credited to a slot only if the slot still holds the sample it held at
dispatch.

Blocks (`blocks.SlotBlocks`): a slot holds the blocks of every position its sample has
written or will write in the chunks dispatched so far. A sample's `position` is where
the device stands after them: exact once every result is read, otherwise a bound (k
more per unread chunk), so the blocks a chunk needs are given before it is dispatched.
A finished or aborted sample frees its blocks at once: the device stopped it, so
nothing writes them any more, and any later writer is dispatched after. A preempted
sample (`preempt`) frees its blocks and keeps its tokens, log-probs and versions; it
waits in `preempted` until the pool resumes it (`resume`) by prefilling its sequence
again.

A sample of a `hold_slot` request that ends on a stop id leaves its slot held: its
cache stays, nothing decodes there and no new sample takes it, until the pool
continues it (`take_held`), frees it (`drop_held`) or evicts it (`evict_oldest`). The
slot's device state needs no change for that: a stopped slot is not live.
"""

import bisect
import dataclasses
import itertools
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from async_rl.generation.decode_state import ChunkTokens, Prefix, ResultTokens
from async_rl.generation.blocks import SlotBlocks
from async_rl.generation.request import Request, SlotHandle
from async_rl.generation.sampling import SlotSampling
from async_rl.trajectory import Trajectory


# Handle keys are unique in the process, so that handles from several pools never meet
# (`replicas.ReplicatedPool` routes by them).
_HANDLE_KEYS = itertools.count()


@dataclasses.dataclass(eq=False)
class Job:
  """A request in flight: its future, its finished samples and what its samples share.

  What they share holds for the params of `cache_version` (`at_version`): the prompt's
  prefill (`prefix`) and, per block pool, the prompt's full blocks that its started
  samples hold (`prompt_blocks`, `blocks.SlotBlocks.assign`).
  """
  request: Request
  prompt_P: np.ndarray
  seed: int
  future: Future
  samples: list
  unstarted: int
  prefix: tuple[Prefix, int] | None = None  # A Prefix and the row of this prompt.
  prompt_blocks: dict = dataclasses.field(default_factory=dict)
  cache_version: int = -1
  aborted: bool = False
  done: bool = False
  handle: SlotHandle | None = None  # The held slot this job continues (`extend`).

  def at_version(self, version: int) -> None:
    """Drops what its samples share if other params than those of `version` made it."""
    if self.cache_version != version:
      self.prefix, self.prompt_blocks, self.cache_version = None, {}, version


@dataclasses.dataclass(eq=False)
class Sample:
  """A started sample: what it produced, and where its slot's device state stands.

  `admitted` orders samples by first admission (a resumed sample keeps its place);
  `position` is the device position after every dispatched call (see the module
  docstring); `end` one past its last allowed position.
  """
  job: Job
  index: int
  sampling: SlotSampling
  cache_version: int  # The params that computed the slot's whole cache.
  admitted: int
  position: int
  end: int
  preempted: bool = False  # Taken out for lack of blocks since it last ran.
  tokens: list = dataclasses.field(default_factory=list)
  logp: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)

  @property
  def length(self) -> int:
    """Its sequence so far: prompt and generated tokens."""
    return len(self.job.prompt_P) + len(self.tokens)

  def cache_need(self, steps: int) -> int:
    """The positions its cache must hold for `steps` more decode steps (the last token
    it may draw is never fed)."""
    return min(self.position + steps, self.end - 1)


@dataclasses.dataclass(frozen=True)
class Held:
  """A held slot: its handle, the sample's whole sequence and its cache's version."""
  handle: SlotHandle
  tokens_T: np.ndarray
  cache_version: int

  def continued_by(self, job: Job) -> bool:
    """Whether `job`'s prompt is the held sequence followed by at least one token."""
    length = self.tokens_T.size
    return job.prompt_P.size > length and np.array_equal(job.prompt_P[:length], self.tokens_T)

  def computed_by(self, version: int) -> bool:
    """Whether the params of `version` computed the slot's cache throughout, so that a
    continuation extends it rather than prefilling again."""
    return self.cache_version == version


class HostBatch:
  """Tracks the S slots and their KV blocks on the host and turns device results into
  samples.

  Args:
    num_slots: S.
    max_target_length: the longest sequence; a sample stops ("length") when its prompt
      plus completion reach it.
    on_done: called with a job once all its samples are finished.
    blocks: the slots' KV blocks.
  """

  def __init__(self, num_slots: int, max_target_length: int, on_done: Callable[[Job], None],
               blocks: SlotBlocks):
    self.slots: list[Sample | None] = [None] * num_slots
    self.held: dict[int, Held] = {}  # By slot, oldest first.
    self.preempted: list[Sample] = []  # Oldest admission first.
    self.blocks = blocks
    self._admissions = itertools.count()
    self._max_len = max_target_length
    self._on_done = on_done
    # (first tokens, the (slot, sample) of each row, version), per device result.
    self._first: list[tuple[ResultTokens, list[tuple[int, Sample]], int]] = []
    self._chunk: tuple[ChunkTokens, list, int] | None = None
    self.calls = self.steps = self.step_tokens = self.wasted_slot_steps = 0
    self.generated_tokens = self.peak_active = self.peak_blocks_used = 0

  def num_active(self) -> int:
    return sum(s is not None for s in self.slots)

  def in_flight(self) -> int:
    """Samples started and not finished: running, or preempted and waiting."""
    return self.num_active() + len(self.preempted)

  def free_slots(self) -> list[int]:
    return [i for i, s in enumerate(self.slots) if s is None and i not in self.held]

  def occupied(self) -> list[tuple[int, Sample]]:
    """The running samples and their slots, oldest admission first."""
    return sorted(((i, s) for i, s in enumerate(self.slots) if s is not None),
                  key=lambda x: x[1].admitted)

  def blocks_of(self, slot: int) -> list[int]:
    """The KV blocks `slot` holds."""
    return self.blocks.blocks[slot]

  def end_of(self, job: Job) -> int:
    return min(len(job.prompt_P) + job.request.sampling.max_new_tokens, self._max_len)

  def start(self, slot: int, job: Job, index: int, sampling: SlotSampling,
            version: int) -> Sample:
    """Records that `slot` (placed) now holds sample `index` of `job`, inserted under
    params `version`; its first token comes with `add_first`."""
    start = len(job.prompt_P)
    self.slots[slot] = Sample(job, index, sampling, version, next(self._admissions), start,
                              self.end_of(job))
    return self.slots[slot]

  def resume(self, slot: int, sample: Sample, version: int) -> None:
    """Moves preempted `sample` into `slot` (placed), where its sequence is to be
    prefilled again under params `version`; its next token comes with `add_first`."""
    self.preempted.remove(sample)
    sample.cache_version, sample.position = version, sample.length
    self.slots[slot] = sample

  def add_first(self, first: ResultTokens, owners: list[tuple[int, Sample]],
                version: int) -> None:
    """Registers the first tokens of started or resumed samples: row i of `first` is
    the (slot, sample) `owners[i]`'s (produced by params `version`)."""
    self._first.append((first, owners, version))

  def preempt(self, slot: int) -> Sample:
    """Takes `slot`'s sample out and frees its blocks; it waits in `preempted`. Call
    after `flush`, so that it keeps every token the device produced."""
    sample, self.slots[slot] = self.slots[slot], None
    self.blocks.release(slot)
    keys = [s.admitted for s in self.preempted]
    self.preempted.insert(bisect.bisect(keys, sample.admitted), sample)
    return sample

  def tables(self) -> np.ndarray:
    """The block tables of the running samples' slots (`Engine.generate_chunk`)."""
    return self.blocks.table([i for i, s in enumerate(self.slots) if s is not None])

  def add_chunk(self, result: ChunkTokens, version: int) -> None:
    """Registers a dispatched decode chunk (produced by params `version`); `flush`
    reads it."""
    owners = list(self.slots)
    self.peak_active = max(self.peak_active, self.num_active())
    self.peak_blocks_used = max(self.peak_blocks_used,
                                self.blocks.num_blocks - self.blocks.num_free)
    self.flush()
    steps = result.tokens_ST.shape[1]
    for slot, s in enumerate(owners):
      if s is not None and self.slots[slot] is s:
        s.position = min(s.position + steps, s.end - 1)
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
    """Finishes the job's running and preempted samples as "aborted"; call after
    `flush`."""
    for slot, s in self.occupied():
      if s.job is job:
        self._finish(slot, "aborted")
    for s in [s for s in self.preempted if s.job is job]:
      self.preempted.remove(s)
      self._record(s, "aborted", {})

  def held_for(self, handle: SlotHandle) -> Held | None:
    """What `handle`'s slot holds; None if the slot is no longer held for it (evicted,
    released)."""
    held = self.held.get(handle.slot)
    return held if held is not None and held.handle == handle else None

  def take_held(self, handle: SlotHandle) -> Held | None:
    """Stops holding `handle`'s slot and returns what it held (the slot keeps its
    blocks, for the caller to continue in or release); None as `held_for`."""
    return self.held.pop(handle.slot) if self.held_for(handle) is not None else None

  def drop_held(self, handle: SlotHandle) -> None:
    """Frees `handle`'s slot and its blocks if it is still held for it."""
    if self.take_held(handle) is not None:
      self.blocks.release(handle.slot)

  def evict_oldest(self) -> bool:
    """Frees the oldest held slot and its blocks; False if none is held."""
    if not self.held:
      return False
    self.drop_held(next(iter(self.held.values())).handle)
    return True

  def _emit(self, slot: int, tokens: list, logp: list, version: int) -> None:
    # The device stops a sample at its first stop id or at its length limit, so only
    # the last of `tokens` can end it.
    s = self.slots[slot]
    s.tokens.extend(tokens)
    s.logp.extend(logp)
    s.versions.extend([version] * len(tokens))
    s.position = s.length - 1
    self.generated_tokens += len(tokens)
    if s.job.request.on_tokens is not None:
      s.job.request.on_tokens(s.index, tokens)
    params = s.job.request.sampling
    if tokens[-1] in params.stop_token_ids:
      self._finish(slot, "stop")
    elif len(s.tokens) >= params.max_new_tokens or s.length >= self._max_len:
      self._finish(slot, "length")

  def _finish(self, slot: int, reason: str) -> None:
    s, self.slots[slot] = self.slots[slot], None
    metadata = {}
    if reason == "stop" and s.job.request.hold_slot:
      tokens_T = np.concatenate([s.job.prompt_P, np.asarray(s.tokens, np.int32)])
      handle = SlotHandle(slot, next(_HANDLE_KEYS), len(tokens_T))
      self.held[slot] = Held(handle, tokens_T, s.cache_version)
      metadata["slot"] = handle
    else:
      self.blocks.release(slot)
    self._record(s, reason, metadata)

  def _record(self, s: Sample, reason: str, metadata: dict) -> None:
    metadata = {"request_id": s.job.request.request_id, "index": s.index, **metadata}
    top_k, top_p = s.job.request.sampling.logp_truncation
    s.job.samples[s.index] = Trajectory.from_completion(
        s.job.prompt_P, s.tokens, s.logp, s.versions, reason, metadata=metadata,
        top_k=top_k, top_p=top_p)
    if all(x is not None for x in s.job.samples):
      self._on_done(s.job)
