"""Advantages: every normalisation mode against a loop reference, exact zeros, properties,
shaping, overlong, errors."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl import advantages as adv_lib
from async_rl.config import AdvantageConfig

RTOL = 1e-6
ATOL = 1e-6

_MODES = [(m, s, loo) for m, s, loo in itertools.product(("group", "batch", None),
                                                        ("group", "batch", None),
                                                        (False, True))
          if not (loo and m is None)]
_SETTINGS = settings(max_examples=60, deadline=None)


def _reference(rewards, group_size, mean_level, std_level, leave_one_out, eps):
  """Per-sample loops in float64: the std is the spread around each sample's own mean."""
  rewards = np.asarray(rewards, np.float64)
  n = len(rewards)

  def members(i, level):
    start = i - i % group_size
    return list(range(start, start + group_size)) if level == "group" else list(range(n))

  centred = rewards.copy()
  if mean_level is not None:
    for i in range(n):
      pool = [j for j in members(i, mean_level) if not (leave_one_out and j == i)]
      centred[i] = rewards[i] - np.mean(rewards[pool])
  if std_level is None:
    return centred
  out = np.empty(n)
  for i in range(n):
    pool = members(i, std_level)
    out[i] = centred[i] / (np.sqrt(np.sum(centred[pool] ** 2) / (len(pool) - 1)) + eps)
  return out


def _close(actual, expected):
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mean_level, std_level, leave_one_out", _MODES)
def test_group_normalize_matches_reference(mean_level, std_level, leave_one_out):
  rewards = np.random.default_rng(0).normal(0.3, 1.0, 12).astype(np.float32)
  got = adv_lib.group_normalize(rewards, 4, mean_level=mean_level, std_level=std_level,
                                leave_one_out=leave_one_out, eps=1e-3)
  assert got.shape == (12,) and got.dtype == np.float32
  _close(got, _reference(rewards, 4, mean_level, std_level, leave_one_out, 1e-3))


def test_group_normalize_hand_values():
  rewards = np.asarray([1, 0, 0, 1, 1, 1, 1, 0])
  half_sqrt3 = 0.8660254037844386
  _close(adv_lib.group_normalize(rewards, 4, eps=0.0),
         [half_sqrt3, -half_sqrt3, -half_sqrt3, half_sqrt3, 0.5, 0.5, 0.5, -1.5])
  _close(adv_lib.group_normalize(rewards, 4, std_level=None, leave_one_out=True),
         [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])
  _close(adv_lib.group_normalize(rewards, 4, mean_level=None, std_level=None), rewards)


def test_std_is_taken_around_the_subtracted_mean():
  rewards = np.asarray([1.0, 3.0, 5.0, 5.0])
  # Group mean [2, 2, 5, 5], centred [-1, 1, 0, 0]; batch std around it: sqrt(2 / 3).
  _close(adv_lib.group_normalize(rewards, 2, std_level="batch", eps=0.0),
         np.asarray([-1, 1, 0, 0]) / np.sqrt(2 / 3))
  # Batch mean 3.5: centred [-2.5, -0.5, 1.5, 1.5]; group 2's spread around 3.5 is
  # sqrt(2 * 1.5^2) although its own rewards are equal.
  _close(adv_lib.group_normalize(rewards, 2, mean_level="batch", eps=0.0),
         [-2.5 / np.sqrt(6.5), -0.5 / np.sqrt(6.5), 1 / np.sqrt(2), 1 / np.sqrt(2)])
  # Leave-one-out group mean [3, 1, 5, 5]: centred [-2, 2, 0, 0]; group std sqrt(8).
  _close(adv_lib.group_normalize(rewards, 2, leave_one_out=True, eps=0.0),
         [-1 / np.sqrt(2), 1 / np.sqrt(2), 0, 0])
  # No mean: the std is the root-mean-square reward of the group, around 0.
  _close(adv_lib.group_normalize(rewards, 2, mean_level=None, eps=0.0),
         [1 / np.sqrt(10), 3 / np.sqrt(10), 1 / np.sqrt(2), 1 / np.sqrt(2)])


def test_equal_rewards_give_exactly_zero():
  # A float32 running sum of 24 copies of 2.3, divided by 24, misses 2.3 by ulps, which
  # a near-zero std plus eps = 1e-6 used to blow up to 0.38.
  rewards = np.full(24, 2.3, np.float32)
  assert np.cumsum(rewards)[-1] / np.float32(24) != rewards[0]
  for mean_level, std_level, loo in _MODES:
    if mean_level is not None:
      got = adv_lib.group_normalize(rewards, 8, mean_level=mean_level, std_level=std_level,
                                    leave_one_out=loo)
      np.testing.assert_array_equal(got, np.zeros(24, np.float32))
  # Shaping in float64 does not make the mean exact either: 10 copies of 2.3 + 0.1.
  shaped = adv_lib.shape_rewards(rewards[:10], bias=0.1)
  assert shaped.mean() != shaped[0]
  got = adv_lib.make_advantage_fn(reward_bias=0.1)(rewards[:10], np.zeros(10), np.zeros(10), 10)
  np.testing.assert_array_equal(got, np.zeros(10, np.float32))


