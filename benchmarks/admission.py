r"""Length-fair admission: what dropping stale groups does to long samples, and masking.

  python -m benchmarks.admission                    # configs/tiny.py:long_tail
  python -m benchmarks.admission --steps=3 --etas=1 # a smoke run

Every run starts from the same warm start of --config and trains --steps steps in
process, with η ∈ --etas and `staleness.on_stale` ∈ {drop, mask_tokens}. Per run,
from the parameter server's length histograms (samples by completion length):

  * the mean, median, 90th percentile and max length of the samples generated
    (offered to the server), admitted and trained;
  * by decile of the generated lengths (a length whose samples straddle a decile
    boundary is split between the two in proportion): the share of samples dropped,
    and the share of the tokens of the samples resolved (trained or dropped; not
    those still buffered at the end) that was trained: dropped groups and tokens
    masked as too stale both lose theirs;
  * held-out greedy accuracy on the --longest held-out problems with the longest
    reference solutions, and on all --heldout of them (also of the warm start).

Writes --out_dir/runs.jsonl (a rerun skips the runs already there). Last line: one
JSON object.
"""

import contextlib
import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from async_rl.cli import from_dict
from async_rl.config import ExperimentConfig
from async_rl.launch import parse_flags
from async_rl.param_server.buffer import length_summary
from async_rl.rl import entry
from async_rl.rl.checkpoint import restore_params
from benchmarks.common.run_stats import (HeldoutEval, longest_heldout, measured_config,
                                         warm_params)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py:long_tail",
                                          "The experiment every run shares.")
_STEPS = flags.DEFINE_integer("steps", 20, "RL steps per run.")
_ETAS = flags.DEFINE_list("etas", ["1", "2", "4"], "max_staleness values.")
_POLICIES = flags.DEFINE_list("policies", ["drop", "mask_tokens"], "staleness.on_stale values.")
_HELDOUT = flags.DEFINE_integer("heldout", 200, "Held-out problems to choose the longest from.")
_LONGEST = flags.DEFINE_integer("longest", 40, "Held-out problems with the longest solutions.")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/async_rl_admission", "Results and workdirs.")


def variant(cfg: ExperimentConfig, eta: int, policy: str) -> ExperimentConfig:
  """The run's config; its own evaluations shrink to one prompt (this script measures)."""
  return dataclasses.replace(
      cfg, sft=dataclasses.replace(cfg.sft, steps=0),
      eval=dataclasses.replace(cfg.eval, num_prompts=1, pass_k=1),
      staleness=dataclasses.replace(cfg.staleness, max_staleness=eta, on_stale=policy))


def by_decile(generated, num, den) -> list[float]:
  """Σ num / Σ den over the lengths in each tenth of the `generated` samples sorted by
  length (histograms by length); a length whose samples straddle a decile boundary
  goes to both deciles in proportion."""
  generated = np.asarray(generated, float)
  num, den = (np.pad(np.asarray(h, float), (0, max(0, generated.size - len(h))))
              for h in (num, den))
  total = generated.sum()
  start = np.concatenate([[0.0], np.cumsum(generated)[:-1]])
  sums = np.zeros((2, 10))
  for length in np.flatnonzero(generated):
    lo, hi = start[length], start[length] + generated[length]
    for d in range(10):
      share = max(0.0, min(hi, (d + 1) * total / 10) - max(lo, d * total / 10))
      sums[:, d] += np.array([num[length], den[length]]) * share / generated[length]
  return [float(n / m) if m else 0.0 for n, m in sums.T]


