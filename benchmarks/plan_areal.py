r"""The capacity planner against AReaL's Table 1, and its sync-vs-async curves.

  python -m benchmarks.plan_areal            # a few minutes on a 2-core CPU
  python -m benchmarks.plan_areal --quick    # the Table 1 rows and a coarse curve

For the 1.5B and 7B rows of AReaL's Table 1 (arXiv 2505.24298: H800 nodes of 8 GPUs,
250 PPO steps; the published setup and what had to be assumed are in
`async_rl.plan.published`), the planner's simulated step times of synchronous and
asynchronous AReaL, as hours for 250 steps, beside the published hours, and the
predicted speedup against the published one (the target: within 20%).

Then, for both setups, the predicted speedup against the cluster size (AReaL's 3:1
split at every size) and against η (at the Table 1 size), plotted to --fig_dir
(`plan_speedup_vs_nodes.png`, `plan_speedup_vs_eta.png`); and the planner's search
(`async_rl.plan.search`) on one 8-GPU H100 host (64 prompts a step) and on 64 H100s
(AReaL's 512) for each setup: the recommended placement and its speedup over the best
synchronous one.

Nothing here is measured: every figure is the cost model's (`async_rl.plan.costs`) at
the hardware table's rates. Last line: one JSON object with the headline figures.
"""

import dataclasses
import json
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from async_rl.plan import hardware, published, search  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Only the Table 1 rows and 3 cluster sizes; no "
                           "η curve and no search.")
_FIG_DIR = flags.DEFINE_string("fig_dir", "docs/figures", "Where the plots go.")

_STEPS = 250  # AReaL's Table 1 runs
_NODES = (4, 8, 16, 24, 32, 64)
_ETAS = (1, 2, 4, 8, 16)
# The recommendations: one 8-GPU host with a batch one host turns over in minutes, and
# 64 GPUs with AReaL's batch.
_HOSTS = ((1, 64), (8, 512))


def _pair(row, nodes=0, eta=4):
  return published.predict_pair(row, nodes=nodes, max_staleness=eta)


def table1():
  rows = []
  print("AReaL Table 1 (H800, 250 steps): published vs predicted")
  print(f"{'model':14} {'nodes':>5} {'sync h':>7} {'pred':>6} {'async h':>7} {'pred':>6} "
        f"{'speedup':>7} {'pred':>6} {'error':>6} {'stale':>5} {'gen idle':>8} {'tr idle':>7}")
  for row in published.AREAL_TABLE1:
    rs, ra = _pair(row)
    sync_h, async_h = rs.step_s * _STEPS / 3600, ra.step_s * _STEPS / 3600
    speedup = rs.step_s / ra.step_s
    out = dict(model=row.preset, nodes=row.nodes, sync_hours=row.sync_hours,
               async_hours=row.async_hours, speedup=row.speedup,
               predicted_sync_hours=sync_h, predicted_async_hours=async_h,
               predicted_speedup=speedup, error=speedup / row.speedup - 1,
               staleness_mean=ra.staleness_mean, async_generator_idle=ra.generator_idle,
               async_trainer_idle=ra.trainer_idle, sync_generator_idle=rs.generator_idle)
    rows.append(out)
    print(f"{row.preset:14} {row.nodes:>5} {row.sync_hours:>7.1f} {sync_h:>6.1f} "
          f"{row.async_hours:>7.1f} {async_h:>6.1f} {row.speedup:>7.2f} {speedup:>6.2f} "
          f"{out['error']:>+6.0%} {ra.staleness_mean:>5.2f} {ra.generator_idle:>8.2f} "
          f"{ra.trainer_idle:>7.2f}")
  return rows


def curve_nodes(nodes):
  out = {}
  print("\nspeedup vs cluster size (3/4 generate, η = 4)")
  for row in published.AREAL_TABLE1:
    points = []
    for n in nodes:
      rs, ra = _pair(row, nodes=n)
      points.append(dict(nodes=n, gpus=8 * n, sync_samples_per_s=rs.samples_per_s,
                         async_samples_per_s=ra.samples_per_s,
                         speedup=ra.samples_per_s / rs.samples_per_s))
      print(f"{row.preset:14} {8 * n:>5} GPUs: sync {rs.samples_per_s:7.2f} async "
            f"{ra.samples_per_s:7.2f} samples/s, x{points[-1]['speedup']:.2f}")
    out[row.preset] = points
  return out


def curve_eta():
  out = {}
  print("\nspeedup vs η (Table 1 cluster sizes)")
  for row in published.AREAL_TABLE1:
    points = []
    for eta in _ETAS:
      rs, ra = _pair(row, eta=eta)
      points.append(dict(eta=eta, speedup=ra.samples_per_s / rs.samples_per_s,
                         staleness_mean=ra.staleness_mean))
      print(f"{row.preset:14} η={eta:<3} x{points[-1]['speedup']:.2f} "
            f"(mean staleness {ra.staleness_mean:.2f})")
    out[row.preset] = points
  return out


