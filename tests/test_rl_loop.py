"""End-to-end in-process runs: async and sync, metrics, staleness bound, failing rewards,
what the run logs and prints."""

import io
import json
import re
import sys
import threading
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from async_rl import cpu, sharding
from async_rl.config import MeshConfig
from async_rl.generation import Engine
from async_rl.rl import build, entry
from async_rl.rl.errors import ConfigError
from async_rl.rl.evaluate import Evaluator
from async_rl.trajectory import Group, Trajectory
from rl_test_utils import small_config


def _lines(workdir, name="metrics.jsonl"):
  return [json.loads(l) for l in (Path(workdir) / name).read_text().splitlines()]


def _steps(workdir):
  """The training steps' lines and the evaluations' (not the warm start's)."""
  lines = [l for l in _lines(workdir) if "sft" not in l]
  return [l for l in lines if "eval" not in l], [l for l in lines if "eval" in l]


@pytest.mark.parametrize("eta, mode", [(1, "retract"), (0, "drain"), (2, "keep")])
def test_run_trains_within_the_staleness_bound(tmp_path, eta, mode):
  cfg = small_config(**{"staleness.max_staleness": eta, "generation.update_mode": mode})
  summary = entry.run(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert summary["end_version"] == 3
  steps, evals = _steps(tmp_path)
  assert [s["step"] for s in steps] == [1, 2, 3]
  assert len(evals) == 2 and "accuracy" in evals[0]["eval"]
  for s in steps:
    assert s["staleness_max"] <= eta
    assert s["trained_tokens"] > 0 and s["skipped"] == 0
    assert s["server"]["version"] == s["step"]
    assert 0.0 <= s["reward_mean"] <= 1.0
  spans = summary["timeline"]
  train = [s for s in spans if s.name == "train"]
  assert len(train) == 3 and all(s.lane == "trainer" for s in train)
  assert all(a.end <= b.start for a, b in zip(train, train[1:]))
  decode = [s for s in spans if s.lane == "generator" and s.name == "decode"]
  assert decode and decode[0].start < train[0].start
  assert (tmp_path / "config.json").exists()
  assert list((tmp_path / "tensorboard").glob("events.*"))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())[-1] == "3"


def test_periodic_evaluations_and_the_final_one_evaluate_each_version_once(tmp_path,
                                                                           monkeypatch):
  engines, make_engine = [], build.make_engine

  def counting(cfg, devices=None, base=None):
    engines.append(make_engine(cfg, devices, base=base))
    return engines[-1]

  monkeypatch.setattr(build, "make_engine", counting)
  cfg = small_config(**{"num_steps": 2, "eval.every_steps": 1})
  summary = entry.run(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert len(engines) == 1, "the held-out and rollout pools share one engine"
  _, evals = _steps(tmp_path)
  assert [e["step"] for e in evals] == [0, 1, 2]
  assert summary["eval_before"] == evals[0]["eval"]
  assert summary["eval_after"] == evals[-1]["eval"]
  assert len([s for s in summary["timeline"] if s.name == "eval"]) == 3


def test_a_reward_function_that_raises_scores_zero_and_the_run_goes_on(tmp_path):
  cfg = small_config(**{"rollout.reward_fn": "reward_fns_for_tests:raises",
                        "num_steps": 2})
  lines = []
  summary = entry.run(cfg, str(tmp_path), progress=False, echo=lines.append)
  assert summary["end_version"] == 2
  steps, evals = _steps(tmp_path)
  assert steps[-1]["rewards"]["errors"] >= 2 * 2 * 2
  assert all(s["reward_mean"] == 0.0 for s in steps)
  # Held-out rewards fail too, and are counted: per evaluation one greedy and pass_k
  # sampled completions of each prompt.
  per_eval = cfg.eval.num_prompts * (1 + cfg.eval.pass_k)
  assert [e["eval"]["rewards"]["errors"] for e in evals] == [per_eval, 2 * per_eval]
  assert [e["eval"]["rewards"]["calls"] for e in evals] == [per_eval, 2 * per_eval]
  assert sum(f"reward_errors={per_eval}" in line for line in lines if " eval v=" in line) == 1


def test_ppo_minibatches_with_the_loglinear_proximal_policy(tmp_path):
  cfg = small_config(**{"num_steps": 2, "ppo.num_minibatches": 2, "ppo.prox_logp": "loglinear",
                        "rollout.reward_fn": "reward_fns_for_tests:length"})
  summary = entry.run(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert summary["end_version"] == 2
  steps, _ = _steps(tmp_path)
  assert [s["applied_updates"] for s in steps] == [2, 2]
  assert [s["updates"] for s in steps] == [2, 4]
  assert [s["server"]["version"] for s in steps] == [1, 2], "the version counts steps"


def test_automatic_thread_counts_share_the_cores_between_generator_and_trainer(monkeypatch):
  # On the CPU the engine's slot groups and the trainer's gradient threads take half
  # the cores each by default, whatever the algorithm's settings.
  monkeypatch.setattr(cpu.threads, "cores", lambda: 4)
  assert cpu.default_threads() == 2
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  for eta in (0, 2):
    cfg = small_config(**{"staleness.max_staleness": eta, "generation.num_slots": 32})
    engine = build.make_engine(cfg)
    assert isinstance(engine, cpu.SlotGroupEngine) and engine.max_concurrent_decodes == 32
    assert engine._groups == 2
    assert build.make_trainer(cfg, mesh).steps.micro_batch_multiple == 2
  cfg = small_config(**{"cpu.decode_threads": 1, "cpu.grad_threads": 3})
  assert isinstance(build.make_engine(cfg), Engine)
  assert build.make_trainer(cfg, mesh).steps.micro_batch_multiple == 3
  # Several devices run their shares already; accelerators run one program.
  def fake_mesh(n, platform):
    return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)] * n))
  cfg = small_config()
  assert build.grad_threads(cfg, fake_mesh(2, "cpu")) == 1
  assert build.grad_threads(cfg, fake_mesh(1, "gpu")) == 1
  assert build.grad_threads(cfg, fake_mesh(1, "cpu")) == 2
  assert build.decode_groups(cfg, "gpu") == 1
  # Slot groups hold at least cpu.engine.MIN_GROUP_SLOTS slots each.
  assert [cpu.engine.num_groups(s, 4) for s in (64, 48, 24, 12, 8)] == [4, 4, 3, 1, 1]


