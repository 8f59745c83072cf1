r"""Staleness ablation: held-out accuracy and throughput vs η, naive vs decoupled PPO.

  python -m benchmarks.staleness_ablation --quick   # η ∈ {0, 4, ∞}, one seed: ~12 min
  python -m benchmarks.staleness_ablation           # the full grid of BENCHMARKS.md

The AReaL paper's Table 2 at CPU scale. Every setting starts from the same warm
start of --config (default configs/tiny.py) and trains the same number of samples
(--steps steps of the config's batch), in process (the quick start's placement):
η ∈ {0, 1, 2, 4, 8, 16, ∞} × {naive PPO, decoupled PPO} × --seeds. η = 0 runs once
per seed and fills both rows: with no staleness the behaviour policy is the proximal
policy, so the two objectives coincide.

Per setting: final held-out greedy accuracy (mean and spread over seeds), effective
training throughput (trained samples/s and tokens/s, steps 2 to N) and the realised
mean and max staleness. Each finished run is appended to --out_dir/runs.jsonl and a
rerun with the same --out_dir skips it, so an interrupted grid resumes. Writes
--out_dir/staleness_ablation.png and .md (the table). Last line: one JSON object.
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

from async_rl import sharding  # noqa: E402
from async_rl.config import ExperimentConfig  # noqa: E402
from async_rl.config_dict import from_config_dict, parse_flags  # noqa: E402
from async_rl.rl.run import run_in_process  # noqa: E402
from async_rl.sft import warm_start  # noqa: E402
from async_rl.rl.run_stats import measure, measured_config  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py",
                                          "The experiment every setting shares.")
_QUICK = flags.DEFINE_bool("quick", False, "η ∈ {0, 4, ∞} and one seed.")
_STEPS = flags.DEFINE_integer("steps", 100, "RL steps per run.")
_SEEDS = flags.DEFINE_integer("seeds", 2, "Seeds per setting (--quick: 1).")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/async_rl_staleness_ablation",
                               "Results, workdirs, the plot and the table go here.")

ETAS = (0, 1, 2, 4, 8, 16, None)  # None: unbounded.
QUICK_ETAS = (0, 4, None)
LOSSES = ("naive_ppo", "decoupled_ppo")


def _eta_name(eta) -> str:
  return "inf" if eta is None else str(eta)


def settings(etas, seeds) -> list[tuple]:
  """(loss, η, seed) of every run; η = 0 once per seed (see the module docstring)."""
  return [(loss, eta, seed) for seed in range(seeds) for eta in etas for loss in LOSSES
          if not (eta == 0 and loss == "naive_ppo")]


def variant(cfg: ExperimentConfig, loss: str, eta, seed: int) -> ExperimentConfig:
  return dataclasses.replace(
      cfg, seed=cfg.seed + seed, sft=dataclasses.replace(cfg.sft, steps=0),
      task=dataclasses.replace(cfg.task, seed=cfg.task.seed + seed),
      ppo=dataclasses.replace(cfg.ppo, prox_logp="behav" if loss == "naive_ppo" else "recompute"),
      staleness=dataclasses.replace(cfg.staleness, max_staleness=eta))


def _load(path) -> dict:
  if not os.path.exists(path):
    return {}
  rows = [json.loads(line) for line in open(path)]
  return {(r["loss"], r["eta"], r["seed"]): r for r in rows}


def table(rows: dict, etas, seeds) -> list[dict]:
  """One line per (loss, η): mean, spread and count over seeds of each figure."""
  out = []
  for loss in LOSSES:
    for eta in etas:
      run_loss = "decoupled_ppo" if eta == 0 else loss  # η = 0 fills both rows.
      runs = [rows[k] for k in ((run_loss, eta, s) for s in range(seeds)) if k in rows]
      if not runs:
        continue
      acc = np.array([r["accuracy"] for r in runs])
      out.append({
          "loss": loss, "eta": _eta_name(eta), "seeds": len(runs),
          "accuracy_mean": float(acc.mean()), "accuracy_spread": float(np.ptp(acc)),
          "accuracy_before": float(np.mean([r["accuracy_before"] for r in runs])),
          "samples_per_s": float(np.mean([r["samples_per_s"] for r in runs])),
          "trained_tokens_per_s": float(np.mean([r["trained_tokens_per_s"] for r in runs])),
          "staleness_mean": float(np.mean([r["staleness_mean"] for r in runs])),
          "staleness_max": int(max(r["staleness_max"] for r in runs))})
  return out


def markdown(lines: list[dict]) -> str:
  out = ["| loss | η | seeds | held-out acc. (mean ± spread/2) | samples/s | trained tok/s "
         "| staleness mean / max |", "|---|---|---|---|---|---|---|"]
  for r in lines:
    out.append(f"| {r['loss']} | {r['eta']} | {r['seeds']} | "
               f"{100 * r['accuracy_mean']:.1f} ± {50 * r['accuracy_spread']:.1f} | "
               f"{r['samples_per_s']:.1f} | {r['trained_tokens_per_s']:.0f} | "
               f"{r['staleness_mean']:.2f} / {r['staleness_max']} |")
  return "\n".join(out)


def plot(lines: list[dict], before: float, path: str) -> None:
  fig, (ax_acc, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
  for loss, style in (("decoupled_ppo", "o-"), ("naive_ppo", "s--")):
    rs = [r for r in lines if r["loss"] == loss]
    x = range(len(rs))
    ax_acc.errorbar(x, [100 * r["accuracy_mean"] for r in rs],
                    yerr=[50 * r["accuracy_spread"] for r in rs], fmt=style, capsize=3,
                    label=loss)
    ax_tput.plot(x, [r["samples_per_s"] for r in rs], style, label=loss)
    for ax in (ax_acc, ax_tput):
      ax.set_xticks(list(x), [r["eta"] for r in rs])
  ax_acc.axhline(100 * before, color="k", ls=":", label="warm start")
  ax_acc.set_xlabel("max staleness η")
  ax_acc.set_ylabel("held-out greedy accuracy (%)")
  ax_tput.set_xlabel("max staleness η")
  ax_tput.set_ylabel("trained samples / s")
  ax_acc.legend()
  ax_tput.legend()
  fig.suptitle("Staleness ablation (tiny model, arithmetic task, 2-core CPU)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  etas = QUICK_ETAS if _QUICK.value else ETAS
  seeds = 1 if _QUICK.value else _SEEDS.value
  cfg = measured_config(from_config_dict(_CONFIG.value), _STEPS.value)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  results = os.path.join(_OUT_DIR.value, "runs.jsonl")
  rows = _load(results)
  todo = [s for s in settings(etas, seeds) if s not in rows]
  t0 = time.perf_counter()
  params = warm_start(cfg, sharding.make_mesh(cfg.mesh), echo=lambda _: None) if todo else None
  for i, (loss, eta, seed) in enumerate(todo):
    run_cfg = variant(cfg, loss, eta, seed)
    workdir = os.path.join(_OUT_DIR.value, f"{loss}_eta{_eta_name(eta)}_seed{seed}")
    started = time.perf_counter()
    summary = run_in_process(run_cfg, workdir, init_params=params, echo=lambda _: None,
                             progress=False)
    row = {"loss": loss, "eta": eta, "seed": seed, "steps": _STEPS.value,
           "run_s": time.perf_counter() - started, **measure(run_cfg, summary)}
    rows[(loss, eta, seed)] = row
    with open(results, "a") as f:
      f.write(json.dumps(row) + "\n")
    print(f"[{i + 1}/{len(todo)} {time.perf_counter() - t0:.0f}s] {loss} η={_eta_name(eta)} "
          f"seed={seed}: accuracy {row['accuracy_before']:.3f} -> {row['accuracy']:.3f}, "
          f"{row['samples_per_s']:.1f} samples/s, staleness {row['staleness_mean']:.2f}"
          f"/{row['staleness_max']}", flush=True)
  lines = table(rows, etas, seeds)
  md = markdown(lines)
  print(md)
  with open(os.path.join(_OUT_DIR.value, "staleness_ablation.md"), "w") as f:
    f.write(md + "\n")
  png = os.path.join(_OUT_DIR.value, "staleness_ablation.png")
  before = float(np.mean([r["accuracy_before"] for r in rows.values()]))
  plot(lines, before, png)
  print(json.dumps({
      "quick": _QUICK.value, "steps": _STEPS.value, "seeds": seeds,
      "samples_per_run": _STEPS.value * cfg.batch_groups * cfg.generation.group_size,
      "accuracy_before": round(before, 4),
      "accuracy": {f"{r['loss']}/{r['eta']}": round(r["accuracy_mean"], 4) for r in lines},
      "samples_per_s": {f"{r['loss']}/{r['eta']}": round(r["samples_per_s"], 2)
                        for r in lines},
      "plot": png}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
