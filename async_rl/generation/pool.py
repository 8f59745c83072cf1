"""GeneratorPool: continuous batching over an `Engine`, with pause, abort and weight swaps.

One decode thread owns the engine, the params and the decode state. Public methods
only post work to it under a lock (`update_weights` also copies the new params onto
the engine's devices, in the caller's thread, while decoding goes on), so all other
device work happens on that thread. The device decodes in chunks of the engine's
`steps_per_call` steps (`Engine.generate_chunk`), ending samples inside a chunk; new
samples, aborts, pauses and weight updates apply between two chunks. Free slots are
refilled from a FIFO queue of samples before each chunk, so short samples never wait
for long ones (see `host_batch` for when a chunk's tokens are read).

KV memory is the engine's budget of blocks (`Engine`, `kv_blocks`), shared by the
samples in flight; a sample that needs a block when none is free is preempted and
resumed later with the same tokens, log-probs and versions (`scheduler`).

Weight updates, applied between two chunks:
  * "retract": every in-flight sequence is re-prefilled (prompt + tokens so far)
    under the new params, so its KV cache is recomputed, then it continues.
  * "keep": the params are swapped and the existing KV cache is kept.
  * "drain": no new sample starts; in-flight samples finish on the old params;
    then the params are swapped and queued samples start.
Each token is tagged with the version of the params that produced it: a chunk runs
on one set of params, so every token of it carries that version.

Held slots (`Request.hold_slot`, `extend`, `release`): a multi-turn episode's sample
that ends its turn on a stop id keeps its slot and KV cache, and `extend` continues it
there with the environment's tokens, computing only those. A held slot counts as
occupied; when queued samples find no free slot, the oldest held slots are evicted
and their `extend` resolves to None, so the caller re-submits the whole episode (held
slots are evicted for KV blocks too, before any running sample is preempted). A
held cache is continued only under the params that computed all of it: after any
weight update (or a "keep" swap mid-turn), `extend` re-prefills the whole episode in
the slot instead, so that a turn starts from the cache a fresh request would have.
"""

import threading
import time
from collections.abc import Hashable
from concurrent.futures import Future

import jax
import numpy as np

from async_rl.config import UPDATE_MODES
from async_rl.generation.host_batch import Job
from async_rl.generation.engine import Engine
from async_rl.generation.request import Request, SlotHandle, validate
from async_rl.generation.scheduler import Inbox, Queued, Scheduler, Update
from async_rl.timeline import Timeline


def _running_future() -> Future:
  # A running future cannot be cancelled; `abort` is the way to stop a request.
  future = Future()
  future.set_running_or_notify_cancel()
  return future


