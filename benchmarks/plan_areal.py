r"""The capacity planner against AReaL's published measurements, across sizes, and timed.

  python -m benchmarks.plan_areal            # a few minutes on a loaded 2-core CPU
  python -m benchmarks.plan_areal --quick    # the published points alone, without bands

1. Every published point of `async_rl.plan.published` (AReaL, arXiv 2505.24298: Table
   1's hours and speedups, Table 7's trained tokens/s against η, the interruptible-
   generation figure as "retract" against "drain") beside the planner's prediction, its
   error, and its band (`async_rl.plan.band`): the prediction over the inputs AReaL did
   not publish (the length distribution's spread, the slots per engine, the memory
   fraction; on one node the device split), with the assumption that moves it most.
2. Table 1's rows as the planner's own search would place them (which synchronous form
   it picks, and its speedup over it), and the speedup against the cluster size
   (`docs/figures/plan_speedup_vs_nodes.png`; Table 7 beside its prediction and band in
   `plan_table7.png`).
3. Every Qwen2.5 size from 0.5B to 32B, read from its `config.json` shapes, on 8 and 64
   nodes of 8 H800s with AReaL's workload: the best synchronous and asynchronous
   placements the search finds.
4. `async-rl-plan`'s search and band, timed: a 32B-class model on 48 nodes of 8 H800s
   and the 7B on 64 H100s, in wall and CPU seconds, beside this machine's float32
   matmul peak and load average, measured in the same run.

Nothing but the timings is measured: every other figure is the cost model's
(`async_rl.plan.costs`) at the hardware table's rates. Last line: one JSON object.
"""

import dataclasses
import json
import os
import tempfile
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from async_rl.plan import band, hardware, inputs, published, search  # noqa: E402
from benchmarks.common.peak import matmul_peak  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Only the published points, without bands.")
_FIG_DIR = flags.DEFINE_string("fig_dir", "docs/figures", "Where the plots go.")

_SWEEP = (band.LENGTH_SPREAD, band.SLOTS, band.MEMORY_FRACTION)
_NODES = (4, 8, 16, 24, 32, 64)
_SIZE_NODES = (8, 64)
_TIMED = (("32b", "H800", 48), ("7b", "H100", 8))


def _band(workload, cluster, placements, sweep):
  if _QUICK.value:
    sweep = ()
  return band.run(workload, cluster, placements, sweep=sweep)


def _row(name, published_value, b, f, unit=""):
  """One published point: its prediction, error, band and what moves it most."""
  predicted = f(b.nominal)
  lo, hi = b.range(f)
  moved, mlo, mhi = b.most(f)
  out = dict(point=name, published=published_value, predicted=predicted,
             error=predicted / published_value - 1, band=(lo, hi), moved_most_by=moved,
             moved_range=(mlo, mhi))
  print(f"{name:34} {published_value:>9.3g}{unit} {predicted:>9.3g}{unit} "
        f"{out['error']:>+6.0%}  {lo:.3g}-{hi:.3g}{unit}  {moved or '-'}")
  return out


def hours(name):
  return lambda preds: (preds[name].step_s * published.TABLE1_STEPS / 3600
                        if preds.get(name) else None)


def trained(name):
  return lambda preds: preds[name].trained_tokens_per_s if preds.get(name) else None


def generated(name):
  return lambda preds: preds[name].tokens_per_s if preds.get(name) else None


def published_points() -> tuple[list, dict]:
  rows, curve = [], {}
  print(f"{'published point':34} {'AReaL':>9} {'predicted':>9} {'error':>6}  band  "
        f"(moved most by)")
  for r in published.AREAL_TABLE1:
    w, c, sync, asyn = published.table1_setup(r)
    b = _band(w, c, {"sync": sync, "async": asyn}, _SWEEP)
    size = r.preset.split("-")[1].upper()
    rows += [_row(f"Table 1, {size}, sync hours", r.sync_hours, b, hours("sync"), " h"),
             _row(f"Table 1, {size}, async hours", r.async_hours, b, hours("async"), " h"),
             _row(f"Table 1, {size}, speedup", r.speedup, b, band.speedup("async", "sync"),
                  "x")]
  for eta, value in published.AREAL_TABLE7:
    w, c, p = published.table7_setup(eta)
    b = _band(w, c, {"p": p}, _SWEEP + (band.DEVICE_SPLIT,))
    rows.append(_row(f"Table 7, η = {eta}, trained tok/s", value, b, trained("p")))
    curve[eta] = rows[-1]
  for preset, with_it, without in published.AREAL_INTERRUPTIBLE:
    w, c, retract = published.interruptible_setup(preset, "retract")
    drain = dataclasses.replace(retract, update_mode="drain")
    b = _band(w, c, {"retract": retract, "drain": drain}, _SWEEP)
    size = preset.split("-")[1].upper()
    rows += [_row(f"interruptible, {size}, retract tok/s", with_it, b, generated("retract")),
             _row(f"interruptible, {size}, drain tok/s", without, b, generated("drain")),
             _row(f"interruptible, {size}, gain", with_it / without, b,
                  lambda preds: preds["retract"].tokens_per_s / preds["drain"].tokens_per_s
                  if preds.get("retract") and preds.get("drain") else None, "x")]
  return rows, curve


