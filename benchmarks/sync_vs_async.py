r"""Synchronous vs asynchronous RL, measured end to end, and the simulator checked against it.

  python -m benchmarks.sync_vs_async --quick     # 30 steps per run instead of 120
  python -m benchmarks.sync_vs_async             # BENCHMARKS.md: 11.6 min on 2 CPU cores

The same config (configs/tiny.py: the long-tailed arithmetic task, the tiny model),
the same warm start and the same number of trained samples in every run:

  sync           η = 0, drain: generation and training alternate; one process, both
                 cores for each phase.
  async_retract  η = --eta, retract: the generator and the trainer in their own Ray
                 actors, pinned to disjoint cores (--generator_cpus, --trainer_cpus:
                 1 and 0 by default).
  async_keep     η = --eta, keep: the same placement.
  overlap_only   η = 1, drain: the same placement; overlap without interruptible
                 generation (one source of the gain, as verl's tables separate them).

Per run: wall time of the RL phase (first decode to last publish), trained samples/s
and tokens/s, generated tokens/s, generator and trainer idle fractions (from the busy
spans the components record, `async_rl.timeline`), mean and max staleness, and final
held-out greedy accuracy. Writes a timeline PNG and a Chrome-trace JSON per run to
--out_dir.

The simulator (`async_rl.sim`) is then calibrated from what each run measured (mean
decode-step time including prefills, mean weight-swap time, trainer seconds per
token, reward latency, the task's output lengths) and predicts each run's trained
samples/s; the table shows prediction vs measurement.

Last line: one JSON object with the headline figures.
"""

import dataclasses
import json
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from async_rl import timeline  # noqa: E402
from async_rl.config import ExperimentConfig, from_dict, parse_flags  # noqa: E402
from async_rl.rl import build  # noqa: E402
from async_rl.sim import SimConfig, simulate  # noqa: E402
from async_rl.tasks import TrainStream  # noqa: E402
from async_rl.tasks.registry import make_task  # noqa: E402
from benchmarks.common.run_stats import (  # noqa: E402
    measure, measured_config, rl_window, warm_params)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py",
                                          "The experiment every run shares.")
_QUICK = flags.DEFINE_bool("quick", False, "Fewer steps.")
_STEPS = flags.DEFINE_integer("steps", None, "RL steps per run (default 30 quick, 120 full).")
_ETA = flags.DEFINE_integer("eta", 4, "max_staleness of the async runs.")
_RUNS = flags.DEFINE_list("runs", ["sync", "async_retract", "async_keep", "overlap_only"],
                          "Which runs, in order.")
_TRAINER_CPUS = flags.DEFINE_list("trainer_cpus", ["0"], "Cores of the async trainer.")
_GENERATOR_CPUS = flags.DEFINE_list("generator_cpus", ["1"], "Cores of the async generator.")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/async_rl_sync_vs_async",
                               "Timelines, traces and workdirs go here.")

_PLACED = {  # name: (max_staleness, update_mode, pinned in Ray actors)
    "sync": (0, "drain", False),
    "async_retract": (None, "retract", True),
    "async_keep": (None, "keep", True),
    "overlap_only": (1, "drain", True),
}


def task_lengths(cfg: ExperimentConfig, n: int = 4096) -> tuple[float, np.ndarray]:
  """Mean prompt tokens and the reference output lengths (solution + EOS) of the task;
  the warm-started policy writes the reference solutions' lengths (eval completion
  lengths agree within a few percent)."""
  stream = TrainStream(cfg.task.arithmetic)
  prompts = [next(stream) for _ in range(n)]
  return (float(np.mean([len(p.tokens) for p in prompts])),
          np.array([len(p.target) for p in prompts]))


def run_one(name: str, cfg: ExperimentConfig, params, workdir: str):
  """Runs `name`'s variant of `cfg` from `params`; returns its config and summary."""
  eta, mode, pinned = _PLACED[name]
  cfg = dataclasses.replace(
      cfg, sft=dataclasses.replace(cfg.sft, steps=0),
      staleness=dataclasses.replace(cfg.staleness, max_staleness=(
          _ETA.value if eta is None else eta)),
      generation=dataclasses.replace(cfg.generation, update_mode=mode))
  quiet = dict(init_params=params, echo=lambda _: None, progress=False)
  if pinned:
    cfg = dataclasses.replace(cfg, placement=dataclasses.replace(
        cfg.placement, kind="ray", pin_trainer_cores=tuple(int(c) for c in _TRAINER_CPUS.value),
        pin_rollout_cores=tuple(int(c) for c in _GENERATOR_CPUS.value)))
  return cfg, build.run(cfg, workdir, **quiet)


def calibrate(cfg: ExperimentConfig, summary: dict, prompt_tokens: float,
              lengths: np.ndarray) -> SimConfig:
  """The simulated system whose component costs are those the run measured."""
  spans, history = summary["timeline"], summary["history"]
  pool = history[-1]["pool"]
  # Mean time of a decode-loop iteration, the prefills of the samples it starts included.
  step_tokens = pool["slot_occupancy"] * pool["decode_steps"] * cfg.generation.num_slots
  decode_step = step_tokens / pool["decode_tokens_per_s"] / pool["decode_steps"]
  swaps = [s.end - s.start for s in spans if s.name == "swap"]
  start, _ = rl_window(spans)
  trainer_busy = sum(s.end - s.start for s in spans
                     if s.lane == "trainer" and s.name != "eval" and s.start >= start)
  steady = history[1:]
  samples = len(steady) * cfg.batch_groups * cfg.generation.group_size
  seq_tokens = sum(m["trained_tokens"] for m in steady) + samples * prompt_tokens
  eta = cfg.staleness.max_staleness
  return SimConfig(
      mode="sync" if eta == 0 else "async", num_generators=1, trainer_accelerators=1,
      slots=cfg.generation.num_slots, decode_step_base=decode_step,
      decode_step_per_slot=0.0, prefill_per_token=0.0, prompt_tokens=round(prompt_tokens),
      reward_latency=history[-1]["rewards"]["mean_latency_s"],
      trainer_per_token=trainer_busy / seq_tokens,
      weight_sync=float(np.mean(swaps)) if swaps else 0.0, max_staleness=eta,
      batch_groups=cfg.batch_groups, group_size=cfg.generation.group_size,
      update_mode=cfg.generation.update_mode, length_dist="empirical",
      # The generator truncates at max_new_tokens.
      length_samples=tuple(int(min(n, cfg.generation.max_new_tokens)) for n in lengths),
      max_length=cfg.generation.max_new_tokens)


