"""benchmarks/gpu_check.sh on the micro config: it trains and summarises throughput."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rl_test_utils import fake_devices

ROOT = Path(__file__).parents[1]


def test_gpu_check_runs_the_micro_config_and_prints_throughput():
  bash = shutil.which("bash")
  if bash is None:
    pytest.skip("gpu_check.sh needs bash")
  env = dict(os.environ, PYTHONPATH=str(ROOT), GPU_CHECK_CONFIG="configs/micro.py",
             GPU_CHECK_STEPS="3")
  out = subprocess.run([bash, "benchmarks/gpu_check.sh", "--config.eval.num_prompts=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  assert "v=3 reward=" in out.stdout
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["config"] == "configs/micro.py" and summary["steps"] == 3
  assert summary["device"]
  for key in ("step_time_s", "train_tokens_per_s", "gen_tokens_per_s",
              "trained_tokens_per_step"):
    assert summary[key] > 0, summary
  assert summary["wall_s"] >= summary["step_time_s"]
  assert summary["generator_replicas"] == len(summary["gen_tokens_per_s_per_replica"]) >= 1
  assert summary["train_tokens_per_s_per_device"] > 0


def test_gpu_check_splits_several_devices_between_trainer_and_replicas():
  # 4 fake CPU devices: the trainer on 2, one generator replica on each of the others.
  bash = shutil.which("bash")
  if bash is None:
    pytest.skip("gpu_check.sh needs bash")
  env = dict(os.environ, PYTHONPATH=str(ROOT), GPU_CHECK_CONFIG="configs/micro.py",
             GPU_CHECK_STEPS="3", XLA_FLAGS=fake_devices(4))
  out = subprocess.run([bash, "benchmarks/gpu_check.sh", "--config.eval.num_prompts=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["devices"] == 4 and summary["trainer_devices"] == 2
  assert summary["generator_replicas"] == 2
  assert all(x > 0 for x in summary["gen_tokens_per_s_per_replica"]), summary
