"""The trajectory record: construction, validation once, groups and staleness."""

import numpy as np
import pytest

from async_rl.trajectory import (Group, Trajectory, split_turns, staleness_counts, staleness_T,
                                 validate)


def _traj(**overrides):
  fields = dict(tokens_T=np.array([1, 2, 3, 4]), loss_mask_T=np.array([0, 1, 0, 1]),
                logp_T=np.array([9.0, -0.5, 9.0, -0.25]), versions_T=np.array([-1, 3, -1, 5]),
                prompt_len=1, finish_reason="stop")
  return Trajectory(**{**fields, **overrides})


def test_from_completion_lays_out_a_single_turn_sample():
  t = Trajectory.from_completion([7, 8], [9, 10, 11], [-1.0, -2.0, -3.0], [4, 4, 5], "length")
  np.testing.assert_array_equal(t.tokens_T, [7, 8, 9, 10, 11])
  np.testing.assert_array_equal(t.loss_mask_T, [0, 0, 1, 1, 1])
  np.testing.assert_array_equal(t.logp_T, [0, 0, -1, -2, -3])
  np.testing.assert_array_equal(t.versions_T, [-1, -1, 4, 4, 5])
  assert t.tokens_T.dtype == np.int32 and t.logp_T.dtype == np.float32
  assert t.prompt_len == 2 and len(t) == 5 and t.num_policy_tokens == 3
  np.testing.assert_array_equal(t.prompt_P, [7, 8])
  np.testing.assert_array_equal(t.completion_C, [9, 10, 11])
  assert t.reward is None and t.with_reward(1).reward == 1.0


def test_validate_canonicalises_and_zeroes_logp_off_policy_tokens():
  t = validate(_traj())
  assert t.tokens_T.dtype == np.int32 and t.loss_mask_T.dtype == bool
  np.testing.assert_array_equal(t.logp_T, [0, -0.5, 0, -0.25])


@pytest.mark.parametrize("overrides, message", [
    ({"tokens_T": np.array([1.0, 2.0, 3.0, 4.0])}, "tokens_T must be a 1-D integer"),
    ({"loss_mask_T": np.array([0, 1, 0])}, r"loss_mask_T must have shape \(4,\)"),
    ({"logp_T": np.zeros(5)}, r"logp_T must have shape \(4,\)"),
    ({"versions_T": np.array([-1, 3.0, -1, 5])}, "versions_T must be integers"),
    ({"versions_T": np.array([-1, -2, -1, 5])}, "versions_T must be >= 0"),
    ({"prompt_len": 0}, "prompt_len must lie in"),
    ({"prompt_len": 2}, "-1 on the prompt"),
    ({"loss_mask_T": np.array([1, 1, 0, 1])}, "False on the first token"),
    ({"tokens_T": np.array([1, 2, 3, 40])}, r"tokens_T must lie in \[0, 32\)"),
    ({"finish_reason": 3}, "finish_reason must be a str"),
    ({"reward": "high"}, "reward must be a real number"),
    ({"top_k": -1}, "top_k must be an int >= 0"),
    ({"top_k": 2.5}, "top_k must be an int >= 0"),
    ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
    ({"top_p": float("nan")}, r"top_p must lie in \(0, 1\]"),
])
def test_validate_names_the_bad_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    validate(_traj(**overrides), vocab_size=32)
  with pytest.raises(ValueError, match="expected a Trajectory"):
    validate({"tokens_T": [1]})


def test_the_truncation_record_survives_validation_and_split_turns():
  t = validate(_traj(top_k=np.int64(8), top_p=0.9))
  assert (t.top_k, t.top_p) == (8, 0.9) and type(t.top_k) is int and t.truncated
  assert not _traj().truncated
  assert {(s.top_k, s.top_p) for s in split_turns(t)} == {(8, 0.9)}


def test_group_versions_and_checks():
  a = Trajectory.from_completion([1], [2, 3], [0, 0], [4, 6], "stop", reward=1.0)
  b = Trajectory.from_completion([1], [2], [0], [5], "stop", reward=0.0)
  group = Group("p", [a, b])
  assert (group.min_version, group.max_version) == (4, 6)
  assert isinstance(group.trajectories, tuple)
  with pytest.raises(ValueError, match="has no reward"):
    Group("p", [a, Trajectory.from_completion([1], [2], [0], [1], "stop")])
  empty = Trajectory.from_completion([1], [], [], [], "aborted", reward=0.0)
  with pytest.raises(ValueError, match="holds no policy token"):
    Group("p", [empty])
  with pytest.raises(ValueError, match="must be a Trajectory"):
    Group("p", [a, "b"])


def test_staleness_counts_policy_tokens_only():
  t = _traj(reward=1.0)
  np.testing.assert_array_equal(staleness_T(t, 6), [3, 1])
  u = Trajectory.from_completion([1], [2, 3, 4], [0, 0, 0], [6, 6, 4], "stop", reward=0.0)
  np.testing.assert_array_equal(staleness_counts([Group("a", [t]), Group("b", [u])], 6),
                                [2, 1, 1, 1])
  assert staleness_counts([], 3).size == 0
  # Only trained tokens count: a policy token masked out of the loss (too stale) does not.
  masked = Trajectory.from_completion([1], [2, 3], [0, 0], [2, 6], "stop", reward=0.0)
  masked = Trajectory(**{**masked.__dict__, "loss_mask_T": np.array([False, False, True])})
  np.testing.assert_array_equal(staleness_counts([Group("c", [masked])], 6), [1])
