"""Deadlines on a run's blocking waits: a log line past the soft one, a stop past the hard one.

A wait is a name ("a training batch", "rollout worker 0 generator") and the
seconds it has lasted without progress. The trainer loop's thread opens its own
waits with `waiting`, or waits for a future or a call with `result` and `call`;
the rollout workers report theirs (`RolloutWorker.waits`), and while the loop runs
a watchdog thread observes all of them every `tick_s` (`watching`).

A wait is logged once it passes `warn_after_s`, with its name and length, and again
each time its length doubles. Past `stall_timeout_s`, `result` and `call` raise
`StallError` themselves; any other wait that may stall is recorded, and the loop
raises it at its next `check`, so that the run checkpoints and stops. A wait opened
with `may_stall=False` (the training step: compute, which cannot be interrupted) is
only ever logged.
"""

import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Callable, Mapping, Optional

from async_rl.rl.errors import StallError, StopRequested

_STOP_POLL_S = 0.1


class Deadlines:
  """The soft and hard deadlines of one process's waits, and what was reported.

  Attributes:
    longest_unreported_s: the longest any observed wait went without a log line:
      the length of a wait when first reported, or of one that ended unreported.
    reports: log lines written.
    stalled: the first recorded `StallError` (see `check`), or None.

  Args:
    warn_after_s: the soft deadline.
    stall_timeout_s: the hard deadline.
    echo: receives each report line (also logged as a warning).
    tick_s: how often the watchdog observes, and how often `result` checks.
  """

  def __init__(self, warn_after_s: float, stall_timeout_s: float,
               echo: Callable[[str], None] = print, tick_s: Optional[float] = None):
    self.warn_after_s, self.stall_timeout_s = warn_after_s, stall_timeout_s
    self.tick_s = min(1.0, warn_after_s / 4) if tick_s is None else tick_s
    self._echo = echo
    self._lock = threading.Lock()
    self._ids = itertools.count()
    self._open: dict[int, tuple[str, float, bool]] = {}  # id -> (what, since, may stall)
    self._others: dict[str, float] = {}  # the latest waits given to `observe`, taken at
    self._others_at = 0.0
    self._seen: dict[str, tuple[float, float, bool]] = {}  # what -> (s, next report, reported)
    self.longest_unreported_s = 0.0
    self.reports = 0
    self.stalled: Optional[StallError] = None

  @contextlib.contextmanager
  def waiting(self, what: str, *, may_stall: bool = True):
    """Marks the calling thread as waiting for `what` until the block ends.

    Yields a function to call on progress: the wait's clock starts again.
    """
    key = next(self._ids)

    def progress():
      with self._lock:
        self._open[key] = (what, time.monotonic(), may_stall)

    progress()
    try:
      yield progress
    finally:
      with self._lock:
        del self._open[key]
      self.observe()

  def observe(self, waits: Optional[Mapping[str, float]] = None) -> None:
    """Reports the waits past a deadline: the open ones and `waits` ({what: seconds},
    other threads' or processes'; None: the last ones given, aged since)."""
    now = time.monotonic()
    with self._lock:
      if waits is not None:
        self._others, self._others_at = dict(waits), now
      current = self._current(now)
      lines = []
      for what, (s, may_stall) in current.items():
        last, due, reported = self._seen.get(what, (0.0, self.warn_after_s, False))
        if s + 2 * self.tick_s < last:  # the same name, but a new wait
          self._ended(last, reported)
          due, reported = self.warn_after_s, False
        if s >= due:
          if not reported:
            self.longest_unreported_s = max(self.longest_unreported_s, s)
          lines.append(f"WARNING: waiting {s:.0f} s for {what}")
          due, reported = 2 * s, True
        self._seen[what] = (s, due, reported)
        if may_stall and s >= self.stall_timeout_s and self.stalled is None:
          self.stalled = StallError(self._stall_message(what, s, current))
      for what in set(self._seen) - set(current):
        last, _, reported = self._seen.pop(what)
        self._ended(last, reported)
      self.reports += len(lines)
    for line in lines:
      logging.warning(line)
      self._echo(line)

  def check(self) -> None:
    """Raises the recorded `StallError`, if a wait passed the hard deadline."""
    if self.stalled is not None:
      raise self.stalled

  def longest(self, *, besides: str) -> float:
    """The longest wait now known, other than those named `besides`; 0 if none."""
    with self._lock:
      current = self._current(time.monotonic())
    return max((s for what, (s, _) in current.items() if what != besides), default=0.0)

  def stall(self, what: str, s: float) -> StallError:
    """A `StallError` for `what`, awaited `s` seconds, naming the other long waits."""
    with self._lock:
      return StallError(self._stall_message(what, s, self._current(time.monotonic())))

  def result(self, future: concurrent.futures.Future, what: str, *,
             stop: Optional[threading.Event] = None) -> Any:
    """`future.result()`, reported past the soft deadline; StallError past the hard one.

    With `stop`, raises `StopRequested` within `_STOP_POLL_S` of it being set (the
    future is left to whoever made it).
    """
    start = time.monotonic()
    poll_s = self.tick_s if stop is None else min(self.tick_s, _STOP_POLL_S)
    with self.waiting(what, may_stall=False):
      while True:
        if stop is not None and stop.is_set():
          raise StopRequested(f"stopped while waiting for {what}")
        try:
          return future.result(timeout=poll_s)
        except concurrent.futures.TimeoutError:
          self.observe()
          waited = time.monotonic() - start
          if waited >= self.stall_timeout_s:
            raise self.stall(what, waited) from None

  def call(self, fn: Callable[[], Any], what: str) -> Any:
    """`fn()` on a helper thread, awaited as `result` awaits a future (a call that
    hangs is left behind on its thread)."""
    future = concurrent.futures.Future()

    def run():
      try:
        future.set_result(fn())
      except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread.
        future.set_exception(e)

    threading.Thread(target=run, name=f"deadline: {what}", daemon=True).start()
    return self.result(future, what)

  @contextlib.contextmanager
  def watching(self, waits: Callable[[], Mapping[str, float]]):
    """Until the block ends, observes the open waits every `tick_s`, and `waits()` as
    often as it answers: a probe that blocks (a worker that is restarting, or hung)
    holds up no report, and the waits it last gave keep ageing meanwhile."""
    stop = threading.Event()

    def probe():
      while not stop.wait(self.tick_s):
        try:
          self.observe(waits())
        except StallError as e:  # a probe that got no answer: that part is stalled
          self.stalled = self.stalled or e
        except Exception:  # noqa: BLE001 - a failed probe must not end the watch.
          logging.exception("watchdog: could not read the rollout workers' waits")

    def tick():
      while not stop.wait(self.tick_s):
        self.observe()

    threads = [threading.Thread(target=f, name=f"watchdog {f.__name__}", daemon=True)
               for f in (probe, tick)]
    for thread in threads:
      thread.start()
    try:
      yield
    finally:
      stop.set()
      for thread in threads:
        thread.join(timeout=10 * self.tick_s)  # a probe that hangs is left behind

  def _current(self, now):
    current = {what: (s + now - self._others_at, True) for what, s in self._others.items()}
    current.update((what, (now - since, may_stall))
                   for what, since, may_stall in self._open.values())
    return current

  def _ended(self, last, reported):
    if not reported:
      self.longest_unreported_s = max(self.longest_unreported_s, last)

  def _stall_message(self, what, s, current):
    others = sorted(((o, t) for o, (t, _) in current.items()
                     if o != what and t >= self.warn_after_s), key=lambda x: -x[1])
    also = "".join(f"; also waiting {t:.0f} s for {o}" for o, t in others[:3])
    return (f"stalled: waited {s:.0f} s for {what} (run.stall_timeout_s="
            f"{self.stall_timeout_s:g}){also}")
