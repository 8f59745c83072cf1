"""The decode thread of `pool.GeneratorPool`: what it does between two chunks.

`GeneratorPool`'s public methods only post work (queued samples, extensions, releases,
aborts, pauses, weight updates) under its condition variable; the methods here, all run
on the pool's one decode thread, apply that work between two decode chunks and run the
chunks. `DecodeThread` is the pool's base class: the state it works on is set up by
`GeneratorPool.__init__`.
"""

import dataclasses
import time
from collections import deque
from concurrent.futures import Future

from async_rl.generation import slots
from async_rl.generation.batch import Job
from async_rl.generation.request import empty_sample

# An idle pool admits a burst of submissions together: it starts once none came for
# SETTLE_S (or the queue fills its slots), at most SETTLE_MAX_S after the first.
SETTLE_S, SETTLE_MAX_S = 0.005, 0.05


@dataclasses.dataclass(eq=False)
class Update:
  params: object
  version: int
  mode: str
  future: Future
  transfer_s: float
  blocked_since: float | None = None


@dataclasses.dataclass
class Stats:
  decode_s: float = 0.0
  paused_s: float = 0.0
  swaps: int = 0
  swap_transfer_s: float = 0.0
  swap_pause_s: float = 0.0
  swap_transfer_s_total: float = 0.0
  swap_pause_s_total: float = 0.0
  extended_in_slot: int = 0
  extended_reprefilled: int = 0
  evictions: int = 0


