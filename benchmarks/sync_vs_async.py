r"""Synchronous vs asynchronous RL, measured end to end, and the simulator checked against it.

  python -m benchmarks.sync_vs_async --quick     # 30 steps per run instead of 120
  python -m benchmarks.sync_vs_async --config=configs/tiny.py:long_reasoning \
      --etas=0,1,2,4,8 --frozen --runs=sync,async_retract   # BENCHMARKS.md: the rest

The same config (--config, by default configs/tiny.py), the same warm start and the
same number of trained samples in every run. Named runs (--runs):

  sync           η = 0, drain: generation and training alternate; one process, every
                 core for each phase (`cpu.decode_threads`, `cpu.grad_threads`).
  async_retract  η = --eta, retract: the generator and the trainer in their own Ray
                 actors, pinned to disjoint cores (--generator_cpus, --trainer_cpus:
                 1 and 0 by default).
  async_keep     η = --eta, keep: the same placement.
  overlap_only   η = 1, drain: the same placement; overlap without interruptible
                 generation (one source of the gain, as verl's tables separate them).

Before them, an η sweep (--etas), runs named eta0, eta1, ...: η = 0 placed as `sync`,
every other η as the async runs, with --sweep_mode updates. With --frozen the sweep trains at learning
rate 0, so every run generates from the warm start's policy and no run's completions
drift longer or shorter than another's; its generated and trained tokens/s are also
given as ratios to η = 0 (AReaL's throughput-by-staleness curve).

Per run: wall time of the steady state (the end of the first training step, which
compiles, to the end of the last), trained samples/s
and tokens/s, generated tokens/s, generator and trainer idle fractions (from the busy
spans the components record, `async_rl.timeline`), where the time went (the shares
of the wall time during which only the generator, only the trainer, both or neither
were busy), the generator's slot occupancy (the share of its slot-steps that made a
token: a synchronous step's long tail leaves slots empty), mean and max staleness,
and held-out greedy accuracy before and after. Writes a timeline PNG and a
Chrome-trace JSON per run to --out_dir. The float32 matmul peak is measured before
the first run and after the last.

The simulator (`async_rl.sim`) is then calibrated from what each run measured (mean
decode-step time including prefills, mean weight-swap time, trainer seconds per
token, reward latency, the task's output lengths) and predicts each run's trained
samples/s; the table shows prediction vs measurement. For the sweep it also
predicts, from the η = 0 run's costs alone, each η's samples/s if generation and
training each kept those costs while running at once ("sim from sync"): the gain
overlap would give on disjoint hardware.

Last line: one JSON object with the headline figures.
"""

import dataclasses
import json
import os
import time
from typing import NamedTuple, Optional

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from async_rl import cpu, timeline  # noqa: E402
from async_rl.cli import from_dict  # noqa: E402
from async_rl.config import ExperimentConfig  # noqa: E402
from async_rl.launch import parse_flags  # noqa: E402
from async_rl.rl import build, entry  # noqa: E402
from async_rl.sim import DecodeCost, SimConfig, simulate  # noqa: E402
from async_rl.tasks import TrainStream  # noqa: E402
from async_rl.tasks.registry import make_task  # noqa: E402
from benchmarks.common.peak import matmul_peak  # noqa: E402
from benchmarks.common.run_stats import (  # noqa: E402
    measure, measured_config, rl_window, warm_params)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py",
                                          "The experiment every run shares.")
_QUICK = flags.DEFINE_bool("quick", False, "Fewer steps.")
_STEPS = flags.DEFINE_integer("steps", None, "RL steps per run (default 30 quick, 120 full).")
_ETA = flags.DEFINE_integer("eta", 4, "max_staleness of the async runs.")
_RUNS = flags.DEFINE_list("runs", ["sync", "async_retract", "async_keep", "overlap_only"],
                          "Which named runs, in order.")
_ETAS = flags.DEFINE_list("etas", [], "The η sweep, run before the named runs: one run per η.")
_FROZEN = flags.DEFINE_bool("frozen", False, "The η sweep at learning rate 0.")
_SWEEP_STEPS = flags.DEFINE_integer("sweep_steps", None, "RL steps per sweep run (default: "
                                    "those of the named runs).")
_SWEEP_MODE = flags.DEFINE_enum("sweep_mode", "retract", ["retract", "keep", "drain"],
                                "update_mode of the sweep's async runs.")
_TRAINER_CPUS = flags.DEFINE_list("trainer_cpus", ["0"], "Cores of the async trainer.")
_GENERATOR_CPUS = flags.DEFINE_list("generator_cpus", ["1"], "Cores of the async generator.")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/async_rl_sync_vs_async",
                               "Timelines, traces and workdirs go here.")