def table1_searched() -> dict:
  """What the planner's own search places on Table 1's clusters."""
  out = {}
  print("\nTable 1's clusters as the search places them (AReaL's workload):")
  for r in published.AREAL_TABLE1:
    w, c, _, _ = published.table1_setup(r)
    res = search.search(w, c, top=2, etas=(2, 4, 8))
    sync, asyn = res["sync"][0], res["async"][0]
    out[r.preset] = dict(sync_form=sync.placement.form, sync_samples_per_s=sync.samples_per_s,
                         async_samples_per_s=asyn.samples_per_s,
                         speedup=asyn.samples_per_s / sync.samples_per_s)
    print(f"  {r.preset} on {r.nodes} nodes: best sync {sync.placement.form} (TP "
          f"{sync.placement.tp}, FSDP {sync.placement.fsdp}) {sync.samples_per_s:.2f} "
          f"samples/s; best async {asyn.samples_per_s:.2f}: x{out[r.preset]['speedup']:.2f}")
  return out


def speedup_vs_nodes() -> dict:
  out = {}
  print("\nTable 1's speedup against the cluster size (3/4 generate, η = 4):")
  for r in published.AREAL_TABLE1:
    points = []
    for nodes in _NODES:
      w, c, sync, asyn = published.table1_setup(r, nodes=nodes)
      rs, ra = (search.predict_scaled(w, c, p) for p in (sync, asyn))
      points.append(dict(gpus=8 * nodes, speedup=ra.samples_per_s / rs.samples_per_s))
    out[r.preset] = points
    print(f"  {r.preset}: " + ", ".join(f"{p['gpus']} GPUs x{p['speedup']:.2f}"
                                          for p in points))
  return out


def sizes() -> dict:
  out = {}
  print("\nQwen2.5 sizes (config.json) on H800 nodes, AReaL's workload: best sync / async")
  base = published.areal_workload("qwen2.5-1.5b")
  with tempfile.TemporaryDirectory() as tmp:
    for size, shapes in published.QWEN25_CONFIGS.items():
      path = os.path.join(tmp, f"{size}.json")
      with open(path, "w") as f:
        json.dump(shapes, f)
      w = dataclasses.replace(base, model=inputs.read_model(path))
      for nodes in _SIZE_NODES:
        res = search.search(w, published.areal_cluster(nodes), top=1, etas=(4,))
        sync, asyn = res["sync"][0], res["async"][0]
        key = f"{size}@{nodes}"
        out[key] = dict(sync=_placement(sync), asynchronous=_placement(asyn),
                        speedup=round(asyn.samples_per_s / sync.samples_per_s, 2))
        print(f"  {size:>4} on {nodes:>2} nodes: {_line(sync)}  |  {_line(asyn)}  "
              f"x{out[key]['speedup']:.2f}")
  return out


def _placement(r: search.Prediction) -> dict:
  p = r.placement
  return dict(form=p.form, gen=p.gen_devices, tp=p.tp, train=p.train_devices, fsdp=p.fsdp,
              slots=p.slots, eta=p.max_staleness, samples_per_s=round(r.samples_per_s, 3))


def _line(r: search.Prediction) -> str:
  p = r.placement
  if p.mode == "async":
    return (f"async {p.gen_devices}+{p.train_devices} TP {p.tp} FSDP {p.fsdp} η {p.max_staleness} "
            f"{r.samples_per_s:.2f}/s")
  return f"{p.form} TP {p.tp} FSDP {p.fsdp} {r.samples_per_s:.2f}/s"


