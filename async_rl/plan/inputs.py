"""What a user hands the planner, read into `plan.search` types: a model, a length
distribution, and the best placement written back as a config file `launch.train` runs."""

import dataclasses
import importlib.util
import json
import math
import os

from async_rl import cli, config
from async_rl.models.hf_config import config_from_hf
from async_rl.plan.search import Placement, Workload

_Z90 = 1.2815515655446004  # the standard normal's 90th percentile


def read_model(spec: str) -> config.ModelConfig:
  """A model from a preset name (`config.MODEL_PRESETS`), a config file (`NAME.py`, or
  `NAME.py:VARIANT` as `launch.train` takes it, whose `get_config()` holds a `model`
  section), or a Hugging Face `config.json` (the file or its directory)."""
  if spec in config.MODEL_PRESETS:
    return config.model_preset(spec)
  file, _, variant = spec.partition(".py:")
  if spec.endswith(".py") or variant:
    loaded = importlib.util.spec_from_file_location(
        "_plan_model_config", spec if not variant else file + ".py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    values = module.get_config(variant) if variant else module.get_config()
    return cli.from_dict(values).model
  path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
  if path.endswith(".json") and os.path.isfile(path):
    with open(path) as f:
      return config.ModelConfig(**config_from_hf(json.load(f)))
  raise ValueError(f"--model: {spec!r} is no preset ({sorted(config.MODEL_PRESETS)}), "
                   f"config file (.py) or Hugging Face config.json")


def read_lengths(spec: str) -> dict:
  """`Workload`'s length fields from "lognormal:MEDIAN:SIGMA", "pareto:MEDIAN:ALPHA",
  "constant:N", "file:PATH" (lengths, whitespace-separated, or "LENGTH COUNT" lines: a
  histogram) or "workdir:PATH" (a run's recorded generated lengths: a lognormal through
  their median and 90th percentile)."""
  kind, _, rest = spec.partition(":")
  args = rest.split(":")
  if kind == "lognormal" and len(args) == 2:
    return dict(length_dist="lognormal", length_median=float(args[0]),
                length_sigma=float(args[1]))
  if kind == "pareto" and len(args) == 2:
    return dict(length_dist="pareto", length_median=float(args[0]),
                length_alpha=float(args[1]))
  if kind == "constant" and len(args) == 1:
    return dict(length_dist="constant", length_median=float(args[0]))
  if kind == "file":
    return dict(length_dist="empirical", length_samples=_histogram_file(rest))
  if kind == "workdir":
    return _workdir_lengths(rest)
  raise ValueError(f"--lengths: {spec!r} is none of lognormal:MEDIAN:SIGMA, "
                   f"pareto:MEDIAN:ALPHA, constant:N, file:PATH, workdir:PATH")


def _histogram_file(path: str) -> tuple[int, ...]:
  with open(path) as f:
    rows = [line.split() for line in f if line.strip()]
  if all(len(r) == 2 for r in rows):
    return tuple(int(n) for n, count in rows for _ in range(int(count)))
  return tuple(int(v) for r in rows for v in r)


def _workdir_lengths(workdir: str) -> dict:
  summary = None
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      generated = json.loads(line).get("lengths", {}).get("generated", {})
      if generated.get("n"):
        summary = generated
  if summary is None or not summary.get("p50") or summary["p90"] <= summary["p50"]:
    raise ValueError(f"--lengths: {workdir}/metrics.jsonl records no spread of generated "
                     f"lengths")
  return dict(length_dist="lognormal", length_median=float(summary["p50"]),
              length_sigma=math.log(summary["p90"] / summary["p50"]) / _Z90)


def config_text(workload: Workload, p: Placement, *, nodes: int, summary: str) -> str:
  """A config file (`get_config()` from `cli.config_dict()`) that runs `p`."""
  model = dataclasses.asdict(workload.model)
  longest = workload.prompt_tokens + workload.max_new_tokens
  model["max_seq_len"] = max(model["max_seq_len"], longest)
  lines = [
      f"c.batch_groups = {workload.batch_groups}",
      f"c.model.update({model!r})",
      f"c.batching.max_tokens_per_mb = {max(workload.train_tokens_per_mb, longest)}",
      f"c.generation.group_size = {workload.group_size}",
      f"c.generation.max_prompt_len = {workload.prompt_tokens}",
      f"c.generation.max_new_tokens = {workload.max_new_tokens}",
      f"c.generation.num_slots = {p.slots}",
      f"c.generation.kv_blocks = {p.kv_tokens // p.kv_block_size}",
      f"c.generation.kv_block_size = {p.kv_block_size}",
      f"c.generation.update_mode = {p.update_mode!r}",
      f"c.staleness.max_staleness = {p.max_staleness!r}",
      f"c.staleness.max_concurrent = {max(1, p.engines * p.slots // workload.group_size)}",
      f"c.mesh.data = {p.train_devices // p.fsdp}",
      f"c.mesh.fsdp = {p.fsdp}",
      "c.mesh.tensor = 1",
  ]
  if nodes == 1 and p.mode == "async":
    lines += [f"c.placement.trainer_devices = {p.train_devices}",
              f"c.placement.generator_replicas = {p.engines}",
              f"c.placement.devices_per_replica = {p.tp}"]
  body = "\n".join("  " + line for line in lines)
  return (f'"""{summary}\n\nWritten by the capacity planner (`async-rl-plan`).\n"""\n\n'
          f"from async_rl.cli import config_dict\n\n\n"
          f"def get_config(variant=None):\n"
          f"  if variant is not None:\n"
          f"    raise ValueError(f\"this config has no variants, got {{variant!r}}\")\n"
          f"  c = config_dict()\n{body}\n  return c\n")
