"""The generator pool's decode thread: what it does between two decode chunks.

`GeneratorPool`'s public methods only post work (queued samples, extensions, releases,
aborts, pauses, weight updates) to an `Inbox` under its condition variable; the
`Scheduler`, run on the pool's one decode thread, owns the engine's params, version and
decode state and the host's view of the slots and their KV blocks, applies that work
between two decode chunks and runs the chunks.

Which samples hold KV blocks (what to grow, preempt, evict and admit) is a
`kv_policy.KVPolicy`'s decision; the host's books are the `HostBatch`'s.
"""

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import Future

import numpy as np

from async_rl.generation.host_batch import Held, HostBatch, Job, Sample
from async_rl.generation.kv_policy import KVPolicy
from async_rl.generation.blocks import SlotBlocks
from async_rl.generation.request import SlotHandle, empty_sample
from async_rl.generation.sampling import SlotSampling
from async_rl.timeline import Timeline

# An idle pool admits a burst of submissions together: it starts once none came for
# SETTLE_S (or the queue fills its slots), at most SETTLE_MAX_S after the first.
SETTLE_S, SETTLE_MAX_S = 0.005, 0.05


@dataclasses.dataclass(frozen=True)
class Queued:
  """A sample waiting in the pool's queue for a slot: sample `index` of `job`."""
  job: Job
  index: int


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
  preemptions: int = 0
  resumed: int = 0


@dataclasses.dataclass(eq=False)
class Inbox:
  """What the pool's callers post for the decode thread, and the pool's state flags;
  read and written only under `cv`."""
  cv: threading.Condition = dataclasses.field(default_factory=threading.Condition)
  queue: deque[Queued] = dataclasses.field(default_factory=deque)
  extends: deque = dataclasses.field(default_factory=deque)  # Jobs continuing a held slot
  releases: list[SlotHandle] = dataclasses.field(default_factory=list)
  aborts: list[Job] = dataclasses.field(default_factory=list)
  updates: deque = dataclasses.field(default_factory=deque)  # Updates, oldest first
  jobs: dict[Hashable, Job] = dataclasses.field(default_factory=dict)
  paused: bool = False
  halted: bool = False  # paused, and no chunk runs
  closing: bool = False
  error: BaseException | None = None
  last_submit: float = 0.0
  pause_started: float = 0.0


