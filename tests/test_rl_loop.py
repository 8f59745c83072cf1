"""End-to-end in-process runs: async and sync, metrics, staleness bound, failing rewards."""

import json
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from async_rl import cpu_threads, sharding, train_step
from async_rl.config import MeshConfig
from async_rl.rl import rollout_worker, trainer_loop
from async_rl.rl import run as run_module
from async_rl.rl.components import make_engine
from async_rl.rl.run import run_in_process
from async_rl.rl.trainer import Trainer
from async_rl.trajectory import Group, Trajectory
from rl_test_utils import small_config


def _steps(workdir):
  lines = [json.loads(l) for l in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return [l for l in lines if "eval" not in l], [l for l in lines if "eval" in l]


@pytest.mark.parametrize("eta, mode", [(1, "retract"), (0, "drain"), (2, "keep")])
def test_run_trains_within_the_staleness_bound(tmp_path, eta, mode):
  cfg = small_config(**{"staleness.max_staleness": eta, "generation.update_mode": mode})
  summary = run_in_process(cfg, str(tmp_path), progress=False, echo=lambda _: None)
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
  engines = []

  def counting(cfg):
    engines.append(make_engine(cfg))
    return engines[-1]

  for module in (run_module, trainer_loop, rollout_worker):
    monkeypatch.setattr(module, "make_engine", counting)
  cfg = small_config(**{"num_steps": 2, "eval.every_steps": 1})
  summary = run_in_process(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert len(engines) == 1, "the held-out and rollout pools share one engine"
  _, evals = _steps(tmp_path)
  assert [e["step"] for e in evals] == [0, 1, 2]
  assert summary["eval_before"] == evals[0]["eval"]
  assert summary["eval_after"] == evals[-1]["eval"]
  assert len([s for s in summary["timeline"] if s.name == "eval"]) == 3


def test_a_reward_function_that_raises_scores_zero_and_the_run_goes_on(tmp_path):
  cfg = small_config(**{"rollout.reward_fn": "reward_fns_for_tests:raises",
                        "num_steps": 2})
  summary = run_in_process(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert summary["end_version"] == 2
  steps, _ = _steps(tmp_path)
  assert steps[-1]["rewards"]["errors"] >= 2 * 2 * 2
  assert all(s["reward_mean"] == 0.0 for s in steps)


def test_ppo_minibatches_with_the_loglinear_proximal_policy(tmp_path):
  cfg = small_config(**{"num_steps": 2, "ppo.num_minibatches": 2, "ppo.prox_logp": "loglinear",
                        "rollout.reward_fn": "reward_fns_for_tests:length"})
  summary = run_in_process(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert summary["end_version"] == 2
  steps, _ = _steps(tmp_path)
  assert [s["applied_updates"] for s in steps] == [2, 2]
  assert [s["updates"] for s in steps] == [2, 4]
  assert [s["server"]["version"] for s in steps] == [1, 2], "the version counts steps"


def test_automatic_thread_counts_share_the_cores_when_both_sides_run_at_once(monkeypatch):
  # On the CPU the engine's slot groups and the trainer's gradient threads take every
  # core when generation and training take turns (η = 0), half each when they overlap.
  monkeypatch.setattr(cpu_threads, "cores", lambda: 4)
  assert [cpu_threads.cores_per_side(eta) for eta in (0, 1, None)] == [4, 2, 2]
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  for eta, threads in ((0, 4), (2, 2)):
    cfg = small_config(**{"staleness.max_staleness": eta, "generation.num_slots": 32})
    assert make_engine(cfg).decode_threads == threads
    assert Trainer(cfg, mesh).grad_threads == threads
  cfg = small_config(**{"generation.decode_threads": 1, "train.grad_threads": 3})
  assert make_engine(cfg).decode_threads == 1 and Trainer(cfg, mesh).grad_threads == 3
  # Several devices run their shares already; accelerators run one program.
  def fake_mesh(n, platform):
    return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)] * n))
  assert train_step.default_grad_threads(fake_mesh(2, "cpu")) == 1
  assert train_step.default_grad_threads(fake_mesh(1, "gpu")) == 1
  assert train_step.default_grad_threads(fake_mesh(1, "cpu")) == 4


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
    trainer = Trainer(small_config(**{"batching.max_tokens_per_mb": 320,
                                      "batching.row_buckets": (40,),
                                      "batching.reuse_slack": slack,
                                      "train.grad_threads": 1}), mesh)
    shapes[slack] = [trainer.pack(groups(lengths)).tokens.shape
                     for lengths in ([22] * 8, [22] * 6 + [10] * 2)]
  assert shapes == {0.0: [(1, 8, 40), (1, 6, 40)], 0.5: [(1, 8, 40), (1, 8, 40)]}