_WARM_CACHE = flags.DEFINE_string("warm_cache", None, "Keeps the warm start between "
                                  "invocations (`run_stats.warm_params`); none: not kept.")


class Variant(NamedTuple):
  """One run: its staleness bound and update mode, whether the generator and the trainer
  run in pinned Ray actors (else one process alternates them), and whether it learns."""
  name: str
  eta: int
  update_mode: str
  pinned: bool
  frozen: bool = False


def named_variant(name: str) -> Variant:
  placed = {"sync": (0, "drain", False), "async_retract": (_ETA.value, "retract", True),
            "async_keep": (_ETA.value, "keep", True), "overlap_only": (1, "drain", True)}
  if name not in placed:
    raise app.UsageError(f"unknown run {name!r}; known: {sorted(placed)}")
  return Variant(name, *placed[name])


def sweep_variant(eta: int, frozen: bool) -> Variant:
  if eta == 0:
    return Variant("eta0", 0, "drain", False, frozen)
  return Variant(f"eta{eta}", eta, _SWEEP_MODE.value, True, frozen)


def task_lengths(cfg: ExperimentConfig, n: int = 4096) -> tuple[float, np.ndarray]:
  """Mean prompt tokens and the reference output lengths (solution + EOS) of the task;
  the warm-started policy writes the reference solutions' lengths (eval completion
  lengths agree within a few percent)."""
  stream = TrainStream(cfg.task.arithmetic)
  prompts = [next(stream) for _ in range(n)]
  return (float(np.mean([len(p.tokens) for p in prompts])),
          np.array([len(p.target) for p in prompts]))


def variant_config(v: Variant, cfg: ExperimentConfig) -> ExperimentConfig:
  """`cfg` as `v` runs it from a given warm start. An unpinned run alternates its
  phases, so each gets every core unless `cfg.cpu` says otherwise."""
  cfg = dataclasses.replace(
      cfg, sft=dataclasses.replace(cfg.sft, steps=0),
      staleness=dataclasses.replace(cfg.staleness, max_staleness=v.eta),
      generation=dataclasses.replace(cfg.generation, update_mode=v.update_mode))
  if v.frozen:  # Its accuracy is the warm start's: one held-out prompt, one sample.
    cfg = dataclasses.replace(
        cfg, optimizer=dataclasses.replace(cfg.optimizer, learning_rate=0.0),
        eval=dataclasses.replace(cfg.eval, num_prompts=1, pass_k=1))
  if v.pinned:
    return dataclasses.replace(cfg, placement=dataclasses.replace(
        cfg.placement, kind="ray", pin_trainer_cores=tuple(int(c) for c in _TRAINER_CPUS.value),
        pin_rollout_cores=tuple(int(c) for c in _GENERATOR_CPUS.value)))
  return dataclasses.replace(cfg, cpu=dataclasses.replace(
      cfg.cpu, decode_threads=cfg.cpu.decode_threads or cpu.cores(),
      grad_threads=cfg.cpu.grad_threads or cpu.cores()))


