r"""The capacity planner's sync-vs-async prediction for this machine, beside the measurement.

  python -m benchmarks.plan_cpu --rounds=3        # 3 rounds of both runs, 20 steps a run
  python -m benchmarks.plan_cpu --predict_only    # the prediction alone (a minute or two)
  python -m benchmarks.plan_cpu --steps=4 --rounds=1   # the smallest measured mode

The planner predicts `benchmarks/sync_vs_async.py`'s two placements of --config
(default configs/tiny.py) from the config's shapes, the task's output lengths, and the
run's own engine, generator pool and trainer, built from each placement's config and
timed on synthetic work of the workload's shapes on the cores the placement gives them
(`plan.host`: in a process pinned to those cores, under whatever else runs on the
machine). A tiny model's steps on a CPU are bound by dispatch, host work and how its
small matmuls spread over the cores, which a matmul peak and the FLOPs do not tell.

  sync   one device of every core: an engine, then a trainer (η = 0, drain), each
         phase with every core (as many decode groups and gradient threads as cores);
  async  two devices of one core each (taken alike: --generator_cpus's is measured), an
         engine on one and a trainer on the other, one thread each, η = --eta, retract.

Then both run, as `benchmarks.sync_vs_async --frozen` does (same warm start, same
steps, learning rate 0), with every training micro-batch one row of
`batching.max_tokens_per_mb` tokens. At learning rate 0 both runs sample the warm
start's policy, so both generate the length distribution the planner was given; runs
that learn drift to other lengths, and differently under each placement (stale samples
make another run), which no cost model predicts. One row per micro-batch, so that after
the first step a step compiles only when its batch needs more micro-batches than any
before it (the planner predicts a steady state, and a CPU compile costs several steps;
what compiles is left in the measurement, and longer runs dilute it).

The runs are interleaved over --rounds rounds, each round timing the engine and trainer
again, predicting again and running both (sync first in even rounds, async first in odd
ones, so that a load that rises or falls through the benchmark weighs on both alike).
Each round gives a predicted and a measured async/sync throughput ratio from runs
minutes apart; the headline is their medians (the target: within 15%) and the measured
ratio's spread over the rounds, which says how far the machine's load moved the
measurement. Beside each run's samples/s the table sets the two costs that make it,
predicted and measured: the generator's busy seconds per step (decoding, prefills and
weight swaps) and the trainer's seconds per token. Last line:
one JSON object.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging

from async_rl import cli, cpu, sharding
from async_rl.cli import from_dict
from async_rl.plan import hardware, host, search
from async_rl.plan.costs import MeasuredCosts
from async_rl.rl import build
from async_rl.tasks.registry import make_task
from benchmarks import sync_vs_async as sva
from benchmarks.common.run_stats import rl_window, warm_params

_PREDICT_ONLY = flags.DEFINE_bool("predict_only", False, "Skip the measured runs.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds of the two runs, interleaved.")

_RUNS = ("sync", "async_retract")


def workload_of(cfg) -> search.Workload:
  """The config's shapes and its task's reference output lengths."""
  prompt_tokens, lengths = sva.task_lengths(cfg)
  cap = cfg.generation.max_new_tokens
  return search.Workload(
      cfg.model, batch_groups=cfg.batch_groups, group_size=cfg.generation.group_size,
      prompt_tokens=max(1, round(prompt_tokens)), max_new_tokens=cap,
      length_dist="empirical", length_samples=tuple(int(min(n, cap)) for n in lengths),
      train_tokens_per_mb=cfg.batching.max_tokens_per_mb)


def placements(cfg, eta: int) -> dict[str, search.Placement]:
  kv = cfg.generation.kv_cache_blocks * cfg.generation.kv_block_size
  one = dict(gen_devices=1, tp=1, train_devices=1, fsdp=1, slots=cfg.generation.num_slots,
             kv_tokens=kv, steps_per_call=cfg.generation.steps_per_call,
             kv_block_size=cfg.generation.kv_block_size)
  return {"sync": search.Placement("sync", max_staleness=0, update_mode="drain", **one),
          "async_retract": search.Placement("async", max_staleness=eta,
                                            update_mode="retract", **one)}


def measure_on_cores(cores: set[int], cfg, **kwargs) -> MeasuredCosts:
  """`plan.host.measure` of `cfg`'s own engine, pool and trainer in a fresh process
  pinned to `cores`, as a placement's side runs there (XLA sizes its thread pool by the
  cores it may use), under whatever else runs on the machine."""
  code = ("import dataclasses, json, os, sys; os.sched_setaffinity(0, set(json.loads("
          "sys.argv[1]))); from benchmarks.plan_cpu import measure_here; "
          "print(json.dumps(dataclasses.asdict(measure_here(json.loads(sys.argv[2]), "
          "**json.loads(sys.argv[3])))))")
  out = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(cores)),
                        json.dumps(cli.to_dict(cfg)), json.dumps(kwargs)],
                       capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"measuring on cores {sorted(cores)} failed:\n{out.stderr[-4000:]}")
  fields = json.loads(out.stdout.strip().splitlines()[-1])
  fields["source"] += f" on cores {sorted(cores)}"
  return MeasuredCosts(**fields)


def measure_here(cfg_dict: dict, **kwargs) -> MeasuredCosts:
  """The config's engine, pool and trainer built by the run's builder, timed in this
  process (`plan.host.measure`)."""
  cfg = from_dict(cfg_dict)
  mesh = sharding.make_mesh(cfg.mesh)
  return host.measure(cfg, trainer=build.make_trainer(cfg, mesh),
                      open_pool=lambda: build.make_pool([build.make_engine(cfg)],
                                                        build.random_params(cfg, mesh)),
                      **kwargs)


def predict_now(cfg, workload: search.Workload, steps: int) -> dict:
  """Times the run's engine and trainer on the cores each placement gives them, built
  from that placement's config (`plan.host`), and predicts both placements."""
  every = set(range(cpu.cores()))
  shape = dict(prompt_tokens=workload.prompt_tokens, lengths=list(workload.length_samples))
  measured = {
      # One process, every core for each phase: as many decode groups and gradient
      # threads as cores (`sync_vs_async.variant_config`).
      "sync": measure_on_cores(every, sva.variant_config(sva.named_variant("sync"), cfg),
                               **shape),
      # A pinned actor of one core decodes its slots as one group and trains from one
      # thread; both sides' cores are taken alike: --generator_cpus's is measured.
      "async_retract": measure_on_cores(
          {int(sva._GENERATOR_CPUS.value[0])},
          sva.variant_config(sva.named_variant("async_retract"), cfg), **shape)}
  machine = hardware.measure_cores(every)  # the weights' copy to the generator
  clusters = {"sync": search.Cluster(machine, 1, 1), "async_retract": search.Cluster(machine, 1, 2)}
  predicted = {name: search.predict(workload, clusters[name], p, steps=max(steps, 4),
                                    measured=measured[name])
               for name, p in placements(cfg, sva._ETA.value).items()}
  sims = {name: search.sim_config(workload, clusters[name], p, measured[name])
          for name, p in placements(cfg, sva._ETA.value).items()}
  return dict(
      samples_per_s={k: v.samples_per_s for k, v in predicted.items()},
      ratio=predicted["async_retract"].samples_per_s / predicted["sync"].samples_per_s,
      components={k: _components(predicted[k], sim) for k, sim in sims.items()})


