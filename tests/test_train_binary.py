"""launch/train.py: resume after SIGKILL with consistent state, data accounting and a log
holding each step once; SIGTERM stops, saves and exits 143, and a second run on a held
workdir is refused; in the synchronous mode, resume (even past a damaged checkpoint)
equals not stopping, and the run not stopped is the binary's smoke run."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

from async_rl.config import ModelConfig
from async_rl.rl.audit import step_lines
from async_rl.rl.checkpoint import restore_params
from conftest import wait_until
from reward_fns_for_tests import IN_FLIGHT_DIR_ENV
from rl_test_utils import check_prompt_accounting

ROOT = Path(__file__).parents[1]


def _train(workdir, *flags, env=None):
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/micro.py",
         f"--workdir={workdir}", *flags]
  path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])  # test reward functions
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=dict(os.environ, PYTHONPATH=path, **(env or {})))


def _checkpoints(workdir):
  path = Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit()) if path.exists() else []


def _kill_after_checkpoint(proc, workdir, step):
  def reached():
    return bool(_checkpoints(workdir)) and _checkpoints(workdir)[-1] >= step

  wait_until(lambda: reached() or proc.poll() is not None, timeout=600, interval=0.05)
  assert reached(), proc.communicate()[0][-3000:]
  proc.send_signal(signal.SIGKILL)
  proc.communicate()


def _steps(workdir):
  path = Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(l) for l in path.read_text().splitlines() if '"eval"' not in l]


# An async run (η 2) with reward calls that take a while, so that kills land among them.
_ETA, _END = 2, 20
_KILLED = (f"--config.staleness.max_staleness={_ETA}", f"--config.num_steps={_END}",
           "--config.rollout.reward_fn=reward_fns_for_tests:sleeps")
# Where a SIGKILL lands, told by what it leaves behind: a reward call's in-flight file
# (the reward workers die with the run), an Orbax save's temporary directory, or
# neither (the generator, always busy in this run, was decoding).
_KILL_POINTS = ("reward", "checkpoint save", "generation")


def _at(workdir, marks):
  saving = any(".orbax-checkpoint-tmp" in p.name
               for p in (Path(workdir) / "checkpoints").glob("*"))
  return "reward" if any(marks.iterdir()) else "checkpoint save" if saving else "generation"


def _kill_at(out, workdir, marks, point, steps, delay_s):
  """SIGKILLs the run once it has logged `steps` steps of its own, `delay_s` later, as
  soon as it is at `point`; returns where the kill landed."""
  run_id = re.search(r"^run (\S+) \(host", out._text, re.M).group(1)

  def logged():
    return sum(s["run_id"] == run_id for s in _steps(workdir)) >= steps

  wait_until(lambda: logged() or out.proc.poll() is not None, timeout=300, interval=0.02,
             message=lambda: out._text[-3000:])
  assert logged(), out._text[-3000:]
  time.sleep(delay_s)

  def at_point():  # One read a poll: by a second one the run may have moved on.
    if _at(workdir, marks) == point:
      return True
    assert out.proc.poll() is None, out._text[-3000:]
    return False

  wait_until(at_point, timeout=300)
  out.proc.send_signal(signal.SIGKILL)
  out.wait()
  return _at(workdir, marks)


def test_an_async_run_killed_at_random_points_trains_each_prompt_once(tmp_path):
  """SIGKILLs mid-reward, mid-checkpoint-save and mid-generation, in a seeded random
  order and at seeded random moments, each followed by the same command; by the prompt
  ledger of every checkpoint, no prompt is trained twice or skipped, a lost one is
  issued again, no trained token is staler than η, and the log ends with each step
  once."""
  rng = random.Random(0)
  marks = tmp_path / "in_flight"
  marks.mkdir()
  env = {IN_FLIGHT_DIR_ENV: str(marks)}
  points = rng.sample(_KILL_POINTS, len(_KILL_POINTS))
  landed, lineage, logged = [], [], []  # lineage: (run id, step it resumed from)
  while len(landed) < len(points):
    assert len(lineage) < 2 * len(points), f"kills keep missing their point: {landed}"
    for p in marks.iterdir():
      p.unlink()
    resumed = (_checkpoints(tmp_path) or [0])[-1]
    out = _Output(_train(tmp_path, *_KILLED, env=env))
    out.wait_for(": workdir ")
    lineage.append((re.search(r"^run (\S+) \(host", out._text, re.M).group(1), resumed))
    point = points[len(landed)]
    if _kill_at(out, tmp_path, marks, point, rng.randint(1, 2), rng.uniform(0, 0.2)) == point:
      landed.append(point)  # else the moment passed as the signal went out: again
    if resumed:
      assert f"resumed from checkpoint {resumed} " in out._text, out._text[-3000:]
    logged += _steps(tmp_path)
    server = check_prompt_accounting(tmp_path)
    assert len(server["buffer"]["staleness_hist"]) <= _ETA + 1, "a token staler than η trained"
  resumed = _checkpoints(tmp_path)[-1]
  out = _Output(_train(tmp_path, *_KILLED, env=env))
  text = out.wait()
  assert out.proc.returncode == 0, text[-3000:]
  assert f"resumed from checkpoint {resumed} " in text
  lineage.append((re.search(r"^run (\S+) \(host", text, re.M).group(1), resumed))

  lines = _steps(tmp_path)
  logged += lines
  assert [s["step"] for s in lines] == list(range(1, _END + 1)), "each step exactly once"
  # Each step's line is that of the run whose checkpoints the next one resumed from.
  for (run_id, start), (_, end) in zip(lineage, lineage[1:] + [(None, _END)]):
    assert {s["run_id"] for s in lines[start:end]} <= {run_id}, (run_id, start, end)
  assert all(a["time"] < b["time"] for a, b in zip(lines, lines[1:]))
  assert len({(s["run_id"], s["step"]) for s in logged}) > _END, "no step was superseded"
  assert max(s["staleness_max"] for s in logged) <= _ETA
  server = check_prompt_accounting(tmp_path)
  assert len(server["buffer"]["staleness_hist"]) <= _ETA + 1
  assert server["gate"]["lost"] > 0, "no group was written off"
  assert server["ledger"]["cursor"]["0"]["index"] >= _END * 2


_VARIED = ("--config.rollout.reward_fn=reward_fns_for_tests:length",)  # params move
_SYNC = ("--config.staleness.max_staleness=0", "--config.num_steps=5", *_VARIED)
# What a step computed, as opposed to how long it took or what ran beside it.
_NOT_COMPARED = ("step", "run_id", "time", "pid", "worker_restarts", "time_pack_s", "time_train_s",
                 "time_wait_s", "time_publish_s", "time_record_s", "train_tokens_per_s",
                 "gen_tokens_per_s", "longest_unreported_wait_s")


def _params(workdir):
  config = json.loads((Path(workdir) / "config.json").read_text())
  params = restore_params(str(Path(workdir) / "checkpoints"), ModelConfig(**config["model"]))
  return jax.tree.leaves(jax.tree.map(np.asarray, params))


def test_sync_resume_from_a_damaged_checkpoint_equals_an_uninterrupted_run(tmp_path):
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  uninterrupted = _train(whole, *_SYNC)
  killed = _train(cut, *_SYNC)
  _kill_after_checkpoint(killed, cut, 3)
  out, _ = uninterrupted.communicate(timeout=600)
  assert uninterrupted.returncode == 0, out[-3000:]
  # The uninterrupted run is the binary's smoke run: it prints its steps and the final
  # evaluation, and writes its step lines and its config.
  assert "v=1 reward=" in out and "v=5 reward=" in out and "eval v=5" in out
  assert [s["step"] for s in _steps(whole)] == [1, 2, 3, 4, 5]
  config = json.loads((whole / "config.json").read_text())
  assert config["num_steps"] == 5 and config["model"]["d_model"] == 32
  # Damage the newest checkpoint too: the resume falls back to the one before.
  newest = _checkpoints(cut)[-1]
  data = max((p for p in (cut / "checkpoints" / str(newest) / "state").rglob("*")
              if p.is_file()), key=lambda p: p.stat().st_size)
  with open(data, "r+b") as f:
    f.truncate(data.stat().st_size // 2)
  resumed = _train(cut, *_SYNC)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out[-3000:]
  assert f"WARNING: checkpoint {newest} is damaged" in out
  assert f"resumed from checkpoint {newest - 1}" in out
  for a, b in zip(_params(whole), _params(cut)):
    np.testing.assert_array_equal(a, b)
  steps = {s["step"]: s for s in step_lines(whole)}
  for s in step_lines(cut):
    if s["step"] >= newest:
      expected = steps[s["step"]]
      for key in expected:
        if key not in _NOT_COMPARED and not isinstance(expected[key], dict):
          assert s[key] == expected[key], (s["step"], key)
  check_prompt_accounting(cut)


class _Output:
  """A process's output, read as it comes; `wait_for(text)` blocks until it appears."""

  def __init__(self, proc):
    self.proc, self._text, self._cv = proc, "", threading.Condition()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      with self._cv:
        self._text += line
        self._cv.notify_all()

  def wait_for(self, text, timeout=600):
    with self._cv:
      assert self._cv.wait_for(lambda: text in self._text or self.proc.poll() is not None,
                               timeout), self._text[-3000:]
      assert text in self._text, self._text[-3000:]

  def wait(self, timeout=600):
    self.proc.wait(timeout)
    time.sleep(0.2)  # the last lines
    with self._cv:
      return self._text