def test_zero_spread_gives_zero_not_a_blow_up():
  # Without a mean and with zero rewards the std is 0: 0 / (0 + eps) = 0, and 0 with eps = 0.
  for eps in (1e-6, 0.0):
    got = adv_lib.group_normalize(np.zeros(4), 2, mean_level=None, eps=eps)
    np.testing.assert_array_equal(got, np.zeros(4, np.float32))
    got = adv_lib.group_normalize([1.0, 1.0, 0.0, 0.0], 2, std_level="batch", eps=eps)
    np.testing.assert_array_equal(got, np.zeros(4, np.float32))
  # A constant group with no mean is scaled by its own magnitude, not by a zero spread.
  _close(adv_lib.group_normalize(np.full(4, 0.1), 4, mean_level=None, eps=0.0),
         np.full(4, np.sqrt(0.75)))


def _grouped_rewards(draw_groups=st.integers(1, 4), draw_size=st.integers(2, 6)):
  """Rewards on a grid of 1/8, so that offsets by multiples of 1/8 are exact in float32."""
  @st.composite
  def strategy(draw):
    groups, size = draw(draw_groups), draw(draw_size)
    values = draw(st.lists(st.integers(-32, 32), min_size=groups * size,
                           max_size=groups * size))
    return np.asarray(values, np.float32) / 8, size
  return strategy()


@_SETTINGS
@given(data=_grouped_rewards(), mode=st.sampled_from(_MODES))
def test_random_rewards_match_reference_and_are_bounded(data, mode):
  rewards, size = data
  mean_level, std_level, loo = mode
  kwargs = dict(mean_level=mean_level, std_level=std_level, leave_one_out=loo)
  got = adv_lib.group_normalize(rewards, size, eps=1e-6, **kwargs)
  _close(got, _reference(rewards, size, mean_level, std_level, loo, 1e-6))
  if std_level is not None:
    n_std = size if std_level == "group" else len(rewards)
    assert np.all(np.abs(got) <= np.sqrt(n_std - 1) * (1 + 1e-6))


@_SETTINGS
@given(data=_grouped_rewards(), offset=st.integers(-64, 64),
       mode=st.sampled_from([m for m in _MODES if m[0] is not None]))
def test_a_constant_offset_changes_nothing(data, offset, mode):
  rewards, size = data
  mean_level, std_level, loo = mode
  kwargs = dict(mean_level=mean_level, std_level=std_level, leave_one_out=loo, eps=1e-6)
  _close(adv_lib.group_normalize(rewards + np.float32(offset / 8), size, **kwargs),
         adv_lib.group_normalize(rewards, size, **kwargs))


@_SETTINGS
@given(data=_grouped_rewards(), value=st.floats(-10, 10, width=32), bias=st.floats(-1, 1),
       mode=st.sampled_from([m for m in _MODES if m[0] == "group"]))
def test_zero_spread_groups_get_exactly_zero(data, value, bias, mode):
  rewards, size = data
  rewards[:size] = value  # group 0 is constant, the others are random
  mean_level, std_level, loo = mode
  fn = adv_lib.make_advantage_fn(reward_bias=bias, mean_level=mean_level, std_level=std_level,
                                 leave_one_out=loo)
  got = fn(rewards, np.zeros(len(rewards)), np.zeros(len(rewards), bool), size)
  np.testing.assert_array_equal(got[:size], np.zeros(size, np.float32))
  assert np.all(np.isfinite(got))


def test_shape_rewards():
  rewards = np.asarray([-1.0, 0.0, 0.5, 2.0])
  _close(adv_lib.shape_rewards(rewards, bias=-0.5, scale=2.0, clip=1.5), [-1.5, -1.0, 0.0, 1.5])
  _close(adv_lib.shape_rewards(rewards, bias=-0.5, scale=2.0), [-3.0, -1.0, 0.0, 3.0])