def _components(prediction: search.Prediction, sim) -> dict:
  """A simulated system's generator seconds per step (decoding, prefills and weight
  swaps) and trainer seconds per token."""
  busy = 1.0 - prediction.generator_shares.get("idle", 0.0)
  return dict(generator_s_per_step=busy * prediction.step_s,
              train_us_per_token=1e6 * sim.trainer_per_token)


def measured_components(run_cfg, summary, prompt_tokens, lengths) -> dict:
  """A run's generator seconds per step from step 2 on (decoding, prefills, weight
  swaps and any compile of a new prompt length) and its trainer's seconds per token."""
  spans, history = summary["timeline"], summary["history"]
  start, _ = rl_window(spans)
  busy = sum(s.end - s.start for s in spans
             if s.lane == "generator" and s.name in ("decode", "swap") and s.start >= start)
  sim = sva.calibrate(run_cfg, summary, prompt_tokens, lengths)
  return dict(generator_s_per_step=busy / max(1, len(history) - 1),
              train_us_per_token=1e6 * sim.trainer_per_token)


def one_train_shape(cfg):
  """`cfg` with every training micro-batch a row of `max_tokens_per_mb` tokens and a
  compiled batch shape reused whenever it holds the batch, so that few steps after the
  first compile: the planner predicts a steady state, and on a CPU a compile costs as
  much as several steps."""
  batching = dataclasses.replace(cfg.batching, row_buckets=(cfg.batching.max_tokens_per_mb,),
                                 reuse_slack=math.inf)
  return dataclasses.replace(cfg, batching=batching)


