"""The micro experiment config (configs/micro.py) with overrides, for loop tests."""

import importlib.util
import json
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


def step_lines(workdir):
  """The step lines of metrics.jsonl that the run's last checkpoints descend from: for
  a step logged twice (trained again after a resume), the later line."""
  path = Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  by_step = {line["step"]: line for line in lines if "eval" not in line}
  return [by_step[step] for step in sorted(by_step)]


def checkpoint_meta(workdir, step=None):
  steps = sorted(int(p.name) for p in (Path(workdir) / "checkpoints").iterdir()
                 if p.name.isdigit())
  step = steps[-1] if step is None else step
  return json.loads((Path(workdir) / "checkpoints" / str(step) / "meta" / "metadata")
                    .read_text())


def check_prompt_accounting(workdir, worker=0):
  """Every prompt drawn from worker `worker`'s stream, up to the final checkpoint's
  cursor, was trained once, rejected or dropped, or is queued to be issued again;
  none was trained twice. Returns the checkpoint's server state."""
  meta = checkpoint_meta(workdir)
  server = meta["server"]
  trained = [p for line in step_lines(workdir) if line["step"] <= meta["version"]
             for p in line["prompts"]]
  assert len(trained) == len(set(trained)), "a prompt was trained twice"
  assert len(trained) == server["buffer"]["trained"]
  cursor = server["ledger"]["cursor"][str(worker)]["index"]
  replay = server["ledger"]["replay"].get(str(worker), [])
  assert {int(p.rsplit("/", 1)[1]) for p in trained} <= set(range(cursor))
  assert cursor == len(trained) + server["gate"]["rejected"] + len(replay), (
      "a prompt was skipped or issued twice")
  return server
