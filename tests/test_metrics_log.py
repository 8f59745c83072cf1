"""The run log holds each step once: a resumed run removes the superseded lines (and
TensorBoard hides their events); every line names its run and time. TensorBoard and
W&B get grouped tags; the warm start and sample completions have their own lines."""

import json
import logging
import math
import struct
import subprocess
import sys
import time
import types

import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from async_rl.rl import metrics_log
from async_rl.rl.metrics_log import FILE, SAMPLES_FILE, MetricsLog


def _lines(workdir):
  return [json.loads(l) for l in (workdir / FILE).read_text().splitlines()]


def _events(path):
  """The events of a TensorBoard file (TFRecords: length, its crc, data, its crc),
  each checksum checked with tensorboardX's own."""
  data, events = path.read_bytes(), []
  while data:
    (n,) = struct.unpack("<Q", data[:8])
    body = data[12:12 + n]
    assert struct.unpack("<II", data[8:12] + data[12 + n:16 + n]) == (
        masked_crc32c(data[:8]), masked_crc32c(body))
    events.append(event_pb2.Event.FromString(body))
    data = data[12 + n + 4:]
  return events


def test_logging_imports_neither_tensorflow_nor_torch():
  # Both are installed here (the test extra), as in many users' environments.
  code = ("import sys, async_rl.rl.metrics_log; "
          "print(sorted(m for m in ('tensorflow', 'torch', 'tensorboardX') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


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


def _tags(path):
  return {v.tag for e in _events(path) for v in e.summary.value}


def test_tensorboard_groups_the_tags_and_plots_no_process_ids():
  line = {"loss": 0.5, "lr": 1e-4, "reward_mean": 0.25, "time_train_s": 1.5,
          "gen_tokens_per_s": 9.0, "longest_unreported_wait_s": 2.0, "staleness_mean": 0.5,
          "staleness_hist": {0: 3, 1: 4}, "worker_restarts": 0, "pid": 4242,
          "prompts": ["a", "b"], "skipped": 0, "grad_norm": math.nan,
          "rollout": {"admitted": 4, "pid": 4243}, "server": {"version": 3},
          "lengths": {"trained": {"p50": 16}}}
  tagged = dict(metrics_log.tags(line))
  assert math.isnan(tagged.pop("train/grad_norm"))  # TensorBoard plots nan as nan
  assert tagged == {
      "train/loss": 0.5, "train/lr": 1e-4, "train/reward_mean": 0.25, "train/skipped": 0,
      "perf/time_train_s": 1.5, "perf/gen_tokens_per_s": 9.0,
      "perf/longest_unreported_wait_s": 2.0,
      "staleness/mean": 0.5, "staleness/hist/0": 3, "staleness/hist/1": 4,
      "rollout/worker_restarts": 0, "rollout/admitted": 4, "server/version": 3,
      "lengths/trained/p50": 16}
  assert dict(metrics_log.tags({"eval": {"accuracy": 0.5, "rewards": {"calls": 8}}})) == {
      "eval/accuracy": 0.5, "eval/rewards/calls": 8}


def _scalars(path):
  return {(e.step, v.tag): v.simple_value for e in _events(path) for v in e.summary.value}


def test_inf_nan_and_values_beyond_float32_are_plotted_as_float32_holds_them(tmp_path):
  # TensorBoard stores scalars as float32: a reward of 1e39 is +inf there.
  log = MetricsLog(str(tmp_path), "first")
  log.write(1, {"reward_mean": 1e39, "loss": -1e39, "grad_norm": math.nan, "lr": math.inf,
                "server": {"tokens": 10**400, "dropped": -10**400}, "skipped": 1})
  log.write(2, {"reward_mean": 0.5})
  log.close()
  (path,) = (tmp_path / "tensorboard").glob("events.*")
  scalars = _scalars(path)
  assert math.isnan(scalars.pop((1, "train/grad_norm")))
  assert scalars == {(1, "train/reward_mean"): math.inf, (1, "train/loss"): -math.inf,
                     (1, "train/lr"): math.inf, (1, "server/tokens"): math.inf,
                     (1, "server/dropped"): -math.inf, (1, "train/skipped"): 1.0,
                     (2, "train/reward_mean"): 0.5}
  assert [(l["step"], l["reward_mean"]) for l in _lines(tmp_path)] == [(1, 1e39), (2, 0.5)]


def test_a_metric_tensorboard_cannot_take_is_left_out_with_one_warning_and_logging_goes_on(
    tmp_path, caplog):
  bad = "acc\udc80"  # not UTF-8: no protocol buffer string can hold it
  log = MetricsLog(str(tmp_path), "first")
  with caplog.at_level(logging.WARNING):
    for step in (1, 2):
      log.write(step, {"loss": float(step), "eval": {bad: 0.5}})
    log.write_samples(2, [{"prompt": "2+2=", "completion": "4\udc80", "reward": 1.0}])
    log.write(3, {"loss": 3.0})
  log.close()
  (path,) = (tmp_path / "tensorboard").glob("events.*")
  assert _scalars(path) == {(1, "train/loss"): 1.0, (2, "train/loss"): 2.0,
                            (3, "train/loss"): 3.0}
  warnings = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
  assert len(warnings) == 2  # once per metric, however often it comes
  assert "eval/acc\\udc80" in warnings[0] and "samples" in warnings[1]
  assert [l["eval"] for l in _lines(tmp_path) if "eval" in l] == [{bad: 0.5}] * 2
  sample = json.loads((tmp_path / SAMPLES_FILE).read_text())
  assert sample["completion"] == "4\udc80"


def test_the_warm_start_logs_before_rl_and_no_resume_supersedes_it(tmp_path):
  log = MetricsLog(str(tmp_path), "first")
  for sft_step in (50, 100):
    log.write_warm_start(sft_step, {"loss": 2.0 / sft_step, "lr": 1e-3}, at=123.0)
  for step in range(1, 4):
    log.write(step, {"loss": float(step)})
  log.close()
  MetricsLog(str(tmp_path), "second", resume_step=1).close()
  lines = _lines(tmp_path)
  assert [(l["step"], l.get("sft")) for l in lines] == [
      (0, {"step": 50, "loss": 0.04, "lr": 1e-3}), (0, {"step": 100, "loss": 0.02, "lr": 1e-3}),
      (1, None)]
  assert lines[0]["time"] == 123.0
  # Its TensorBoard events are a run of their own, out of reach of the resumed run's purge.
  (sft_file,) = (tmp_path / "tensorboard" / "sft").glob("events.*")
  assert _tags(sft_file) == {"sft/loss", "sft/lr"}
  steps = [e.step for e in _events(sft_file) if e.summary.value]
  assert steps == [50, 50, 100, 100]
  assert all("sft/loss" not in _tags(f) for f in (tmp_path / "tensorboard").glob("events.*"))


def test_samples_go_to_their_own_file_and_tensorboard_text_each_step_once(tmp_path):
  sample = {"prompt_id": "p0", "reward": 1.0, "correct": True, "finish_reason": "stop",
            "prompt": "2+2=", "completion": "4\nend"}
  log = MetricsLog(str(tmp_path), "first")
  for step in (2, 4):
    log.write_samples(step, [sample, {**sample, "reward": 0.0, "correct": False}])
  log.close()
  MetricsLog(str(tmp_path), "second", resume_step=3).close()
  lines = [json.loads(l) for l in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
  assert [(l["step"], l["reward"], l["completion"]) for l in lines] == [
      (2, 1.0, "4\nend"), (2, 0.0, "4\nend")]
  assert all(l["run_id"] == "first" for l in lines)
  first = min((tmp_path / "tensorboard").glob("events.*"), key=lambda p: p.stat().st_mtime)
  texts = [(e.step, v.tensor.string_val[0].decode()) for e in _events(first)
           for v in e.summary.value]
  assert [step for step, _ in texts] == [2, 4]
  assert "    2+2=" in texts[0][1] and "    4\n    end" in texts[0][1]
  assert "reward=0" in texts[0][1] and "correct=False" in texts[0][1]


class _FakeWandb(types.ModuleType):
  """The calls MetricsLog makes of `wandb`, recorded."""

  def __init__(self):
    super().__init__("wandb")
    self.calls = []
    fake = self

    class Run:
      def define_metric(self, name, step_metric=None):
        fake.calls.append(("define_metric", name, step_metric))

      def log(self, values):
        fake.calls.append(("log", values))

      def finish(self):
        fake.calls.append(("finish",))

    class Table:
      def __init__(self, columns, data):
        self.columns, self.data = columns, data

    self.Table = Table
    self.init = lambda **kw: fake.calls.append(("init", kw)) or Run()


def test_weights_and_biases_gets_the_grouped_metrics_on_their_own_axes(tmp_path, monkeypatch):
  wandb = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", wandb)
  metrics_log.check_wandb("proj")
  log = MetricsLog(str(tmp_path / "run_a"), "r1", wandb_project="proj", hparams={"seed": 3})
  log.write_warm_start(10, {"loss": 1.5})
  log.write(1, {"loss": 0.5, "pid": 7, "rollout": {"admitted": 2}})
  log.write(1, {"eval": {"accuracy": 0.25}})
  log.write_samples(1, [{"prompt": "q", "completion": "a", "reward": 1.0}])
  log.close()
  (init, *calls) = wandb.calls
  assert init == ("init", {"project": "proj", "name": "r1", "config": {"seed": 3},
                           "group": "run_a", "dir": str(tmp_path / "run_a")})
  logged = [c[1] for c in calls if c[0] == "log"]
  assert logged[:3] == [{"sft/loss": 1.5, "sft/step": 10},
                        {"train/loss": 0.5, "rollout/admitted": 2, "version": 1},
                        {"eval/accuracy": 0.25, "version": 1}]
  table = logged[3]["samples/completions"]
  assert table.columns == ["step", "completion", "prompt", "reward"]
  assert table.data == [[1, "a", "q", 1.0]]
  axes = {c[1]: c[2] for c in calls if c[0] == "define_metric"}
  assert axes == {"version": None, "sft/step": None, "sft/*": "sft/step",
                  "train/*": "version", "rollout/*": "version", "eval/*": "version",
                  "samples/*": "version"}
  assert calls[-1] == ("finish",)


def test_weights_and_biases_asked_for_but_not_installed_is_a_config_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  metrics_log.check_wandb(None)
  with pytest.raises(ValueError, match=r"log\.wandb_project needs the wandb package"):
    metrics_log.check_wandb("proj")
