"""RewardService: reward functions in worker processes, with a hard per-call timeout.

Each call runs in one of `num_workers` worker processes (worker.py), fed by one
thread per worker from a shared queue. A call still running at `timeout_s` is not
waited for: its worker's process group is SIGKILLed and a fresh worker takes its
place. An exception, a return value that is not a finite real number, or a worker
that dies (os._exit, a segfault, the OOM killer) scores 0.0 and is counted. None of
these raises, so a broken reward function cannot stop a training run. A worker may
get a limit on its address space (`memory_mb`): an allocation past it scores 0 as an
error.

What a worker writes to stdout or stderr (a reward function's prints, a traceback)
goes into this process's log, a line at a time, as `reward worker i (pid p): ...`:
at most `output_lines` lines per `output_interval_s` per worker, then one line saying
how many were left out, so a chatty reward function cannot flood the trainer's log.

Workers are fresh interpreters, not forks: the caller holds JAX's threads, and fork
would copy their locks mid-use. Nor does this use multiprocessing's spawn, which
re-imports the caller's main module (a training binary, and JAX) in every worker.
So a reward function given as an object, rather than a name the workers can import,
is pickled by value with cloudpickle (`worker.ship_fn`) once, and sent to each worker
with its first call there; it then runs under the same timeout and counters.
"""

import collections
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
from typing import Any, Callable

from absl import logging

from async_rl.rewards import worker as worker_lib
from async_rl.rewards.code_tests import ALLOW_WEAK_SANDBOX_ENV
from async_rl.rewards.registry import RewardFn, resolve_reward_fn


_MAX_LINE_BYTES = 1 << 14
_RELAY_JOIN_S = 5.0


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


class OutputLimiter:
  """Lines of one worker's output into the log: at most `max_lines` per `interval_s`,
  then, once the interval is over, one line counting those left out.

  `line(text, now)` logs a line or counts it; `flush(now)` reports the count once the
  interval is over (or at once with `now=None`, when the output has ended).
  """

  def __init__(self, name: str, max_lines: int, interval_s: float,
               log: Callable[[str], None] = logging.warning):
    self.name, self.max_lines, self.interval_s, self._log = name, max_lines, interval_s, log
    self._ends = float("-inf")  # when the current interval ends
    self._lines = self.left_out = 0

  def line(self, text: str, now: float) -> None:
    self.flush(now)
    if now >= self._ends:
      self._ends, self._lines = now + self.interval_s, 0
    if self._lines < self.max_lines:
      self._lines += 1
      self._log(f"{self.name}: {text}")
    else:
      self.left_out += 1

  def flush(self, now: float | None = None) -> None:
    if self.left_out and (now is None or now >= self._ends):
      n = self.left_out
      self._log(f"{self.name}: {n} more line{'s' if n > 1 else ''} of output left out "
                f"(at most {self.max_lines} per {self.interval_s:g} s are logged)")
      self.left_out = 0

  def seconds_to_flush(self, now: float) -> float | None:
    """How long until a count is due; None if none is."""
    return max(0.0, self._ends - now) if self.left_out else None


def _relay(fd: int, limiter: OutputLimiter):
  """Feeds `fd`'s lines to `limiter` until end of file; closes `fd`."""
  poller = select.poll()
  poller.register(fd, select.POLLIN)
  pending = b""
  try:
    while True:
      wait_s = limiter.seconds_to_flush(time.monotonic())
      if poller.poll(None if wait_s is None else wait_s * 1000 + 1):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
          break
        *lines, pending = (pending + chunk).split(b"\n")
        if len(pending) > _MAX_LINE_BYTES:  # a line without end is logged in pieces
          lines.append(pending)
          pending = b""
        now = time.monotonic()
        for line in lines:
          limiter.line(line.decode(errors="replace").rstrip(), now)
      limiter.flush(time.monotonic())
    if pending:
      limiter.line(pending.decode(errors="replace").rstrip(), time.monotonic())
  finally:
    limiter.flush()
    os.close(fd)


