"""launch.eval: a run's checkpoint scored on its task's held-out set, as a JSON report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_rl.rl import build, export
from rl_test_utils import small_config

ROOT = Path(__file__).parents[1]


def _run(*args):
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_eval_scores_a_checkpoint_at_a_step_and_writes_the_report(tmp_path):
  workdir, report = tmp_path / "run", tmp_path / "report.json"
  out = _run("launch.train", "--config=configs/micro.py", f"--workdir={workdir}",
             "--config.num_steps=2")
  assert out.returncode == 0, out.stderr[-3000:]
  out = _run("launch.eval", f"--workdir={workdir}", "--step=1", "--num_prompts=3",
             "--pass_k=2", f"--out={report}")
  assert out.returncode == 0, out.stderr[-3000:]
  printed = json.loads(out.stdout.strip().splitlines()[-1])
  assert printed == json.loads(report.read_text())
  assert printed["step"] == 1 and printed["task"] == "arithmetic"
  assert printed["num_prompts"] == 3 and printed["reward_calls"] == 3 * (1 + 2)
  assert 0 <= printed["accuracy"] <= printed["pass_at_2"] <= 1
  assert printed["completion_len"] > 0 and printed["reward_failures"] == 0


def test_eval_names_what_is_missing(tmp_path):
  out = _run("launch.eval", f"--workdir={tmp_path}")
  assert out.returncode != 0 and "config.json does not exist" in out.stderr
  out = _run("launch.eval")
  assert out.returncode != 0 and "give --workdir" in out.stderr


def test_eval_reward_workers_get_the_run_s_memory_limit(monkeypatch):
  # async-rl-eval builds its evaluator as a run does, so rollout.reward_memory_mb holds.
  class Built(Exception):
    pass

  def reward_service(**kwargs):
    raise Built(kwargs)

  monkeypatch.setattr(build, "RewardService", reward_service)
  with pytest.raises(Built) as built:
    export.score(export.load_policy(small_config(**{"rollout.reward_memory_mb": 1234,
                                                    "rollout.reward_workers": 3})))
  assert built.value.args[0]["memory_mb"] == 1234 and built.value.args[0]["num_workers"] == 3
