r"""Held-out accuracy by chain length: the calculator tool task against the single-turn task.

  python -m benchmarks.tool_use --config=configs/tiny.py:tool   # with the tool
  python -m benchmarks.tool_use --config=configs/tiny.py        # the quick start

Runs --config as the quick start does (the task's warm start, then RL in process with
the run's own evaluation), then scores the warm start and the final params greedily on
up to --per_length distinct held-out problems of each chain length (task.min_terms to
task.max_terms operands), through the task's workflow: with the tool, each problem is
an episode of calls and results. A problem counts as solved only for the exact worked
solution (`tasks.arithmetic.verify`, on the whole transcript), the same text for both
tasks. Prints a table; the last line is one JSON object.
"""

import dataclasses
import json
import os
import tempfile
import time

from absl import app, flags, logging
from ml_collections import config_flags

from async_rl.cli import from_dict
from async_rl.generation import GeneratorPool
from async_rl.launch import parse_flags
from async_rl.rl import build, entry
from async_rl.rl.checkpoint import restore_params
from async_rl.rl.evaluate import evaluate
from async_rl.tasks import heldout_set, verify
from async_rl.tasks.registry import make_task
from benchmarks.common.run_stats import warm_params

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py:tool", "The experiment.")
_PER_LENGTH = flags.DEFINE_integer("per_length", 50, "Distinct held-out problems per length.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (default: a new one).")


def distinct_heldout(task_cfg, num_terms: int, n: int) -> list:
  """Up to `n` distinct held-out prompts with `num_terms` operands. The split hashes the
  prompt string alone, so these are held out of the run's own training stream too."""
  fixed = dataclasses.replace(task_cfg, min_terms=num_terms, max_terms=num_terms)
  seen, out = set(), []
  for p in heldout_set(fixed, 20 * n):
    if p.problem.prompt not in seen and len(out) < n:
      seen.add(p.problem.prompt)
      out.append(p)
  return out


def accuracy(cfg, task, params, prompts) -> float:
  with GeneratorPool(build.make_engine(cfg), params) as pool:
    return evaluate(pool, prompts, score=lambda pairs: [verify(t, p.problem) for p, t in pairs],
                    decode=task.tokenizer.decode, max_new_tokens=cfg.generation.max_new_tokens,
                    stop_token_ids=task.tokenizer.stop_ids, pass_k=1, seed=cfg.seed,
                    workflow=task.workflow, vocab_size=cfg.model.vocab_size)["accuracy"]


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = build.resolve(from_dict(_CONFIG.value))
  task = make_task(cfg.task)
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="async_rl_tool_use_")
  t0 = time.perf_counter()
  warm = warm_params(cfg, task)
  t_sft = time.perf_counter()
  summary = entry.run(cfg, workdir, init_params=warm, task=task, progress=False,
                      echo=lambda _: None)
  t_rl = time.perf_counter()
  final = restore_params(os.path.join(workdir, "checkpoints"), cfg.model)
  rows = []
  arithmetic = cfg.task.arithmetic
  for k in range(arithmetic.min_terms, arithmetic.max_terms + 1):
    prompts = distinct_heldout(arithmetic, k, _PER_LENGTH.value)
    rows.append({"terms": k, "problems": len(prompts),
                 "warm_start": accuracy(cfg, task, warm, prompts),
                 "after_rl": accuracy(cfg, task, final, prompts)})
  print(f"{cfg.task.name}: {cfg.num_steps} RL steps x {cfg.batch_groups} prompts x "
        f"{cfg.generation.group_size} samples after {cfg.sft.steps} warm-start steps")
  print("| operands | problems | warm start | after RL |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['terms']} | {r['problems']} | {100 * r['warm_start']:.1f}% | "
          f"{100 * r['after_rl']:.1f}% |")
  print(json.dumps({
      "task": cfg.task.name, "rl_steps": cfg.num_steps, "sft_steps": cfg.sft.steps,
      "samples": cfg.num_steps * cfg.batch_groups * cfg.generation.group_size,
      "eval_before": summary["eval_before"]["accuracy"],
      "eval_after": summary["eval_after"]["accuracy"],
      "by_length": rows, "sft_s": round(t_sft - t0, 1), "rl_s": round(t_rl - t_sft, 1),
      "workdir": workdir}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
