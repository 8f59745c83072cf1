"""The cluster recipes in launch/recipes/: they parse, print the commands they would run,
and the jax.distributed one trains on this machine under a stand-in for `srun`."""

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from rl_test_utils import fake_devices

ROOT = Path(__file__).parents[1]
RECIPES = ROOT / "launch" / "recipes"


@pytest.fixture(scope="module")
def bash():
  path = shutil.which("bash")
  if path is None:
    pytest.skip("the recipes are bash scripts")
  return path


@pytest.mark.parametrize("name", ["slurm_jax.sbatch", "slurm_ray.sbatch"])
def test_recipes_parse(bash, name):
  subprocess.run([bash, "-n", str(RECIPES / name)], check=True)


def _dry_run(bash, name, *args, **env):
  out = subprocess.run([bash, str(RECIPES / name), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=True,
                       env=dict(os.environ, DRY_RUN="1", HEAD_NODE="node1",
                                WORKDIR="/shared/run", **env))
  return out.stdout.splitlines()


def test_the_ray_recipe_starts_a_head_workers_and_the_driver(bash):
  head, workers, driver = _dry_run(bash, "slurm_ray.sbatch", "--config.num_steps=3",
                                   SLURM_NNODES="3", RAY_HEAD_WAIT_S="0",
                                   RAY_WORKER_WAIT_S="0")
  assert "ray start --head --port=6379" in head and "-w node1" in head
  assert "--nodes=2" in workers and "--address=node1:6379" in workers
  for flag in ("--config.placement.kind=ray", "--config.placement.ray_address=node1:6379",
               f"--config.placement.working_dir={ROOT}", "--workdir=/shared/run",
               "--config.num_steps=3"):
    assert flag in driver, driver


def test_the_jax_recipe_trains_across_two_processes(bash, tmp_path):
  # A stand-in for srun: runs the task command once per task, as SLURM would on each
  # node, with the task's SLURM_PROCID.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text(
      "#!/usr/bin/env bash\n"
      "while [[ \"$1\" == --* ]]; do shift; done\n"
      "for i in $(seq 0 $((SLURM_NTASKS - 1))); do SLURM_PROCID=$i \"$@\" & done\n"
      "wait -n && wait -n\n")
  (bin_dir / "srun").chmod(0o755)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  workdir = tmp_path / "run"
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             PYTHONPATH=str(ROOT), HEAD_NODE="127.0.0.1", PORT=str(port), SLURM_NTASKS="2",
             WORKDIR=str(workdir), CONFIG="configs/micro.py",
             XLA_FLAGS=fake_devices(2))
  out = subprocess.run([bash, str(RECIPES / "slurm_jax.sbatch"), "--config.num_steps=2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  steps = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [s["step"] for s in steps if "eval" not in s] == [1, 2]
