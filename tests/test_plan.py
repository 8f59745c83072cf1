"""The capacity planner: the cost model's hand-computed cases, the synchronous forms, the
search, the band, the binary, and the checks against AReaL's published measurements."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from async_rl import cli, config
from async_rl.models import memory
from async_rl.plan import band, costs, hardware, host, inputs, published, search
from async_rl.sim import DecodeCost, engine, simulate
from async_rl.trajectory import Group, Trajectory

ROOT = Path(__file__).parents[1]
# N = L (D (H + 2K) E + H E D + 3 D F) + D V = 2 (32768 + 16384 + 98304) + 32768.
_TINY = config.ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=32, d_ff=256, dtype="bfloat16", param_dtype="bfloat16")
_N = 327680
_EFF = hardware.Efficiency(matmul=((1e5, 0.5), (1e7, 0.5)), attention=0.5, decode_read=0.5,
                           step_overhead_s=1e-3, source="round numbers")
_HW = hardware.Hardware("toy", peak_flops=1e12, hbm_bw=1e9, hbm_bytes=1e9, nvlink_bw=1e8,
                        network_bw=1e7, host_link_bw=1e6, link_latency_s=1e-5,
                        efficiency=_EFF, source="round numbers")


def test_table_rows_are_sourced_and_physical():
  assert set(hardware.HARDWARE) == {"H800", "H100", "H200", "A100-80GB", "B200"}
  for hw in hardware.HARDWARE.values():
    e = hw.efficiency
    assert hw.source and e.source and 0 < e.attention <= 1 and 0 < e.decode_read <= 1
    assert all(0 < eff <= 1 for _, eff in e.matmul) and 0 < e.step_overhead_s < 0.01
    assert hw.peak_flops > 1e14 and hw.hbm_bw > 1e12 and hw.nvlink_bw > hw.network_bw
    assert hw.network_bw >= hw.host_link_bw / 2 and hw.host_link_bw >= 32e9
  # Efficiencies per architecture, never per row: the Hopper parts share theirs, and
  # every kind the serving engine's decode figures.
  assert {hardware.HARDWARE[n].efficiency for n in ("H800", "H100", "H200")} == {
      hardware.HOPPER}
  assert len({(h.efficiency.decode_read, h.efficiency.step_overhead_s)
              for h in hardware.HARDWARE.values()}) == 1
  with pytest.raises(ValueError, match="unknown hardware 'H900'"):
    hardware.hardware("H900")


def test_matmul_efficiency_grows_with_the_gemms_a_device_runs():
  # Megatron-LM's H100 points: 41% at 2B params, 47.5% at 462B, log-linear between.
  h800 = hardware.HARDWARE["H800"]
  assert costs.matmul_eff(h800, 2e9) == pytest.approx(0.41)
  assert costs.matmul_eff(h800, 462e9) == pytest.approx(0.475)
  mid = 2e9 * (462 / 2) ** 0.5  # halfway in log
  assert costs.matmul_eff(h800, mid) == pytest.approx((0.41 + 0.475) / 2)
  assert costs.matmul_eff(h800, 0.5e9) < 0.41 < 0.475 < costs.matmul_eff(h800, 1e13) < 1
  assert costs.matmul_eff(h800, 1.0) >= 0.1  # bounded below, however small the share
  # Tensor parallelism splits the matmuls: a 7B prefill at TP 8 runs smaller GEMMs.
  model = config.model_preset("qwen2.5-7b")
  one, eight = (costs.prefill_s_per_token(model, h800, 1024, tp=t) for t in (1, 8))
  assert eight * 8 > one


def test_host_is_measured():
  host = hardware.measure_host(size=128, reps=2, copy_bytes=2**22)
  assert host.name == "host" and host.peak_flops > 1e6 and host.hbm_bw > 1e6
  assert host.efficiency == hardware.MEASURED and host.efficiency.step_overhead_s == 0.0
  one = hardware.measure_cores({0}, size=128, reps=2, copy_bytes=2**22)
  assert one.name == "host cores [0]" and one.peak_flops > 1e6 and one.hbm_bw > 1e6
  assert one.efficiency == hardware.MEASURED


def test_decode_step_memory_bound_by_hand():
  assert costs.weight_bytes(_TINY) == 2 * _N
  assert costs.kv_bytes_per_token(_TINY) == 2 * 2 * 2 * 32 * 2
  dc = costs.decode_cost(_TINY, _HW, tp=1, block_size=16)
  bw = 1e9 * 0.5
  assert dc.base == pytest.approx(1e-3 + 2 * _N / bw)  # the engine's step, then reads
  assert dc.per_token == pytest.approx(512 / bw)
  assert dc.per_slot == pytest.approx(7.5 * 512 / bw)  # half a block read past the end
  # 4 slots, 1000 live tokens: reads 655360 + 4 * 3840 + 1000 * 512 bytes.
  assert dc.step_s(4, 1000) == pytest.approx(1e-3 + (2 * _N + 4 * 3840 + 512_000) / bw)


def test_decode_step_compute_bound_by_hand():
  fast_memory = dataclasses.replace(_HW, hbm_bw=1e15, efficiency=dataclasses.replace(
      _EFF, step_overhead_s=0.0))
  dc = costs.decode_cost(_TINY, fast_memory, tp=1, block_size=16)
  rate = 1e12 * 0.5
  # 2 N per token for the matmuls, 4 L H E per cached key.
  assert dc.step_s(64, 6400) == pytest.approx((64 * 2 * _N + 6400 * 4 * 2 * 4 * 32) / rate)


def test_tensor_parallel_splits_reads_and_adds_all_reduces():
  one, two = (costs.decode_cost(_TINY, _HW, tp=t, block_size=16) for t in (1, 2))
  # The engine's step overhead is paid once, whatever the degree.
  assert two.base == pytest.approx(1e-3 + (one.base - 1e-3) / 2 + 2 * 2 * 1e-5)
  assert two.per_token == pytest.approx(one.per_token / 2)
  # Per slot and step: 2 all-reduces per layer of D bf16 values, ring: 2 (t-1)/t.
  assert two.per_slot == pytest.approx(one.per_slot / 2 + 2 * 2 * 1.0 * 128 * 2 / 1e8)
  four = costs.decode_cost(_TINY, _HW, tp=4, block_size=16)  # K = 2: keys and values split twice
  assert four.per_token == pytest.approx(one.per_token / 2)


def test_prefill_train_publish_by_hand():
  rate = 1e12 * 0.5
  assert costs.prefill_s_per_token(_TINY, _HW, 100, tp=1) == pytest.approx(
      (2 * _N + 2 * 256 * 100) / rate)
  # Tokens reading 51 keys on average: 6 N + 12 L H E keys, and a third more for the
  # recomputed log-probs.
  per_token = 6 * _N + 12 * 256 * 51
  assert costs.train_s_per_token(_TINY, _HW, 51) == pytest.approx(per_token * 4 / 3 / rate)
  assert costs.train_s_per_token(_TINY, _HW, 51, recompute_logp=False) == pytest.approx(
      per_token / rate)
  # Attention slower than the matmuls: each part at its own efficiency.
  slow = dataclasses.replace(_HW, efficiency=dataclasses.replace(_EFF, attention=0.25))
  assert costs.train_s_per_token(_TINY, slow, 51, recompute_logp=False) == pytest.approx(
      (6 * _N / 0.5 + 12 * 256 * 51 / 0.25) / 1e12)
  n = _TINY.num_params()
  assert costs.publish_s(_TINY, _HW, crosses_nodes=True) == pytest.approx(2 * n / 1e7)
  assert costs.publish_s(_TINY, _HW, crosses_nodes=False) == pytest.approx(2 * n / 1e8)
  assert costs.train_sync_s(_TINY, _HW, 1, crosses_nodes=False) == 0.0
  assert costs.train_sync_s(_TINY, _HW, 4, crosses_nodes=False) == pytest.approx(
      6 * n * 3 / 4 / 1e8)
  # Releasing the generator: the trainer's state (params, 2 moments, float32 gradients:
  # 2 + 4 + 4 bytes a param in bf16) out to the host and back, per FSDP shard.
  assert costs.swap_s(_TINY, _HW, fsdp=4) == pytest.approx(2 * 10 * n / 4 / 1e6)


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
  m = costs.MeasuredCosts(decode_base=1e-3, decode_per_slot=1e-4, prefill_per_token=1e-5,
                          train_per_token=2e-4, source="by hand")
  w = search.Workload(_TINY, batch_groups=4, group_size=2, prompt_tokens=10,
                      max_new_tokens=40, length_dist="constant", length_median=40)
  p = search.Placement("sync", 1, 1, 1, 1, 8, 400, 0, "drain")
  cfg = search.sim_config(w, search.Cluster(_HW, 1, 1), p, m)
  assert (cfg.trainer_per_token, cfg.trainer_step_base) == (2e-4, 0.0)
  assert cfg.decode == DecodeCost(base=1e-3, per_slot=1e-4) and cfg.prefill_per_token == 1e-5
  assert cfg.weight_sync == search.sim_config(w, search.Cluster(_HW, 1, 1), p).weight_sync


def test_memory_uses_the_memory_module_counts():
  gen = config.GenerationConfig(kv_blocks=64, kv_block_size=16, max_prompt_len=1,
                                max_new_tokens=16)
  ref = memory.estimate_memory(config.ExperimentConfig(model=_TINY, generation=gen))
  m = costs.memory_per_device(_TINY, kv_tokens=1024, block_size=16, tp=2, fsdp=4)
  assert m["generator"] == pytest.approx(ref["params"] / 2 + ref["kv_cache"] / 2)
  assert m["trainer"] == pytest.approx(ref["trainer"] / 4)
  bare = costs.memory_per_device(_TINY, kv_tokens=0, block_size=16, train_tokens_per_mb=10)
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
  assert {p.form for p in sync} == {"sync, resident", "sync, offload"}
  small = search.Cluster(dataclasses.replace(hardware.HARDWARE["H100"], hbm_bytes=4e9), 1, 8)
  assert search.candidates(_workload(model=config.model_preset("qwen2.5-7b")), small,
                           mode="async") == []


def test_predict_long_tail_async_beats_sync_and_keeps_the_bound():
  w = _workload(length_sigma=1.5)
  cluster = search.Cluster(hardware.HARDWARE["H100"], 1, 8)
  kv = search.max_kv_tokens(w, cluster, tp=1, fsdp=8, form="sync, resident")
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
  w, c, sync, asyn = published.table1_setup(row)
  rs, ra = (search.predict_scaled(w, c, p, max_simulated_samples=512) for p in (sync, asyn))
  predicted = ra.samples_per_s / rs.samples_per_s
  assert predicted == pytest.approx(row.speedup, rel=0.2), (predicted, row.speedup)
  if row.preset == "qwen2.5-1.5b":  # and its hours, each side
    hours = [r.step_s * published.TABLE1_STEPS / 3600 for r in (rs, ra)]
    assert hours == pytest.approx([row.sync_hours, row.async_hours], rel=0.3), hours


def test_areal_table7_jumps_from_eta_0_to_1_then_stays_nearly_flat():
  tokens = {}
  for eta, _ in published.AREAL_TABLE7:
    w, c, p = published.table7_setup(eta)
    tokens[eta] = search.predict_scaled(w, c, p, max_simulated_samples=512).trained_tokens_per_s
  after = [tokens[eta] for eta in tokens if eta > 0]
  # Published: 1.76x from η 0 to 1, then within 9% up to η 16.
  assert tokens[1] / tokens[0] > 1.5
  assert max(after) / min(after) < 1.15


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
  assert any(line.split()[1:2] == ["sync,"] for line in lines[2:])
  assert any(line.split()[1:2] == ["async"] for line in lines[2:])
  # The band: the assumptions swept, a recommendation, the speedup's range.
  assert any("over the band (length spread, slots per engine, memory fraction, TP degree"
             in line for line in lines)
  assert sum(line.rstrip().endswith("recommended") for line in lines) == 1
  assert any(line.startswith("async over the best synchronous placement") and "moved most by"
             in line for line in lines)
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
    kv = search.max_kv_tokens(w, cluster, tp=1, fsdp=8 - gen, form="async")
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

  from async_rl import sharding  # noqa: PLC0415
  from async_rl.rl import build  # noqa: PLC0415
  cfg = small_config()
  mesh = sharding.make_mesh(cfg.mesh)
  m = host.measure(cfg, trainer=build.make_trainer(cfg, mesh),
                   open_pool=lambda: build.make_pool([build.make_engine(cfg)],
                                                     build.random_params(cfg, mesh)),
                   prompt_tokens=4, lengths=[1, 3, 6, 6, 9], reps=1)
  full_step = m.decode_base + m.decode_per_slot * cfg.generation.num_slots
  assert m.decode_base >= 0 and m.decode_per_slot >= 0 and full_step > 0
  assert m.prefill_per_token >= 0 and 0 < m.train_per_token < 1
  assert "engine" in m.source and "trainer" in m.source


def test_sync_offload_releases_the_generator_while_the_trainer_runs():
  # A 7B on one node, of whose memory 45% is usable: resident, the generator's KV
  # cache shares each device with the trainer's state; released, it has the device to
  # itself, and the trainer's state crosses the host link twice a step.
  w = _workload(model=config.model_preset("qwen2.5-7b"), batch_groups=32,
                max_new_tokens=16384, length_median=8192)
  cluster = search.Cluster(hardware.HARDWARE["H800"], 1, 8, memory_fraction=0.45)
  kv = {form: search.max_kv_tokens(w, cluster, tp=2, fsdp=8, form=form)
        for form in ("sync, resident", "sync, offload", "async")}
  assert kv["sync, offload"] == kv["async"] > kv["sync, resident"]
  trainer = costs.memory_per_device(w.model, kv_tokens=0, block_size=16, fsdp=8,
                                    train_tokens_per_mb=w.train_tokens_per_mb)["trainer"]
  per_token = costs.kv_bytes_per_token(w.model) / 2
  assert kv["sync, offload"] - kv["sync, resident"] == pytest.approx(trainer / per_token,
                                                                     abs=16)
  resident = search.Placement("sync", 8, 2, 8, 8, 16, kv["sync, resident"], 0, "drain")
  offload = dataclasses.replace(resident, offload=True, kv_tokens=kv["sync, offload"])
  assert offload.form == "sync, offload" and search.fits(w, cluster, offload)
  assert not search.fits(w, cluster, dataclasses.replace(resident, kv_tokens=kv["async"]))
  base = {p.form: search.sim_config(w, cluster, p).trainer_step_base for p in (resident, offload)}
  assert base["sync, offload"] - base["sync, resident"] == pytest.approx(
      costs.swap_s(w.model, cluster.hardware, fsdp=8))
  rr, ro = (search.predict(w, cluster, p, steps=4) for p in (resident, offload))
  assert ro.memory_per_device == pytest.approx(max(ro.generator_memory, ro.trainer_memory))
  assert rr.memory_per_device == pytest.approx(rr.generator_memory + rr.trainer_memory)
  # 16 slots fit either cache: the same events, each step longer by the swap...
  assert rr.preempted_per_step == ro.preempted_per_step == 0
  assert ro.step_s - rr.step_s == pytest.approx(costs.swap_s(w.model, cluster.hardware, fsdp=8))
  # ...64 fill the resident one: the larger cache outweighs the swap.
  rr, ro = (search.predict(w, cluster, dataclasses.replace(p, slots=64), steps=4)
            for p in (resident, offload))
  assert rr.preempted_per_step > ro.preempted_per_step == 0
  assert ro.samples_per_s > rr.samples_per_s


@pytest.mark.parametrize("size", sorted(published.QWEN25_CONFIGS))
def test_every_size_has_sync_and_async_placements_on_8_to_64_h800_nodes(size, tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(published.QWEN25_CONFIGS[size]))
  model = inputs.read_model(str(tmp_path / "config.json"))
  w = dataclasses.replace(published.areal_workload("qwen2.5-1.5b"), model=model)
  for nodes in (8, 64):
    cluster = published.areal_cluster(nodes)
    for mode in ("sync", "async"):
      assert search.candidates(w, cluster, mode=mode, etas=(4,), update_modes=("retract",),
                               slots=(128,)), (size, nodes, mode)
  if size == "32b":  # on 48 nodes, the trainer fits only sharded across nodes
    sync = search.candidates(w, published.areal_cluster(48), mode="sync", slots=(128,))
    assert sync and min(p.fsdp for p in sync) > 8
    assert {p.form for p in sync} == {"sync, resident", "sync, offload"}


def test_the_band_sweeps_each_assumption_and_recommends_the_best_worst_case():
  w = _workload(model=config.model_preset("qwen2.5-0.5b"), batch_groups=8, group_size=4,
                max_new_tokens=2048, length_median=512)
  cluster = search.Cluster(hardware.HARDWARE["H100"], 1, 8)
  results = search.search(w, cluster, top=2, etas=(2,), update_modes=("retract",),
                          max_simulated_samples=32, steps=4)
  rec = band.recommend(w, cluster, results, top=2, steps=4, max_simulated_samples=32)
  cases = rec.band.scenarios
  assert cases[0].assumption == "" and len(cases) == 1 + 2 * len(band.ASSUMPTIONS)
  assert [c.value for c in cases if c.assumption == band.LENGTH_SPREAD] == [
      "log-sd 0.80", "log-sd 1.25"]
  assert [c.cluster.memory_fraction for c in cases if c.assumption == band.MEMORY_FRACTION] == [
      pytest.approx(search.MEMORY_FRACTION - 0.1), pytest.approx(search.MEMORY_FRACTION + 0.1)]
  for name, (lo, mid, hi) in rec.ranges.items():
    assert lo <= mid <= hi and lo < hi, name  # the band is a range around the nominal
    assert mid == rec.band.nominal[name].samples_per_s
  worst = {name: lo for name, (lo, _, _) in rec.ranges.items()}
  assert worst[rec.best] == max(worst.values())
  assert rec.best_sync.startswith("sync") and rec.best_async.startswith("async")
  assert set(rec.close) == {k for k, r in rec.ranges.items() if k != rec.best
                            and r[2] >= rec.ranges[rec.best][0]}
  f = band.speedup(rec.best_async, rec.best_sync)
  lo, hi = rec.band.range(f)
  moved, mlo, mhi = rec.band.most(f)
  assert lo <= f(rec.band.nominal) <= hi and moved in band.ASSUMPTIONS
  assert lo <= mlo <= mhi <= hi
  spans = {a: [v for c, v in rec.band.values(f) if c.assumption in ("", a)]
           for a in band.ASSUMPTIONS}
  assert max(spans[moved]) - min(spans[moved]) == max(
      max(v) - min(v) for v in spans.values() if v)


def test_compact_groups_recommend_as_per_token_groups(monkeypatch):
  """The simulator hands the buffer a group as one token of each of its versions;
  per-token groups (how it ran before) must give the same search, prediction for
  prediction."""
  w = _workload(model=config.model_preset("qwen2.5-0.5b"), batch_groups=8, group_size=4,
                max_new_tokens=2048, length_median=512, length_sigma=1.5)
  cluster = search.Cluster(hardware.HARDWARE["H100"], 1, 8)

  def run():
    return search.search(w, cluster, top=2, etas=(1, 2), max_simulated_samples=32, steps=5)

  compact = run()

  def per_token(group):
    def sample(s):
      versions = np.repeat([v for v, _ in s.versions], [n for _, n in s.versions])
      return Trajectory.from_completion(np.zeros(1, np.int32), np.zeros(s.length, np.int32),
                                        np.zeros(s.length, np.float32), versions, "length",
                                        reward=0.0)
    return Group(None, tuple(sample(s) for s in group.samples))

  monkeypatch.setattr(engine, "_scored", per_token)
  assert run() == compact
  assert any(r.staleness_mean > 0 for r in compact["async"])  # versions did mix
