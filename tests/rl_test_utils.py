"""The micro experiment config (configs/micro.py) with overrides, for loop tests."""

import importlib.util
from pathlib import Path

from async_rl.config_dict import from_config_dict

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
