"""A trainer over two `jax.distributed` processes equals one process on as many devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from rl_test_utils import fake_devices

_CHECK = Path(__file__).with_name("multihost_check.py")
_TIMEOUT_S = 600


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(num_processes, devices_per_process, out):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(_CHECK.parent.parent), str(_CHECK.parent)]))
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, str(_CHECK), str(i), str(num_processes), port,
                             str(devices_per_process), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(num_processes)]
  for p in procs:
    _, err = p.communicate(timeout=_TIMEOUT_S)
    assert p.returncode == 0, err[-3000:]
  return dict(np.load(out))


def test_two_processes_train_like_one(tmp_path):
  multi = _run(2, 2, tmp_path / "multi.npz")
  single = _run(1, 4, tmp_path / "single.npz")
  assert int(multi["devices"]) == int(single["devices"]) == 4
  assert set(multi) == set(single)
  np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-6)
  for name in sorted(set(single) - {"losses", "devices"}):
    # The same program on the same global mesh: only the collectives' reduction
    # order may differ (gloo across processes, in-process otherwise).
    a, b = multi[name], single[name]
    assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b), name


def _train(workdir, num_processes, devices_per_process, steps, *overrides):
  """`launch.train` on the micro config over `num_processes` processes; their exit codes
  and outputs."""
  root = _CHECK.parent.parent
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(_CHECK.parent)]),
             XLA_FLAGS=fake_devices(devices_per_process))
  port = str(_free_port())
  distributed = ([f"--coordinator_address=127.0.0.1:{port}",
                  f"--num_processes={num_processes}"] if num_processes > 1 else [])
  procs = [subprocess.Popen(
      [sys.executable, "-m", "launch.train", "--config=configs/micro.py",
       f"--workdir={workdir}", f"--config.num_steps={steps}", *overrides, *distributed,
       *([f"--process_id={i}"] if num_processes > 1 else [])],
      cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(num_processes)]
  outs = [p.communicate(timeout=_TIMEOUT_S) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, (out + err)[-3000:]
  return outs


def _steps(workdir):
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [l for l in lines if "eval" not in l]


def test_the_cli_trains_over_two_processes_like_one_and_resumes(tmp_path):
  # Synchronous (η = 0, drain): the batches depend only on the seed, so the two-process
  # trainer sees the batches the one-process one does.
  overrides = ("--config.staleness.max_staleness=0", "--config.generation.update_mode=drain",
               "--config.rollout.reward_fn=reward_fns_for_tests:length", "--config.mesh.fsdp=4")
  multi, single = tmp_path / "multi", tmp_path / "single"
  _train(multi, 2, 2, 3, *overrides)
  _train(single, 1, 4, 3, *overrides)
  a, b = _steps(multi), _steps(single)
  assert [s["step"] for s in a] == [s["step"] for s in b] == [1, 2, 3]
  assert [s["trained_tokens"] for s in a] == [s["trained_tokens"] for s in b]
  np.testing.assert_allclose([s["loss"] for s in a], [s["loss"] for s in b], rtol=1e-5,
                             atol=1e-7)
  assert any(s["loss"] != 0 for s in b), "the rewards vary, so the losses can differ"
  # Resuming: every process restores the checkpoint; process 0 resumes the run.
  _train(multi, 2, 2, 4, *overrides)
  assert [s["step"] for s in _steps(multi)] == [1, 2, 3, 4]
