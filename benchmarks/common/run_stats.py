"""Figures of a finished run, from its step metrics and the busy spans it recorded, and
the held-out accuracy of the params it left.

Used by the benchmarks that run the system end to end.
"""

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from flax import serialization

from async_rl import sharding, timeline
from async_rl.config import ExperimentConfig
from async_rl.rl import build
from async_rl.sft import warm_start
from async_rl.tasks.registry import make_task


def measured_config(cfg: ExperimentConfig, steps: int) -> ExperimentConfig:
  """`cfg` for a measured run of `steps` steps: held-out evaluation only before and
  after, and no periodic checkpoint (the final one is still written)."""
  return dataclasses.replace(
      cfg, num_steps=steps, eval=dataclasses.replace(cfg.eval, every_steps=0),
      checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=steps))


def rl_window(spans) -> tuple[float, float]:
  """From the end of the first training step, so that its compilation is left out,
  to the end of the last one."""
  publish = [s.end for s in spans if s.name == "publish"]
  return min(publish), max(publish)


def measure(cfg: ExperimentConfig, summary: dict) -> dict:
  """The run's steady-state figures (steps 2 to N), from its metrics and busy spans."""
  spans, history = summary["timeline"], summary["history"]
  start, end = rl_window(spans)
  wall, steady = end - start, history[1:]
  samples = len(steady) * cfg.batch_groups * cfg.generation.group_size
  trained = sum(m["trained_tokens"] for m in steady)
  generated = (history[-1]["rollout"]["generated_tokens"]
               - history[0]["rollout"]["generated_tokens"])
  staleness = sum(m["staleness_mean"] * m["trained_tokens"] for m in steady) / trained
  return {
      "wall_s": wall, "steps": len(history), "samples_per_s": samples / wall,
      "trained_tokens_per_s": trained / wall, "generated_tokens_per_s": generated / wall,
      "generator_idle": 1 - timeline.busy_fraction(spans, "generator", start, end),
      "trainer_idle": 1 - timeline.busy_fraction(spans, "trainer", start, end),
      "staleness_mean": staleness, "staleness_max": max(m["staleness_max"] for m in steady),
      "completion_len": trained / samples,
      "accuracy_before": summary["eval_before"]["accuracy"],
      "accuracy": summary["eval_after"]["accuracy"],
  }


def warm_params(cfg: ExperimentConfig, task, cache_dir: Optional[str] = None):
  """The params of `cfg`'s warm start on `task` (its initial params with `sft.steps` = 0),
  on the host: every run of a benchmark's grid starts from them.

  With `cache_dir`, they are read from there when a warm start of the same settings
  (model, warm start, task, mesh, seed) was written before, and written there
  otherwise: a long-sequence warm start costs more than the runs it feeds. How it packs
  its micro-batches (`cfg.batching`) changes only the order of its sums, so a run with
  other batching settings shares it.
  """
  path = None
  if cache_dir is not None:
    key = json.dumps([dataclasses.asdict(x) for x in (cfg.model, cfg.sft, cfg.task, cfg.mesh)]
                     + [cfg.seed], sort_keys=True)
    path = Path(cache_dir) / f"warm_{hashlib.sha256(key.encode()).hexdigest()[:16]}.msgpack"
    if path.exists():
      return serialization.msgpack_restore(path.read_bytes())
  params = warm_start(task, cfg.model, cfg.sft, cfg.batching, sharding.make_mesh(cfg.mesh),
                      seed=cfg.seed, echo=lambda _: None)
  if path is not None:
    os.makedirs(cache_dir, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(serialization.msgpack_serialize(params))
    partial.replace(path)  # a reader never sees half a file
  return params


def longest_heldout(cfg: ExperimentConfig, n: int, longest: int):
  """The task, its first `n` held-out prompts, and the `longest` of them with the
  longest reference solutions (the longest chains)."""
  task = make_task(build.resolve(cfg).task)
  prompts = task.heldout(n)
  return task, prompts, sorted(prompts, key=lambda p: -len(p.target))[:longest]


class HeldoutEval:
  """Greedy accuracy of successive params on held-out prompts, through one `Evaluator`
  kept open, so that an evaluation compiles nothing after the first.

  `load(params)` swaps params in; `accuracy(prompts)` scores the loaded ones (correct:
  a score of at least `eval.correct_threshold`, by `eval.correct_fn` or the reward). A
  context manager: leaving it closes the pool and the reward workers.
  """

  def __init__(self, cfg: ExperimentConfig, task, params):
    cfg = build.resolve(cfg)
    self._version = 0
    self._evaluator = build.make_evaluator(cfg, task, params)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._evaluator.close()

  def load(self, params) -> None:
    self._version += 1
    self._evaluator.load(params, self._version)

  def accuracy(self, prompts) -> float:
    return self._evaluator.evaluate(prompts, pass_k=1)["accuracy"]
