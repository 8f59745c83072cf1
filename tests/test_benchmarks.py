"""Smoke tests of the end-to-end benchmarks on the micro config: they run, write their
files and end with one JSON line; and the baselines the benchmarks compare against."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from async_rl import models
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams, SlotSampling
from conftest import two_layer_model

ROOT = Path(__file__).parents[1]


def _run(module, *args, timeout=600, config=("--config=configs/micro.py",)):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", module, *config, *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


def test_sync_vs_async_measures_both_modes_and_checks_the_simulator(tmp_path):
  pytest.importorskip("ray")
  cpus = sorted(os.sched_getaffinity(0))
  stdout, summary = _run("benchmarks.sync_vs_async", "--steps=2", "--runs=sync",
                         "--etas=0,1", "--frozen", "--sweep_steps=2",
                         f"--trainer_cpus={cpus[0]}", f"--generator_cpus={cpus[-1]}",
                         f"--out_dir={tmp_path}")
  assert set(summary["runs"]) == {"sync"} and set(summary["sweep"]) == {"0", "1"}
  run = summary["runs"]["sync"]
  assert run["samples_per_s"] > 0 and run["predicted_samples_per_s"] > 0
  assert 0 <= run["accuracy"] <= 1
  for eta, point in summary["sweep"].items():
    assert point["trained_tokens_per_s"] > 0 and point["generated_tokens_per_s"] > 0
    where = [point[k] for k in ("only_generator", "only_trainer", "both", "neither")]
    assert sum(where) == pytest.approx(1, abs=1e-3)
    assert point["sim_from_sync_samples_per_s_ratio"] > 0
  assert summary["sweep"]["0"]["trained_tokens_per_s_ratio"] == 1
  assert summary["sweep"]["1"]["trained_tokens_per_s_ratio"] > 0
  assert summary["matmul_gflops"] > 0 and summary["frozen"]
  for name in ("sync", "eta0", "eta1"):
    assert (tmp_path / f"timeline_{name}.png").stat().st_size > 0
    trace = json.loads((tmp_path / f"trace_{name}.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert lanes == {"generator", "trainer"}
  assert "sync " in stdout and "eta1 " in stdout  # the tables


def test_staleness_ablation_runs_the_grid_and_resumes(tmp_path):
  args = ("--quick", "--steps=2", "--heldout=6", "--longest=2", f"--out_dir={tmp_path}")
  _, summary = _run("benchmarks.staleness_ablation", *args)
  rows = [json.loads(l) for l in (tmp_path / "runs.jsonl").read_text().splitlines()]
  before, runs = rows[0], rows[1:]
  assert before["prox_logp"] == "warm_start"
  # η ∈ {0, 2} × three proximal policies, η = 0 once: four runs of the same trained samples.
  assert {r["steps"] for r in runs} == {2}
  assert [(r["prox_logp"], r["eta"]) for r in runs] == [
      ("recompute", 0), ("behav", 2), ("recompute", 2), ("loglinear", 2)]
  assert all(r["staleness_max"] <= r["eta"] for r in runs)
  assert all(0 <= r[k] <= 1 for r in rows for k in ("accuracy", "accuracy_longest"))
  cells = summary["cells"]
  assert set(cells) == {f"{p}/{eta}" for p in ("behav", "recompute", "loglinear")
                        for eta in ("0", "2")}
  # η = 0's run fills the three rows; one seed gives a mean and no sd.
  assert {cells[f"{p}/0"]["accuracy"] for p in ("behav", "recompute", "loglinear")} == {
      round(runs[0]["accuracy"], 4)}
  assert cells["behav/0"]["ran_as"] == "recompute" and cells["behav/2"]["ran_as"] == "behav"
  assert all(c["seeds"] == 1 and c["accuracy_sd"] is None for c in cells.values())
  assert (tmp_path / "staleness_ablation.png").stat().st_size > 0
  # A rerun finds every run done: it trains nothing and reports the same table.
  stdout, again = _run("benchmarks.staleness_ablation", *args)
  assert again["cells"] == summary["cells"]
  assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 5
  assert "[1/" not in stdout and "| behav (as recompute) | 0 | 1 |" in stdout


def test_memory_reads_the_compiler_and_its_flop_count_checks_out():
  # Remat on, so the recomputation term of the closed form is exercised too.
  stdout, summary = _run("benchmarks.memory", "--tokens=80,160", "--config.model.remat=True")
  assert set(summary["temp_gib"]) == {"80", "160"}
  assert summary["count_check"] < 1e-3
  breakdown = summary["flops_breakdown"]
  # The LM head's logits are scored again in the backward pass, chunked or not.
  assert breakdown["remat"] > 0 and breakdown["head_recompute"] > 0
  assert abs(sum(breakdown.values()) - summary["flops_ratio"]) < 1e-3
  assert "walk/closed form" in stdout  # the table
  assert "temp_gib_16bit" not in summary  # a float32 config


def test_memory_counts_a_bf16_step_with_16_bit_buffers_and_what_remat_saves():
  # Four layers wide enough that the weights outweigh the activations (and a layer
  # scan that stays a loop: one layer's is inlined, and XLA merges more).
  bf16 = ("--tokens=160", "--config.model.remat=True", "--config.model.dtype=bfloat16",
          "--config.model.param_dtype=bfloat16", "--config.model.n_layers=4",
          "--config.model.d_model=256", "--config.model.d_ff=1024")
  _, full = _run("benchmarks.memory", *bf16)
  _, saving = _run("benchmarks.memory", *bf16, "--saves=mlp_gate,qkv")
  for summary in (full, saving):
    assert summary["count_check"] < 1e-3
    # XLA:CPU widens bf16 slices of the layer scan (a float32 copy of the weights)
    # to float32; the float16 compile keeps them 16-bit.
    assert summary["temp_gib_16bit"]["160"] < summary["temp_gib"]["160"]
  # Saving values spares recomputation and costs memory.
  assert 0 < saving["flops_breakdown"]["remat"] < full["flops_breakdown"]["remat"]
  assert saving["flops_ratio"] < full["flops_ratio"]
  assert saving["temp_gib_16bit"]["160"] > full["temp_gib_16bit"]["160"]


def test_tool_use_scores_each_chain_length_through_the_workflow():
  stdout, summary = _run("benchmarks.tool_use", "--config.task.name=arithmetic_tool",
                         "--config.sft.steps=2", "--config.num_steps=2", "--per_length=2")
  assert summary["task"] == "arithmetic_tool" and summary["rl_steps"] == 2
  assert [r["terms"] for r in summary["by_length"]] == [2, 3]  # micro: task.max_terms = 3
  assert all(r["problems"] == 2 and 0 <= r["after_rl"] <= 1 for r in summary["by_length"])
  assert "| operands |" in stdout


def test_multi_turn_times_prefills_and_both_workflows():
  stdout, summary = _run("benchmarks.multi_turn", "--groups=2", "--reps=2", "--in_flight=1",
                         config=())
  assert summary["matmul_gflops"] > 0 and set(summary["prefill_ms"]) == {"16", "32", "64", "80"}
  assert summary["extend_ms"] > 0
  runs = summary["runs"]
  single, multi, in_slot = (runs[f"{name}/1"] for name in (
      "single_turn", "multi_turn", "multi_turn_in_slot"))
  assert single["turns"] == 1.0 and single["env_tokens"] == 0 and multi["turns"] > 1
  assert single["reprefill_share"] == 0 < multi["reprefill_share"]
  # The same seeded episodes either way; one group of 8 fits the 16 slots.
  assert in_slot["policy_tokens"] == multi["policy_tokens"] and in_slot["turns"] == multi["turns"]
  assert in_slot["in_slot_share"] == 1.0 and in_slot["evictions"] == 0
  assert multi["in_slot_share"] == 0.0 and set(runs) == {
      f"{name}/{k}" for name in ("single_turn", "multi_turn", "multi_turn_in_slot")
      for k in (1, 2)}


def test_grpo_step_times_the_workload_against_its_flop_floor():
  stdout, summary = _run("benchmarks.grpo_step", "--quick", config=())
  run = summary["variants"]["sync_naive"]
  assert set(summary["variants"]) == {"sync_naive"} and run["timed_steps"] == 1
  # Generation, then the train forward and backward: 4 forwards of 64 sequences of 16 + 64
  # tokens, 2 N + 4 L H E (p + 1) FLOPs each, N = 1,015,808 and L H E = 512.
  forward = 64 * (80 * 2 * 1_015_808 + 4 * 512 * sum(range(1, 81)))
  assert run["gen_flops"] == forward and run["train_flops"] == 3 * forward
  assert summary["floor_s"] == pytest.approx(4 * forward / (summary["matmul_gflops"] * 1e9),
                                             rel=1e-3)
  assert summary["sec_per_step"] == run["step_s"] and summary["floor_ratio"] > 1
  assert summary["floor_ratio"] == pytest.approx(summary["sec_per_step"] / summary["floor_s"],
                                                 rel=1e-3)
  assert 0 < run["gen_s"] < run["step_s"] and 0 < run["train_s"] < run["step_s"]
  # Every sample ran to exactly 64 new tokens (no stop id), all of them trained.
  assert list(run["completion_lengths"]) == ["64"] and run["completion_lengths"]["64"] >= 3 * 64
  assert run["trained_tokens"] == [64 * 64]
  assert 0 <= run["reward_mean"][0] <= run["reward_mean"][1] <= 1
  assert run["staleness_max"] == 0 and run["skipped_steps"] == 0
  assert "sync_naive " in stdout  # the table


def test_faults_survives_every_in_process_fault(tmp_path):
  # A 20 s stall timeout (45 by default): the in-process runs compile their engine
  # before they start, so it bounds the runs' own waits, not compiling under load.
  stdout, summary = _run("benchmarks.faults", "--quick", f"--out_dir={tmp_path}",
                         "--stall_timeout_s=20")
  assert summary["faults"] == {name: True for name in (
      "non_finite_step", "raising_reward", "hanging_reward", "stalled_generator",
      "truncated_checkpoint")}
  assert summary["injected"] == summary["survived"] == 5
  assert summary["lost_samples"] == 0 and summary["staleness_violations"] == 0
  # Reported within the 2 s soft deadline, give or take the watchdog's tick and load.
  assert summary["longest_unreported_wait_s"] < 4.0
  assert "in_process (" in stdout


def test_admission_deciles_split_tied_lengths_in_proportion():
  from benchmarks.admission import by_decile  # noqa: PLC0415 (a script's helper)
  one_each = [0] + [1] * 10  # ten samples, of lengths 1 to 10: one per decile
  assert by_decile(one_each, [0] * 10 + [1], one_each) == [0.0] * 9 + [1.0]
  # 5 samples of length 1 and 15 of length 2: the third decile takes half a sample of each.
  assert by_decile([0, 5, 15], [0, 5, 0], [0, 5, 15]) == [1.0, 1.0, 0.5] + [0.0] * 7


def test_the_peer_scripts_draw_the_workloads_prompts_and_tokenize_them_back():
  # benchmarks/peers/ runs the workload through TRL and Tunix in their own virtualenvs;
  # what they share with the library's run is checked here, where both are importable.
  # grpo_step is read in a subprocess: importing it here would define its absl flags a
  # second time beside those of the other benchmarks this process imports.
  pytest.importorskip("tokenizers")
  pytest.importorskip("transformers")
  spec = importlib.util.spec_from_file_location(
      "peer_workload", ROOT / "benchmarks" / "peers" / "peer_workload.py")
  peer = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(peer)
  library = subprocess.run([sys.executable, "-c", """if True:
      import json
      from benchmarks import grpo_step as g
      stream = g.RandomTokenTask(seed=7).stream()
      print(json.dumps(dict(
          prompts=[list(next(stream).tokens) for _ in range(40)],
          constants=[g.MODEL.vocab_size, g.PROMPT_LEN, g.NEW_TOKENS, g.FIRST_ID, g.INIT_STD,
                     g.PROMPTS, g.GROUP, g.WARMUP],
          reward=g.even_fraction("2 3 4 255", None))))"""],
      cwd=ROOT, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert library.returncode == 0, library.stderr[-3000:]
  library = json.loads(library.stdout.strip().splitlines()[-1])
  ids = peer.prompt_ids(7, 40)
  assert ids == library["prompts"]
  assert [peer.VOCAB, peer.PROMPT_LEN, peer.NEW_TOKENS, peer.FIRST_ID, peer.INIT_STD,
          peer.PROMPTS, peer.GROUP, peer.WARMUP] == library["constants"]
  tokenizer = peer.make_tokenizer()
  texts = [" ".join(map(str, p)) for p in ids]
  assert tokenizer(texts)["input_ids"] == ids
  assert tokenizer.eos_token_id == tokenizer.pad_token_id == peer.VOCAB
  assert peer.even_fraction([2, 3, 4, 255]) == library["reward"] == 0.5


@pytest.mark.parametrize("share_prefill", [False, True])
def test_the_generation_benchmarks_static_sampler_draws_the_pools_tokens(share_prefill):
  # benchmarks/generation.py compares the pool's speed with this sampler's on the same
  # tokens; it builds the cache itself, so it must follow the cache's layout.
  from benchmarks import generation as bench  # noqa: PLC0415 (a script's helper)
  cfg = two_layer_model(61)
  params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
  prompts_BP = np.random.default_rng(0).integers(3, 61, (2, 6), dtype=np.int32)
  requests = [Request(i, p.tolist(), n=2, sampling=SamplingParams(max_new_tokens=5, seed=i))
              for i, p in enumerate(prompts_BP)]
  sampling_N = jax.tree.map(lambda *x: np.stack(x), *[
      SlotSampling.create(r.sampling, r.sampling.seed, j) for r in requests for j in range(2)])
  static = bench._static_sampler(params, prompts_BP, sampling_N, cfg=cfg, new_tokens=5,
                                 share_prefill=share_prefill)
  engine = Engine(cfg, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=32)
  with GeneratorPool(engine, params) as pool:
    pooled = [s.completion_C for f in [pool.submit(r) for r in requests] for s in f.result()]
  np.testing.assert_array_equal(np.asarray(static), np.stack(pooled))
