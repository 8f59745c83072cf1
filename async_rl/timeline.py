"""Busy intervals of the system's components, recorded by the components themselves.

Each component owns a `Timeline` and records what it spends time on (a decode step,
a prefill, a weight swap, a training step) as `Span`s on its lane. Spans carry wall
clock times (`time.time()`), so spans from several processes on one host share an
axis. The pure functions below turn spans into busy fractions and a Chrome trace
(open it at chrome://tracing or ui.perfetto.dev).
"""

import collections
import contextlib
import threading
import time
from typing import Iterable, NamedTuple

MAX_SPANS = 200_000  # About 20 MB: bounded memory however long a run is.


class Span(NamedTuple):
  lane: str
  name: str
  start: float
  end: float


class Timeline:
  """A thread-safe record of the newest `max_spans` busy intervals.

  A span recorded with `merge=True` that starts within `merge_gap_s` of the end of
  the previous span of its lane and name extends it, so a generator decoding step
  after step is one span, not thousands.
  """

  def __init__(self, *, merge_gap_s: float = 1e-3, max_spans: int = MAX_SPANS):
    self._merge_gap_s = merge_gap_s
    self._closed: collections.deque[Span] = collections.deque(maxlen=max_spans)
    self._open: dict[tuple[str, str], Span] = {}  # The newest span of each lane and name.
    self._lock = threading.Lock()

  def record(self, lane: str, name: str, start: float, end: float, *,
             merge: bool = False) -> None:
    with self._lock:
      last = self._open.get((lane, name))
      if merge and last is not None and start - last.end <= self._merge_gap_s:
        self._open[(lane, name)] = last._replace(end=max(end, last.end))
        return
      if last is not None:
        self._closed.append(last)
      self._open[(lane, name)] = Span(lane, name, start, end)

  @contextlib.contextmanager
  def span(self, lane: str, name: str):
    start = time.time()
    try:
      yield
    finally:
      self.record(lane, name, start, time.time())

  def spans(self) -> list[Span]:
    with self._lock:
      return sorted([*self._closed, *self._open.values()], key=lambda s: s.start)


def busy_fraction(spans: Iterable[Span], lane: str, start: float, end: float) -> float:
  """The share of [start, end] covered by the union of `lane`'s spans."""
  covered, reach = 0.0, start
  for s in sorted((s for s in spans if s.lane == lane), key=lambda s: s.start):
    lo, hi = max(s.start, reach), min(s.end, end)
    if hi > lo:
      covered += hi - lo
      reach = hi
  return covered / (end - start) if end > start else 0.0


def chrome_trace(spans: Iterable[Span]) -> dict:
  """The spans as a Chrome trace-event document: one thread row per lane."""
  spans = sorted(spans, key=lambda s: s.start)
  t0 = spans[0].start if spans else 0.0
  lanes = {lane: i for i, lane in enumerate(dict.fromkeys(s.lane for s in spans))}
  events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": lane}}
            for lane, i in lanes.items()]
  events += [{"ph": "X", "name": s.name, "pid": 0, "tid": lanes[s.lane],
              "ts": (s.start - t0) * 1e6, "dur": (s.end - s.start) * 1e6} for s in spans]
  return {"traceEvents": events, "displayTimeUnit": "ms"}
