r"""The capacity planner's sync-vs-async prediction for this machine, beside the measurement.

  python -m benchmarks.plan_cpu                   # predict, then measure (120 steps a run)
  python -m benchmarks.plan_cpu --predict_only    # seconds: the prediction alone
  python -m benchmarks.plan_cpu --steps=4         # the smallest measured mode

"this machine" is measured first, as each placement will use it
(`plan.hardware.measure_cores`: a jitted matmul and an array copy in a process pinned
to those cores, under whatever else runs on the machine): every core together, and the
generator's core alone. The planner then predicts `benchmarks/sync_vs_async.py`'s two
placements of --config (default configs/tiny.py) from the config's shapes and the
task's output lengths alone:

  sync   one device of every core: an engine, then a trainer (η = 0, drain);
  async  two devices of one core each (taken alike: --generator_cpus's is measured), an
         engine on one and a trainer on the other, η = --eta, retract.

and runs both, as `benchmarks.sync_vs_async` does (same warm start, same steps), so the
predicted async/sync throughput ratio stands beside the measured one (the target:
within 15%). The predicted absolute throughputs are printed too; on a CPU the tiny
model's steps are dominated by dispatch, not by the bytes and FLOPs the model counts, so
only the ratio is expected to hold. Last line: one JSON object.
"""

import json
import os
import time

from absl import app, flags, logging

from async_rl import cpu
from async_rl.cli import from_dict
from async_rl.plan import hardware, search
from async_rl.rl import build
from async_rl.tasks.registry import make_task
from benchmarks import sync_vs_async as sva
from benchmarks.common.run_stats import warm_params

_PREDICT_ONLY = flags.DEFINE_bool("predict_only", False, "Skip the measured runs.")


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


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = from_dict(sva._CONFIG.value)
  cores = cpu.cores()
  every = hardware.measure_cores(set(range(cores)))
  one = hardware.measure_cores({int(sva._GENERATOR_CPUS.value[0])})
  for hw in (every, one):
    print(f"{hw.name}: {hw.peak_flops / 1e9:.1f} GFLOP/s float32 matmul, "
          f"{hw.hbm_bw / 1e9:.1f} GB/s copy", flush=True)
  workload = workload_of(cfg)
  clusters = {"sync": search.Cluster(every, 1, 1), "async_retract": search.Cluster(one, 1, 2)}
  steps = sva._STEPS.value or (30 if sva._QUICK.value else 120)
  predicted = {name: search.predict(workload, clusters[name], p, steps=max(steps, 4))
               for name, p in placements(cfg, sva._ETA.value).items()}
  measured = {}
  if not _PREDICT_ONLY.value:
    out_dir = sva._OUT_DIR.value
    for name in predicted:
      if os.path.exists(os.path.join(out_dir, name)):
        raise app.UsageError(f"{out_dir}/{name} exists: pass an empty --out_dir")
    os.makedirs(out_dir, exist_ok=True)
    params = warm_params(cfg, make_task(build.resolve(cfg).task),
                         cache_dir=sva._WARM_CACHE.value)
    prompt_tokens, lengths = sva.task_lengths(cfg)
    for name in predicted:
      t0 = time.perf_counter()
      row, _, _ = sva.run_variant(sva.named_variant(name), cfg, params, steps, prompt_tokens,
                                  lengths)
      measured[name] = row["samples_per_s"]
      print(f"{name}: measured {row['samples_per_s']:.2f} samples/s "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
  print(f"{'run':14} {'predicted samples/s':>19} {'measured':>9}")
  for name, pred in predicted.items():
    got = f"{measured[name]:9.2f}" if name in measured else f"{'-':>9}"
    print(f"{name:14} {pred.samples_per_s:>19.2f} {got}")
  ratio = predicted["async_retract"].samples_per_s / predicted["sync"].samples_per_s
  headline = dict(d_model=cfg.model.d_model, steps=steps, cores=cores,
                  matmul_gflops={hw.name: round(hw.peak_flops / 1e9, 1) for hw in (every, one)},
                  copy_gb_s={hw.name: round(hw.hbm_bw / 1e9, 2) for hw in (every, one)},
                  predicted_ratio=round(ratio, 3),
                  predicted_samples_per_s={k: round(v.samples_per_s, 2)
                                           for k, v in predicted.items()})
  if measured:
    got = measured["async_retract"] / measured["sync"]
    headline.update(measured_ratio=round(got, 3), error=round(ratio / got - 1, 3),
                    within_15_percent=abs(ratio / got - 1) <= 0.15,
                    measured_samples_per_s={k: round(v, 2) for k, v in measured.items()})
  print(f"async/sync: predicted {ratio:.2f}" + (
      f", measured {headline['measured_ratio']:.2f}" if measured else ""))
  print(json.dumps(headline))


if __name__ == "__main__":
  app.run(main)
