"""In process, weights go from trainer to generator as device arrays: no host copy."""

import json
import os
import subprocess
import sys
from pathlib import Path

_CHECK = Path(__file__).with_name("publish_check.py")


def test_publish_path_reshards_device_arrays_without_host_transfers():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_CHECK.parent.parent),
                                                     str(_CHECK.parent)]))
  out = subprocess.run([sys.executable, str(_CHECK)], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["trainer_devices"] == [0, 1, 2, 3, 4, 5]
  assert result["generator_devices"] == [6, 7]
  assert result["published_on_devices"] and result["equal"]
  assert result["split_sharded"] > 0 and result["split_equal"]
  assert result["pool_version"] == 1 and result["sampled_tokens"] == 4