def recommend():
  out = {}
  h100 = hardware.HARDWARE["H100"]
  for row in published.AREAL_TABLE1:
    for nodes, batch_groups in _HOSTS:
      workload = dataclasses.replace(published.areal_setup(row)[0], batch_groups=batch_groups)
      cluster = search.Cluster(h100, nodes, 8)
      t0 = time.perf_counter()
      res = search.search(workload, cluster, top=2, etas=(2, 4, 8))
      took = time.perf_counter() - t0
      key = f"{row.preset}@{8 * nodes}xH100, batch {batch_groups}x16"
      if not res["async"] and not res["sync"]:
        print(f"\n{key}: nothing fits")
        out[key] = None
        continue
      best = max(res["sync"] + res["async"], key=lambda r: r.samples_per_s)
      sync_best = max((r.samples_per_s for r in res["sync"]), default=float("nan"))
      p = best.placement
      out[key] = dict(dataclasses.asdict(p), samples_per_s=best.samples_per_s,
                      speedup_over_sync=best.samples_per_s / sync_best,
                      memory_gib=best.memory_per_device / 2**30,
                      staleness_mean=best.staleness_mean, search_s=took)
      print(f"\n{key} (search {took:.0f} s): {p.mode}, {p.gen_devices} generating "
            f"(tp {p.tp}), {p.train_devices} training (fsdp {p.fsdp}), {p.slots} slots, "
            f"KV {p.kv_tokens} tokens, η={p.max_staleness}, {p.update_mode}: "
            f"{best.samples_per_s:.2f} samples/s, x{best.samples_per_s / sync_best:.2f} "
            f"over the best sync, {best.memory_per_device / 2**30:.1f} GiB/device")
  return out


def _plot(nodes_curve, eta_curve, fig_dir):
  os.makedirs(fig_dir, exist_ok=True)
  paths = {}
  fig, ax = plt.subplots(figsize=(6, 4.2))
  for (name, points), color in zip(nodes_curve.items(), ("tab:blue", "tab:orange")):
    ax.plot([p["gpus"] for p in points], [p["speedup"] for p in points], "o-", color=color,
            label=f"{name}: predicted")
  for row, color in zip(published.AREAL_TABLE1, ("tab:blue", "tab:orange")):
    ax.plot([8 * row.nodes], [row.speedup], "*", color=color, markersize=14,
            label=f"{row.preset}: AReaL Table 1")
  paths["nodes"] = _save(fig, ax, "H800 GPUs (3/4 generate in async)",
                         "Predicted speedup of asynchronous RL, η = 4",
                         os.path.join(fig_dir, "plan_speedup_vs_nodes.png"))
  if eta_curve:
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for (name, points), row in zip(eta_curve.items(), published.AREAL_TABLE1):
      ax.plot([p["eta"] for p in points], [p["speedup"] for p in points], "o-",
              label=f"{name} on {8 * row.nodes} H800")
    paths["eta"] = _save(fig, ax, "η (max staleness)",
                         "Predicted speedup against the staleness bound",
                         os.path.join(fig_dir, "plan_speedup_vs_eta.png"))
  return paths


def _save(fig, ax, xlabel: str, title: str, path: str) -> str:
  """Labels a speedup plot (log2 x axis), writes it to `path` and returns the path."""
  ax.set_xscale("log", base=2)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("async / sync throughput")
  ax.set_title(title)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  t0 = time.perf_counter()
  table = table1()
  nodes_curve = curve_nodes((4, 16, 64) if _QUICK.value else _NODES)
  eta_curve = {} if _QUICK.value else curve_eta()
  recs = {} if _QUICK.value else recommend()
  paths = _plot(nodes_curve, eta_curve, _FIG_DIR.value)
  headline = dict(
      quick=_QUICK.value,
      table1={r["model"]: dict(published=round(r["speedup"], 2),
                               predicted=round(r["predicted_speedup"], 2),
                               error=round(r["error"], 3),
                               within_20_percent=abs(r["error"]) <= 0.2) for r in table},
      speedup_vs_gpus={k: {p["gpus"]: round(p["speedup"], 2) for p in v}
                       for k, v in nodes_curve.items()},
      speedup_vs_eta={k: {p["eta"]: round(p["speedup"], 2) for p in v}
                      for k, v in eta_curve.items()},
      recommend={k: v and {m: (round(x, 3) if isinstance(x, float) else x)
                           for m, x in v.items()} for k, v in recs.items()},
      plots=paths, wall_s=round(time.perf_counter() - t0, 1))
  print(json.dumps(headline))


if __name__ == "__main__":
  app.run(main)
