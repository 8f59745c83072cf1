"""launch/train.py: a smoke run, and resume after SIGKILL with consistent state."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _train(workdir, *flags):
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/micro.py",
         f"--workdir={workdir}", *flags]
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _steps(workdir):
  path = Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(l) for l in path.read_text().splitlines() if '"eval"' not in l]


def _meta(workdir, step):
  return json.loads((Path(workdir) / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def test_smoke_run_prints_steps_and_writes_outputs(tmp_path):
  proc = _train(tmp_path, "--config.num_steps=2")
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert "v=1 reward=" in out and "v=2 reward=" in out and "eval v=2" in out
  assert [s["step"] for s in _steps(tmp_path)] == [1, 2]
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["num_steps"] == 2 and config["model"]["d_model"] == 32


def test_resume_after_sigkill_continues_version_step_and_data(tmp_path):
  proc = _train(tmp_path, "--config.num_steps=50")
  deadline = time.time() + 600
  while len(_steps(tmp_path)) < 3 and proc.poll() is None and time.time() < deadline:
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  killed_at = len(_steps(tmp_path))
  assert killed_at >= 3
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  last = saved[-1]
  meta = _meta(tmp_path, last)
  assert meta["version"] == last and meta["prompts"][0]["index"] > 0

  proc = _train(tmp_path, "--config.num_steps=6")
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  steps = [s["step"] for s in _steps(tmp_path)]
  resumed = steps[killed_at:]
  assert resumed == list(range(last + 1, 7)), (steps, last)
  assert _meta(tmp_path, 6)["prompts"][0]["index"] > meta["prompts"][0]["index"]
  assert f"v={last + 1} reward=" in out