def spread(values: list[float]) -> dict:
  """The median, least and greatest of `values`, and their range over the median."""
  mid = float(np.median(values))
  return dict(median=round(mid, 3), min=round(min(values), 3), max=round(max(values), 3),
              spread=round((max(values) - min(values)) / mid, 3))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = one_train_shape(from_dict(sva._CONFIG.value))
  workload = workload_of(cfg)
  steps = sva._STEPS.value or (10 if sva._QUICK.value else 20)
  rounds = 1 if _PREDICT_ONLY.value else _ROUNDS.value
  if rounds < 1:
    raise app.UsageError(f"--rounds must be >= 1, got {rounds}")
  out_dir = sva._OUT_DIR.value
  params = prompt_tokens = lengths = None
  if not _PREDICT_ONLY.value:
    for r in range(rounds):
      for name in _RUNS:
        if os.path.exists(os.path.join(out_dir, f"{name}_r{r}")):
          raise app.UsageError(f"{out_dir}/{name}_r{r} exists: pass an empty --out_dir")
    os.makedirs(out_dir, exist_ok=True)
    # Every run compiles the same programs; from disk the later ones compile less.
    cache = os.path.join(out_dir, "jax_cache")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=cache,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    params = warm_params(cfg, make_task(build.resolve(cfg).task),
                         cache_dir=sva._WARM_CACHE.value)
    prompt_tokens, lengths = sva.task_lengths(cfg)
  per_round = []
  for r in range(rounds):
    t0 = time.perf_counter()
    pred = predict_now(cfg, workload, steps)
    print(f"round {r}: predicted async/sync {pred['ratio']:.2f} "
          f"(measuring {time.perf_counter() - t0:.0f} s)", flush=True)
    measured, parts = {}, {}
    order = () if _PREDICT_ONLY.value else _RUNS if r % 2 == 0 else _RUNS[::-1]
    for name in order:
      t0 = time.perf_counter()
      v = sva.named_variant(name)._replace(name=f"{name}_r{r}", frozen=True)
      row, run_cfg, summary = sva.run_variant(v, cfg, params, steps, prompt_tokens, lengths)
      measured[name] = row["samples_per_s"]
      parts[name] = measured_components(run_cfg, summary, prompt_tokens, lengths)
      print(f"round {r}: {name} measured {row['samples_per_s']:.2f} samples/s "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
    per_round.append(dict(predicted=pred, measured=measured, components=parts))
  print(f"{'round':>5} {'run':14} {'samples/s: predicted':>20} {'measured':>9} "
        f"{'generator s/step: predicted':>27} {'measured':>9} "
        f"{'train us/token: predicted':>25} {'measured':>9}")
  for r, got in enumerate(per_round):
    for name in _RUNS:
      pred, meas = got["predicted"]["components"][name], got["components"].get(name, {})
      cells = [(got["predicted"]["samples_per_s"][name], got["measured"].get(name), 20)] + [
          (pred[k], meas.get(k), 27 if k == "generator_s_per_step" else 25)
          for k in ("generator_s_per_step", "train_us_per_token")]
      print(f"{r:>5} {name:14} " + " ".join(
          f"{p:>{w}.2f} " + (f"{m:>9.2f}" if m is not None else f"{'-':>9}")
          for p, m, w in cells))
  predicted_ratio = spread([got["predicted"]["ratio"] for got in per_round])
  headline = dict(d_model=cfg.model.d_model, steps=steps, cores=cpu.cores(), rounds=rounds,
                  predicted_ratio=predicted_ratio, per_round=[_round_row(got) for got in per_round])
  line = f"async/sync: predicted {predicted_ratio['median']:.2f}"
  if not _PREDICT_ONLY.value:
    measured_ratio = spread([got["measured"]["async_retract"] / got["measured"]["sync"]
                             for got in per_round])
    error = predicted_ratio["median"] / measured_ratio["median"] - 1
    headline.update(measured_ratio=measured_ratio, error=round(error, 3),
                    within_15_percent=abs(error) <= 0.15)
    line += (f", measured {measured_ratio['median']:.2f} (median of {rounds}; "
             f"{measured_ratio['min']:.2f}-{measured_ratio['max']:.2f}), error {error:+.0%}")
  print(line)
  print(json.dumps(headline))


def _round_row(got: dict) -> dict:
  pred = got["predicted"]
  return dict(predicted_ratio=round(pred["ratio"], 3),
              predicted_samples_per_s={k: round(x, 2) for k, x in pred["samples_per_s"].items()},
              measured_samples_per_s={k: round(x, 2) for k, x in got["measured"].items()},
              predicted_components=_rounded(pred["components"]),
              measured_components=_rounded(got["components"]))


def _rounded(parts: dict) -> dict:
  return {run: {k: round(x, 3) for k, x in v.items()} for run, v in parts.items()}


if __name__ == "__main__":
  app.run(main)