class Scheduler:
  """The decode thread's half of `GeneratorPool`: `run` is the thread's loop.

  Args:
    engine: the engine it decodes with.
    params: the initial params, already on the engine's devices (`load_params`).
    version: their version.
    inbox: where the pool posts work.
    timeline: where the decode thread records its busy spans.
  """

  def __init__(self, engine, params, version: int, inbox: Inbox, timeline: Timeline):
    self.engine, self.params, self.version = engine, params, version
    self.inbox, self.timeline = inbox, timeline
    self._state = engine.init_decode_state()
    S = engine.max_concurrent_decodes
    blocks = SlotBlocks([engine.pool_of(s) for s in range(S)], num_blocks=engine.num_blocks,
                        block_size=engine.block_size, max_blocks=engine.max_blocks)
    self.batch = HostBatch(S, engine.max_target_length, self._complete, blocks)
    self.kv = KVPolicy(self.batch, engine.steps_per_call)
    self.stats = Stats()

  def _update_ready(self) -> bool:
    updates = self.inbox.updates
    return bool(updates) and (updates[0].mode != "drain" or not self.batch.in_flight())

  def _has_work(self) -> bool:
    box = self.inbox
    if box.closing or box.aborts or box.releases or (box.paused and not box.halted):
      return True
    if self._update_ready():
      return True
    return not box.paused and (bool(box.queue) or bool(box.extends)
                               or self.batch.in_flight() > 0)

  def run(self):
    try:
      while self._iterate():
        pass
      self._close_out()
    except BaseException as e:  # noqa: BLE001 - every waiter must learn of the failure.
      self._fail(e)

  def _iterate(self) -> bool:
    box = self.inbox
    with box.cv:
      box.cv.wait_for(self._has_work)
      if box.closing:
        return False
      aborts, box.aborts = box.aborts, []
      releases, box.releases = box.releases, []
      box.queue = deque(q for q in box.queue if q.job not in aborts)
      box.extends = deque(job for job in box.extends if job not in aborts)
      halt = box.paused and not box.halted
      paused = box.paused
      update = box.updates[0] if box.updates else None
      queued = bool(box.queue)
    if aborts or paused or update is not None:
      # Everything below needs every token produced so far.
      self.batch.flush()
    if halt:
      with box.cv:
        box.halted = box.paused
        box.cv.notify_all()
    for job in aborts:
      self._abort_job(job)
    for handle in releases:
      self.batch.drop_held(handle)
    if update is not None:
      if update.mode != "drain" or not self.batch.in_flight():
        self._apply(update)
        return True
      update.blocked_since = update.blocked_since or time.perf_counter()
    if paused:
      return True
    start, wall_start = time.perf_counter(), time.time()
    if update is None:
      if queued and not self.batch.num_active():
        self._settle()
      if queued or self.batch.preempted:
        # Reading the pending chunk first frees the slots it finished, so waiting
        # samples take them in the next chunk. With nothing waiting a freed slot would
        # stay empty anyway, so the next chunk is dispatched before the pending one
        # is read (`add_chunk`), and the host's bookkeeping overlaps the device.
        self.batch.flush()
      self._start_extensions()
    # A blocked drain starts no new sample, but preempted ones are in flight.
    self._grow()
    self._admit(new=update is None)
    if self.batch.num_active():
      self._state, result = self.engine.generate_chunk(self.params, self._state,
                                                       self.batch.tables())
      self.batch.add_chunk(result, self.version)
    self.stats.decode_s += time.perf_counter() - start
    self.timeline.record("generator", "decode", wall_start, time.time(), merge=True)
    return True

  def _settle(self):
    """Waits, with no sample running, for a burst of submissions to end (SETTLE_S):
    a step's groups arrive one by one from the workflows' threads, and a chunk
    started for the first alone would run every slot for its few samples."""
    box = self.inbox
    first, free = time.perf_counter(), len(self.batch.free_slots())
    with box.cv:
      while not (box.closing or box.aborts or box.updates or box.paused or box.extends
                 or len(box.queue) >= free):
        wait = min(box.last_submit + SETTLE_S, first + SETTLE_MAX_S) - time.perf_counter()
        if wait <= 0:
          return
        box.cv.wait(wait)

  def _grow(self):
    """Gives every running sample the blocks of the next chunk, oldest first; where a
    pool runs short, evicts its oldest held slot or preempts its newest sample."""
    if self.kv.grow() is None:
      return
    # Exact positions first: finished samples free their blocks, and a preempted
    # sample keeps every token the device drew.
    self.batch.flush()
    while (pool := self.kv.grow()) is not None:
      if self.kv.make_room(pool) == "evicted":
        self.stats.evictions += 1
      else:
        self.stats.preemptions += 1

  def _admit(self, new: bool):
    """Starts waiting samples, in order, while a free slot's pool has their blocks:
    preempted samples, then (if `new`) queued ones. Held slots are evicted, oldest
    first, when no slot is free, or when no sample runs to free blocks."""
    box, batch = self.inbox, self.batch
    resumed, started = [], []
    while True:
      with box.cv:
        preempted = batch.preempted[0] if batch.preempted else None
        queued = box.queue[0] if preempted is None and new and box.queue else None
      if preempted is not None:
        placed = self.kv.place_preempted(preempted)
      elif queued is not None:
        queued.job.at_version(self.version)
        placed = self.kv.place_queued(queued.job)
      else:
        break
      if placed is None:
        if self.kv.evict_to_admit():
          self.stats.evictions += 1
          continue
        break
      slot, shared = placed
      if preempted is not None:
        batch.resume(slot, preempted, self.version)
        self.stats.resumed += preempted.preempted
        preempted.preempted = False
        resumed.append((slot, preempted))
      else:
        with box.cv:
          box.queue.popleft()
        job, index = queued.job, queued.index
        sampling = SlotSampling.create(job.request.sampling, job.seed, index)
        started.append((slot, batch.start(slot, job, index, sampling, self.version), shared))
    if resumed:
      self._resume_samples(resumed)
    if started:
      self._start_samples(started)

  def _start_samples(self, started: list[tuple[int, Sample, int]]) -> None:
    """Inserts the new samples of `started`, each (slot, sample, blocks shared): the
    sample's slot holds its blocks, the first `shared` of them its prompt's full blocks
    that an earlier sample wrote. A job's prompt is prefilled once for all its samples
    under the live params (`Job.at_version`)."""
    batch = self.batch
    jobs = list(dict.fromkeys(s.job for _, s, _ in started))
    stale = [job for job in jobs if job.prefix is None]
    if stale:
      # The prefill's own first-token draw goes unused: insert_samples draws each.
      refs = self.engine.prefill_many(
          params=self.params, prompts=[job.prompt_P for job in stale],
          samplings=[SlotSampling.create(job.request.sampling, job.seed, 0) for job in stale])
      for job, ref in zip(stale, refs):
        job.prefix = ref
    # One insert_samples call per Prefix: prompts prefilled together start together.
    starts = {}
    for slot, sample, shared in started:
      prefix, row = sample.job.prefix
      starts.setdefault(id(prefix), (prefix, []))[1].append((slot, sample, shared, row))
      sample.job.unstarted -= 1
    for job in jobs:
      if not job.unstarted:
        job.prefix = None
    for prefix, entries in starts.values():
      self._state, first = self.engine.insert_samples(
          prefix, self._state, [row for *_, row in entries], [slot for slot, *_ in entries],
          [s.sampling for _, s, _, _ in entries], [batch.blocks_of(slot) for slot, *_ in entries],
          [shared for _, _, shared, _ in entries])
      batch.add_first(first, [(slot, s) for slot, s, _, _ in entries], self.version)

  def _resume_samples(self, resumed: list[tuple[int, Sample]]) -> None:
    """Resumes each preempted (slot, sample) of `resumed` in the slot it was placed in and
    moved to (`HostBatch.resume`): its prompt and the tokens it generated so far are
    prefilled under the live params and it draws its next token, as it would have
    without the preemption (a draw's key depends only on the sample and the position)."""
    for slot, sample in resumed:
      padded, length = self.engine.pad_tokens(np.concatenate(
          [sample.job.prompt_P, np.asarray(sample.tokens, np.int32)]))
      prefix, first = self.engine.prefill(params=self.params, padded_tokens=padded,
                                          true_length=length, sampling=sample.sampling,
                                          generated=len(sample.tokens))
      self._state = self.engine.insert(prefix, self._state, slot, self.batch.blocks_of(slot))
      self.batch.add_first(first, [(slot, sample)], self.version)

  def _start_extensions(self):
    box, batch = self.inbox, self.batch
    with box.cv:
      jobs, box.extends = list(box.extends), deque()
    for job in jobs:
      held = batch.held_for(job.handle)
      if held is None:
        self._resolve(job, None)
      elif not held.continued_by(job):
        batch.drop_held(job.handle)
        self._resolve(job, error=ValueError(
            f"request {job.request.request_id!r}: the prompt does not continue the "
            f"{held.tokens_T.size} tokens its slot holds"))
      elif not self.kv.place_extension(job, self.version):
        # Too few free blocks to continue here: the whole episode waits its turn as a
        # new request, to be prefilled again.
        with box.cv:
          box.queue.appendleft(Queued(job, 0))
        self.stats.extended_reprefilled += 1
      elif self._continue_held(job, held):
        self.stats.extended_in_slot += 1
      else:
        self.stats.extended_reprefilled += 1

  def _continue_held(self, job: Job, held: Held) -> bool:
    """Starts `job` (one sample, whose prompt continues `held`'s sequence) in the held
    slot, which holds the blocks it needs. Returns whether the cache was continued: it
    is when the live params computed all of it (`Held.computed_by`), else the whole
    prompt is prefilled again in the slot."""
    slot, length = held.handle.slot, held.tokens_T.size
    sampling = SlotSampling.create(job.request.sampling, job.seed, 0)
    blocks = self.batch.blocks_of(slot)
    in_slot = held.computed_by(self.version)
    if in_slot:
      # The held sample's last token was drawn but never fed, so its K/V goes first.
      self._state, first = self.engine.extend(self.params, self._state, slot,
                                              job.prompt_P[length - 1:], length - 1,
                                              sampling, blocks)
    else:
      padded, true_length = self.engine.pad_tokens(job.prompt_P)
      prefix, first = self.engine.prefill(params=self.params, padded_tokens=padded,
                                          true_length=true_length, sampling=sampling)
      self._state = self.engine.insert(prefix, self._state, slot, blocks)
    job.unstarted = 0
    sample = self.batch.start(slot, job, 0, sampling, self.version)
    self.batch.add_first(first, [(slot, sample)], self.version)
    return in_slot

  def _resolve(self, job: Job, result=None, error: Exception | None = None):
    job.done, job.prefix = True, None
    with self.inbox.cv:
      del self.inbox.jobs[job.request.request_id]
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
      self.batch.drop_held(job.handle)
    self.batch.release(job)
    if not job.done:
      for i, x in enumerate(job.samples):
        if x is None:
          job.samples[i] = empty_sample(job.request.request_id, i, job.prompt_P, "aborted")
      self._complete(job)

  def _apply(self, update: Update):
    blocked_since = update.blocked_since or time.perf_counter()
    wall_start = time.time()
    self.params, self.version = update.params, update.version
    if update.mode == "retract":
      # Every running sample is prefilled again (prompt and tokens so far) under the new
      # params, as a preempted one is resumed; the swap's pause covers the prefills.
      for slot, _ in self.batch.occupied():
        self.batch.preempt(slot)
      self._admit(new=False)
      self.batch.flush()
    pause_s = time.perf_counter() - blocked_since
    self.timeline.record("generator", "swap", wall_start, time.time())
    with self.inbox.cv:
      self.inbox.updates.popleft()
      st = self.stats
      st.swaps += 1
      st.swap_transfer_s, st.swap_pause_s = update.transfer_s, pause_s
      st.swap_transfer_s_total += update.transfer_s
      st.swap_pause_s_total += pause_s
    update.future.set_result({"transfer_s": update.transfer_s, "pause_s": pause_s})

  def _close_out(self):
    box = self.inbox
    self.batch.flush()
    for job in list(box.jobs.values()):
      self._abort_job(job)
    while self.batch.evict_oldest():
      pass
    with box.cv:
      box.queue.clear()
      box.extends.clear()
      updates, box.updates = list(box.updates), deque()
    for update in updates:
      update.future.set_exception(RuntimeError("the generator pool shut down before the update"))

  def _fail(self, error: BaseException):
    box = self.inbox
    with box.cv:
      box.error = error
      jobs, box.jobs = list(box.jobs.values()), {}
      updates, box.updates = list(box.updates), deque()
      box.queue.clear()
      box.extends.clear()
      box.cv.notify_all()
    for waiter in [j.future for j in jobs if not j.done] + [u.future for u in updates]:
      waiter.set_exception(error)
