"""PPO losses: hand-computed tokens, masking hygiene, micro-batch additivity, registry."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import loss as loss_lib

RTOL = 1e-6
ATOL = 1e-7


def _tokens(ratio, weight, adv, mask=None):
  """Log-probs realising the given r = π_θ/π_prox and w = π_prox/π_behav, as [1, T]."""
  ratio, weight = np.asarray(ratio, np.float64), np.asarray(weight, np.float64)
  behav = np.full(ratio.shape, -1.0)
  prox = behav + np.log(weight)
  logp = prox + np.log(ratio)
  mask = np.ones(ratio.shape) if mask is None else np.asarray(mask)
  as_row = lambda x: jnp.asarray(np.asarray(x, np.float32)[None])
  return tuple(as_row(x) for x in (logp, prox, behav, adv, mask))


def _run(args, name="decoupled_ppo", num_tokens=None, entropy=None, **hparams):
  """(loss, metrics, d loss / d logp), jitted: op-by-op grad is slow on CPU."""
  fn = loss_lib.make_loss(name, **hparams)
  (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(
      *args, num_tokens, entropy)
  return loss, metrics, grad


def _close(actual, expected, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=atol)


def test_both_advantage_signs_on_both_sides_of_the_clip_range():
  args = _tokens(ratio=[1.5, 0.5, 1.5, 0.5, 1.1], weight=[1, 1, 1, 1, 1],
                 adv=[1, 1, -1, -1, 2])
  loss, metrics, grad = _run(args, eps_clip=0.2)
  _close(loss, (-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5)
  _close(metrics["clip_fraction"], 2 / 5)
  _close(metrics["dual_clip_fraction"], 0.0)
  _close(metrics["num_tokens"], 5.0)
  _close(grad[0], [0.0, -0.5 / 5, 1.5 / 5, 0.0, -2.2 / 5])


def test_gradient_sign_raises_good_tokens_and_lowers_bad_ones():
  args = _tokens(ratio=[1.0, 1.0], weight=[1.0, 1.0], adv=[0.7, -0.3])
  g = np.asarray(_run(args, eps_clip=0.2)[2][0])
  assert g[0] < 0 < g[1]
  _close(g, [-0.35, 0.15])


def test_behaviour_weight_scales_tokens_and_cap_masks_numerator_only():
  args = _tokens(ratio=[1.1, 1.1, 0.9], weight=[2.0, 0.5, 1.0], adv=[1, 1, -1])
  loss, metrics = loss_lib.decoupled_ppo_loss(*args, eps_clip=0.2)
  _close(loss, (-2.2 - 0.55 + 0.9) / 3)
  _close(metrics["capped_fraction"], 0.0)
  loss, metrics, grad = _run(args, eps_clip=0.2, behav_imp_weight_cap=1.5)
  _close(loss, (-0.55 + 0.9) / 3)
  _close(metrics["capped_fraction"], 1 / 3)
  _close(metrics["behav_weight_mean"], 3.5 / 3)
  _close(metrics["behav_weight_max"], 2.0)
  _close(metrics["num_tokens"], 3.0)
  _close(grad[0], [0.0, -0.55 / 3, 0.9 / 3])


def test_dual_clip_bounds_negative_advantages_only():
  args = _tokens(ratio=[5.0, 1.1, 5.0], weight=[2.0, 1.0, 1.0], adv=[-1, -2, 1])
  loss, metrics, grad = _run(args, eps_clip=0.2, c_clip=3.0)
  _close(loss, (6.0 + 2.2 - 1.2) / 3)
  _close(metrics["dual_clip_fraction"], 1 / 3)
  _close(metrics["clip_fraction"], 1 / 3)
  loss, _ = loss_lib.decoupled_ppo_loss(*args, eps_clip=0.2)
  _close(loss, (10.0 + 2.2 - 1.2) / 3)
  _close(grad[0], [0.0, 2.2 / 3, 0.0])


def test_asymmetric_clip_higher():
  args = _tokens(ratio=[1.25, 1.5, 0.75], weight=[1, 1, 1], adv=[1, 1, -1])
  loss, metrics = loss_lib.decoupled_ppo_loss(*args, eps_clip=0.2, eps_clip_higher=0.28)
  _close(loss, (-1.25 - 1.28 + 0.8) / 3)
  _close(metrics["clip_fraction"], 2 / 3)
  loss, metrics = loss_lib.decoupled_ppo_loss(*args, eps_clip=0.2)
  _close(loss, (-1.2 - 1.2 + 0.8) / 3)
  _close(metrics["clip_fraction"], 1.0)


def test_num_tokens_sets_denominator_and_metrics_use_it():
  args = _tokens(ratio=[2.0, 1.0], weight=[1, 1], adv=[-1, 0.5])
  entropy = jnp.asarray([[0.3, 0.5]], jnp.float32)
  loss, metrics = loss_lib.decoupled_ppo_loss(*args, eps_clip=0.2, num_tokens=8,
                                              entropy=entropy)
  _close(loss, (2.0 - 0.5) / 8)
  _close(metrics["approx_kl"], (0.5 - 1.0 + math.log(2.0)) / 8)
  _close(metrics["entropy"], 0.8 / 8)
  _close(metrics["num_tokens"], 2.0)
  _, metrics = loss_lib.decoupled_ppo_loss(*args, eps_clip=0.2)
  assert "entropy" not in metrics
  _close(metrics["approx_kl"], (0.5 - 1.0 + math.log(2.0)) / 2)


def test_all_masked_gives_zero_loss_and_zero_gradient():
  args = _tokens(ratio=[1.5, 0.5], weight=[3.0, 1.0], adv=[1, -1], mask=[0, 0])
  for name in loss_lib.LOSSES:
    loss, metrics, grad = _run(args, name, eps_clip=0.2, c_clip=3.0, behav_imp_weight_cap=2.0)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(grad, np.zeros_like(grad))
    assert all(np.isfinite(v) and float(v) == 0.0 for v in metrics.values())


def test_garbage_in_masked_tokens_does_not_leak():
  clean = _tokens(ratio=[1.5, 0.9], weight=[1.2, 0.8], adv=[1, -1])
  junk = [jnp.asarray([[v1, v2]], jnp.float32)
          for v1, v2 in ((jnp.inf, 1e30), (-jnp.inf, -1e30), (jnp.nan, 88.0), (jnp.nan, 1e30))]
  dirty = [jnp.concatenate([c, j], axis=1) for c, j in zip(clean[:4], junk)]
  dirty.append(jnp.asarray([[1, 1, 0, 0]], jnp.float32))
  entropy = jnp.asarray([[0.2, 0.4, jnp.nan, jnp.inf]], jnp.float32)
  hparams = dict(eps_clip=0.2, c_clip=3.0, behav_imp_weight_cap=5.0)
  for name in loss_lib.LOSSES:
    want, want_metrics, want_grad = _run(clean, name, entropy=entropy[:, :2], **hparams)
    got, got_metrics, got_grad = _run(dirty, name, entropy=entropy, **hparams)
    assert np.isfinite(float(got))
    _close(got, want)
    _close(got_grad[:, :2], want_grad)
    np.testing.assert_array_equal(got_grad[:, 2:], np.zeros((1, 2), np.float32))
    for key, value in want_metrics.items():
      _close(got_metrics[key], value)


def _random_batch(seed, shape=(4, 6)):
  rng = np.random.default_rng(seed)
  behav = rng.normal(-2.0, 0.5, shape)
  prox = behav + rng.normal(0.0, 0.6, shape)
  logp = prox + rng.normal(0.0, 0.4, shape)
  adv = rng.normal(0.0, 1.0, shape)
  mask = (rng.random(shape) < 0.75).astype(np.float32)
  return tuple(jnp.asarray(x, jnp.float32) for x in (logp, prox, behav, adv, mask))


def test_naive_equals_decoupled_with_prox_equal_to_behav():
  logp, prox, behav, adv, mask = _random_batch(0)
  hparams = dict(eps_clip=0.2, eps_clip_higher=0.3, c_clip=3.0)
  naive, naive_metrics = loss_lib.naive_ppo_loss(logp, prox, behav, adv, mask, **hparams)
  ref, ref_metrics = loss_lib.decoupled_ppo_loss(logp, behav, behav, adv, mask, **hparams)
  _close(naive, ref)
  _close(naive_metrics["behav_weight_max"], 1.0)
  for key, value in ref_metrics.items():
    _close(naive_metrics[key], value)
  decoupled, _ = loss_lib.decoupled_ppo_loss(logp, prox, behav, adv, mask, **hparams)
  assert abs(float(decoupled) - float(naive)) > 1e-3


def test_micro_batches_with_global_num_tokens_sum_to_full_batch():
  batch = _random_batch(1)
  entropy = jnp.asarray(np.random.default_rng(2).random((4, 6)), jnp.float32)
  hparams = dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=2.0, behav_imp_weight_cap=1.3)
  full, full_metrics, full_grad = _run(batch, entropy=entropy, **hparams)
  assert 0 < float(full_metrics["capped_fraction"]) < 1
  assert 0 < float(full_metrics["clip_fraction"]) < 1
  n = batch[4].sum()
  loss_a, metrics_a, grad_a = _run([x[:2] for x in batch], num_tokens=n, entropy=entropy[:2],
                                   **hparams)
  loss_b, metrics_b, grad_b = _run([x[2:] for x in batch], num_tokens=n, entropy=entropy[2:],
                                   **hparams)
  _close(loss_a + loss_b, full, atol=1e-6)
  _close(jnp.concatenate([grad_a, grad_b]), full_grad, atol=1e-7)
  for key, value in full_metrics.items():
    combine = max if key == "behav_weight_max" else (lambda a, b: a + b)
    _close(combine(metrics_a[key], metrics_b[key]), value, atol=1e-6)


def test_make_loss_binds_hyperparameters():
  batch = _random_batch(4)
  fn = loss_lib.make_loss("decoupled_ppo", eps_clip=0.1, behav_imp_weight_cap=2.0)
  want, _ = loss_lib.decoupled_ppo_loss(*batch, eps_clip=0.1, behav_imp_weight_cap=2.0,
                                        num_tokens=40)
  got, _ = fn(*batch, 40)
  _close(got, want)


@pytest.mark.parametrize("hparams, word", [
    ({"eps_clip": 0.0}, "eps_clip"),
    ({"eps_clip": -0.1}, "eps_clip"),
    ({"eps_clip": 0.2, "eps_clip_higher": -0.01}, "eps_clip_higher"),
    ({"eps_clip": 0.2, "c_clip": 1.0}, "c_clip"),
    ({"eps_clip": 0.2, "behav_imp_weight_cap": 0.0}, "behav_imp_weight_cap"),
    ({"eps_clip": 0.2, "clip_eps": 0.2}, "clip_eps"),
    ({}, "eps_clip"),
])
def test_make_loss_rejects_bad_hyperparameters(hparams, word):
  with pytest.raises(ValueError, match=word):
    loss_lib.make_loss("decoupled_ppo", **hparams)


def test_make_loss_rejects_unknown_name():
  with pytest.raises(ValueError, match="decoupled_ppo.*naive_ppo"):
    loss_lib.make_loss("grpo", eps_clip=0.2)


def test_loss_function_validates_directly():
  with pytest.raises(ValueError, match="c_clip"):
    loss_lib.decoupled_ppo_loss(*_random_batch(5), eps_clip=0.2, c_clip=0.5)
