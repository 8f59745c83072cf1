r"""The capacity planner's sync-vs-async prediction for this machine, beside the measurement.

  python -m benchmarks.plan_cpu                   # 3 rounds of both runs, 120 steps a run
  python -m benchmarks.plan_cpu --predict_only    # seconds: the prediction alone
  python -m benchmarks.plan_cpu --steps=4 --rounds=1   # the smallest measured mode

The planner predicts `benchmarks/sync_vs_async.py`'s two placements of --config
(default configs/tiny.py) from the config's shapes, the task's output lengths, and
this machine as each placement will use it (`plan.hardware.measure_cores`: a jitted
matmul and an array copy in a process pinned to those cores, under whatever else
runs on the machine): every core together, and the generator's core alone.

  sync   one device of every core: an engine, then a trainer (η = 0, drain);
  async  two devices of one core each (taken alike: --generator_cpus's is measured), an
         engine on one and a trainer on the other, η = --eta, retract.

Then both run, as `benchmarks.sync_vs_async` does (same warm start, same steps),
interleaved over --rounds rounds, each round measuring the machine again, predicting
again and running both (sync first in even rounds, async first in odd ones, so that a
load that rises or falls through the benchmark weighs on both alike). Each round gives
a predicted and a measured async/sync throughput ratio from runs minutes apart; the
headline is their medians (the target: within 15%) and the measured ratio's spread
over the rounds, which says how far the machine's load moved the measurement. The
predicted absolute throughputs are printed too; on a CPU the tiny model's steps are
dominated by dispatch, not by the bytes and FLOPs the model counts, so only the ratio
is expected to hold. Last line: one JSON object.
"""

import json
import os
import time

import jax
import numpy as np
from absl import app, flags, logging

from async_rl import cpu
from async_rl.cli import from_dict
from async_rl.plan import hardware, search
from async_rl.rl import build
from async_rl.tasks.registry import make_task
from benchmarks import sync_vs_async as sva
from benchmarks.common.run_stats import warm_params

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
             kv_tokens=kv)
  return {"sync": search.Placement("sync", max_staleness=0, update_mode="drain", **one),
          "async_retract": search.Placement("async", max_staleness=eta,
                                            update_mode="retract", **one)}


def predict_now(cfg, workload: search.Workload, steps: int) -> dict:
  """Measures the machine's shares as the two placements use them, and predicts both."""
  every = hardware.measure_cores(set(range(cpu.cores())))
  one = hardware.measure_cores({int(sva._GENERATOR_CPUS.value[0])})
  clusters = {"sync": search.Cluster(every, 1, 1), "async_retract": search.Cluster(one, 1, 2)}
  predicted = {name: search.predict(workload, clusters[name], p, steps=max(steps, 4))
               for name, p in placements(cfg, sva._ETA.value).items()}
  return dict(
      samples_per_s={k: v.samples_per_s for k, v in predicted.items()},
      ratio=predicted["async_retract"].samples_per_s / predicted["sync"].samples_per_s,
      matmul_gflops={hw.name: round(hw.peak_flops / 1e9, 1) for hw in (every, one)},
      copy_gb_s={hw.name: round(hw.hbm_bw / 1e9, 2) for hw in (every, one)})


def spread(values: list[float]) -> dict:
  """The median, least and greatest of `values`, and their range over the median."""
  mid = float(np.median(values))
  return dict(median=round(mid, 3), min=round(min(values), 3), max=round(max(values), 3),
              spread=round((max(values) - min(values)) / mid, 3))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = from_dict(sva._CONFIG.value)
  workload = workload_of(cfg)
  steps = sva._STEPS.value or (30 if sva._QUICK.value else 120)
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
    pred = predict_now(cfg, workload, steps)
    print(f"round {r}: " + ", ".join(
        f"{name} {pred['matmul_gflops'][name]:.1f} GFLOP/s {pred['copy_gb_s'][name]:.1f} GB/s"
        for name in pred["matmul_gflops"]) + f"; predicted async/sync {pred['ratio']:.2f}",
        flush=True)
    measured = {}
    order = () if _PREDICT_ONLY.value else _RUNS if r % 2 == 0 else _RUNS[::-1]
    for name in order:
      t0 = time.perf_counter()
      v = sva.named_variant(name)._replace(name=f"{name}_r{r}")
      row, _, _ = sva.run_variant(v, cfg, params, steps, prompt_tokens, lengths)
      measured[name] = row["samples_per_s"]
      print(f"round {r}: {name} measured {row['samples_per_s']:.2f} samples/s "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
    per_round.append(dict(predicted=pred, measured=measured))
  print(f"{'round':>5} {'run':14} {'predicted samples/s':>19} {'measured':>9}")
  for r, got in enumerate(per_round):
    for name in _RUNS:
      meas = f"{got['measured'][name]:9.2f}" if name in got["measured"] else f"{'-':>9}"
      print(f"{r:>5} {name:14} {got['predicted']['samples_per_s'][name]:>19.2f} {meas}")
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
  return dict(predicted_ratio=round(pred["ratio"], 3), matmul_gflops=pred["matmul_gflops"],
              copy_gb_s=pred["copy_gb_s"],
              predicted_samples_per_s={k: round(x, 2) for k, x in pred["samples_per_s"].items()},
              measured_samples_per_s={k: round(x, 2) for k, x in got["measured"].items()})


if __name__ == "__main__":
  app.run(main)
