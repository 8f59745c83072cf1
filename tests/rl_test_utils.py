"""The micro experiment config (configs/micro.py) with overrides, for loop tests."""

import importlib.util
import json
from pathlib import Path

from async_rl.config_dict import from_config_dict
from async_rl.rl.run_stats import prompt_accounting

MICRO = Path(__file__).parents[1] / "configs" / "micro.py"


def small_config(**overrides):
  spec = importlib.util.spec_from_file_location("micro", MICRO)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.num_steps = 3
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (c[section] if section else c)[field] = value
  return from_config_dict(c)



def checkpoint_meta(workdir, step=None):
  steps = sorted(int(p.name) for p in (Path(workdir) / "checkpoints").iterdir()
                 if p.name.isdigit())
  step = steps[-1] if step is None else step
  return json.loads((Path(workdir) / "checkpoints" / str(step) / "meta" / "metadata")
                    .read_text())


def check_prompt_accounting(workdir, worker=0):
  """Every prompt drawn from worker `worker`'s stream, up to the newest checkpoint's
  cursor, was trained once, rejected or dropped, or is queued to be issued again;
  none was trained twice. Returns the checkpoint's server state."""
  a = prompt_accounting(str(workdir), worker)
  assert a["trained_twice"] == 0, a
  assert a["trained"] == a["server"]["buffer"]["trained"], a
  assert a["drawn"] > 0 and a["unaccounted"] == 0, ("a prompt was skipped or issued twice", a)
  return a["server"]
