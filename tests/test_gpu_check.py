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


# Imports the check, the binary it runs and the builder with every third-party
# distribution outside the image and the wheel list hidden, as on the lent machine:
# an optional import falls back as it would there, and a needed one fails the import,
# naming the module.
_IMPORT_AS_ON_THE_IMAGE = """
import importlib.metadata as md, json, re, sys
allowed = set(json.loads(sys.argv[1]))
ours = {"async_rl", "benchmarks", "launch", "configs"}
dists = md.packages_distributions()
normal = lambda name: re.sub(r"[-_.]+", "-", name).lower()

class NotInTheImage:
  def find_spec(self, name, path=None, target=None):
    top = name.split(".")[0]
    found = dists.get(top, [])
    if top not in ours and found and not allowed & {normal(d) for d in found}:
      raise ModuleNotFoundError(f"{top} ({found}) is neither in the image nor a wheel",
                                name=name)
    return None

sys.meta_path.insert(0, NotInTheImage())
sys.argv = ["x"]
import benchmarks.gpu_check, benchmarks.memory, async_rl.rl.build, async_rl.rl.metrics_log
import async_rl.rewards.worker
"""


def test_the_checks_imports_need_only_the_image_and_the_wheels():
  allowed = sorted(IMAGE | {_normal(r.name) for r in _wheels()})
  out = subprocess.run([sys.executable, "-c", _IMPORT_AS_ON_THE_IMAGE, json.dumps(allowed)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("script", ["gpu_check_device.sh", "gpu_wheels.sh"])
def test_device_scripts_are_valid_bash(script):
  bash = shutil.which("bash")
  if bash is None:
    pytest.skip("needs bash")
  path = ROOT / "benchmarks" / script
  assert os.access(path, os.X_OK)
  out = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
