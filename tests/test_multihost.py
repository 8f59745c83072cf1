"""A trainer over two `jax.distributed` processes equals one process on as many devices."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

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
