"""RewardService: reward functions in worker processes, with a hard per-call timeout.

Each call runs in one of `num_workers` worker processes (worker.py), fed by one
thread per worker from a shared queue. A call still running at `timeout_s` is not
waited for: its worker's process group is SIGKILLed and a fresh worker takes its
place. An exception, a return value that is not a finite real number, or a worker
that dies (os._exit, a segfault, the OOM killer) scores 0.0 and is counted. None of
these raises, so a broken reward function cannot stop a training run.

Workers are fresh interpreters, not forks: the caller holds JAX's threads, and fork
would copy their locks mid-use. Nor does this use multiprocessing's spawn, which
re-imports the caller's main module (a training binary, and JAX) in every worker.
So a reward function given as an object, rather than a name the workers can import,
is pickled by value with cloudpickle (`worker.ship_fn`) once, and sent to each worker
with its first call there; it then runs under the same timeout and counters.
"""

import dataclasses
import os
import pickle
import queue
import select
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from absl import logging

from async_rl.rewards import worker as worker_lib
from async_rl.rewards.code_tests import ALLOW_WEAK_SANDBOX_ENV
from async_rl.rewards.registry import RewardFn, resolve_reward_fn


@dataclasses.dataclass(frozen=True)
class RewardTask:
  """One reward call: `resolve_reward_fn(fn)(completion, reference)`.

  Attributes:
    fn: a key of `REWARD_FNS`, "module:function" (see registry.py), or the function
      itself (shipped to the workers by value).
    completion: the generated text, or its token ids.
    reference: what the completion is checked against (an answer, test cases, ...);
      must be picklable.
  """
  fn: str | RewardFn
  completion: str | Sequence[int]
  reference: Any


class _WorkerDied(Exception):
  pass