class GeneratorPool:
  """Serves `Request`s on one engine from a background decode thread.

  Futures complete on the decode thread, so their callbacks must be quick and must
  not call `pause`. Use as a context manager or call `shutdown`.

  Args:
    engine: the engine (its slots, cache length and devices).
    params: initial params; copied onto the engine's devices.
    version: the version of `params`.
    seed: seeds the draw of per-request seeds for requests without one.
    timeline: where the decode thread records its busy spans (on lane "generator":
      "decode", which includes prefills of new samples, and "swap" for weight
      updates); a new one if None.
  """

  def __init__(self, engine: Engine, params, *, version: int = 0, seed: int = 0,
               timeline: Timeline | None = None):
    self.engine = engine
    self.timeline = Timeline() if timeline is None else timeline
    self._inbox = Inbox()
    self._cv = self._inbox.cv
    self._scheduler = Scheduler(engine, engine.load_params(params), version, self._inbox,
                                self.timeline)
    self._update_lock = threading.Lock()
    self._requested_version = version
    self._seeds = np.random.default_rng(seed)
    self._thread = threading.Thread(target=self._scheduler.run, name="generator-pool",
                                    daemon=True)
    self._thread.start()

  # Public API: called from any thread.

  @property
  def version(self) -> int:
    """Version of the params now used for decoding."""
    return self._scheduler.version

  @property
  def requested_version(self) -> int:
    """The newest version handed to `update_weights` (`version` once it is live)."""
    return self._requested_version

  def submit(self, request: Request) -> Future:
    """Queues `request`; the future resolves to its n `Trajectory`s, in index order
    (each with `metadata` {"request_id", "index"}, and "slot" for a held sample).

    Raises:
      ValueError: a malformed request or a request_id already in flight.
      RuntimeError: the pool is shut down or its decode thread failed.
    """
    with self._cv:
      job = self._new_job(request)
      self._inbox.queue.extend(Queued(job, i) for i in range(request.n))
      self._inbox.last_submit = time.perf_counter()
      self._cv.notify_all()
    return job.future

  def extend(self, handle: SlotHandle, request: Request) -> Future:
    """Like `submit` for a request of one sample whose prompt continues the sample
    that `handle` holds (its whole sequence, then new tokens): the sample continues
    in its slot, so only the new tokens are computed (the whole prompt is prefilled
    again in the slot if the params changed since its cache was computed). The
    future resolves to [the Trajectory], or to None if the slot is no longer held
    (evicted or released): submit the request then.

    Raises:
      ValueError: as `submit`, or `request.n` is not 1; the future fails with one if
        the prompt does not start with the held sequence.
      RuntimeError: as `submit`.
    """
    if request.n != 1:
      raise ValueError(f"request {request.request_id!r}: extend takes n=1, got {request.n}")
    with self._cv:
      job = self._new_job(request)
      job.handle = handle
      self._inbox.extends.append(job)
      self._cv.notify_all()
    return job.future

  def release(self, handle: SlotHandle) -> None:
    """Frees the slot `handle` holds (the episode ended); a no-op if it is not held."""
    with self._cv:
      self._inbox.releases.append(handle)
      self._cv.notify_all()

  def _new_job(self, request: Request) -> Job:
    """Validates `request` and registers its job; call under the lock."""
    prompt_P = validate(request, vocab_size=self.engine.cfg.vocab_size,
                        max_prefill_length=self.engine.max_prefill_length)
    self._check_open()
    if request.request_id in self._inbox.jobs:
      raise ValueError(f"request_id {request.request_id!r} is already in flight")
    seed = request.sampling.seed
    if seed is None:
      seed = int(self._seeds.integers(2 ** 32))
    job = Job(request, prompt_P, seed, _running_future(), [None] * request.n, request.n)
    self._inbox.jobs[request.request_id] = job
    return job

  def abort(self, request_id: Hashable) -> bool:
    """Stops a request: its slots are freed before the next decode chunk and its
    future resolves with what was generated (unfinished samples: "aborted").
    Returns False if the request is unknown or already finished."""
    with self._cv:
      job = self._inbox.jobs.get(request_id)
      if job is None or job.aborted:
        return False
      job.aborted = True
      self._inbox.aborts.append(job)
      self._cv.notify_all()
      return True

  def pause(self) -> None:
    """Stops decoding between two chunks; returns once no chunk is running.

    Aborts and weight updates are still applied while paused (a "drain" update
    waits for `resume`, since draining needs decoding)."""
    box = self._inbox
    with self._cv:
      if not box.paused:
        box.paused, box.halted, box.pause_started = True, False, time.perf_counter()
        self._cv.notify_all()
      self._cv.wait_for(lambda: box.halted or box.closing or box.error is not None)

  def resume(self) -> None:
    box = self._inbox
    with self._cv:
      if box.paused:
        self._scheduler.stats.paused_s += time.perf_counter() - box.pause_started
        box.paused = False
        self._cv.notify_all()

  def update_weights(self, params, version: int, mode: str = "retract") -> Future:
    """Copies `params` onto the engine's devices, then has them swapped in.

    Returns once the copy is complete, so the caller may donate or free its
    buffers; the returned future resolves to {"transfer_s", "pause_s"} once the new
    params are live. `pause_s` is how long decoding (retract, keep) or admission of
    new samples (drain) was held back for the swap.

    Raises:
      ValueError: an unknown mode, or `version` not above every earlier version.
      RuntimeError: the pool is shut down or its decode thread failed.
    """
    if mode not in UPDATE_MODES:
      raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
    with self._update_lock:
      with self._cv:
        self._check_open()
        if version <= self._requested_version:
          raise ValueError(f"version {version} must exceed the latest version "
                           f"{self._requested_version}")
      start = time.perf_counter()
      params = jax.block_until_ready(self.engine.load_params(params))
      update = Update(params, version, mode, _running_future(), time.perf_counter() - start)
      with self._cv:
        self._check_open()
        self._requested_version = version
        self._inbox.updates.append(update)
        self._cv.notify_all()
    return update.future

  def metrics(self) -> dict:
    """Slot occupancy, throughput, queue length, pause time and swap latencies.

    `decode_steps` counts device steps, `decode_calls` the chunks that ran any;
    `slot_occupancy` is the share of slot-steps that emitted a token and
    `wasted_fraction` the share spent idle after a sample finished mid-chunk.
    `held_slots` are slots kept for episodes between turns; `extended_in_slot` and
    `extended_reprefilled` count `extend`s continued on their cache and re-prefilled
    after a weight update, `evictions` held slots freed for queued samples or KV blocks.
    `kv_blocks_used` and `kv_blocks_free` count the engine's KV blocks now,
    `peak_kv_blocks_used` and `peak_active_slots` the most a chunk was dispatched with;
    `preemptions` counts samples taken out of their slot for lack of blocks,
    `resumed_samples` those resumed, `preempted_samples` those waiting now.
    """
    with self._cv:
      s, b, box = self._scheduler.stats, self._scheduler.batch, self._inbox
      paused_s = s.paused_s + (time.perf_counter() - box.pause_started if box.paused else 0)
      return {
          "version": self._scheduler.version,
          "active_slots": b.num_active(),
          "held_slots": len(b.held),
          "extended_in_slot": s.extended_in_slot,
          "extended_reprefilled": s.extended_reprefilled,
          "evictions": s.evictions,
          "kv_blocks_used": b.blocks.num_blocks - b.blocks.num_free,
          "kv_blocks_free": b.blocks.num_free,
          "peak_kv_blocks_used": b.peak_blocks_used,
          "peak_active_slots": b.peak_active,
          "preemptions": s.preemptions,
          "resumed_samples": s.resumed,
          "preempted_samples": len(b.preempted),
          "slot_occupancy": b.step_tokens / max(b.steps * len(b.slots), 1),
          "queue_length": len(box.queue),
          "decode_steps": b.steps,
          "decode_calls": b.calls,
          "steps_per_call": b.steps / max(b.calls, 1),
          "wasted_slot_steps": b.wasted_slot_steps,
          "wasted_fraction": b.wasted_slot_steps / max(b.steps * len(b.slots), 1),
          "generated_tokens": b.generated_tokens,
          "decode_tokens_per_s": b.step_tokens / s.decode_s if s.decode_s else 0.0,
          "time_paused_s": paused_s,
          "weight_updates": s.swaps,
          "swap_transfer_s": s.swap_transfer_s,
          "swap_pause_s": s.swap_pause_s,
          "swap_transfer_s_total": s.swap_transfer_s_total,
          "swap_pause_s_total": s.swap_pause_s_total,
      }

  def shutdown(self) -> None:
    """Aborts everything outstanding and stops the decode thread; idempotent."""
    with self._cv:
      self._inbox.closing = True
      self._cv.notify_all()
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.shutdown()

  def _check_open(self):
    if self._inbox.error is not None:
      raise RuntimeError("the generator pool's decode thread failed") from self._inbox.error
    if self._inbox.closing:
      raise RuntimeError("the generator pool is shut down")