def test_the_engines_kv_budget_splits_over_slot_groups_that_hold_a_sequence(monkeypatch):
  monkeypatch.setattr(cpu.threads, "cores", lambda: 4)
  base = {"generation.num_slots": 32, "generation.kv_block_size": 8}
  sequence = small_config(**base).generation.sequence_blocks
  # No budget: each of the 2 groups holds its 16 slots at full length.
  engine = build.make_engine(small_config(**base))
  assert engine._groups == 2 and engine.num_blocks == 16 * sequence
  # Three sequences' worth splits in two shares of 1.5 each.
  engine = build.make_engine(small_config(**base, **{"generation.kv_blocks": 3 * sequence}))
  assert engine._groups == 2 and engine.num_blocks == 3 * sequence // 2
  assert engine.block_size == 8 and engine.kv_cache_bytes == 2 * engine._engine.kv_cache_bytes
  # One sequence's worth cannot be split: one group.
  engine = build.make_engine(small_config(**base, **{"generation.kv_blocks": sequence}))
  assert isinstance(engine, Engine) and engine.num_blocks == sequence


def test_the_trainer_packs_into_a_shape_it_compiled_within_the_slack():
  # One trajectory of 22 tokens per row of 40 (320 tokens per micro-batch: at most 8
  # rows): 8 of them pack as [1, 8, 40]; then six of 22 and two of 10 (a 10 beside a
  # 22) need 6 rows, 0.75x the slots of [1, 8, 40], which a slack of 0.5 takes.
  def groups(lengths):
    return [Group(f"g{i}", [Trajectory.from_completion(
        np.arange(3, 9), np.full(n - 6, 5), np.zeros(n - 6), np.zeros(n - 6, np.int32),
        "stop", reward=float(k)) for k, n in enumerate(pair)])
            for i, pair in enumerate(zip(lengths[::2], lengths[1::2]))]

  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  shapes = {}
  for slack in (0.0, 0.5):
    trainer = build.make_trainer(small_config(**{"batching.max_tokens_per_mb": 320,
                                                 "batching.row_buckets": (40,),
                                                 "batching.reuse_slack": slack,
                                                 "cpu.grad_threads": 1}), mesh)
    shapes[slack] = [trainer.pack(groups(lengths)).tokens.shape
                     for lengths in ([22] * 8, [22] * 6 + [10] * 2)]
  assert shapes == {0.0: [(1, 8, 40), (1, 6, 40)], 0.5: [(1, 8, 40), (1, 8, 40)]}


