"""Projected throughput of sync vs async RL at 8 to 1024 accelerators (simulated).

  python -m benchmarks.simulate --quick   # about a minute on a 2-core CPU
  python -m benchmarks.simulate --out=/tmp/sim.png

Runs `async_rl.sim.simulate` for each accelerator count N in 8, 16, ..., 1024:
  sync:  all N accelerators generate, then all N train (η = 0, drain);
  async: 3N/4 generate and N/4 train concurrently (η = `--eta`, retract).
The batch grows with the cluster (`--samples_per_accelerator` samples per step per
accelerator, groups of 16), so perfect scaling is throughput linear in N.

The simulator itself is checked against the real system: `benchmarks/sync_vs_async.py`
calibrates it from each measured CPU run and its predictions land within 5% (see
BENCHMARKS.md). The accelerator costs below cannot be measured on this project's
CPU machines, so they are ILLUSTRATIVE: plausible orders of magnitude for a ~1B
model (a decode step of 32 slots ~40 ms, training ~4x faster per token than
decoding, 1 s weight sync, 0.5 s reward latency, lognormal output lengths with
median 512, log-sd 1 and a 32k cap, so the longest sample of a batch keeps growing
with the batch). `benchmarks/plan_areal.py` runs the same simulator on costs from the
hardware table instead (`async_rl.plan`, docs/planning.md).

Prints a table, then, as the last line, one JSON object with the headline figures;
writes a PNG of throughput vs accelerator count for both modes to `--out`.
"""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from async_rl.sim import SimConfig, simulate  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Fewer training steps per point.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the output lengths.")
_ETA = flags.DEFINE_integer("eta", 4, "max_staleness of the async runs.")
_SAMPLES = flags.DEFINE_integer("samples_per_accelerator", 32,
                                "Samples per training step per accelerator.")
_OUT = flags.DEFINE_string("out", "/tmp/async_rl_simulate.png", "Where to write the plot.")

_ACCELERATORS = (8, 16, 32, 64, 128, 256, 512, 1024)
_GROUP = 16
# Illustrative, uncalibrated costs (seconds, tokens); see the module docstring.
_COSTS = dict(slots=32, decode_step_base=0.03, decode_step_per_slot=3e-4,
              prefill_per_token=2e-5, prompt_tokens=256, reward_latency=0.5,
              trainer_per_token=3e-4, weight_sync=1.0, group_size=_GROUP,
              length_dist="lognormal", length_median=512, length_sigma=1.0,
              max_length=32768)


def configs(n: int, eta: int, samples_per_accelerator: int) -> dict[str, SimConfig]:
  """The sync and async systems on `n` accelerators."""
  batch_groups = max(1, n * samples_per_accelerator // _GROUP)
  return {
      "sync": SimConfig(mode="sync", num_generators=n, trainer_accelerators=n,
                        max_staleness=0, update_mode="drain", batch_groups=batch_groups,
                        **_COSTS),
      "async": SimConfig(mode="async", num_generators=n - n // 4, trainer_accelerators=n // 4,
                         max_staleness=eta, update_mode="retract", batch_groups=batch_groups,
                         **_COSTS),
  }


def _plot(rows, path):
  fig, ax = plt.subplots(figsize=(6, 4.5))
  ns = [r["accelerators"] for r in rows]
  for mode, style in (("async", "o-"), ("sync", "s-")):
    ax.plot(ns, [r[f"{mode}_tokens_per_s"] for r in rows], style, label=mode)
  base = rows[0]["async_tokens_per_s"] / ns[0]
  ax.plot(ns, [base * n for n in ns], "k:", label="linear (from async at 8)")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("accelerators")
  ax.set_ylabel("trained tokens / s (simulated)")
  ax.set_title("Simulated throughput, illustrative uncalibrated costs")
  ax.legend()
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  steps = 8 if _QUICK.value else 16
  rows = []
  print(f"{'accel':>6} {'mode':6} {'tokens/s':>10} {'samples/s':>10} {'gen idle':>9} "
        f"{'train idle':>10} {'stale mean':>10} {'stale max':>9} {'dropped':>8}")
  for n in _ACCELERATORS:
    row = {"accelerators": n}
    for mode, cfg in configs(n, _ETA.value, _SAMPLES.value).items():
      res = simulate(cfg, steps, _SEED.value)
      assert cfg.accelerators == n
      print(f"{n:>6} {mode:6} {res.tokens_per_s:>10.0f} {res.samples_per_s:>10.2f} "
            f"{res.generator_idle:>9.3f} {res.trainer_idle:>10.3f} "
            f"{res.staleness_mean:>10.2f} {res.staleness_max:>9} {res.dropped_groups:>8}")
      row[f"{mode}_tokens_per_s"] = res.tokens_per_s
      row[f"{mode}_generator_idle"] = res.generator_idle
    row["ratio"] = row["async_tokens_per_s"] / row["sync_tokens_per_s"]
    rows.append(row)
  _plot(rows, _OUT.value)
  first, last = rows[0], rows[-1]
  scale = last["accelerators"] / first["accelerators"]
  headline = {
      "quick": _QUICK.value, "calibrated": False, "steps": steps, "eta": _ETA.value,
      "accelerators": [r["accelerators"] for r in rows],
      "async_over_sync": [round(r["ratio"], 3) for r in rows],
      "async_tokens_per_s_1024": last["async_tokens_per_s"],
      "sync_tokens_per_s_1024": last["sync_tokens_per_s"],
      "async_scaling_efficiency": last["async_tokens_per_s"] / first["async_tokens_per_s"] / scale,
      "sync_scaling_efficiency": last["sync_tokens_per_s"] / first["sync_tokens_per_s"] / scale,
      "plot": _OUT.value,
  }
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                    for k, v in headline.items()}))


if __name__ == "__main__":
  app.run(main)
