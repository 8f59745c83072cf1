"""A training step's metrics and the completions its log shows (`rl.step_metrics`)."""

import re
import types

import numpy as np
import pytest

from async_rl.config import LogConfig
from async_rl.rl import step_metrics
from async_rl.trajectory import Group, Trajectory


def test_samples_are_the_first_completions_of_the_batch_their_middles_cut_to_length():
  def traj(prompt, completion, reward):
    return Trajectory.from_completion(np.array(prompt), np.array(completion),
                                      np.zeros(len(completion)), np.zeros(len(completion),
                                                                          np.int32),
                                      "length", reward=reward)

  groups = [Group("g0", [traj([1, 2], [3] * 300, 1.0), traj([1, 2], [4], 0.5)]),
            Group("g1", [traj([5], [6], 2.0), traj([5], [7], 0.0)])]
  decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)
  samples = step_metrics.samples(groups, decode, LogConfig(num_samples=3, sample_chars=64),
                                 correct_threshold=1.0)
  assert [(s["prompt_id"], s["prompt"], s["reward"], s["correct"]) for s in samples] == [
      ("g0", "bc", 1.0, True), ("g0", "bc", 0.5, False), ("g1", "f", 2.0, True)]
  assert [s["completion"] for s in samples[1:]] == ["e", "g"]
  long = samples[0]["completion"]
  head, cut, tail = re.fullmatch(r"(d*) \[\.\.\.(\d+) characters\.\.\.\] (d*)", long).groups()
  assert len(long) <= 64 and len(head) + int(cut) + len(tail) == 300
  assert abs(len(head) - len(tail)) <= 1


def _worker_metrics(pid, calls, latency_s):
  return {"rollout": {"submitted": 2, "generated_tokens": 10 * pid}, "pool": {"version": 1},
          "rewards": {"calls": float(calls), "errors": 1.0, "timeouts": 0.0,
                      "worker_restarts": 0.0, "mean_latency_s": latency_s},
          "pid": pid}


def test_step_metrics_keep_one_schema_whatever_the_number_of_rollout_workers():
  groups = [types.SimpleNamespace(prompt_id=f"g{i}", trajectories=[
      types.SimpleNamespace(reward=r) for r in (0.0, 1.0)]) for i in range(2)]

  def metrics(workers):
    return step_metrics.step_metrics(
        {"skipped": 0, "applied_updates": 1, "trained_tokens": 8, "time_train_s": 2.0},
        groups, server={"staleness_hist": [3, 1], "lost_groups": 0}, lengths={},
        workers=workers, since=step_metrics.Since(0.0, np.zeros(1, np.int64)), now=2.0,
        time_wait_s=0.1, time_publish_s=0.2, time_record_s=0.0, skipped_steps=0,
        applied_updates=1, learning_rate=lambda n: 1e-3, correct_threshold=1.0,
        longest_unreported_wait_s=0.0)

  one, _ = metrics([_worker_metrics(1, 4, 0.5)])
  two, counted = metrics([_worker_metrics(1, 4, 0.5), _worker_metrics(2, 6, 1.0)])
  assert set(one) == set(two)
  for section in ("rollout", "rewards"):
    assert set(one[section]) == set(two[section])
  assert {i: w["pid"] for i, w in one["workers"].items()} == {"0": 1}
  assert {i: w["pid"] for i, w in two["workers"].items()} == {"0": 1, "1": 2}
  assert two["rewards"]["calls"] == 10 and two["rewards"]["errors"] == 2
  assert two["rewards"]["mean_latency_s"] == pytest.approx((0.5 * 4 + 1.0 * 6) / 10)
  assert two["rollout"]["generated_tokens"] == 30 and two["gen_tokens_per_s"] == 15
  assert two["reward_error_rate"] == 2 / 10 and counted.reward_failures == 2
  assert one["staleness_hist"] == {0: 3, 1: 1} and one["staleness_mean"] == 0.25
  assert one["accuracy"] == 0.5 and one["train_tokens_per_s"] == 4
