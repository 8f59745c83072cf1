"""Smoke tests of the end-to-end benchmarks on the micro config: they run, write their
files and end with one JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _run(module, *args, timeout=600):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", module, "--config=configs/micro.py", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


def test_sync_vs_async_measures_both_modes_and_checks_the_simulator(tmp_path):
  pytest.importorskip("ray")
  cpus = sorted(os.sched_getaffinity(0))
  stdout, summary = _run("benchmarks.sync_vs_async", "--steps=3", "--runs=sync,async_keep",
                         f"--trainer_cpus={cpus[0]}", f"--generator_cpus={cpus[-1]}",
                         "--sweep_slots=4,16", f"--out_dir={tmp_path}")
  assert set(summary["runs"]) == {"sync", "async_keep"}
  for run in summary["runs"].values():
    assert run["samples_per_s"] > 0 and run["predicted_samples_per_s"] > 0
    assert 0 <= run["accuracy"] <= 1
  assert summary["speedup_over_sync"]["async_keep"] > 0
  for name in ("sync", "async_keep"):
    assert (tmp_path / f"timeline_{name}.png").stat().st_size > 0
    trace = json.loads((tmp_path / f"trace_{name}.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert lanes == {"generator", "trainer"}
  assert "sync " in stdout and "async_keep " in stdout  # the table
  projected = summary["projected_samples_per_s_by_slots"]
  assert set(projected) == {"sync", "async_keep"}
  assert all(set(p) == {"4", "16"} and min(p.values()) > 0 for p in projected.values())
  assert summary["projected_best_over_best_sync"]["async_keep"] > 0


def test_slot_projection_at_the_runs_own_slots_is_its_prediction():
  from async_rl.sim import SimConfig, simulate
  from benchmarks.sync_vs_async import project_slots, steady_samples_per_s
  sim = SimConfig(mode="sync", num_generators=1, trainer_accelerators=1, slots=8,
                  decode_step_base=0.01, decode_step_per_slot=0.0, prefill_per_token=0.0,
                  trainer_per_token=0.0, max_staleness=0, update_mode="drain",
                  length_dist="constant", length_median=20, batch_groups=4, group_size=4)
  projected = project_slots(sim, [4, 8, 32], steps=6)
  assert projected[8] == steady_samples_per_s(simulate(sim, 6, seed=0), sim, 6)
  # 16 samples of 20 tokens per step, decode cost proportional to slots: 4 slots run
  # four waves of 20 steps at 0.005 s and 8 slots two at 0.01 s (0.4 s a step either
  # way), but 32 slots run one wave at 0.04 s with half the slots idle (0.8 s).
  assert projected[4] == pytest.approx(40.0) and projected[8] == pytest.approx(40.0)
  assert projected[32] == pytest.approx(20.0)


def test_staleness_ablation_runs_the_grid_and_resumes(tmp_path):
  args = ("--quick", "--steps=2", f"--out_dir={tmp_path}")
  _, summary = _run("benchmarks.staleness_ablation", *args)
  runs = [json.loads(l) for l in (tmp_path / "runs.jsonl").read_text().splitlines()]
  # η ∈ {0, 4, ∞} × two losses, η = 0 once: five runs of the same trained samples.
  assert len(runs) == 5 and {r["steps"] for r in runs} == {2}
  assert {(r["loss"], r["eta"]) for r in runs} == {
      ("decoupled_ppo", 0), ("naive_ppo", 4), ("decoupled_ppo", 4), ("naive_ppo", None),
      ("decoupled_ppo", None)}
  assert all(r["eta"] is None or r["staleness_max"] <= r["eta"] for r in runs)
  assert set(summary["accuracy"]) == {f"{loss}/{eta}" for loss in ("naive_ppo", "decoupled_ppo")
                                      for eta in ("0", "4", "inf")}
  assert (tmp_path / "staleness_ablation.png").stat().st_size > 0
  # A rerun finds every run done: it trains nothing and reports the same table.
  stdout, again = _run("benchmarks.staleness_ablation", *args)
  assert again["accuracy"] == summary["accuracy"]
  assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 5
  assert "[1/" not in stdout
