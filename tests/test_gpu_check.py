"""benchmarks/gpu_check.py end to end in its fast mode, and what its device launcher needs:
the wheel list and the shell scripts around it."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
SECTIONS = ("env", "kernels", "training", "decode", "sync_async", "real_run", "memory")


def _normal(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _lines(name: str) -> list[str]:
  lines = (ROOT / "benchmarks" / name).read_text().splitlines()
  return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _wheels() -> list[Requirement]:
  return [Requirement(line) for line in _lines("gpu_wheels.txt")]


# What the lent machine's image holds: a wheel of one of them must not be carried.
IMAGE = {_normal(name) for name in _lines("gpu_image_packages.txt")}


def test_fast_check_runs_every_section_and_ends_with_one_json_line(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--fast",
                        f"--out={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary == json.loads((tmp_path / "gpu_check.json").read_text())
  assert summary["fast"] and summary["backend"] == "cpu"
  assert tuple(summary["sections"]) == SECTIONS
  for name, section in summary["sections"].items():
    assert section["status"] == "ok", (name, section)
    assert f"[{name}] ok" in out.stdout
  s = summary["sections"]
  assert s["kernels"]["interpret"] and s["kernels"]["all_within_bf16_rounding"]
  assert s["training"]["tokens_per_s"] > 0 and 0 < s["training"]["mfu"]
  assert s["decode"]["slots_4"]["tokens_per_s"] > 0
  assert s["real_run"]["steps"] == 2 and s["real_run"]["trained_tokens_per_s"] > 0
  assert s["sync_async"]["async_over_sync"] > 0
  assert {"training", "decode_4"} <= set(s["memory"])
  assert set(summary["goals"]) == {"decode_roofline_fraction", "train_mfu",
                                   "kernels_within_bf16_rounding", "memory_ratio",
                                   "async_over_sync"}


def test_wheel_list_pins_packages_the_image_lacks():
  wheels = _wheels()
  assert wheels
  for req in wheels:
    assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", req
    assert _normal(req.name) not in IMAGE, f"{req.name} is in the image: do not carry it"
  names = [_normal(r.name) for r in wheels]
  assert len(names) == len(set(names))


def test_the_checks_imports_need_only_the_image_and_the_wheels():
  # Every third-party module that importing the check, the binary it runs and the
  # builder loads comes from a distribution in the image or in the wheel list.
  code = ("import sys, importlib.metadata as md, json; sys.argv = ['x'];"
          "import benchmarks.gpu_check, benchmarks.memory, async_rl.rl.build,"
          " async_rl.rl.metrics_log, async_rl.rewards.worker;"
          "dists = md.packages_distributions();"
          "print(json.dumps({m: dists.get(m, []) for m in {n.split('.')[0] for n in sys.modules}"
          " if m not in sys.stdlib_module_names}))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert out.returncode == 0, out.stderr[-3000:]
  allowed = IMAGE | {_normal(r.name) for r in _wheels()}
  ours = {"async_rl", "benchmarks", "launch", "configs"}
  missing = {m: d for m, d in json.loads(out.stdout).items()
             if m not in ours and d and not allowed & {_normal(x) for x in d}}
  assert not missing, missing


@pytest.mark.parametrize("script", ["gpu_check_device.sh", "gpu_wheels.sh"])
def test_device_scripts_are_valid_bash(script):
  bash = shutil.which("bash")
  if bash is None:
    pytest.skip("needs bash")
  path = ROOT / "benchmarks" / script
  assert os.access(path, os.X_OK)
  out = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