class DecodeThread:
  """The decode thread's half of `GeneratorPool` (see the module docstring)."""

  def _update_ready(self) -> bool:
    return bool(self._updates) and (self._updates[0].mode != "drain"
                                    or not self._batch.num_active())

  def _has_work(self) -> bool:
    if self._closing or self._aborts or self._releases or (self._paused and not self._halted):
      return True
    if self._update_ready():
      return True
    return not self._paused and (bool(self._queue) or bool(self._extends)
                                 or self._batch.num_active() > 0)

  def _run(self):
    try:
      while self._iterate():
        pass
      self._close_out()
    except BaseException as e:  # noqa: BLE001 - every waiter must learn of the failure.
      self._fail(e)

  def _iterate(self) -> bool:
    with self._cv:
      self._cv.wait_for(self._has_work)
      if self._closing:
        return False
      aborts, self._aborts = self._aborts, []
      releases, self._releases = self._releases, []
      self._queue = deque(item for item in self._queue if item[0] not in aborts)
      self._extends = deque(job for job in self._extends if job not in aborts)
      halt = self._paused and not self._halted
      paused = self._paused
      update = self._updates[0] if self._updates else None
      queued = bool(self._queue)
    if aborts or paused or update is not None:
      # Everything below needs every token produced so far.
      self._batch.flush()
    if halt:
      with self._cv:
        self._halted = self._paused
        self._cv.notify_all()
    for job in aborts:
      self._abort_job(job)
    for handle in releases:
      self._batch.drop_held(handle)
    if update is not None:
      if update.mode != "drain" or not self._batch.num_active():
        self._apply(update)
        return True
      update.blocked_since = update.blocked_since or time.perf_counter()
    if paused:
      return True
    start, wall_start = time.perf_counter(), time.time()
    if update is None:
      if queued and not self._batch.num_active():
        self._settle()
      if queued:
        # Reading the pending chunk first frees the slots it finished, so queued
        # samples take them in the next chunk. With nothing queued a freed slot would
        # stay empty anyway, so the next chunk is dispatched before the pending one
        # is read (`add_chunk`), and the host's bookkeeping overlaps the device.
        self._batch.flush()
      self._admit()
    if self._batch.num_active():
      self._state, result = self.engine.generate_chunk(self._params, self._state)
      self._batch.add_chunk(result, self._version)
    self._stats.decode_s += time.perf_counter() - start
    self.timeline.record("generator", "decode", wall_start, time.time(), merge=True)
    return True

  def _settle(self):
    """Waits, with no sample running, for a burst of submissions to end (SETTLE_S):
    a step's groups arrive one by one from the workflows' threads, and a chunk
    started for the first alone would run every slot for its few samples."""
    first, free = time.perf_counter(), len(self._batch.free_slots())
    with self._cv:
      while not (self._closing or self._aborts or self._updates or self._paused
                 or self._extends or len(self._queue) >= free):
        wait = min(self._last_submit + SETTLE_S, first + SETTLE_MAX_S) - time.perf_counter()
        if wait <= 0:
          return
        self._cv.wait(wait)

  def _admit(self):
    self._start_extensions()
    free = self._batch.free_slots()
    with self._cv:
      short = len(self._queue) - len(free)
    if short > 0 and self._batch.held:
      self._stats.evictions += self._batch.evict(short)
      free = self._batch.free_slots()
    with self._cv:
      taken = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
    if taken:
      self._state = slots.start_samples(self.engine, self._params, self._version, self._state,
                                        self._batch, taken, self.engine.spread(free))

  def _start_extensions(self):
    with self._cv:
      jobs, self._extends = list(self._extends), deque()
    for job in jobs:
      held = self._batch.take_held(job.handle)
      if held is None:
        self._resolve(job, None)
      elif not slots.continues(job, held):
        self._resolve(job, error=ValueError(
            f"request {job.request.request_id!r}: the prompt does not continue the "
            f"{held.tokens_T.size} tokens its slot holds"))
      else:
        self._state, in_slot = slots.continue_held(self.engine, self._params, self._version,
                                                   self._state, self._batch, job, held)
        if in_slot:
          self._stats.extended_in_slot += 1
        else:
          self._stats.extended_reprefilled += 1

  def _resolve(self, job: Job, result=None, error: Exception | None = None):
    job.done, job.prefix = True, None
    with self._cv:
      del self._jobs[job.request.request_id]
    if error is not None:
      job.future.set_exception(error)
    else:
      job.future.set_result(result)

  def _complete(self, job: Job):
    self._resolve(job, list(job.samples))

  def _abort_job(self, job: Job):
    if job.done:
      return
    if job.handle is not None:  # An extension aborted before it started frees its slot.
      self._batch.drop_held(job.handle)
    self._batch.release(job)
    if not job.done:
      for i, x in enumerate(job.samples):
        if x is None:
          job.samples[i] = empty_sample(job.request.request_id, i, job.prompt_P, "aborted")
      self._complete(job)

  def _apply(self, update: Update):
    blocked_since = update.blocked_since or time.perf_counter()
    wall_start = time.time()
    self._params, self._version = update.params, update.version
    if update.mode == "retract":
      self._state = slots.restart_all(self.engine, self._params, self._version, self._state,
                                      self._batch)
    pause_s = time.perf_counter() - blocked_since
    self.timeline.record("generator", "swap", wall_start, time.time())
    with self._cv:
      self._updates.popleft()
      st = self._stats
      st.swaps += 1
      st.swap_transfer_s, st.swap_pause_s = update.transfer_s, pause_s
      st.swap_transfer_s_total += update.transfer_s
      st.swap_pause_s_total += pause_s
    update.future.set_result({"transfer_s": update.transfer_s, "pause_s": pause_s})

  def _close_out(self):
    self._batch.flush()
    for job in list(self._jobs.values()):
      self._abort_job(job)
    self._batch.held.clear()
    with self._cv:
      self._queue.clear()
      self._extends.clear()
      updates, self._updates = list(self._updates), deque()
    for update in updates:
      update.future.set_exception(RuntimeError("the generator pool shut down before the update"))

  def _fail(self, error: BaseException):
    with self._cv:
      self._error = error
      jobs, self._jobs = list(self._jobs.values()), {}
      updates, self._updates = list(self._updates), deque()
      self._queue.clear()
      self._extends.clear()
      self._cv.notify_all()
    for waiter in [j.future for j in jobs if not j.done] + [u.future for u in updates]:
      waiter.set_exception(error)
