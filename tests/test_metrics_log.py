"""The run log holds each step once: a resumed run removes the superseded lines (and
TensorBoard hides their events); every line names its run and time."""

import json
import struct
import time

from tensorboardX.proto import event_pb2

from async_rl.rl.metrics_log import FILE, MetricsLog


def _lines(workdir):
  return [json.loads(l) for l in (workdir / FILE).read_text().splitlines()]


def _events(path):
  """The events of a TensorBoard file (TFRecords: length, its crc, data, its crc)."""
  data, events = path.read_bytes(), []
  while data:
    (n,) = struct.unpack("<Q", data[:8])
    events.append(event_pb2.Event.FromString(data[12:12 + n]))
    data = data[12 + n + 4:]
  return events


def _first_run(workdir):
  log = MetricsLog(str(workdir), "first")
  log.write(0, {"eval": {"accuracy": 0.25}})
  for step in range(1, 6):
    log.write(step, {"loss": float(step)})
  log.write(4, {"eval": {"accuracy": 0.5}})
  log.close()


def test_every_line_carries_the_run_id_and_the_time(tmp_path):
  before = time.time()
  _first_run(tmp_path)
  lines = _lines(tmp_path)
  assert [l["step"] for l in lines] == [0, 1, 2, 3, 4, 5, 4]
  assert all(l["run_id"] == "first" and before <= l["time"] <= time.time() for l in lines)


def test_a_resume_removes_the_lines_above_its_checkpoint_and_a_torn_last_line(tmp_path):
  _first_run(tmp_path)
  with open(tmp_path / FILE, "a") as f:
    f.write('{"step": 6, "loss": 1.')  # the process was killed mid-write
  log = MetricsLog(str(tmp_path), "second", resume_step=3)
  assert log.evals == {0: {"accuracy": 0.25}}
  for step in range(4, 7):
    log.write(step, {"loss": -float(step)})
  log.close()
  lines = _lines(tmp_path)
  assert [l["step"] for l in lines] == [0, 1, 2, 3, 4, 5, 6]
  assert [l["run_id"] for l in lines] == ["first"] * 4 + ["second"] * 3
  assert [l["loss"] for l in lines[4:]] == [-4.0, -5.0, -6.0]
  assert not (tmp_path / f"{FILE}.tmp").exists()


def test_a_run_that_starts_afresh_keeps_no_line(tmp_path):
  _first_run(tmp_path)
  log = MetricsLog(str(tmp_path), "again")
  assert log.evals == {}
  log.close()
  assert (tmp_path / FILE).read_text() == ""


def test_tensorboard_hides_the_events_past_the_checkpoint(tmp_path):
  _first_run(tmp_path)
  MetricsLog(str(tmp_path), "second", resume_step=3).close()
  files = sorted((tmp_path / "tensorboard").glob("events.*"), key=lambda p: p.stat().st_mtime)
  assert len(files) == 2
  starts = [e.step for e in _events(files[-1]) if e.HasField("session_log")]
  # TensorBoard drops the events of steps >= a session START's step written before it.
  assert starts == [4]