def timed_searches() -> dict:
  """`async-rl-plan`'s work for two clusters, timed, with the peak and load beside."""
  out = {}
  print("\nasync-rl-plan's search and band, timed:")
  with tempfile.TemporaryDirectory() as tmp:
    for size, kind, nodes in _TIMED:
      path = os.path.join(tmp, "config.json")
      with open(path, "w") as f:
        json.dump(published.QWEN25_CONFIGS[size], f)
      w = dataclasses.replace(published.areal_workload("qwen2.5-1.5b"),
                              model=inputs.read_model(path))
      cluster = search.Cluster(hardware.HARDWARE[kind], nodes, 8)
      load = os.getloadavg()[0]
      wall, cpu = time.perf_counter(), time.process_time()
      res = search.search(w, cluster, top=2, etas=(2, 4, 8))
      rec = band.recommend(w, cluster, res, top=2,
                           sweep=(band.LENGTH_SPREAD, band.SLOTS, band.MEMORY_FRACTION,
                                  band.TP_DEGREE))
      wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
      best = rec.band.nominal[rec.best]
      key = f"{size}@{nodes}x8 {kind}"
      out[key] = dict(wall_s=round(wall, 1), cpu_s=round(cpu, 1),
                      load_before=round(load, 1), load_after=round(os.getloadavg()[0], 1),
                      recommended=_placement(best), close=len(rec.close))
      print(f"  {key}: {wall:.1f} s wall, {cpu:.1f} s CPU (load {load:.1f} -> "
            f"{os.getloadavg()[0]:.1f}); recommends {_line(best)}")
  return out


def _plot(curve: dict, nodes: dict, fig_dir: str) -> dict:
  os.makedirs(fig_dir, exist_ok=True)
  paths = {}
  fig, ax = plt.subplots(figsize=(6, 4.2))
  etas = list(curve)
  ax.plot(etas, [curve[e]["published"] / 1e3 for e in etas], "k*-", label="AReaL Table 7")
  ax.plot(etas, [curve[e]["predicted"] / 1e3 for e in etas], "o-", color="tab:blue",
          label="predicted")
  if not _QUICK.value:
    ax.fill_between(etas, [curve[e]["band"][0] / 1e3 for e in etas],
                    [curve[e]["band"][1] / 1e3 for e in etas], color="tab:blue", alpha=0.2,
                    label="band")
  ax.set_xscale("symlog", base=2, linthresh=1)
  ax.set_xlabel("η (max staleness)")
  ax.set_ylabel("trained k tokens/s")
  ax.set_title("1.5B on one node of 8 H800s, 8k context")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  paths["table7"] = os.path.join(fig_dir, "plan_table7.png")
  fig.savefig(paths["table7"], dpi=110)
  plt.close(fig)
  if nodes:
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for (name, points), r, color in zip(nodes.items(), published.AREAL_TABLE1,
                                        ("tab:blue", "tab:orange")):
      ax.plot([p["gpus"] for p in points], [p["speedup"] for p in points], "o-", color=color,
              label=f"{name}: predicted")
      ax.plot([8 * r.nodes], [r.speedup], "*", color=color, markersize=14,
              label=f"{name}: AReaL Table 1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("H800 GPUs (3/4 generate)")
    ax.set_ylabel("async / sync (η = 0, same split)")
    ax.set_title("Predicted speedup of asynchronous RL, η = 4")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["nodes"] = os.path.join(fig_dir, "plan_speedup_vs_nodes.png")
    fig.savefig(paths["nodes"], dpi=110)
    plt.close(fig)
  return paths


def main(argv):
  del argv
  t0 = time.perf_counter()
  peak = matmul_peak()
  rows, curve = published_points()
  searched = nodes = by_size = timed = {}
  if not _QUICK.value:
    searched = table1_searched()
    nodes = speedup_vs_nodes()
    by_size = sizes()
    timed = timed_searches()
  paths = _plot(curve, nodes, _FIG_DIR.value)
  peak_after = matmul_peak()
  print(f"\nfloat32 matmul peak {peak / 1e9:.1f} GFLOP/s before, {peak_after / 1e9:.1f} after")
  headline = dict(
      quick=_QUICK.value,
      points=[{k: (round(v, 4) if isinstance(v, float) else
                   [round(x, 4) for x in v] if isinstance(v, tuple) else v)
               for k, v in r.items()} for r in rows],
      table1_searched=searched, speedup_vs_gpus=nodes, sizes=by_size, timed=timed,
      matmul_peak_gflops=[round(peak / 1e9, 1), round(peak_after / 1e9, 1)],
      plots=paths, wall_s=round(time.perf_counter() - t0, 1))
  print(json.dumps(headline))


if __name__ == "__main__":
  app.run(main)