_COLORS = {"decode": "tab:blue", "swap": "tab:orange", "train": "tab:green",
           "publish": "tab:red", "log": "tab:gray", "eval": "tab:purple"}


def plot_timeline(spans, start: float, end: float, title: str, path: str) -> None:
  lanes = ["generator", "trainer"]
  fig, ax = plt.subplots(figsize=(11, 2.4))
  for y, lane in enumerate(lanes):
    for name, color in _COLORS.items():
      bars = [(s.start - start, s.end - s.start) for s in spans
              if s.lane == lane and s.name == name and s.end > start and s.start < end]
      if bars:
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, label=name)
  ax.set_yticks(range(len(lanes)), lanes)
  ax.set_xlim(0, end - start)
  ax.set_xlabel("seconds since the first decode step (the first training step compiles)")
  ax.set_title(title)
  handles, labels = ax.get_legend_handles_labels()
  unique = dict(zip(labels, handles))
  ax.legend(unique.values(), unique.keys(), loc="upper right", ncol=len(unique), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  steps = _STEPS.value or (30 if _QUICK.value else 120)
  cfg = measured_config(from_dict(_CONFIG.value), steps)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  t0 = time.perf_counter()
  params = warm_params(cfg, make_task(build.resolve(cfg).task))
  print(f"warm start: {cfg.sft.steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
  prompt_tokens, lengths = task_lengths(cfg)
  results = {}
  for name in _RUNS.value:
    if name not in _PLACED:
      raise app.UsageError(f"unknown run {name!r}; known: {sorted(_PLACED)}")
    workdir = os.path.join(_OUT_DIR.value, name)
    if os.path.exists(workdir):
      raise app.UsageError(f"{workdir} exists: pass an empty --out_dir")
    run_cfg, summary = run_one(name, cfg, params, workdir)
    row = measure(run_cfg, summary)
    sim = simulate(calibrate(run_cfg, summary, prompt_tokens, lengths), steps, seed=0)
    ends = sim.step_end_times  # Steady state, as measured: steps 2 to N.
    predicted = (steps - 1) * cfg.batch_groups * cfg.generation.group_size / (ends[-1] - ends[0])
    row.update(eta=run_cfg.staleness.max_staleness, update_mode=run_cfg.generation.update_mode,
               predicted_samples_per_s=predicted,
               prediction_error=predicted / row["samples_per_s"] - 1)
    spans = summary["timeline"]
    start = min(s.start for s in spans if s.lane == "generator")
    png = os.path.join(_OUT_DIR.value, f"timeline_{name}.png")
    plot_timeline(spans, start, rl_window(spans)[1], f"{name}: η={row['eta']}, {row['update_mode']}, "
                  f"{row['samples_per_s']:.1f} samples/s", png)
    with open(os.path.join(_OUT_DIR.value, f"trace_{name}.json"), "w") as f:
      json.dump(timeline.chrome_trace(spans), f)
    results[name] = row
    print(f"{name}: {json.dumps({k: _round(v) for k, v in row.items()})}", flush=True)
  _print_table(results)
  sync = results.get("sync")
  headline = {"quick": _QUICK.value, "steps": steps, "eta": _ETA.value,
              "samples_per_step": cfg.batch_groups * cfg.generation.group_size,
              "runs": {k: {m: _round(v[m]) for m in (
                  "samples_per_s", "predicted_samples_per_s", "accuracy", "wall_s")}
                       for k, v in results.items()},
              "out_dir": _OUT_DIR.value}
  if sync:
    headline["speedup_over_sync"] = {k: _round(v["samples_per_s"] / sync["samples_per_s"])
                                     for k, v in results.items() if k != "sync"}
  print(json.dumps(headline))


def _round(v):
  return round(v, 4) if isinstance(v, float) else v


def _print_table(results):
  cols = [("wall_s", "wall s", ".0f"), ("samples_per_s", "samples/s", ".2f"),
          ("trained_tokens_per_s", "train tok/s", ".0f"),
          ("generated_tokens_per_s", "gen tok/s", ".0f"),
          ("generator_idle", "gen idle", ".2f"), ("trainer_idle", "train idle", ".2f"),
          ("staleness_mean", "stale mean", ".2f"), ("staleness_max", "stale max", "d"),
          ("accuracy_before", "acc before", ".3f"), ("accuracy", "acc after", ".3f"),
          ("predicted_samples_per_s", "sim samples/s", ".2f"),
          ("prediction_error", "sim err", "+.1%")]
  print(f"{'run':14}" + "".join(f"{h:>14}" for _, h, _ in cols))
  for name, row in results.items():
    print(f"{name:14}" + "".join(format(row[k], fmt).rjust(14) for k, _, fmt in cols))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
