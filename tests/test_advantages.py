"""Advantages: every normalisation mode against numpy, shaping, overlong, errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import advantages as adv_lib

RTOL = 1e-6
ATOL = 1e-6

_MODES = [(m, s, loo) for m, s, loo in itertools.product(("group", "batch", None),
                                                        ("group", "batch", None),
                                                        (False, True))
          if not (loo and m is None)]


def _reference(rewards, group_size, mean_level, std_level, leave_one_out, eps):
  """Per-sample loops in float64, independent of the vectorised implementation."""
  rewards = np.asarray(rewards, np.float64)
  out = np.empty_like(rewards)
  for i in range(len(rewards)):
    start = i - i % group_size
    members = {"group": list(range(start, start + group_size)),
               "batch": list(range(len(rewards))), None: []}
    value = rewards[i]
    if mean_level is not None:
      pool = [j for j in members[mean_level] if not (leave_one_out and j == i)]
      value -= np.mean(rewards[pool])
    if std_level is not None:
      value /= np.std(rewards[members[std_level]], ddof=1) + eps
    out[i] = value
  return out


def _close(actual, expected):
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mean_level, std_level, leave_one_out", _MODES)
def test_group_normalize_matches_reference(mean_level, std_level, leave_one_out):
  rewards = np.random.default_rng(0).normal(0.3, 1.0, 12).astype(np.float32)
  got = adv_lib.group_normalize(rewards, 4, mean_level=mean_level, std_level=std_level,
                                leave_one_out=leave_one_out, eps=1e-3)
  assert got.shape == (12,) and got.dtype == jnp.float32
  _close(got, _reference(rewards, 4, mean_level, std_level, leave_one_out, 1e-3))


def test_group_normalize_hand_values():
  rewards = jnp.asarray([1, 0, 0, 1, 1, 1, 1, 0])
  half_sqrt3 = 0.8660254037844386
  _close(adv_lib.group_normalize(rewards, 4, eps=0.0),
         [half_sqrt3, -half_sqrt3, -half_sqrt3, half_sqrt3, 0.5, 0.5, 0.5, -1.5])
  _close(adv_lib.group_normalize(rewards, 4, std_level=None, leave_one_out=True),
         [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])
  _close(adv_lib.group_normalize(rewards, 4, mean_level=None, std_level=None), rewards)


def test_constant_group_gives_zero_advantage():
  got = adv_lib.group_normalize(jnp.asarray([1.0, 1.0, 1.0, 0.0, 1.0, 0.5]), 3)
  _close(got[:3], [0.0, 0.0, 0.0])
  assert np.all(np.isfinite(got))


def test_group_normalize_jits_with_static_group_size():
  rewards = jnp.asarray(np.random.default_rng(1).random(8), jnp.float32)
  fn = jax.jit(adv_lib.group_normalize, static_argnums=1,
               static_argnames=("mean_level", "std_level", "leave_one_out"))
  _close(fn(rewards, 2, leave_one_out=True),
         _reference(rewards, 2, "group", "group", True, 1e-6))


def test_shape_rewards():
  rewards = jnp.asarray([-1.0, 0.0, 0.5, 2.0])
  _close(adv_lib.shape_rewards(rewards, bias=-0.5, scale=2.0, clip=1.5), [-1.5, -1.0, 0.0, 1.5])
  _close(adv_lib.shape_rewards(rewards, bias=-0.5, scale=2.0), [-3.0, -1.0, 0.0, 3.0])


def test_overlong_penalty():
  got = adv_lib.overlong_penalty(jnp.asarray([5, 6, 7, 8, 10, 11]), max_len=10, cache_len=4,
                                 factor=0.5)
  _close(got, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


def test_advantage_fn_zeroes_truncated_then_adds_penalty():
  fn = adv_lib.make_advantage_fn(zero_truncated=True, overlong_max_len=10,
                                 overlong_cache_len=4, std_level=None)
  rewards, lengths = jnp.asarray([1.0, 1.0, 0.0, 1.0]), jnp.asarray([5, 8, 10, 10])
  truncated = jnp.asarray([False, False, False, True])
  want = [1.125, 0.625, -0.875, -0.875]
  _close(fn(rewards, lengths, truncated, 4), want)
  _close(jax.jit(fn, static_argnums=3)(rewards, lengths, truncated, 4), want)
  _close(fn(rewards, lengths, truncated, 2), [0.25, -0.25, 0.0, 0.0])


def test_advantage_fn_shapes_before_normalising():
  fn = adv_lib.make_advantage_fn(bias=-0.5, scale=2.0, clip=0.5, mean_level="batch",
                                 std_level=None)
  rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0])
  _close(fn(rewards, jnp.zeros(4), jnp.ones(4, bool), 2), [0.75, -0.25, -0.25, -0.25])


def test_default_advantage_fn_is_group_normalize():
  rewards = jnp.asarray(np.random.default_rng(2).random(6), jnp.float32)
  _close(adv_lib.make_advantage_fn()(rewards, jnp.full(6, 99), jnp.ones(6, bool), 3),
         adv_lib.group_normalize(rewards, 3))


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
    adv_lib.group_normalize(jnp.zeros(6), group_size, **kwargs)


def test_group_normalize_rejects_non_flat_rewards():
  with pytest.raises(ValueError, match="rewards"):
    adv_lib.group_normalize(jnp.zeros((2, 3)), 3)


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
    fn(jnp.zeros(4), **kwargs)


@pytest.mark.parametrize("kwargs, word", [
    ({"overlong_max_len": 8}, "overlong_cache_len"),
    ({"overlong_max_len": 8, "overlong_cache_len": 9}, "overlong_cache_len"),
    ({"overlong_max_len": 8, "overlong_cache_len": 4, "overlong_factor": -1}, "overlong_factor"),
    ({"clip": -1.0}, "clip"),
    ({"scale": -1.0}, "scale"),
    ({"std_level": "groups"}, "std_level"),
    ({"mean_level": None, "leave_one_out": True}, "leave_one_out"),
])
def test_make_advantage_fn_errors(kwargs, word):
  with pytest.raises(ValueError, match=word):
    adv_lib.make_advantage_fn(**kwargs)