def test_a_stop_during_the_first_evaluation_ends_it_and_checkpoints_version_0(
    tmp_path, monkeypatch):
  stop, lines = threading.Event(), []
  evaluate = Evaluator.evaluate

  def stopped_meanwhile(self, *args, **kwargs):
    stop.set()  # its waits (tests/test_deadlines.py) end as soon as they see it
    return evaluate(self, *args, **kwargs)

  monkeypatch.setattr(Evaluator, "evaluate", stopped_meanwhile)
  summary = entry.run(small_config(), str(tmp_path), stop=stop, progress=False,
                      echo=lines.append)
  assert summary["stopped"] and summary["eval_before"] is None
  assert (summary["end_version"], summary["checkpoint"]) == (0, 0)
  assert _steps(tmp_path) == ([], [])
  assert f"stopped at version 0: checkpoint 0 in {tmp_path / 'checkpoints'} holds it; rerun " \
         f"the same command to resume" in lines


def test_a_stop_before_the_run_is_built_writes_nothing(tmp_path):
  stop = threading.Event()
  stop.set()
  summary = entry.run(small_config(), str(tmp_path / "w"), stop=stop, progress=False,
                      echo=lambda _: None)
  assert summary == {"stopped": True} and not (tmp_path / "w").exists()


def test_the_log_holds_the_warm_start_learning_rates_and_samples_and_a_log_file_no_bar(
    tmp_path, monkeypatch):
  cfg = small_config(**{"num_steps": 2, "sft.steps": 2, "sft.batch_size": 4,
                        "sft.log_every": 1, "optimizer.warmup_steps": 2,
                        "optimizer.learning_rate": 1e-3,
                        "rollout.reward_fn": "reward_fns_for_tests:length",
                        "eval.correct_threshold": 1000.0, "log.samples_every": 1,
                        "log.num_samples": 4})  # micro: the batch's 2 groups of 2
  stderr, lines = io.StringIO(), []  # standard error is a log file, not a terminal
  monkeypatch.setattr(sys, "stderr", stderr)
  entry.run(cfg, str(tmp_path), progress=True, echo=lines.append)
  assert "\r" not in stderr.getvalue() and "train:" not in stderr.getvalue()

  # The warm start's lines come first (before RL: version 0), its learning rate warming
  # up over min(10, sft.steps) steps from 0; RL's over optimizer.warmup_steps updates.
  warm = [l["sft"] for l in _lines(tmp_path) if "sft" in l]
  assert [(w["step"], w["lr"]) for w in warm] == [(1, 0.0), (2, pytest.approx(5e-4))]
  assert all(0 < w["loss"] < 10 for w in warm)
  steps, _ = _steps(tmp_path)
  assert [s["lr"] for s in steps] == [0.0, pytest.approx(5e-4)]

  # The samples are the batch just trained: its rewards, and correctness by
  # eval.correct_threshold, which the accuracy counts too.
  samples = _lines(tmp_path, "samples.jsonl")
  for s in steps:
    batch = [x for x in samples if x["step"] == s["step"]]
    rewards = [x["reward"] for x in batch]
    assert len(batch) == 4 and {x["prompt_id"] for x in batch} == set(s["prompts"])
    assert s["reward_mean"] == pytest.approx(np.mean(rewards))
    assert s["accuracy"] == 0.0 and not any(x["correct"] for x in batch)
  assert any(x["reward"] >= 1 for x in samples), "acc would differ by reward >= 1"

  stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
  step_lines = [l for l in lines if re.match(stamp + "v=", l)]
  assert len(step_lines) == 2 and all(l.count(" train=") == 1 for l in step_lines)
  assert all(re.search(r" update=\d+\.\d\ds publish=", l) for l in step_lines)
  assert sum(bool(re.match(stamp + r"(sft step \d/2|eval v=\d:) ", l)) for l in lines) == 4


def test_weights_and_biases_asked_for_without_wandb_stops_the_run_before_it_is_built(
    tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  cfg = small_config(**{"log.wandb_project": "proj"})
  with pytest.raises(ConfigError, match=r"log\.wandb_project needs the wandb package"):
    entry.run(cfg, str(tmp_path / "w"), progress=False, echo=lambda _: None)
  assert not (tmp_path / "w").exists()
