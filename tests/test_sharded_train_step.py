"""The same update on 8 fake CPU devices (fsdp, tensor, mixed) as on one device."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rl_test_utils import fake_devices


def test_sharded_update_matches_single_device():
  env = dict(os.environ, XLA_FLAGS=fake_devices(8),
             PYTHONPATH=str(Path(__file__).parents[1]))
  out = subprocess.run([sys.executable, str(Path(__file__).with_name("sharded_update_check.py"))],
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.loads(out.stdout.strip().splitlines()[-1])
  for layout, r in results.items():
    # Reduction order differs across shards: float32 rounding only.
    assert r["grad_rel_diff"] < 1e-5, (layout, r)
    assert r["loss_diff"] < 1e-6, (layout, r)
    assert r["prox_max_abs_diff"] < 1e-5, (layout, r)
    assert r["sharded_leaves"] > 0, (layout, r)
