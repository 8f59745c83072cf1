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


def _busy_intervals(spans: Iterable[Span], lane: str, start: float,
                    end: float) -> list[tuple[float, float]]:
  """The union of `lane`'s spans clipped to [start, end], as disjoint sorted intervals."""
  out = []
  for s in sorted((s for s in spans if s.lane == lane), key=lambda s: s.start):
    lo, hi = max(s.start, start), min(s.end, end)
    if hi <= lo:
      continue
    if out and lo <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], hi))
    else:
      out.append((lo, hi))
  return out


def overlap_shares(spans: Iterable[Span], a: str, b: str, start: float,
                   end: float) -> dict[str, float]:
  """Where the time of [start, end] went between lanes `a` and `b`: the shares during
  which only `a` was busy, only `b`, both at once, and neither (waiting); they sum to 1.

  A synchronous run has no `both`; an asynchronous one that overlaps perfectly has no
  `neither`.
  """
  shares = {f"only_{a}": 0.0, f"only_{b}": 0.0, "both": 0.0, "neither": 0.0}
  if end <= start:
    return shares
  spans = list(spans)
  # Each lane's intervals are disjoint, so its state flips at each of their ends.
  events = sorted((t, lane) for lane in (a, b)
                  for iv in _busy_intervals(spans, lane, start, end) for t in iv)
  busy, last = {a: False, b: False}, start
  for t, lane in events + [(end, None)]:
    key = ("both" if busy[a] and busy[b] else f"only_{a}" if busy[a]
           else f"only_{b}" if busy[b] else "neither")
    shares[key] += (t - last) / (end - start)
    last = t
    if lane is not None:
      busy[lane] = not busy[lane]
  return shares


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
