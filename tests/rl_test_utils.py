"""The micro experiment config (configs/micro.py) with overrides, and a run's parts built
as `rl.entry.run` builds them, for loop tests."""

import importlib.util
import os
from pathlib import Path

from async_rl.cli import from_dict
from async_rl.rl import build, checkpoint
from async_rl.rl.audit import prompt_accounting
from async_rl.tasks.registry import make_task

MICRO = Path(__file__).parents[1] / "configs" / "micro.py"


def fake_devices(n: int) -> str:
  """XLA_FLAGS for a subprocess with `n` fake CPU devices and this session's other flags."""
  return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()


def small_config(**overrides):
  spec = importlib.util.spec_from_file_location("micro", MICRO)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.num_steps = 3
  for key, value in overrides.items():
    *sections, field = key.split(".")
    node = c
    for section in sections:
      node = node[section]
    node[field] = value
  return from_dict(c)


def run_parts(cfg, workdir, server, **loop_kw):
  """The train loop and rollout worker 0 of `cfg` on `server`, sharing one engine as
  `entry.run` does (not started: `loop.run([worker])`)."""
  cfg = build.resolve(cfg)
  task = make_task(cfg.task)
  engines = [build.make_engine(cfg)]
  loop = build.train_loop(cfg, str(workdir), server, task=task, engines=engines, **loop_kw)
  return loop, build.rollout_worker(cfg, server, task=task, engines=engines)


def checkpoint_meta(workdir, step=None) -> checkpoint.Meta:
  """The meta of the run's checkpoint `step` (default: the newest)."""
  directory = str(Path(workdir) / "checkpoints")
  return checkpoint.read_meta(directory, checkpoint.steps(directory)[-1] if step is None else step)


def check_prompt_accounting(workdir, worker=0):
  """Every prompt drawn from worker `worker`'s stream, up to the newest checkpoint's
  cursor, was trained once, rejected or dropped, or is queued to be issued again;
  none was trained twice. Returns the checkpoint's server state."""
  a = prompt_accounting(str(workdir), worker)
  assert a["trained_twice"] == 0, a
  assert a["trained"] == a["server"]["buffer"]["trained"], a
  assert a["drawn"] > 0 and a["unaccounted"] == 0, ("a prompt was skipped or issued twice", a)
  return a["server"]
