"""Off-policy corrections: sequence means in packed rows, the rejection-sampling family by
hand (token and sequence level, mask and clamp, every metric), the log-linear proximal
estimate, and the bounds' checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import config, off_policy

RTOL = 1e-6
ATOL = 1e-6
LN2 = math.log(2.0)


def _close(actual, expected):
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=RTOL, atol=ATOL)


def _row(x):
  return jnp.asarray([x], jnp.float32)


def test_sequence_mean_keeps_sequences_and_rows_apart():
  # Row 0 packs two sequences; row 1's segment 1 is a different sequence from row 0's.
  x = jnp.asarray([[1.0, 3.0, 5.0, 2.0, 4.0, 9.0], [7.0, 1.0, 100.0, 0.0, 0.0, 0.0]])
  weight = jnp.asarray([[1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
  segment_ids = jnp.asarray([[1, 1, 1, 2, 2, 0], [1, 1, 1, 0, 0, 0]])
  _close(off_policy.sequence_mean(x, weight, segment_ids),
         [[2, 2, 2, 3, 3, 0], [4, 4, 4, 0, 0, 0]])
  # A sequence with no weight gets 0; leading axes are rows too.
  _close(off_policy.sequence_mean(x[None], 0 * weight[None], segment_ids[None]),
         np.zeros((1, 2, 6)))


# ρ = π_prox / π_behav = 4, 2, 1, 1/2, 1/4 on five valid tokens.
LOG_RHO = _row([2 * LN2, LN2, 0.0, -LN2, -2 * LN2])
ONES = jnp.ones((1, 5), bool)
SEG = jnp.ones((1, 5), jnp.int32)


def test_divergences_by_hand():
  _close(off_policy.divergence(LOG_RHO, "ratio"), [[4, 2, 1, 0.5, 0.25]])
  _close(off_policy.divergence(LOG_RHO, "kl_k1"), [[2 * LN2, LN2, 0, -LN2, -2 * LN2]])
  _close(off_policy.divergence(LOG_RHO, "kl_k2"),
         [[2 * LN2**2, LN2**2 / 2, 0, LN2**2 / 2, 2 * LN2**2]])
  # k3 = 1/ρ - 1 + log ρ: 0 at ρ = 1, larger below 1 than above.
  _close(off_policy.divergence(LOG_RHO, "kl_k3"),
         [[2 * LN2 - 0.75, LN2 - 0.5, 0, 1 - LN2, 3 - 2 * LN2]])


@pytest.mark.parametrize("metric, lower, upper, keep", [
    ("ratio", 0.3, 3.0, [0, 1, 1, 1, 0]),
    ("ratio", None, 1.5, [0, 0, 1, 1, 1]),
    ("ratio", 0.6, None, [1, 1, 1, 0, 0]),
    ("kl_k1", -0.8, 1.0, [0, 1, 1, 1, 0]),
    ("kl_k2", None, 0.5, [0, 1, 1, 1, 0]),
    ("kl_k3", None, 0.25, [0, 1, 1, 0, 0]),
])
def test_token_mask_drops_tokens_outside_the_bounds(metric, lower, upper, keep):
  weight, kept, corrected = off_policy.behaviour_weight(
      LOG_RHO, ONES, SEG, level="token", action="mask", metric=metric, lower=lower,
      upper=upper)
  _close(weight, [[4, 2, 1, 0.5, 0.25]])
  np.testing.assert_array_equal(kept, [keep])
  np.testing.assert_array_equal(corrected, [[not k for k in keep]])


def test_token_clamp_truncates_the_weight():
  weight, kept, corrected = off_policy.behaviour_weight(
      LOG_RHO, ONES, SEG, level="token", action="clamp", lower=0.3, upper=3.0)
  _close(weight, [[3, 2, 1, 0.5, 0.3]])
  np.testing.assert_array_equal(kept, ONES)
  np.testing.assert_array_equal(corrected, [[1, 0, 0, 0, 1]])


def test_no_bound_no_correction_at_any_level():
  for level in config.REJECTION_LEVELS:
    weight, kept, corrected = off_policy.behaviour_weight(LOG_RHO, ONES, SEG, level=level)
    _close(weight, [[4, 2, 1, 0.5, 0.25]])
    np.testing.assert_array_equal(kept, ONES)
    assert not corrected.any()


# One row packing [prompt, c, c] and [prompt, prompt, c, c], then padding. The
# completion ρ are 4, 1 (geometric mean 2) and 2, 1/8 (geometric mean 1/2); the
# prompt and padding positions hold values the mask must hide.
PACKED_LOG_RHO = _row([9.0, 2 * LN2, 0.0, -9.0, 9.0, LN2, -3 * LN2, 9.0])
PACKED_VALID = jnp.asarray([[0, 1, 1, 0, 0, 1, 1, 0]], bool)
PACKED_SEG = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0]])
SEQ_GEOMEAN = [2, 2, 2, 0.5, 0.5, 0.5, 0.5, 1]


@pytest.mark.parametrize("lower, upper, keep", [
    (None, 3.0, [1, 1, 1, 1]),   # token ρ = 4 exceeds 3, but its sequence's mean does not
    (None, 1.5, [0, 0, 1, 1]),
    (0.6, None, [1, 1, 0, 0]),
])
def test_sequence_mask_judges_the_geometric_mean_and_drops_whole_sequences(lower, upper,
                                                                           keep):
  weight, kept, corrected = off_policy.behaviour_weight(
      PACKED_LOG_RHO, PACKED_VALID, PACKED_SEG, level="sequence", action="mask",
      lower=lower, upper=upper)
  completions = [1, 2, 5, 6]
  _close(weight[0, completions], [2, 2, 0.5, 0.5])
  np.testing.assert_array_equal(kept[0, completions], keep)
  np.testing.assert_array_equal(corrected[0, completions], [not k for k in keep])
  assert not kept[0, [0, 3, 4, 7]].any() and not corrected[0, [0, 3, 4, 7]].any()


def test_sequence_clamp_truncates_the_sequence_weight():
  weight, kept, corrected = off_policy.behaviour_weight(
      PACKED_LOG_RHO, PACKED_VALID, PACKED_SEG, level="sequence", action="clamp",
      lower=0.6, upper=1.5)
  _close(weight[0, [1, 2, 5, 6]], [1.5, 1.5, 0.6, 0.6])
  np.testing.assert_array_equal(kept, PACKED_VALID)
  np.testing.assert_array_equal(corrected, PACKED_VALID)


def test_sequence_kl_is_the_arithmetic_mean_and_keeps_token_weights():
  # k2 means: sequence 1 (2 ln²2 + 0) / 2 = ln²2 = 0.48; sequence 2
  # (ln²2 / 2 + 9 ln²2 / 2) / 2 = 2.5 ln²2 = 1.20.
  for upper, keep in ((1.0, [1, 1, 0, 0]), (2.0, [1, 1, 1, 1]), (0.4, [0, 0, 0, 0])):
    weight, kept, _ = off_policy.behaviour_weight(
        PACKED_LOG_RHO, PACKED_VALID, PACKED_SEG, level="sequence", metric="kl_k2",
        upper=upper)
    _close(weight[0, [1, 2, 5, 6]], [4, 1, 2, 0.125])
    np.testing.assert_array_equal(kept[0, [1, 2, 5, 6]], keep)


def test_loglinear_interpolates_by_version():
  behav, logp = _row([-1.0, -1.0, -1.0, -1.0, -1.0]), _row([-2.5, -2.5, -2.5, -2.5, jnp.nan])
  versions = jnp.asarray([[5, 4, 3, 0, -1]])
  # Step v = 5, before minibatch 1 of 2: v_θ = 5.5. α = 0, 1/1.5, 2/2.5, 5/5.5; -1: behav.
  got = off_policy.loglinear_prox_logp(logp, behav, versions, prox_version=5, theta_version=5.5)
  alpha = np.asarray([0, 2 / 3, 0.8, 10 / 11])
  _close(got[0, :4], -1.0 - 1.5 * alpha)
  _close(got[0, 4], -1.0)
  # Before the first minibatch θ is π_prox: the estimate is log π_θ itself, for every token.
  got = off_policy.loglinear_prox_logp(logp, behav, versions, prox_version=5, theta_version=5)
  _close(got[0, :4], [-2.5] * 4)


def test_loglinear_takes_traced_versions_and_passes_no_gradient():
  behav = _row([-1.0, -2.0])
  versions = jnp.asarray([[1, 2]])

  def total(logp, prox_version, theta_version):
    return off_policy.loglinear_prox_logp(logp, behav, versions, prox_version=prox_version,
                                          theta_version=theta_version).sum()

  value, grad = jax.jit(jax.value_and_grad(total))(_row([-3.0, -3.0]), 2, 2.5)
  _close(value, (-1.0 - 2.0 * (1 / 1.5)) + -2.0)
  np.testing.assert_array_equal(grad, np.zeros((1, 2)))


@pytest.mark.parametrize("kwargs, word", [
    ({"level": "row"}, "rejection_level"),
    ({"action": "drop"}, "rejection_action"),
    ({"metric": "kl"}, "rejection_metric"),
    ({"action": "clamp", "metric": "kl_k3", "upper": 1.0}, "rejection_metric='ratio'"),
    ({"upper": 1.0}, "rejection_upper"),
    ({"lower": 0.0}, "rejection_lower"),
    ({"lower": 1.0}, "rejection_lower"),
    ({"metric": "kl_k1", "lower": 0.5, "upper": 0.1}, "rejection_lower"),
    ({"metric": "kl_k2", "upper": 0.0}, "rejection_upper"),
    ({"metric": "kl_k3", "upper": -1.0}, "rejection_upper"),
])
def test_check_correction_names_the_bad_field(kwargs, word):
  with pytest.raises(ValueError, match=word):
    off_policy.check_correction(**kwargs)


def test_check_correction_accepts_valid_settings():
  off_policy.check_correction(level="sequence", action="clamp", lower=0.5, upper=2.0)
  off_policy.check_correction(metric="kl_k1", lower=-0.5, upper=0.5)
  off_policy.check_correction(metric="kl_k3", upper=0.1)
