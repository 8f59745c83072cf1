r"""Capacity planner: how to place an RL run on a cluster, and how fast it will go.

  async-rl-plan --model=qwen2.5-7b --hardware=H100 --nodes=8 --gpus_per_node=8 \
      --batch_groups=512 --group_size=16 --prompt_tokens=1024 --max_new_tokens=31744 \
      --lengths=lognormal:8000:1.0 [--write_config=/tmp/plan.py]

(in a clone of the repository, also `python -m launch.plan ...`). --model takes a
preset, a config file or a Hugging Face config.json; --lengths takes
lognormal:MEDIAN:SIGMA, pareto:MEDIAN:ALPHA, constant:N, file:PATH (a histogram) or
workdir:PATH (a run's recorded lengths); --hardware is a row of the hardware table
(`async_rl.plan.hardware`) or "host" (this machine, measured now).

Searches placements (synchronous, with the generator resident beside the trainer or
released while it trains, and asynchronous; the generation/training split, the engines'
tensor-parallel degree, the trainer's FSDP degree, slots, KV budget, η, update mode),
drops those that do not fit a device's memory, and prints the best simulated ones,
fastest first. Then the band (`async_rl.plan.band`): the best placements again over the
assumptions not given (the length distribution's spread, and the slots per engine, the
memory fraction and the TP degree unless --slots, --memory_fraction and --tp fix them),
the placement best across it, the speedup's range and the assumption that moves it
most. --write_config writes the recommended placement as a config file for
`launch.train`. docs/planning.md explains the cost model and the band.
"""

from absl import app, flags

from async_rl import launch
from async_rl.plan import band, hardware, inputs, search

_MODEL = flags.DEFINE_string("model", None, "Preset name, config file (.py) or HF config.json.")
_HARDWARE = flags.DEFINE_string("hardware", "H100", f"One of {sorted(hardware.HARDWARE)} or "
                                f"{hardware.HOST!r}.")