class _Worker:
  """One worker process and its pipes, driven by a single service thread."""

  def __init__(self, startup_timeout_s: float, env: dict[str, str]):
    self.loaded: set[str] = set()  # The keys of the reward functions this process holds.
    child_rx, self._tx = os.pipe()
    self._rx, child_tx = os.pipe()
    try:
      # Its own session, so that a kill takes whatever the reward function started;
      # JAX_PLATFORMS keeps a function that imports JAX off the accelerator.
      self._proc = subprocess.Popen(
          worker_lib.worker_command(child_rx, child_tx), pass_fds=(child_rx, child_tx),
          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
          env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
    except OSError:
      self._close_pipes()
      raise
    finally:
      os.close(child_rx)
      os.close(child_tx)
    try:
      self._receive(startup_timeout_s)
    except (TimeoutError, _WorkerDied) as e:
      self.kill()
      raise RuntimeError(f"reward worker did not start: {e}") from e

  @property
  def alive(self) -> bool:
    return self._proc.poll() is None

  def call(self, request: bytes, timeout_s: float) -> tuple[str, Any]:
    """Sends a pickled request; raises TimeoutError or _WorkerDied."""
    try:
      worker_lib.send_bytes(self._tx, request)
    except BrokenPipeError as e:
      raise _WorkerDied(self._exit_status()) from e
    return self._receive(timeout_s)

  def _receive(self, timeout_s: float):
    poller = select.poll()
    poller.register(self._rx, select.POLLIN)
    if not poller.poll(timeout_s * 1000):
      raise TimeoutError(f"no answer in {timeout_s} s")
    try:
      return worker_lib.recv(self._rx)
    except EOFError as e:
      raise _WorkerDied(self._exit_status()) from e

  def _exit_status(self) -> str:
    try:
      return f"exit status {self._proc.wait(timeout=1.0)}"
    except subprocess.TimeoutExpired:
      return "closed its pipe"

  def kill(self):
    try:
      os.killpg(self._proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    self._proc.wait()
    self._close_pipes()

  def close(self, grace_s: float = 1.0):
    try:
      worker_lib.send_bytes(self._tx, pickle.dumps(None))
      self._proc.wait(timeout=grace_s)
    except (OSError, subprocess.TimeoutExpired):
      pass
    self.kill()

  def _close_pipes(self):
    # Once only: a second close could hit a descriptor another thread reopened.
    fds, (self._tx, self._rx) = (self._tx, self._rx), (-1, -1)
    for fd in fds:
      if fd >= 0:
        os.close(fd)


class RewardService:
  """Scores completions in a pool of worker processes; a broken call scores 0.0.

  Any thread may `submit`. Use it as a context manager, or call `close()`.

  Args:
    num_workers: worker processes, so the number of calls running at once.
    timeout_s: hard limit on one call, from when its worker receives it.
    startup_timeout_s: limit on starting a worker process.
    allow_weak_sandbox: whether code rewards may run untrusted programs where only
      the weak sandbox exists (rewards/sandbox.py); passed to the workers as
      ASYNC_RL_ALLOW_WEAK_SANDBOX.
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, *,
               startup_timeout_s: float = 60.0, allow_weak_sandbox: bool = False):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    self._timeout_s = timeout_s
    self._startup_timeout_s = startup_timeout_s
    self._worker_env = {ALLOW_WEAK_SANDBOX_ENV: "1" if allow_weak_sandbox else "0"}
    self._queue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._closed = False
    self._shipped: dict[Any, tuple[str, str | bytes, Any]] = {}  # name or id -> (key, shipped, fn)
    self._counts = dict(calls=0, errors=0, timeouts=0, worker_restarts=0)
    self._latency_s = 0.0
    self._threads = [threading.Thread(target=self._serve, name=f"reward-worker-{i}",
                                      daemon=True) for i in range(num_workers)]
    for thread in self._threads:
      thread.start()

  def submit(self, task: RewardTask) -> Future:
    """Queues `task`; the future's result is its reward (0.0 on any failure).

    Raises ValueError for an unknown reward function and pickling errors for a
    task the workers cannot receive. The future's only exception is a RuntimeError
    when no worker process can be started at all.
    """
    key, shipped = self._ship(task.fn)
    payload = pickle.dumps((task.completion, task.reference))
    future = Future()
    with self._lock:
      if self._closed:
        raise RuntimeError("RewardService is closed")
      self._queue.put((key, shipped, payload, future))
    return future

  def _ship(self, fn) -> tuple[str, str | bytes]:
    """The key the workers know `fn` by and what loads it there, made once per fn."""
    ident = fn if isinstance(fn, str) else id(fn)  # Objects need not be hashable.
    with self._lock:
      entry = self._shipped.get(ident)
    if entry is None:
      resolve_reward_fn(fn)
      key = fn if isinstance(fn, str) else f"<{getattr(fn, '__qualname__', 'fn')} {id(fn):x}>"
      # The entry holds `fn`, so its id stays its own.
      entry = (key, worker_lib.ship_fn(fn), fn)
      with self._lock:
        entry = self._shipped.setdefault(ident, entry)
    return entry[0], entry[1]

  def score_batch(self, tasks: Sequence[RewardTask]) -> list[float]:
    """The rewards of `tasks`, in order, computed in parallel."""
    futures = [self.submit(task) for task in tasks]
    return [future.result() for future in futures]

  def metrics(self) -> dict[str, float]:
    """Counts since construction, and the mean time a call spent in a worker."""
    with self._lock:
      calls = self._counts["calls"]
      return {**{k: float(v) for k, v in self._counts.items()},
              "mean_latency_s": self._latency_s / calls if calls else 0.0}

  def close(self):
    """Cancels queued calls, lets running ones finish or time out, stops workers."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      pending = []
      while True:
        try:
          pending.append(self._queue.get_nowait())
        except queue.Empty:
          break
      for _ in self._threads:
        self._queue.put(None)
    for *_, future in pending:
      future.cancel()
    for thread in self._threads:
      thread.join()

  def __enter__(self) -> "RewardService":
    return self

  def __exit__(self, *exc_info):
    self.close()

  def _count(self, start: float, counter: str | None = None, restart: bool = False):
    with self._lock:
      self._counts["calls"] += 1
      self._latency_s += time.monotonic() - start
      if counter:
        self._counts[counter] += 1
      if restart:
        self._counts["worker_restarts"] += 1

  def _start_worker(self) -> _Worker | None:
    try:
      return _Worker(self._startup_timeout_s, self._worker_env)
    except (OSError, RuntimeError) as e:
      logging.error("reward service: cannot start a worker: %s", e)
      return None

  def _serve(self):
    worker = self._start_worker()
    while (item := self._queue.get()) is not None:
      fn, shipped, payload, future = item
      if not future.set_running_or_notify_cancel():
        continue
      if worker is not None and not worker.alive:
        worker.kill()
        worker = self._start_worker()
        with self._lock:
          self._counts["worker_restarts"] += 1
      if worker is None and (worker := self._start_worker()) is None:
        future.set_exception(RuntimeError("no reward worker could be started"))
        continue
      request = pickle.dumps((fn, None if fn in worker.loaded else shipped, payload))
      start = time.monotonic()
      try:
        kind, answer = worker.call(request, self._timeout_s)
      except (TimeoutError, _WorkerDied) as e:
        worker.kill()
        timed_out = isinstance(e, TimeoutError)
        logging.warning("reward fn %s %s; its worker was replaced", fn,
                        f"timed out after {self._timeout_s} s" if timed_out
                        else f"killed its worker ({e})")
        self._count(start, "timeouts" if timed_out else "errors", restart=True)
        future.set_result(0.0)
        worker = self._start_worker()
        continue
      if kind == "ok":
        worker.loaded.add(fn)
        self._count(start)
        future.set_result(answer)
      else:
        logging.warning("reward fn %s failed: %s", fn, answer)
        self._count(start, "errors")
        future.set_result(0.0)
    if worker is not None:
      worker.close()