def calibrate(cfg: ExperimentConfig, summary: dict, prompt_tokens: float,
              lengths: np.ndarray, eta: Optional[int] = None,
              update_mode: Optional[str] = None) -> SimConfig:
  """The simulated system whose component costs are those the run measured; with
  `eta` and `update_mode`, run at that bound and with those updates instead of the
  run's."""
  spans, history = summary["timeline"], summary["history"]
  pool = history[-1]["workers"]["0"]["pool"]
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
  eta = cfg.staleness.max_staleness if eta is None else eta
  update_mode = update_mode or cfg.generation.update_mode
  return SimConfig(
      mode="sync" if eta == 0 else "async", num_generators=1, trainer_accelerators=1,
      slots=cfg.generation.num_slots, decode=DecodeCost(base=decode_step),
      prefill_per_token=0.0, prompt_tokens=round(prompt_tokens),
      reward_latency=history[-1]["rewards"]["mean_latency_s"],
      trainer_per_token=trainer_busy / seq_tokens,
      weight_sync=float(np.mean(swaps)) if swaps else 0.0, max_staleness=eta,
      batch_groups=cfg.batch_groups, group_size=cfg.generation.group_size,
      update_mode=update_mode, steps_per_call=cfg.generation.steps_per_call,
      length_dist="empirical",
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


def predicted_samples_per_s(sim_cfg: SimConfig, steps: int) -> float:
  """The simulator's trained samples/s over steps 2 to `steps`, as a run is measured."""
  ends = simulate(sim_cfg, steps, seed=0).step_end_times
  return (steps - 1) * sim_cfg.batch_groups * sim_cfg.group_size / (ends[-1] - ends[0])


def steady_occupancy(history: list[dict]) -> float:
  """The share of the generator's slot-steps that made a token, from step 2 on."""
  first, last = history[0]["workers"]["0"]["pool"], history[-1]["workers"]["0"]["pool"]
  steps = last["decode_steps"] - first["decode_steps"]
  made = (last["slot_occupancy"] * last["decode_steps"]
          - first["slot_occupancy"] * first["decode_steps"])
  return made / steps if steps else 0.0


def run_variant(v: Variant, cfg: ExperimentConfig, params, steps: int, prompt_tokens: float,
                lengths: np.ndarray) -> tuple[dict, ExperimentConfig, dict]:
  """Runs `v` for `steps` steps from `params`; its figures, config and summary. Writes its
  timeline PNG and Chrome trace."""
  run_cfg = variant_config(v, measured_config(cfg, steps))
  summary = entry.run(run_cfg, os.path.join(_OUT_DIR.value, v.name), init_params=params,
                      echo=lambda _: None, progress=False)
  row = measure(run_cfg, summary)
  spans, history = summary["timeline"], summary["history"]
  start, end = rl_window(spans)
  predicted = predicted_samples_per_s(calibrate(run_cfg, summary, prompt_tokens, lengths), steps)
  row.update(eta=v.eta, update_mode=v.update_mode, frozen=v.frozen,
             predicted_samples_per_s=predicted,
             prediction_error=predicted / row["samples_per_s"] - 1,
             slot_occupancy=steady_occupancy(history),
             preemptions=history[-1]["workers"]["0"]["pool"]["preemptions"],
             swap_share=timeline.busy_fraction([s for s in spans if s.name == "swap"],
                                               "generator", start, end),
             **timeline.overlap_shares(spans, "generator", "trainer", start, end))
  first = min(s.start for s in spans if s.lane == "generator")
  plot_timeline(spans, first, end, f"{v.name}: η={v.eta}, {v.update_mode}"
                f"{', frozen' if v.frozen else ''}, {row['samples_per_s']:.1f} samples/s",
                os.path.join(_OUT_DIR.value, f"timeline_{v.name}.png"))
  with open(os.path.join(_OUT_DIR.value, f"trace_{v.name}.json"), "w") as f:
    json.dump(timeline.chrome_trace(spans), f)
  return row, run_cfg, summary


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  steps = _STEPS.value or (30 if _QUICK.value else 120)
  sweep_steps = _SWEEP_STEPS.value or steps
  cfg = from_dict(_CONFIG.value)
  variants = ([(sweep_variant(int(eta), _FROZEN.value), sweep_steps) for eta in _ETAS.value]
              + [(named_variant(name), steps) for name in _RUNS.value])
  for v, _ in variants:
    if os.path.exists(os.path.join(_OUT_DIR.value, v.name)):
      raise app.UsageError(f"{_OUT_DIR.value}/{v.name} exists: pass an empty --out_dir")
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  # Every run compiles the same programs; from disk the later ones compile less. The
  # Ray actors read the directory from the environment they inherit (a cache directory
  # already set there, a test session's, is kept).
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(_OUT_DIR.value,
                                                                      "jax_cache")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  peaks = [matmul_peak()]
  print(f"float32 matmul peak: {peaks[0] / 1e9:.0f} GFLOP/s", flush=True)
  t0 = time.perf_counter()
  params = warm_params(cfg, make_task(build.resolve(cfg).task), cache_dir=_WARM_CACHE.value)
  print(f"warm start: {cfg.sft.steps} steps (or cached) in {time.perf_counter() - t0:.0f} s",
        flush=True)
  prompt_tokens, lengths = task_lengths(cfg)
  results, sweep_sync = {}, None
  for v, n in variants:
    t0 = time.perf_counter()
    row, run_cfg, summary = run_variant(v, cfg, params, n, prompt_tokens, lengths)
    row["run_s"] = time.perf_counter() - t0
    results[v.name] = row
    if v.name == "eta0":
      sweep_sync = (run_cfg, summary)
    print(f"{v.name}: {json.dumps({k: _round(x) for k, x in row.items()})}", flush=True)
  peaks.append(matmul_peak())
  print(f"float32 matmul peak after the runs: {peaks[1] / 1e9:.0f} GFLOP/s", flush=True)
  sweep = {v.name: results[v.name] for v, _ in variants if v.name.startswith("eta")}
  named = {v.name: results[v.name] for v, _ in variants if not v.name.startswith("eta")}
  if sweep_sync:  # The η = 0 run's costs, overlapped at each η.
    for row in sweep.values():
      row["sim_from_sync_samples_per_s"] = predicted_samples_per_s(calibrate(
          *sweep_sync, prompt_tokens, lengths, eta=row["eta"], update_mode=row["update_mode"]),
          sweep_steps)
    for row in sweep.values():
      for k in ("generated_tokens_per_s", "trained_tokens_per_s", "samples_per_s",
                "predicted_samples_per_s", "sim_from_sync_samples_per_s"):
        row[f"{k}_ratio"] = row[k] / sweep["eta0"][k]
  if named:
    _print_named(named)
  if sweep:
    _print_sweep(sweep)
  headline = {"quick": _QUICK.value, "steps": steps, "sweep_steps": sweep_steps,
              "eta": _ETA.value, "frozen": _FROZEN.value, "sweep_mode": _SWEEP_MODE.value,
              "samples_per_step": cfg.batch_groups * cfg.generation.group_size,
              "matmul_gflops": _round(peaks[0] / 1e9),
              "matmul_gflops_after": _round(peaks[1] / 1e9),
              "runs": {k: {m: _round(r[m]) for m in (
                  "samples_per_s", "predicted_samples_per_s", "accuracy_before", "accuracy",
                  "wall_s", "generated_tokens_per_s", "trained_tokens_per_s")}
                       for k, r in named.items()},
              "out_dir": _OUT_DIR.value}
  if "sync" in named:
    headline["speedup_over_sync"] = {k: _round(r["samples_per_s"] / named["sync"]["samples_per_s"])
                                     for k, r in named.items() if k != "sync"}
  if sweep:
    headline["sweep"] = {str(r["eta"]): {k: _round(x) for k, x in r.items() if k in _SWEEP_KEYS
                                         or k.endswith("_ratio")} for r in sweep.values()}
  print(json.dumps(headline))


_SWEEP_KEYS = ("generated_tokens_per_s", "trained_tokens_per_s", "samples_per_s",
               "predicted_samples_per_s", "sim_from_sync_samples_per_s", "slot_occupancy",
               "only_generator", "only_trainer", "both", "neither", "swap_share",
               "staleness_mean", "completion_len", "preemptions", "wall_s")


def _round(v):
  return round(v, 4) if isinstance(v, float) else v


def _print_table(label, results, cols):
  print(f"{label:12}" + "".join(f"{h:>14}" for _, h, _ in cols))
  for name, row in results.items():
    print(f"{name:12}" + "".join(
        (format(row[k], fmt) if k in row else "-").rjust(14) for k, _, fmt in cols))


_WHERE = [("only_generator", "gen only", ".2f"), ("only_trainer", "train only", ".2f"),
          ("both", "both", ".2f"), ("neither", "neither", ".2f"),
          ("slot_occupancy", "slot occ.", ".2f")]


def _print_named(results):
  _print_table("run", results, [
      ("wall_s", "wall s", ".0f"), ("samples_per_s", "samples/s", ".2f"),
      ("trained_tokens_per_s", "train tok/s", ".0f"),
      ("generated_tokens_per_s", "gen tok/s", ".0f"), *_WHERE,
      ("staleness_mean", "stale mean", ".2f"), ("staleness_max", "stale max", "d"),
      ("completion_len", "compl. len", ".1f"),
      ("accuracy_before", "acc before", ".3f"), ("accuracy", "acc after", ".3f"),
      ("predicted_samples_per_s", "sim samples/s", ".2f"), ("prediction_error", "sim err", "+.1%")])


def _print_sweep(results):
  _print_table("η sweep", results, [
      ("wall_s", "wall s", ".0f"), ("generated_tokens_per_s", "gen tok/s", ".0f"),
      ("generated_tokens_per_s_ratio", "gen x η0", ".2f"),
      ("trained_tokens_per_s", "train tok/s", ".0f"),
      ("trained_tokens_per_s_ratio", "train x η0", ".2f"), *_WHERE,
      ("staleness_mean", "stale mean", ".2f"), ("completion_len", "compl. len", ".1f"),
      ("predicted_samples_per_s", "sim samples/s", ".2f"), ("prediction_error", "sim err", "+.1%"),
      ("predicted_samples_per_s_ratio", "sim x η0", ".2f"),
      ("sim_from_sync_samples_per_s_ratio", "sync sim x η0", ".2f")])


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
