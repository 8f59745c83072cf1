"""The real-model benchmark's smoke test (`benchmarks/real_model.py --quick`), in a file of
its own so that the suite's workers share the benchmarks' time evenly: every part runs,
against transformers and its FLOP floor, and ends with one JSON line."""

import pytest

from test_benchmarks import _run


def test_real_model_runs_every_part_against_transformers_and_its_floor():
  pytest.importorskip("transformers")
  stdout, s = _run("benchmarks.real_model", "--quick", "--rounds=1", config=(), timeout=1500)
  assert s["quick"] and s["layers"] == 2 and s["vocab"] == 4096 and s["steps"] == 3
  peak = s["matmul_gflops"] * 1e9
  # Decode: S prompts of 40 ids, 63 token forwards after each, 2 N + 4 L H E (p + 1) FLOPs
  # at position p, N = 9,437,184 matmul params and L H E = 1152.
  for S in ("1", "8"):
    d = s["decode"][S]
    forward = int(S) * (103 * 2 * 9_437_184 + 4 * 1152 * sum(range(1, 104)))
    assert d["flops"] == forward and d["floor_ratio"] == pytest.approx(
        d["seconds"] * peak / forward, rel=1e-3)
    assert d["tokens_per_s"] == pytest.approx(int(S) * 64 / d["seconds"], rel=1e-3)
    assert d["ratio"] == pytest.approx(d["hf_seconds"] / d["seconds"], rel=1e-3)
  # Train: 32 sequences of 104 tokens, 3 forwards' FLOPs; the trainer packed all of them.
  t = s["train"]
  train = 3 * 32 * (104 * 2 * 9_437_184 + 4 * 1152 * sum(range(1, 105)))
  assert t["flops"] == train and t["packed_tokens"] >= 32 * 104
  assert t["mfu"] == pytest.approx(train / t["seconds"] / peak, rel=1e-3)
  assert t["hf_seconds"] > 0 and t["grad_threads"] >= 1
  # The GRPO runs: every sample 64 new tokens, one timed step; the floor's generation
  # runs each of the 8 prompts once, then 63 token forwards per sample.
  gen = (8 * (40 * 2 * 9_437_184 + 4 * 1152 * sum(range(1, 41)))
         + 32 * (63 * 2 * 9_437_184 + 4 * 1152 * sum(range(41, 104))))
  for g in (s["grpo"], s["overlap"]):
    assert g["completion_lengths"] == [64] == s["first_step_cold"]["completion_lengths"]
    assert g["floor_s"] == pytest.approx((gen + train) / peak, rel=1e-3)
    assert 0 < g["gen_s"] < g["step_s"] and 0 < g["train_s"] < g["step_s"]
    assert g["floor_ratio"] > 1 and g["peak_rss_gb"] > 0
  assert s["first_step_cold"]["to_first_step_s"] > 0 and g["to_first_step_s"] > 0
  assert "GRPO step, η = 1" in stdout and "S=8" in stdout  # the tables