class _Worker:
  """One worker process and its pipes, driven by a single service thread; its output is
  relayed into the log by a thread of its own."""

  def __init__(self, name: str, startup_timeout_s: float, env: dict[str, str],
               memory_mb: int, output_lines: int, output_interval_s: float):
    self.loaded: set[str] = set()  # The keys of the reward functions this process holds.
    child_rx, self._tx = os.pipe()
    self._rx, child_tx = os.pipe()
    out_rx, child_out = os.pipe()
    try:
      # Its own session, so that a kill takes whatever the reward function started;
      # JAX_PLATFORMS keeps a function that imports JAX off the accelerator. An
      # address-space limit counts memory reserved, not used: a glibc malloc arena
      # per thread reserves 64 MB, so a few arenas are shared instead.
      self._proc = subprocess.Popen(
          worker_lib.worker_command(child_rx, child_tx, memory_mb),
          pass_fds=(child_rx, child_tx), stdin=subprocess.DEVNULL, stdout=child_out,
          stderr=child_out, start_new_session=True,
          env={**os.environ, "JAX_PLATFORMS": "cpu", "MALLOC_ARENA_MAX": "2", **env})
    except OSError:
      self._close_pipes()
      os.close(out_rx)
      raise
    finally:
      os.close(child_rx)
      os.close(child_tx)
      os.close(child_out)
    self._relay = threading.Thread(
        target=_relay, name=f"{name} output", daemon=True,
        args=(out_rx, OutputLimiter(f"{name} (pid {self._proc.pid})", output_lines,
                                    output_interval_s)))
    self._relay.start()
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
    # Its output ends with it (and whatever else it started in its session).
    self._relay.join(_RELAY_JOIN_S)

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
    memory_mb: limit on each worker's address space (0: none).
    allow_weak_sandbox: whether code rewards may run untrusted programs where only
      the weak sandbox exists (rewards/sandbox.py); passed to the workers as
      ASYNC_RL_ALLOW_WEAK_SANDBOX.
    output_lines, output_interval_s: at most this many lines of a worker's output
      are logged per this many seconds.
    error_window: the recent calls `recent_failures` counts over.
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, *,
               startup_timeout_s: float = 60.0, memory_mb: int = 0,
               allow_weak_sandbox: bool = False, output_lines: int = 20,
               output_interval_s: float = 10.0, error_window: int = 64):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 0:
      raise ValueError(f"memory_mb must be >= 0 (0: no limit), got {memory_mb}")
    self._timeout_s = timeout_s
    self._startup_timeout_s = startup_timeout_s
    self._memory_mb = memory_mb
    self._output = (output_lines, output_interval_s)
    self._worker_env = {ALLOW_WEAK_SANDBOX_ENV: "1" if allow_weak_sandbox else "0"}
    self._queue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._closed = False
    self._shipped: dict[Any, tuple[str, str | bytes, Any]] = {}  # name or id -> (key, shipped, fn)
    self._names: dict[str, str] = {}  # key -> the function's name, for messages
    self._counts = dict(calls=0, errors=0, timeouts=0, worker_restarts=0)
    self._latency_s = 0.0
    self.error_window = error_window
    self._recent = collections.deque(maxlen=error_window)  # per call: did it fail
    self._first_error: str | None = None
    self._threads = [threading.Thread(target=self._serve, args=(f"reward worker {i}",),
                                      name=f"reward-worker-{i}", daemon=True)
                     for i in range(num_workers)]
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
      name = fn if isinstance(fn, str) else getattr(fn, "__qualname__", "fn")
      key = fn if isinstance(fn, str) else f"<{name} {id(fn):x}>"
      # The entry holds `fn`, so its id stays its own.
      entry = (key, worker_lib.ship_fn(fn), fn)
      with self._lock:
        entry = self._shipped.setdefault(ident, entry)
        self._names.setdefault(entry[0], name)
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

  def recent_failures(self) -> tuple[int, int, str | None]:
    """Failed calls (errors and timeouts) among the last `error_window`, the calls
    counted (fewer until that many were made), and the first failure of all, with the
    function it came from."""
    with self._lock:
      return sum(self._recent), len(self._recent), self._first_error

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

  def _count(self, start: float, counter: str | None = None, restart: bool = False,
             fn: str = "", error: str = ""):
    with self._lock:
      fn = self._names.get(fn, fn)
      self._counts["calls"] += 1
      self._latency_s += time.monotonic() - start
      self._recent.append(counter is not None)
      if counter:
        self._counts[counter] += 1
        failures = self._counts["errors"] + self._counts["timeouts"]
        if self._first_error is None:
          self._first_error = f"{fn}: {error}"
      if restart:
        self._counts["worker_restarts"] += 1
    # The 1st, 2nd, 4th, 8th, ... failure is logged: a function that always fails must
    # not flood the log.
    if counter and failures & (failures - 1) == 0:
      logging.warning("reward fn %s %s (%d failed calls so far)", fn, error, failures)

  def _start_worker(self, name: str) -> _Worker | None:
    try:
      return _Worker(name, self._startup_timeout_s, self._worker_env, self._memory_mb,
                     *self._output)
    except (OSError, RuntimeError) as e:
      logging.error("reward service: cannot start a worker: %s", e)
      return None

  def _serve(self, name: str):
    worker = self._start_worker(name)
    while (item := self._queue.get()) is not None:
      fn, shipped, payload, future = item
      if not future.set_running_or_notify_cancel():
        continue
      if worker is not None and not worker.alive:
        worker.kill()
        worker = self._start_worker(name)
        with self._lock:
          self._counts["worker_restarts"] += 1
      if worker is None and (worker := self._start_worker(name)) is None:
        future.set_exception(RuntimeError("no reward worker could be started"))
        continue
      request = pickle.dumps((fn, None if fn in worker.loaded else shipped, payload))
      start = time.monotonic()
      try:
        kind, answer = worker.call(request, self._timeout_s)
      except (TimeoutError, _WorkerDied) as e:
        worker.kill()
        timed_out = isinstance(e, TimeoutError)
        what = (f"timed out after {self._timeout_s} s" if timed_out
                else f"killed its worker ({e})")
        self._count(start, "timeouts" if timed_out else "errors", restart=True, fn=fn,
                    error=f"{what}; its worker was replaced")
        future.set_result(0.0)
        worker = self._start_worker(name)
        continue
      if kind == "ok":
        worker.loaded.add(fn)
        self._count(start)
        future.set_result(answer)
      else:
        limit = (f" (past the reward workers' memory limit, {self._memory_mb} MB)"
                 if answer.startswith("MemoryError") else "")
        self._count(start, "errors", fn=fn, error=f"failed: {answer}{limit}")
        future.set_result(0.0)
    if worker is not None:
      worker.close()