def test_overlong_penalty():
  got = adv_lib.overlong_penalty(np.asarray([5, 6, 7, 8, 10, 11]), max_len=10, cache_len=4,
                                 factor=0.5)
  _close(got, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


def test_advantage_fn_zeroes_truncated_then_adds_penalty():
  fn = adv_lib.make_advantage_fn(zero_truncated=True, overlong_max_len=10,
                                 overlong_cache_len=4, std_level=None)
  rewards, lengths = np.asarray([1.0, 1.0, 0.0, 1.0]), np.asarray([5, 8, 10, 10])
  truncated = np.asarray([False, False, False, True])
  _close(fn(rewards, lengths, truncated, 4), [1.125, 0.625, -0.875, -0.875])
  _close(fn(rewards, lengths, truncated, 2), [0.25, -0.25, 0.0, 0.0])


def test_advantage_fn_shapes_before_normalising():
  fn = adv_lib.make_advantage_fn(reward_bias=-0.5, reward_scale=2.0, reward_clip=0.5, mean_level="batch",
                                 std_level=None)
  rewards = np.asarray([1.0, 0.0, 0.0, 0.0])
  _close(fn(rewards, np.zeros(4), np.ones(4, bool), 2), [0.75, -0.25, -0.25, -0.25])


def test_default_advantage_fn_is_group_normalize():
  rewards = np.random.default_rng(2).random(6).astype(np.float32)
  got = adv_lib.make_advantage_fn()(rewards, np.full(6, 99), np.ones(6, bool), 3)
  assert got.dtype == np.float32
  _close(got, adv_lib.group_normalize(rewards, 3))


@pytest.mark.parametrize("kwargs, group_size, word", [
    ({}, 4, "group_size"),
    ({}, 0, "group_size"),
    ({}, 2.0, "group_size"),
    ({"mean_level": "global"}, 3, "mean_level"),
    ({"std_level": "row"}, 3, "std_level"),
    ({}, 1, "std_level"),
    ({"std_level": None, "leave_one_out": True}, 1, "leave_one_out"),
    ({"mean_level": None, "leave_one_out": True}, 3, "leave_one_out"),
    ({"eps": -1.0}, 3, "eps"),
])
def test_group_normalize_errors(kwargs, group_size, word):
  with pytest.raises(ValueError, match=word):
    adv_lib.group_normalize(np.zeros(6), group_size, **kwargs)


def test_group_normalize_rejects_non_flat_rewards():
  with pytest.raises(ValueError, match="rewards"):
    adv_lib.group_normalize(np.zeros((2, 3)), 3)


@pytest.mark.parametrize("fn, kwargs, word", [
    (adv_lib.shape_rewards, {"scale": 0.0}, "scale"),
    (adv_lib.shape_rewards, {"clip": 0.0}, "clip"),
    (adv_lib.overlong_penalty, {"max_len": 0, "cache_len": 0, "factor": 1.0}, "max_len"),
    (adv_lib.overlong_penalty, {"max_len": 8, "cache_len": 9, "factor": 1.0}, "cache_len"),
    (adv_lib.overlong_penalty, {"max_len": 8, "cache_len": 0, "factor": 1.0}, "cache_len"),
    (adv_lib.overlong_penalty, {"max_len": 8, "cache_len": 4, "factor": -1.0}, "factor"),
])
def test_shaping_errors(fn, kwargs, word):
  with pytest.raises(ValueError, match=word):
    fn(np.zeros(4), **kwargs)


@pytest.mark.parametrize("kwargs, word", [
    ({"overlong_max_len": 8}, "overlong_cache_len"),
    ({"overlong_max_len": 8, "overlong_cache_len": 9}, "overlong_cache_len"),
    ({"overlong_max_len": 8, "overlong_cache_len": 4, "overlong_factor": -1}, "overlong_factor"),
    ({"reward_clip": -1.0}, "reward_clip"),
    ({"reward_scale": -1.0}, "reward_scale"),
    ({"std_level": "groups"}, "std_level"),
    ({"mean_level": None, "leave_one_out": True}, "leave_one_out"),
])
def test_make_advantage_fn_errors(kwargs, word):
  with pytest.raises(ValueError, match=word):
    adv_lib.make_advantage_fn(**kwargs)


def test_from_config_names_the_config_field():
  fn = adv_lib.from_config(AdvantageConfig(overlong_cache_len=4, std_level=None), 10)
  rewards, lengths = np.ones(2), np.asarray([5, 10])
  _close(fn(rewards, lengths, np.zeros(2, bool), 2), [0.5, -0.5])  # penalties 0 and -1
  with pytest.raises(ValueError, match=r"advantage\.reward_clip must be > 0"):
    adv_lib.from_config(AdvantageConfig(reward_clip=0.0), 10)
  with pytest.raises(ValueError, match=r"advantage\.overlong_cache_len must be in"):
    adv_lib.from_config(AdvantageConfig(overlong_cache_len=11), 10)
