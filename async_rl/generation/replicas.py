"""Data-parallel generation: one pool's interface over several generator replicas.

Each replica is a `GeneratorPool` on an engine of its own devices. `ReplicatedPool`
sends a request to the replica with the fewest samples in flight; the turns of a
multi-turn episode that continue in a held slot go to the replica that holds it (a
slot handle's key is unique in the process, so handles never collide). Weight updates
go to every replica, each copying the params device to device onto its own devices;
the live version is the oldest replica's, so the staleness gate never counts a group
as fresher than the weights that may sample it. Pause, resume, abort and shutdown
apply to every replica; `metrics` adds their counters up and lists each.
"""

import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import Future

from async_rl.generation.pool import GeneratorPool
from async_rl.generation.request import Request, SlotHandle

# Counters that add up over replicas; the others are reported per replica only.
_SUMMED = ("active_slots", "held_slots", "extended_in_slot", "extended_reprefilled",
           "evictions", "queue_length", "decode_steps", "decode_calls", "wasted_slot_steps",
           "generated_tokens", "weight_updates", "swap_transfer_s_total", "swap_pause_s_total",
           "kv_blocks_used", "kv_blocks_free", "preemptions", "resumed_samples",
           "preempted_samples")


class ReplicatedPool:
  """The `GeneratorPool` interface over `pools`, one per generator replica.

  Args:
    pools: the replicas' pools; they share one `timeline` (lane "generator").
  """

  def __init__(self, pools: Sequence[GeneratorPool]):
    if not pools:
      raise ValueError("a replicated pool needs at least one pool")
    self.pools = list(pools)
    self.timeline = self.pools[0].timeline
    self.engine = self.pools[0].engine
    self._lock = threading.Lock()
    self._in_flight = [0] * len(self.pools)  # samples submitted and not finished
    self._holder: dict[SlotHandle, int] = {}  # held slot -> the replica that holds it

  @property
  def version(self) -> int:
    """The oldest version any replica decodes with."""
    return min(p.version for p in self.pools)

  @property
  def requested_version(self) -> int:
    return min(p.requested_version for p in self.pools)

  def submit(self, request: Request) -> Future:
    """`GeneratorPool.submit` on the replica with the fewest samples in flight."""
    with self._lock:
      i = min(range(len(self.pools)), key=lambda j: (self._in_flight[j], j))
      self._in_flight[i] += request.n
    try:
      future = self.pools[i].submit(request)
    except BaseException:
      self._finished(i, request.n, None)
      raise
    future.add_done_callback(lambda f: self._finished(i, request.n, f))
    return future

  def extend(self, handle: SlotHandle, request: Request) -> Future:
    """`GeneratorPool.extend` on the replica that holds `handle`; the future resolves
    to None if none does (then submit the request)."""
    with self._lock:
      i = self._holder.pop(handle, None)
      if i is not None:
        self._in_flight[i] += request.n
    if i is None:
      future = Future()
      future.set_result(None)
      return future
    future = self.pools[i].extend(handle, request)
    future.add_done_callback(lambda f: self._finished(i, request.n, f))
    return future

  def release(self, handle: SlotHandle) -> None:
    with self._lock:
      i = self._holder.pop(handle, None)
    if i is not None:
      self.pools[i].release(handle)

  def _finished(self, i: int, n: int, future) -> None:
    # Runs before the caller's own callbacks (registered first), so a held slot's
    # replica is known before the caller can continue it.
    with self._lock:
      self._in_flight[i] -= n
      if future is None or future.cancelled() or future.exception() is not None:
        return
      for trajectory in future.result() or ():
        handle = trajectory.metadata.get("slot")
        if handle is not None:
          self._holder[handle] = i

  def abort(self, request_id: Hashable) -> bool:
    return any([p.abort(request_id) for p in self.pools])

  def pause(self) -> None:
    for p in self.pools:
      p.pause()

  def resume(self) -> None:
    for p in self.pools:
      p.resume()

  def update_weights(self, params, version: int, mode: str = "retract") -> Future:
    """`GeneratorPool.update_weights` on every replica, one after another (each
    returns once its copy is done); the future resolves to the summed transfer
    time and the longest pause once every replica is live."""
    futures = [p.update_weights(params, version, mode) for p in self.pools]
    done, remaining, lock = Future(), [len(futures)], threading.Lock()

    def one_done(_):
      with lock:
        remaining[0] -= 1
        if remaining[0]:
          return
      errors = [f.exception() for f in futures if f.exception() is not None]
      if errors:
        done.set_exception(errors[0])
      else:
        results = [f.result() for f in futures]
        done.set_result({"transfer_s": sum(r["transfer_s"] for r in results),
                         "pause_s": max(r["pause_s"] for r in results)})

    done.set_running_or_notify_cancel()
    for f in futures:
      f.add_done_callback(one_done)
    return done

  def metrics(self) -> dict:
    """The replicas' counters added up, their oldest version, and each one's metrics
    under "replicas"."""
    each = [p.metrics() for p in self.pools]
    out = {k: sum(m[k] for m in each) for k in _SUMMED}
    steps = sum(m["decode_steps"] for m in each)
    out.update(version=min(m["version"] for m in each),
               slot_occupancy=sum(m["slot_occupancy"] * m["decode_steps"] for m in each)
               / max(steps, 1),
               steps_per_call=steps / max(out["decode_calls"], 1),
               decode_tokens_per_s=sum(m["decode_tokens_per_s"] for m in each),
               time_paused_s=max(m["time_paused_s"] for m in each),
               replicas=each)
    return out

  def shutdown(self) -> None:
    for p in self.pools:
      p.shutdown()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.shutdown()