def figures(hist: dict[str, list[int]]) -> dict:
  generated = hist["generated"]
  size = len(generated)
  resolved = sum(np.pad(np.asarray(hist[k], float), (0, size - len(hist[k])))
                 for k in ("trained", "dropped"))
  return {
      **{kind: length_summary(hist[kind]) for kind in ("generated", "admitted", "trained")},
      "dropped_by_decile": by_decile(generated, hist["dropped"], generated),
      "trained_token_share_by_decile": by_decile(generated, hist["trained_tokens"],
                                                 resolved * np.arange(size)),
  }


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = measured_config(from_dict(_CONFIG.value), _STEPS.value)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  results = os.path.join(_OUT_DIR.value, "runs.jsonl")
  rows = {}
  if os.path.exists(results):
    rows = {("warm_start" if r["policy"] == "warm_start" else (r["eta"], r["policy"])): r
            for r in map(json.loads, open(results))}
  todo = [(int(e), p) for e in _ETAS.value for p in _POLICIES.value
          if (int(e), p) not in rows]
  task, heldout, longest = longest_heldout(cfg, _HELDOUT.value, _LONGEST.value)
  t0 = time.perf_counter()
  params = warm_params(cfg, task) if todo else None
  with HeldoutEval(cfg, task, params) if todo else contextlib.nullcontext() as held_out:

    def evaluate(trained) -> dict:
      held_out.load(trained)
      return {"accuracy_longest": held_out.accuracy(longest),
              "accuracy": held_out.accuracy(heldout)}

    if todo and "warm_start" not in rows:
      rows["warm_start"] = evaluate(params)
      with open(results, "a") as f:
        f.write(json.dumps({"eta": None, "policy": "warm_start", **rows["warm_start"]}) + "\n")
    for eta, policy in todo:
      run_cfg = variant(cfg, eta, policy)
      workdir = os.path.join(_OUT_DIR.value, f"eta{eta}_{policy}")
      started = time.perf_counter()
      summary = entry.run(run_cfg, workdir, init_params=params, echo=lambda _: None,
                          progress=False)
      server = summary["server"]
      trained = restore_params(os.path.join(workdir, "checkpoints"), run_cfg.model)
      row = {"eta": eta, "policy": policy, "steps": _STEPS.value,
             "run_s": round(time.perf_counter() - started, 1),
             "dropped_groups": server["dropped"], "admitted_groups": server["admitted"],
             "masked_tokens": server["masked_tokens"], "trained_stale": server["trained_stale"],
             "staleness_max": max(m["staleness_max"] for m in summary["history"]),
             **figures(server["length_hist"]), **evaluate(trained)}
      rows[(eta, policy)] = row
      with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
      print(f"[{time.perf_counter() - t0:.0f}s] η={eta} {policy}: dropped {row['dropped_groups']}"
            f"/{row['dropped_groups'] + row['admitted_groups']} groups, mean length generated "
            f"{row['generated']['mean']:.1f} trained {row['trained']['mean']:.1f}, accuracy on "
            f"the longest {row['accuracy_longest']:.3f}", flush=True)
  ordered = [rows[k] for k in sorted(k for k in rows if k != "warm_start")]
  before = rows.get("warm_start", {})
  print(f"warm start: accuracy on the longest {before.get('accuracy_longest', float('nan')):.3f}"
        f" all {before.get('accuracy', float('nan')):.3f}")
  for r in ordered:
    print(f"η={r['eta']} {r['policy']:<11} gen mean/p50/p90/max "
          f"{r['generated']['mean']:.1f}/{r['generated']['p50']}/{r['generated']['p90']}/"
          f"{r['generated']['max']}  trained {r['trained']['mean']:.1f}/{r['trained']['p50']}/"
          f"{r['trained']['p90']}/{r['trained']['max']}  dropped by decile "
          + " ".join(f"{x:.2f}" for x in r["dropped_by_decile"])
          + "  trained token share by decile "
          + " ".join(f"{x:.2f}" for x in r["trained_token_share_by_decile"])
          + f"  acc longest {r['accuracy_longest']:.3f} all {r['accuracy']:.3f}")
  print(json.dumps({"steps": _STEPS.value, "warm_start": before, "runs": {
      f"eta{r['eta']}/{r['policy']}": {
          "mean_len_generated": r["generated"].get("mean"),
          "mean_len_trained": r["trained"].get("mean"),
          "dropped_top_decile": r["dropped_by_decile"][-1],
          "trained_token_share_top_decile": r["trained_token_share_by_decile"][-1],
          "accuracy_longest": r["accuracy_longest"], "accuracy": r["accuracy"]}
      for r in ordered}}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
