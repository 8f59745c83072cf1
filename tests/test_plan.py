"""The capacity planner: the cost model's hand-computed cases, the search, the binary, and
the check against AReaL's published sync-vs-async speedups."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_rl import cli, config
from async_rl.models import memory
from async_rl.plan import costs, hardware, host, inputs, published, search
from async_rl.sim import simulate

ROOT = Path(__file__).parents[1]
# N = L (D (H + 2K) E + H E D + 3 D F) + D V = 2 (32768 + 16384 + 98304) + 32768.
_TINY = config.ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=32, d_ff=256, dtype="bfloat16", param_dtype="bfloat16")
_N = 327680
_HW = hardware.Hardware("toy", peak_flops=1e12, hbm_bw=1e9, hbm_bytes=1e9, nvlink_bw=1e8,
                        network_bw=1e7, link_latency_s=1e-5, decode_eff=0.5, mfu=0.5,
                        step_overhead_s=1e-3, source="round numbers")


def test_table_rows_are_sourced_and_physical():
  assert set(hardware.HARDWARE) == {"H800", "H100", "H200", "A100-80GB", "B200"}
  for hw in hardware.HARDWARE.values():
    assert hw.source and 0 < hw.decode_eff <= 1 and 0 < hw.mfu <= 1
    assert 0 < hw.step_overhead_s < 0.01
    assert hw.peak_flops > 1e14 and hw.hbm_bw > 1e12 and hw.nvlink_bw > hw.network_bw
  # One efficiency per kind, never per row: the Hopper parts share theirs, and every
  # kind the serving engine's step overhead.
  assert len({(h.decode_eff, h.mfu) for n, h in hardware.HARDWARE.items()
              if n in ("H800", "H100", "H200")}) == 1
  assert len({h.step_overhead_s for h in hardware.HARDWARE.values()}) == 1
  with pytest.raises(ValueError, match="unknown hardware 'H900'"):
    hardware.hardware("H900")


def test_host_is_measured():
  host = hardware.measure_host(size=128, reps=2, copy_bytes=2**22)
  assert host.name == "host" and host.peak_flops > 1e6 and host.hbm_bw > 1e6
  assert host.decode_eff == host.mfu == 1.0 and host.step_overhead_s == 0.0
  one = hardware.measure_cores({0}, size=128, reps=2, copy_bytes=2**22)
  assert one.name == "host cores [0]" and one.peak_flops > 1e6 and one.hbm_bw > 1e6


def test_decode_step_memory_bound_by_hand():
  assert costs.weight_bytes(_TINY) == 2 * _N
  assert costs.kv_bytes_per_token(_TINY) == 2 * 2 * 2 * 32 * 2
  dc = costs.decode_cost(_TINY, _HW, block_size=16)
  bw = 1e9 * 0.5
  assert dc.base == pytest.approx(1e-3 + 2 * _N / bw)  # the engine's step, then reads
  assert dc.per_token == pytest.approx(512 / bw)
  assert dc.per_slot == pytest.approx(7.5 * 512 / bw)  # half a block read past the end
  # 4 slots, 1000 live tokens: reads 655360 + 4 * 3840 + 1000 * 512 bytes.
  assert dc.step_s(4, 1000) == pytest.approx(1e-3 + (2 * _N + 4 * 3840 + 512_000) / bw)


def test_decode_step_compute_bound_by_hand():
  fast_memory = dataclasses.replace(_HW, hbm_bw=1e15, step_overhead_s=0.0)
  dc = costs.decode_cost(_TINY, fast_memory)
  rate = 1e12 * 0.5
  # 2 N per token for the matmuls, 4 L H E per cached key.
  assert dc.step_s(64, 6400) == pytest.approx((64 * 2 * _N + 6400 * 4 * 2 * 4 * 32) / rate)


def test_tensor_parallel_splits_reads_and_adds_all_reduces():
  one, two = costs.decode_cost(_TINY, _HW), costs.decode_cost(_TINY, _HW, tp=2)
  # The engine's step overhead is paid once, whatever the degree.
  assert two.base == pytest.approx(1e-3 + (one.base - 1e-3) / 2 + 2 * 2 * 1e-5)
  assert two.per_token == pytest.approx(one.per_token / 2)
  # Per slot and step: 2 all-reduces per layer of D bf16 values, ring: 2 (t-1)/t.
  assert two.per_slot == pytest.approx(one.per_slot / 2 + 2 * 2 * 1.0 * 128 * 2 / 1e8)
  four = costs.decode_cost(_TINY, _HW, tp=4)  # K = 2: keys and values split only twice
  assert four.per_token == pytest.approx(one.per_token / 2)


def test_prefill_train_publish_by_hand():
  rate = 1e12 * 0.5
  assert costs.prefill_s_per_token(_TINY, _HW, 100) == pytest.approx(
      (2 * _N + 2 * 256 * 100) / rate)
  # Sequences of 101 tokens: mean position 50; 6 N + 12 L H E (p + 1), and a third more
  # for the recomputed log-probs.
  per_token = 6 * _N + 12 * 256 * 51
  assert costs.train_s_per_token(_TINY, _HW, 101) == pytest.approx(per_token * 4 / 3 / rate)
  assert costs.train_s_per_token(_TINY, _HW, 101, recompute_logp=False) == pytest.approx(
      per_token / rate)
  n = _TINY.num_params()
  assert costs.publish_s(_TINY, _HW, crosses_nodes=True) == pytest.approx(2 * n / 1e7)
  assert costs.publish_s(_TINY, _HW, crosses_nodes=False) == pytest.approx(2 * n / 1e8)
  assert costs.train_sync_s(_TINY, _HW, 1, crosses_nodes=False) == 0.0
  assert costs.train_sync_s(_TINY, _HW, 4, crosses_nodes=False) == pytest.approx(
      6 * n * 3 / 4 / 1e8)



def test_measured_host_costs_by_hand():
  # A step of 1 ms at one slot and 1.7 ms at 8: 0.1 ms a slot, 0.9 ms fixed.
  base, per_slot = host.decode_line(1e-3, 1.7e-3, 8)
  assert (base, per_slot) == (pytest.approx(0.9e-3), pytest.approx(0.1e-3))
  assert host.decode_line(2e-3, 1.9e-3, 8) == (pytest.approx(1.9e-3), 0.0)  # noise: flat
  assert host.decode_line(0.1e-3, 1.7e-3, 8) == (0.0, pytest.approx(1.7e-3 / 8))  # too steep
  # 16 tokens in 50 ms, 32 in 90 ms: 2.5 ms a step, 10 ms of prefill.
  assert host.step_and_rest(0.05, 0.09, 16, 32) == (pytest.approx(2.5e-3), pytest.approx(0.01))
  assert host.step_and_rest(0.05, 0.04, 16, 32) == (pytest.approx(0.04 / 32), 0.0)  # noise
  with pytest.raises(ValueError, match="longer"):
    host.step_and_rest(0.05, 0.09, 16, 16)
  assert host.request_lengths(86, 8) == (40, 80)  # whole chunks of 8
  assert host.request_lengths(12, 8) == (6, 12)  # two chunks do not fit: single steps
  with pytest.raises(ValueError, match="two new tokens"):
    host.request_lengths(1, 8)
  # Quantiles: a batch of 4 from 1..100 takes the 13th, 38th, 63rd and 88th.
  assert host.quantile_lengths(range(100, 0, -1), 4) == [13, 38, 63, 88]
  assert host.quantile_lengths([7], 3) == [7, 7, 7]
  m = host.MeasuredCosts(decode_base=1e-3, decode_per_slot=1e-4, prefill_per_token=1e-5,
                         train_per_token=2e-4, source="by hand")
  w = search.Workload(_TINY, batch_groups=4, group_size=2, prompt_tokens=10,
                      max_new_tokens=40, length_dist="constant", length_median=40)
  p = search.Placement("sync", 1, 1, 1, 1, 8, 400, 0, "drain")
  cfg = search.sim_config(w, search.Cluster(_HW, 1, 1), p, m)
  assert (cfg.trainer_per_token, cfg.trainer_step_base) == (2e-4, 0.0)
  assert (cfg.decode_step_base, cfg.decode_step_per_slot, cfg.prefill_per_token) == (
      1e-3, 1e-4, 1e-5)
  assert cfg.decode_compute_per_slot == cfg.decode_step_per_context_token == 0.0
  assert cfg.weight_sync == search.sim_config(w, search.Cluster(_HW, 1, 1), p).weight_sync


def test_memory_uses_the_memory_module_counts():
  gen = config.GenerationConfig(kv_blocks=64, kv_block_size=16, max_prompt_len=1,
                                max_new_tokens=16)
  ref = memory.estimate_memory(config.ExperimentConfig(model=_TINY, generation=gen))
  m = costs.memory_per_device(_TINY, kv_tokens=1024, tp=2, fsdp=4)
  assert m["generator"] == pytest.approx(ref["params"] / 2 + ref["kv_cache"] / 2)
  assert m["trainer"] == pytest.approx(ref["trainer"] / 4)
  bare = costs.memory_per_device(_TINY, kv_tokens=0, train_tokens_per_mb=10)
  assert bare["generator"] == ref["params"]
  # Under remat: each layer's input (L D) and one layer's q, k, v, output and MLP widths.
  width = 2 * 128 + (4 + 2 * 2 + 4) * 32 + 3 * 256
  assert bare["trainer"] == ref["trainer"] + 10 * width * 2


def _workload(**kw):
  base = dict(model=config.model_preset("qwen2.5-1.5b"), batch_groups=16, group_size=8,
              prompt_tokens=256, max_new_tokens=4096, length_median=1024, length_sigma=1.0)
  base.update(kw)
  return search.Workload(**base)


def test_candidates_fit_and_memory_prunes():
  w = _workload()
  cluster = search.Cluster(hardware.HARDWARE["H100"], 1, 8)
  cands = search.candidates(w, cluster, mode="async", etas=(4,), update_modes=("retract",))
  assert cands and all(search.fits(w, cluster, p) for p in cands)
  assert all(p.gen_devices + p.train_devices == 8 and p.gen_devices % p.tp == 0
             for p in cands)
  assert all(p.kv_tokens <= p.slots * (256 + 4096) for p in cands)
  sync = search.candidates(w, cluster, mode="sync")
  assert sync and all(p.max_staleness == 0 and p.gen_devices == 8 for p in sync)
  small = search.Cluster(dataclasses.replace(hardware.HARDWARE["H100"], hbm_bytes=4e9), 1, 8)
  assert search.candidates(_workload(model=config.model_preset("qwen2.5-7b")), small,
                           mode="async") == []


def test_predict_long_tail_async_beats_sync_and_keeps_the_bound():
  w = _workload(length_sigma=1.5)
  cluster = search.Cluster(hardware.HARDWARE["H100"], 1, 8)
  kv = search.max_kv_tokens(w, cluster, tp=1, fsdp=8, sync=True)
  sync = search.Placement("sync", 8, 1, 8, 8, 64, kv, 0, "drain")
  asyn = search.Placement("async", 6, 1, 2, 2, 64, kv, 2, "retract")
  rs, ra = search.predict(w, cluster, sync, steps=4), search.predict(w, cluster, asyn, steps=4)
  assert ra.samples_per_s > rs.samples_per_s
  assert len(ra.staleness_hist) <= 3 and rs.staleness_mean == 0
  assert rs.memory_per_device == pytest.approx(rs.generator_memory + rs.trainer_memory)
  assert 0 < ra.slot_occupancy <= 1 and sum(ra.generator_shares.values()) == pytest.approx(1)
  # The simulated system is the placement's, at the table's costs.
  cfg = search.sim_config(w, cluster, asyn)
  assert (cfg.num_generators, cfg.trainer_accelerators, cfg.kv_tokens) == (6, 2, kv)
  assert len(simulate(cfg, 2).step_end_times) == 2


@pytest.mark.parametrize("row", published.AREAL_TABLE1, ids=lambda r: r.preset)
def test_areal_table1_speedup_within_20_percent(row):
  rs, ra = published.predict_pair(row)
  predicted = ra.samples_per_s / rs.samples_per_s
  assert predicted == pytest.approx(row.speedup, rel=0.2), (predicted, row.speedup)


def test_read_model_and_lengths(tmp_path):
  assert inputs.read_model("qwen2.5-7b") == config.model_preset("qwen2.5-7b")
  assert inputs.read_model(str(ROOT / "configs" / "qwen2_5.py")).d_model == 1536
  assert inputs.read_model(str(ROOT / "configs" / "qwen2_5.py") + ":7b").d_model == 3584
  hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=512, hidden_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True, max_position_embeddings=1024, torch_dtype="bfloat16")
  (tmp_path / "config.json").write_text(json.dumps(hf))
  assert inputs.read_model(str(tmp_path)).d_model == 64
  with pytest.raises(ValueError, match="--model: 'nope'"):
    inputs.read_model("nope")
  assert inputs.read_lengths("lognormal:500:0.5") == dict(
      length_dist="lognormal", length_median=500.0, length_sigma=0.5)
  (tmp_path / "hist.txt").write_text("10 2\n30 1\n")
  assert inputs.read_lengths(f"file:{tmp_path}/hist.txt")["length_samples"] == (10, 10, 30)
  run = tmp_path / "run"
  run.mkdir()
  line = {"lengths": {"generated": {"n": 9, "p50": 100, "p90": 200}}}
  (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
  got = inputs.read_lengths(f"workdir:{run}")
  assert got["length_median"] == 100 and got["length_sigma"] == pytest.approx(0.5409, abs=1e-4)
  with pytest.raises(ValueError, match="--lengths"):
    inputs.read_lengths("zipf:1")


def test_binary_ranks_and_writes_a_config_train_loads(tmp_path):
  out_cfg = tmp_path / "planned.py"
  out = subprocess.run(
      [sys.executable, "-m", "launch.plan", "--model=qwen2.5-0.5b", "--hardware=H100",
       "--batch_groups=8", "--group_size=4", "--prompt_tokens=128", "--max_new_tokens=1024",
       "--lengths=lognormal:256:0.8", "--top=1", "--etas=2", f"--write_config={out_cfg}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert any(line.split()[1:2] == ["sync"] for line in lines[2:])
  assert any(line.split()[1:2] == ["async"] for line in lines[2:])
  # launch.train's loader: the file's get_config(), converted by cli.from_dict.
  spec = importlib.util.spec_from_file_location("planned", out_cfg)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = cli.from_dict(module.get_config())
  assert cfg.model == dataclasses.replace(config.model_preset("qwen2.5-0.5b"),
                                          max_seq_len=cfg.model.max_seq_len)
  assert cfg.generation.max_new_tokens == 1024 and cfg.batch_groups == 8


def test_estimate_ranks_splits_as_the_simulator_does():
  w = _workload(batch_groups=32, max_new_tokens=8192)
  cluster = search.Cluster(hardware.HARDWARE["H100"], 1, 8)
  est, sim = [], []
  for gen in (4, 6, 7):  # generation-bound, balanced, trainer-bound
    kv = search.max_kv_tokens(w, cluster, tp=1, fsdp=8 - gen, sync=False)
    p = search.Placement("async", gen, 1, 8 - gen, 8 - gen, 128, min(kv, 128 * 8448), 4,
                         "retract")
    est.append(search.estimate_samples_per_s(w, cluster, p))
    sim.append(search.predict(w, cluster, p, steps=5).samples_per_s)
  assert sorted(range(3), key=est.__getitem__) == sorted(range(3), key=sim.__getitem__)
  # At or above the simulation: it takes the slots as full and leaves out the pipeline's stalls.
  assert all(s <= e <= 1.5 * s for e, s in zip(est, sim))


def test_measure_times_the_runs_own_engine_and_trainer():
  # The micro config's engine and trainer, in this process: no cost below zero, a decode
  # step and a trained token each a positive time (under a second).
  from rl_test_utils import small_config  # noqa: PLC0415
  cfg = small_config()
  m = host.measure(cfg, prompt_tokens=4, lengths=[1, 3, 6, 6, 9], reps=1)
  full_step = m.decode_base + m.decode_per_slot * cfg.generation.num_slots
  assert m.decode_base >= 0 and m.decode_per_slot >= 0 and full_step > 0
  assert m.prefill_per_token >= 0 and 0 < m.train_per_token < 1
  assert "engine" in m.source and "trainer" in m.source