# A job controller's grace period (Kubernetes' default) before it SIGKILLs: the run
# stops well within it (on an idle machine, in a few seconds; see docs/operations.md).
_GRACE_S = 30


def _sigterm(out):
  start = time.monotonic()
  out.proc.send_signal(signal.SIGTERM)
  text = out.wait(timeout=_GRACE_S)
  return text, time.monotonic() - start


def test_sigterm_saves_and_exits_143_at_startup_and_mid_run_and_the_same_command_resumes(
    tmp_path):
  flags = ("--config.num_steps=200",)
  # At startup: the run holds its workdir and builds its parts (compiles).
  out = _Output(_train(tmp_path, *flags))
  out.wait_for(": workdir ")
  text, took = _sigterm(out)
  assert out.proc.returncode == 143, text[-3000:]
  assert took < _GRACE_S
  assert "SIGTERM: stopping" in text and "train: stopped by SIGTERM; exit status 143" in text
  assert "stopped at version 0: checkpoint 0 in" in text and _checkpoints(tmp_path) == [0]

  # Mid-run, with a second run on the same workdir refused meanwhile.
  out = _Output(_train(tmp_path, *flags))
  out.wait_for("v=2 reward=")
  holder = re.search(r"^(run \S+ \(host \S+, pid \d+, started \S+\))", out._text, re.M)
  assert f"pid {out.proc.pid}," in holder.group(1)
  second = _train(tmp_path, *flags)
  refused, _ = second.communicate(timeout=600)
  assert second.returncode == 1 and f"is in use by {holder.group(1)}" in refused, refused[-3000:]
  text, took = _sigterm(out)
  assert out.proc.returncode == 143, text[-3000:]
  assert took < _GRACE_S
  stopped = int(re.search(r"stopped at version (\d+): checkpoint \1 in", text).group(1))
  assert 2 <= stopped < 200 and _checkpoints(tmp_path)[-1] == stopped

  # The same command resumes (here to a nearer end).
  out = _Output(_train(tmp_path, f"--config.num_steps={stopped + 1}"))
  text = out.wait()
  assert out.proc.returncode == 0, text[-3000:]
  assert f"resumed from checkpoint {stopped}" in text
  assert [s["step"] for s in _steps(tmp_path)] == list(range(1, stopped + 2))
  check_prompt_accounting(tmp_path)