_NODES = flags.DEFINE_integer("nodes", 1, "Nodes.")
_GPUS = flags.DEFINE_integer("gpus_per_node", 8, "Accelerators per node.")
_BATCH = flags.DEFINE_integer("batch_groups", 64, "Prompt groups per training step.")
_GROUP = flags.DEFINE_integer("group_size", 8, "Samples per prompt.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 512, "Tokens of a prompt.")
_NEW = flags.DEFINE_integer("max_new_tokens", 8192, "The longest completion.")
_LENGTHS = flags.DEFINE_string("lengths", "lognormal:2048:1.0", "Completion lengths.")
_REWARD = flags.DEFINE_float("reward_latency", 0.0, "Seconds from a group's end to its reward.")
_TOP = flags.DEFINE_integer("top", 2, "Placements per mode simulated at every η and update "
                            "mode (the best by a closed-form estimate), and banded.")
_ETAS = flags.DEFINE_list("etas", ["2", "4", "8"], "The η to try in async mode.")
_TP = flags.DEFINE_integer("tp", None, "Fix the engines' tensor-parallel degree (open: "
                           "searched, and swept by the band).")
_SLOTS = flags.DEFINE_integer("slots", None, "Fix the slots per engine (open: searched, and "
                              "swept by the band).")
_MEMORY = flags.DEFINE_float("memory_fraction", None, "Fix the share of a device's memory "
                             f"a run may fill (open: {search.MEMORY_FRACTION}, swept by the "
                             "band).")
_BAND = flags.DEFINE_bool("band", True, "Sweep the assumptions not given (the band).")
_WRITE = flags.DEFINE_string("write_config", None, "Write the recommended placement's config "
                             "here.")
flags.mark_flags_as_required(["model"])

GIB = 2**30


def main(argv):
  del argv
  try:
    model = inputs.read_model(_MODEL.value)
    lengths = inputs.read_lengths(_LENGTHS.value)
    hw = hardware.hardware(_HARDWARE.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  workload = search.Workload(model, batch_groups=_BATCH.value, group_size=_GROUP.value,
                             prompt_tokens=_PROMPT.value, max_new_tokens=_NEW.value,
                             reward_latency=_REWARD.value, **lengths)
  cluster = search.Cluster(hw, _NODES.value, _GPUS.value,
                           memory_fraction=_MEMORY.value or search.MEMORY_FRACTION)
  grid = dict(etas=tuple(int(e) for e in _ETAS.value))
  if _TP.value:
    grid["tps"] = (_TP.value,)
  if _SLOTS.value:
    grid["slots"] = (_SLOTS.value,)
  results = search.search(workload, cluster, top=_TOP.value, **grid)
  print(f"{model.num_params() / 1e9:.2f}B params on {cluster.devices} x {hw.name} "
        f"({_NODES.value} nodes); batch {workload.batch_groups} x {workload.group_size}, "
        f"mean completion {workload.mean_length():.0f} tokens")
  rows = sorted(results["sync"] + results["async"], key=lambda r: -r.samples_per_s)
  if not rows:
    print("no placement fits: a larger cluster, a smaller model or shorter sequences")
    return
  sync_best = max((r.samples_per_s for r in results["sync"]), default=None)
  print(format_table(rows, sync_best))
  ranked = rows
  if _BAND.value:
    sweep = [band.LENGTH_SPREAD] + [name for name, given in (
        (band.SLOTS, _SLOTS.value), (band.MEMORY_FRACTION, _MEMORY.value),
        (band.TP_DEGREE, _TP.value)) if not given]
    rec = band.recommend(workload, cluster, results, top=_TOP.value, sweep=sweep)
    print()
    print(format_band(rec))
    ranked = [rec.band.nominal[k] for k in sorted(rec.ranges, key=lambda k: -rec.ranges[k][0])]
  if _WRITE.value:
    write_config(workload, cluster, ranked + rows)


def write_config(workload: search.Workload, cluster: search.Cluster, ranked: list) -> None:
  """Writes the first of `ranked` this project runs: its synchronous mode keeps the
  generator resident, so an offload placement is passed over (and said to be)."""
  best = next((r for r in ranked if not r.placement.offload), None)
  if best is None:
    print("no placement this project runs fits: its synchronous mode keeps the generator "
          "resident; nothing written")
    return
  if ranked[0].placement.offload:
    print("the recommended placement releases the generator while the trainer runs, which "
          "this project's synchronous mode does not: writing the best it runs instead")
  p, model = best.placement, workload.model
  summary = (f"{p.form} placement of {model.num_params() / 1e9:.2f}B params on "
             f"{cluster.devices} x {cluster.hardware.name}: predicted "
             f"{best.samples_per_s:.2f} samples/s")
  with open(_WRITE.value, "w") as f:
    f.write(inputs.config_text(workload, p, nodes=cluster.nodes, summary=summary))
  print(f"wrote {_WRITE.value}: {describe(p)}")


def describe(p: search.Placement) -> str:
  """A placement in a line."""
  engines = f"{p.engines} engine{'s' if p.engines > 1 else ''}"
  if p.mode == "async":
    return (f"async: {engines} at TP {p.tp} on {p.gen_devices} devices, "
            f"{p.train_devices} training (FSDP {p.fsdp}), {p.slots} slots, "
            f"η = {p.max_staleness}, {p.update_mode}")
  return (f"{p.form}: {engines} at TP {p.tp} on every device, then the trainer "
          f"(FSDP {p.fsdp}), {p.slots} slots")


def format_band(rec: band.Recommendation) -> str:
  """The band's verdict: the recommended placement, those it cannot tell from it, and
  the speedup's range with the assumption that moves it most."""
  varied = {s.assumption for s in rec.band.scenarios}
  swept = [a for a in band.ASSUMPTIONS if a in varied]
  lines = [f"over the band ({', '.join(swept) or 'nothing swept'}; samples/s: worst, "
           f"nominal, best):"]
  for name, (lo, mid, hi) in sorted(rec.ranges.items(), key=lambda kv: -kv[1][0]):
    mark = "recommended" if name == rec.best else (
        "within its band" if name in rec.close else "")
    p = rec.band.nominal[name].placement
    fit = "" if lo > 0 else " (does not fit in some scenario)"
    lines.append(f"  {lo:7.2f} {mid:7.2f} {hi:7.2f}  {describe(p)}{fit}  {mark}".rstrip())
  if rec.close:
    lines.append(f"  {len(rec.close)} placement(s) fall within the recommended one's band: "
                 f"the model cannot tell them apart; pick by what else matters")
  if rec.best_sync and rec.best_async:
    f = band.speedup(rec.best_async, rec.best_sync)
    lo, hi = rec.band.range(f)
    moved, mlo, mhi = rec.band.most(f)
    nominal = f(rec.band.nominal)
    sync = rec.band.nominal[rec.best_sync].placement
    lines.append(f"async over the best synchronous placement ({sync.form}): {nominal:.2f}x, "
                 f"band {lo:.2f}-{hi:.2f}x; moved most by the {moved} ({mlo:.2f}-{mhi:.2f}x)")
  return "\n".join(lines)


def format_table(rows, sync_best) -> str:
  """The ranked predictions, one line each."""
  head = (f"{'#':>2} {'form':14} {'gen':>5} {'tp':>2} {'train':>5} {'fsdp':>4} {'slots':>5} "
          f"{'kv tok':>8} {'eta':>3} {'update':7} {'samples/s':>9} {'tok/s':>9} "
          f"{'x sync':>6} {'GiB/dev':>7} {'stale':>5} {'occup':>5} {'gen idle':>8} "
          f"{'tr idle':>7}")
  out = [head]
  for i, r in enumerate(rows, 1):
    p = r.placement
    ratio = f"{r.samples_per_s / sync_best:6.2f}" if sync_best else f"{'-':>6}"
    out.append(f"{i:>2} {p.form:14} {p.gen_devices:>5} {p.tp:>2} {p.train_devices:>5} "
               f"{p.fsdp:>4} {p.slots:>5} {p.kv_tokens:>8} {p.max_staleness:>3} "
               f"{p.update_mode:7} {r.samples_per_s:>9.2f} {r.tokens_per_s:>9.0f} {ratio} "
               f"{r.memory_per_device / GIB:>7.1f} {r.staleness_mean:>5.2f} "
               f"{r.slot_occupancy:>5.2f} {r.generator_idle:>8.2f} {r.trainer_idle:>7.2f}")
  return "\n".join(out)


def run():
  """The console script `async-rl-plan`."""
  launch.run(main, __name__, has_config=False)


if __name__ == "__main__":
  run()
