r"""The capacity planner's sync-vs-async prediction for this machine, beside the measurement.

  python -m benchmarks.plan_cpu                   # predict, then measure (120 steps a run)
  python -m benchmarks.plan_cpu --predict_only    # seconds: the prediction alone
  python -m benchmarks.plan_cpu --steps=4         # the smallest measured mode

"this machine" is measured first (`plan.hardware.measure_host`: a jitted matmul and an
array copy) and split evenly over its cores, one core a device. The planner then
predicts `benchmarks/sync_vs_async.py`'s two placements of --config (default
configs/tiny.py) from the config's shapes and the task's output lengths alone:

  sync   one engine over every core, then a trainer over every core (η = 0, drain);
  async  one engine on --generator_cpus, a trainer on --trainer_cpus (one core each),
         η = --eta, retract.

and runs both, as `benchmarks.sync_vs_async` does (same warm start, same steps), so the
predicted async/sync throughput ratio stands beside the measured one (the target:
within 15%). The predicted absolute throughputs are printed too; on a CPU the tiny
model's steps are dominated by dispatch, not by the bytes and FLOPs the model counts, so
only the ratio is expected to hold. Last line: one JSON object.
"""

import dataclasses
import json
import os
import time

from absl import app, flags, logging

from async_rl import cpu
from async_rl.config import from_dict
from async_rl.plan import hardware, search
from async_rl.rl import build
from async_rl.tasks.registry import make_task
from benchmarks import sync_vs_async as sva
from benchmarks.common.run_stats import warm_params

_PREDICT_ONLY = flags.DEFINE_bool("predict_only", False, "Skip the measured runs.")


def per_core(host: hardware.Hardware, cores: int) -> hardware.Hardware:
  """One core of `host` as a device: an even share of its compute and memory."""
  return dataclasses.replace(host, name=f"host core (1 of {cores})",
                             peak_flops=host.peak_flops / cores, hbm_bw=host.hbm_bw / cores,
                             hbm_bytes=host.hbm_bytes / cores)


def workload_of(cfg) -> search.Workload:
  """The config's shapes and its task's reference output lengths."""
  prompt_tokens, lengths = sva.task_lengths(cfg)
  cap = cfg.generation.max_new_tokens
  return search.Workload(
      cfg.model, batch_groups=cfg.batch_groups, group_size=cfg.generation.group_size,
      prompt_tokens=max(1, round(prompt_tokens)), max_new_tokens=cap,
      length_dist="empirical", length_samples=tuple(int(min(n, cap)) for n in lengths),
      train_tokens_per_mb=cfg.batching.max_tokens_per_mb)


def placements(cfg, cores: int, eta: int) -> dict[str, search.Placement]:
  kv = cfg.generation.kv_cache_blocks * cfg.generation.kv_block_size
  slots = cfg.generation.num_slots
  return {
      "sync": search.Placement("sync", gen_devices=cores, tp=cores, train_devices=cores,
                               fsdp=cores, slots=slots, kv_tokens=kv, max_staleness=0,
                               update_mode="drain"),
      "async_retract": search.Placement("async", gen_devices=1, tp=1, train_devices=1,
                                        fsdp=1, slots=slots, kv_tokens=kv,
                                        max_staleness=eta, update_mode="retract"),
  }


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = from_dict(sva._CONFIG.value)
  cores = cpu.cores()
  host = hardware.measure_host()
  print(f"this machine: {cores} cores, {host.peak_flops / 1e9:.0f} GFLOP/s float32 matmul, "
        f"{host.hbm_bw / 1e9:.1f} GB/s copy", flush=True)
  workload = workload_of(cfg)
  cluster = search.Cluster(per_core(host, cores), 1, cores)
  steps = sva._STEPS.value or (30 if sva._QUICK.value else 120)
  predicted = {name: search.predict(workload, cluster, p, steps=max(steps, 4))
               for name, p in placements(cfg, cores, sva._ETA.value).items()}
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
  headline = dict(config=cfg.model.d_model, steps=steps, cores=cores,
                  matmul_gflops=round(host.peak_flops / 1e9, 1),
                  copy_gb_s=round(host.hbm_bw / 1e9, 2), predicted_ratio=round(ratio, 3),
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
