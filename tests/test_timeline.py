import threading

import pytest

from async_rl.timeline import Span, Timeline, busy_fraction, chrome_trace, overlap_shares


def test_back_to_back_spans_merge_and_gaps_split():
  t = Timeline(merge_gap_s=0.01)
  t.record("gen", "decode", 0.0, 1.0, merge=True)
  t.record("gen", "decode", 1.005, 2.0, merge=True)  # within the gap: extends the span
  t.record("gen", "swap", 2.0, 2.5, merge=True)      # another name: its own span
  t.record("gen", "decode", 2.5, 3.0, merge=True)    # 0.5 s after the last: a new span
  t.record("trainer", "train", 0.5, 1.5)
  t.record("trainer", "train", 1.5, 2.0)             # merge=False: its own span
  assert t.spans() == [Span("gen", "decode", 0.0, 2.0), Span("trainer", "train", 0.5, 1.5),
                       Span("trainer", "train", 1.5, 2.0), Span("gen", "swap", 2.0, 2.5),
                       Span("gen", "decode", 2.5, 3.0)]


def test_oldest_spans_are_dropped_past_the_bound():
  t = Timeline(max_spans=3)
  for i in range(10):
    t.record("gen", "decode", 2 * i, 2 * i + 1, merge=True)
  # Three closed spans are kept, plus the newest (open) one.
  assert [s.start for s in t.spans()] == [12, 14, 16, 18]


def test_span_context_records_even_on_error():
  t = Timeline()
  with pytest.raises(RuntimeError):
    with t.span("trainer", "train"):
      raise RuntimeError("boom")
  (s,) = t.spans()
  assert (s.lane, s.name) == ("trainer", "train") and s.end >= s.start


def test_concurrent_recording_loses_nothing():
  t = Timeline()

  def worker(k):
    for i in range(1000):
      t.record(f"lane{k}", "x", float(i), i + 0.5)

  threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  spans = t.spans()
  assert len(spans) == 4000
  assert all(sum(s.lane == f"lane{k}" for s in spans) == 1000 for k in range(4))


def test_busy_fraction_counts_overlaps_once_and_clips_to_the_window():
  spans = [Span("g", "decode", 0, 4), Span("g", "swap", 3, 5), Span("g", "decode", 8, 12),
           Span("t", "train", 0, 10)]
  assert busy_fraction(spans, "g", 0, 10) == pytest.approx(0.7)  # [0,5] + [8,10]
  assert busy_fraction(spans, "g", 4, 9) == pytest.approx(0.4)   # [4,5] + [8,9]
  assert busy_fraction(spans, "t", 2, 6) == 1.0
  assert busy_fraction(spans, "missing", 0, 10) == 0.0


def test_chrome_trace_has_a_row_per_lane_and_microsecond_times():
  spans = [Span("generator", "decode", 100.0, 100.5), Span("trainer", "train", 100.25, 101.0)]
  doc = chrome_trace(spans)
  meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
  assert {e["args"]["name"]: e["tid"] for e in meta} == {"generator": 0, "trainer": 1}
  x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
  assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in x] == [
      ("decode", 0, 0.0, 500_000.0), ("train", 1, 250_000.0, 750_000.0)]


def test_overlap_shares_split_the_window_between_the_two_lanes():
  spans = [Span("g", "decode", 0, 4), Span("g", "swap", 3, 5), Span("g", "decode", 8, 12),
           Span("t", "train", 2, 7), Span("t", "publish", 7, 8), Span("x", "other", 0, 10)]
  shares = overlap_shares(spans, "g", "t", 0, 10)
  # g: [0,5] + [8,10]; t: [2,8]. Only g [0,2] + [8,10], only t [5,8], both [2,5].
  assert shares == pytest.approx({"only_g": 0.4, "only_t": 0.3, "both": 0.3, "neither": 0.0})
  shares = overlap_shares(spans, "g", "t", 4, 14)
  assert shares == pytest.approx({"only_g": 0.4, "only_t": 0.3, "both": 0.1, "neither": 0.2})
  assert sum(overlap_shares(spans, "g", "t", 1, 1).values()) == 0

