"""PPO loss: hand-computed tokens, off-policy corrections and GSPO in the loss, masking
hygiene, packed == unpacked, micro-batch additivity, hyper-parameter checks; the KL
penalty's estimators and the entropy bonus against their definitions, values and
gradients."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import loss as loss_lib, policy
from async_rl.config import KL_ESTIMATORS, PPOConfig

RTOL = 1e-6
ATOL = 1e-7


def _tokens(ratio, weight, adv, mask=None, segment_ids=None):
  """Log-probs realising the given r = π_θ/π_prox and w = π_prox/π_behav, as [1, T]

  (one sequence per row unless `segment_ids` says otherwise)."""
  ratio, weight = np.asarray(ratio, np.float64), np.asarray(weight, np.float64)
  behav = np.full(ratio.shape, -1.0)
  prox = behav + np.log(weight)
  logp = prox + np.log(ratio)
  mask = np.ones(ratio.shape) if mask is None else np.asarray(mask)
  segment_ids = np.ones(ratio.shape) if segment_ids is None else np.asarray(segment_ids)
  as_row = lambda x: jnp.asarray(np.asarray(x, np.float32)[None])
  return tuple(as_row(x) for x in (logp, prox, behav, adv, mask)) + (
      jnp.asarray(segment_ids, jnp.int32)[None],)


def _run(args, name="decoupled_ppo", num_tokens=None, entropy=None, ref_logp=None, **hparams):
  """(loss, metrics, d loss / d logp), jitted: op-by-op grad is slow on CPU."""
  fn = loss_lib.make_loss(name, **hparams)
  (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(
      *args, num_tokens, entropy, ref_logp)
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
  loss, metrics, grad = _run(args, eps_clip=0.2, rejection_upper=1.5)
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


# The options of the loss that change how tokens or sequences are weighted, combined so
# that three settings cover them (each costs a compilation).
OPTIONS = [
    {"importance_level": "sequence", "rejection_upper": 2.0},
    {"rejection_level": "sequence", "rejection_action": "clamp", "rejection_lower": 0.5,
     "rejection_upper": 2.0},
    {"rejection_level": "sequence", "rejection_metric": "kl_k3", "rejection_upper": 0.1},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_all_masked_gives_zero_loss_and_zero_gradient(options):
  args = _tokens(ratio=[1.5, 0.5], weight=[3.0, 1.0], adv=[1, -1], mask=[0, 0])
  loss, metrics, grad = _run(args, eps_clip=0.2, c_clip=3.0, **options)
  assert float(loss) == 0.0
  np.testing.assert_array_equal(grad, np.zeros_like(grad))
  assert all(np.isfinite(v) and float(v) == 0.0 for v in metrics.values())


@pytest.mark.parametrize("options", OPTIONS)
def test_garbage_in_masked_tokens_does_not_leak(options):
  clean = _tokens(ratio=[1.5, 0.9], weight=[1.2, 0.8], adv=[1, -1])
  junk = [jnp.asarray([[v1, v2]], jnp.float32)
          for v1, v2 in ((jnp.inf, 1e30), (-jnp.inf, -1e30), (jnp.nan, 88.0), (jnp.nan, 1e30))]
  dirty = [jnp.concatenate([c, j], axis=1) for c, j in zip(clean[:4], junk)]
  dirty += [jnp.asarray([[1, 1, 0, 0]], jnp.float32), jnp.ones((1, 4), jnp.int32)]
  entropy = jnp.asarray([[0.2, 0.4, jnp.nan, jnp.inf]], jnp.float32)
  hparams = dict(eps_clip=0.2, c_clip=3.0, **options)
  want, want_metrics, want_grad = _run(clean, entropy=entropy[:, :2], **hparams)
  got, got_metrics, got_grad = _run(dirty, entropy=entropy, **hparams)
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
  mask = (rng.random(shape) < 0.75).astype(np.float32)
  segment_ids = np.asarray([[1, 1, 1, 2, 2, 2], [1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1],
                            [1, 2, 2, 3, 3, 0]])[:shape[0]]
  mask = np.where(segment_ids > 0, mask, 0.0)
  # One advantage per sequence, as the trainer gives.
  adv = rng.normal(0.0, 1.0, (shape[0], shape[1] + 1))[np.arange(shape[0])[:, None],
                                                       segment_ids]
  return tuple(jnp.asarray(x, jnp.float32) for x in (logp, prox, behav, adv, mask)) + (
      jnp.asarray(segment_ids, jnp.int32),)


def test_behaviour_weight_with_sequence_rejection_in_the_loss():
  # One row, two sequences: w = 4, 1 (geometric mean 2) and 2, 1/8 (geometric mean 1/2).
  args = _tokens(ratio=[1, 1, 1, 1], weight=[4, 1, 2, 0.125], adv=[1, 1, 1, 1],
                 segment_ids=[1, 1, 2, 2])
  loss, metrics, grad = _run(args, eps_clip=0.2, rejection_level="sequence",
                             rejection_upper=1.5)
  _close(loss, -0.5 * 2 / 4)  # sequence 1 is dropped, sequence 2 weighs 1/2 per token
  _close(metrics["capped_fraction"], 2 / 4)
  _close(metrics["behav_weight_mean"], 7.125 / 4)
  _close(metrics["behav_weight_max"], 4.0)
  _close(grad[0], [0, 0, -0.5 / 4, -0.5 / 4])
  loss, metrics, _ = _run(args, eps_clip=0.2, rejection_action="clamp", rejection_upper=3.0)
  _close(loss, -(3 + 1 + 2 + 0.125) / 4)  # token-level TIS
  _close(metrics["capped_fraction"], 1 / 4)


def test_gspo_uses_one_ratio_per_sequence():
  # Row 0 packs r = (1.1, 0.9) with A = 1 and r = (1.0, 0.49) with A = -1; row 1 holds
  # r = (1.5, 0.6) with A = 1 and w = (2, 1). Sequence ratios: sqrt(0.99), 0.7, sqrt(0.9).
  row0 = _tokens(ratio=[1.1, 0.9, 1.0, 0.49], weight=[1, 1, 1, 1], adv=[1, 1, -1, -1],
                 segment_ids=[1, 1, 2, 2])
  row1 = _tokens(ratio=[1.5, 0.6, 1.0, 1.0], weight=[2, 1, 1, 1], adv=[1, 1, 0, 0],
                 mask=[1, 1, 0, 0], segment_ids=[1, 1, 0, 0])
  args = [jnp.concatenate(pair) for pair in zip(row0, row1)]
  s1, s3 = math.sqrt(0.99), math.sqrt(0.9)
  loss, metrics, grad = _run(args, eps_clip=0.2, importance_level="sequence")
  # Sequence 2: 0.7 < 1 - eps with A < 0, so both its tokens are clipped at 0.8.
  _close(loss, (-2 * s1 + 2 * 0.8 - 3 * s3) / 6)
  _close(metrics["clip_fraction"], 2 / 6)
  # GSPO-token: each token's gradient is w_t s ∇log π_θ(y_t), its own w, where GSPO
  # through the sequence mean would give both tokens of row 1 the mean w, 1.5.
  _close(grad, [[-s1 / 6, -s1 / 6, 0, 0], [-2 * s3 / 6, -s3 / 6, 0, 0]])
  # Per token, r = 1.5 is clipped instead, and 0.49 and 1.0 are judged apart.
  loss, metrics, _ = _run(args, eps_clip=0.2)
  _close(loss, (-1.1 - 0.9 + 1.0 + 0.8 - 2 * 1.2 - 0.6) / 6)
  _close(metrics["clip_fraction"], 2 / 6)


def _gspo_reference(prox, behav, adv, mask, segment_ids, *, eps_clip):
  """GSPO as written, with one w per sequence (the geometric mean of its tokens' w), as
  a function of log π_θ: s = exp(mean log r) per sequence, differentiated through the
  mean."""
  sequences = [(r, np.flatnonzero((np.asarray(segment_ids[r]) == seg) & (np.asarray(mask[r]) > 0)))
               for r in range(mask.shape[0]) for seg in range(1, mask.shape[1] + 1)]

  def loss(logp):
    total = 0.0
    for r, idx in sequences:
      if idx.size:
        s = jnp.exp(jnp.mean(logp[r, idx] - prox[r, idx]))
        w = jnp.exp(jnp.mean(prox[r, idx] - behav[r, idx]))
        a = adv[r, idx]
        total += w * jnp.sum(jnp.maximum(-a * s, -a * jnp.clip(s, 1 - eps_clip, 1 + eps_clip)))
    return total / mask.sum()

  return loss


def test_gspo_token_form_has_gspo_gradient_when_w_is_per_sequence():
  logp, prox, behav, adv, mask, seg = _random_batch(3)
  # w = 1 (naive PPO), and w per sequence (the sequence-level ratio correction).
  for batch, options in (((logp, behav, behav, adv, mask, seg), {}),
                         ((logp, prox, behav, adv, mask, seg),
                          {"rejection_level": "sequence", "rejection_upper": 1e9})):
    loss, _, grad = _run(batch, eps_clip=0.2, importance_level="sequence", **options)
    reference = _gspo_reference(*batch[1:], eps_clip=0.2)
    want, want_grad = jax.jit(jax.value_and_grad(reference))(logp)
    _close(loss, want)
    _close(grad, want_grad)


@pytest.mark.parametrize("options", OPTIONS)
def test_packed_rows_equal_one_sequence_per_row(options):
  batch = _random_batch(6, shape=(1, 6))  # one row: sequences [0:3] and [3:6]
  unpacked = [jnp.concatenate([x[:, :3], x[:, 3:]]) for x in batch[:5]]
  unpacked.append(jnp.ones((2, 3), jnp.int32))
  hparams = dict(eps_clip=0.2, c_clip=3.0, **options)
  loss, metrics, grad = _run(batch, **hparams)
  want, want_metrics, want_grad = _run(unpacked, **hparams)
  _close(loss, want)
  _close(grad.reshape(2, 3), want_grad)
  for key, value in want_metrics.items():
    _close(metrics[key], value)


def test_prox_equal_to_behav_is_naive_ppo_and_no_correction_fires():
  logp, prox, behav, adv, mask, seg = _random_batch(0)
  hparams = dict(eps_clip=0.2, eps_clip_higher=0.3, c_clip=3.0)
  naive, naive_metrics = loss_lib.decoupled_ppo_loss(logp, behav, behav, adv, mask, seg,
                                                     **hparams)
  _close(naive_metrics["behav_weight_max"], 1.0)
  for options in [{"rejection_upper": 2.0}] + OPTIONS[1:]:
    corrected, metrics = loss_lib.decoupled_ppo_loss(logp, behav, behav, adv, mask, seg,
                                                     **hparams, **options)
    _close(corrected, naive)
    _close(metrics["capped_fraction"], 0.0)
  decoupled, _ = loss_lib.decoupled_ppo_loss(logp, prox, behav, adv, mask, seg, **hparams)
  assert abs(float(decoupled) - float(naive)) > 1e-3


@pytest.mark.parametrize("options", [
    {"rejection_upper": 1.3},
    {"importance_level": "sequence", "rejection_level": "sequence",
     "rejection_action": "clamp", "rejection_lower": 0.8, "rejection_upper": 1.3},
])
def test_micro_batches_with_global_num_tokens_sum_to_full_batch(options):
  batch = _random_batch(1)
  entropy = jnp.asarray(np.random.default_rng(2).random((4, 6)), jnp.float32)
  hparams = dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=2.0, **options)
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
  hparams = dict(eps_clip=0.1, importance_level="sequence", rejection_level="sequence",
                 rejection_upper=2.0)
  fn = loss_lib.make_loss("decoupled_ppo", **hparams)
  want, _ = loss_lib.decoupled_ppo_loss(*batch, num_tokens=40, **hparams)
  got, _ = fn(*batch, 40)
  _close(got, want)


@pytest.mark.parametrize("hparams, word", [
    ({"eps_clip": 0.0}, "eps_clip"),
    ({"eps_clip": -0.1}, "eps_clip"),
    ({"eps_clip": 0.2, "eps_clip_higher": -0.01}, "eps_clip_higher"),
    ({"eps_clip": 0.2, "c_clip": 1.0}, "c_clip"),
    ({"eps_clip": 0.2, "importance_level": "segment"}, "importance_level"),
    ({"eps_clip": 0.2, "rejection_upper": 1.0}, "rejection_upper"),
    ({"eps_clip": 0.2, "rejection_action": "clamp", "rejection_metric": "kl_k2"},
     "rejection_metric"),
    ({"eps_clip": 0.2, "behav_imp_weight_cap": 5.0}, "behav_imp_weight_cap"),
    ({"eps_clip": 0.2, "prox_logp": "behav"}, "prox_logp"),
    ({"eps_clip": 0.2, "clip_eps": 0.2}, "clip_eps"),
    ({}, "eps_clip"),
])
def test_make_loss_rejects_bad_hyperparameters(hparams, word):
  with pytest.raises(ValueError, match=word):
    loss_lib.make_loss("decoupled_ppo", **hparams)


def test_make_loss_rejects_unknown_names():
  with pytest.raises(ValueError, match="decoupled_ppo"):
    loss_lib.make_loss("grpo", eps_clip=0.2)
  with pytest.raises(ValueError, match="decoupled_ppo.*got 'naive_ppo'"):
    loss_lib.make_loss("naive_ppo", eps_clip=0.2)


@pytest.mark.parametrize("hparams, word", [
    ({"eps_clip": 0.0}, "ppo.eps_clip"),
    ({"prox_logp": "fresh"}, "ppo.prox_logp"),
    ({"loss": "naive_ppo"}, "ppo.loss must be one of"),
    ({"rejection_lower": 2.0}, "ppo.rejection_lower"),
    ({"rejection_metric": "kl_k1", "rejection_lower": 0.1, "rejection_upper": 0.0},
     "ppo.rejection_lower"),
    ({"cap": 1.0}, r"ppo\.cap"),
    ({"kl_beta": -0.1}, r"ppo\.kl_beta must be >= 0"),
    ({"kl_estimator": "kl_k3"}, r"ppo\.kl_estimator must be one of"),
    ({"kl_in": "advantage"}, r"ppo\.kl_in must be one of"),
    ({"entropy_coef": -0.01}, r"ppo\.entropy_coef must be >= 0"),
])
def test_check_hparams_names_the_config_field(hparams, word):
  with pytest.raises(ValueError, match=word):
    loss_lib.check_hparams(prefix="ppo.", **hparams)


def test_check_hparams_accepts_every_ppo_option():
  for prox in ("recompute", "loglinear", "behav"):
    loss_lib.check_hparams(loss="decoupled_ppo", prox_logp=prox, eps_clip=0.2,
                           eps_clip_higher=0.28, c_clip=3.0, importance_level="sequence",
                           rejection_level="sequence", rejection_action="clamp",
                           rejection_metric="ratio", rejection_upper=2.0, rejection_lower=0.5,
                           kl_beta=0.04, kl_estimator="k2", kl_in="reward", entropy_coef=0.01)


def test_loss_function_validates_directly():
  with pytest.raises(ValueError, match="c_clip"):
    loss_lib.decoupled_ppo_loss(*_random_batch(5), eps_clip=0.2, c_clip=0.5)


# The KL penalty and the entropy bonus. Four sampled tokens, the last masked.
LOGP = [-1.0, -2.0, -0.5, -3.0]  # log π_θ
REF_LOGP = [-1.5, -1.0, -0.5, -2.0]  # log π_ref
KL_MASK = [1.0, 1.0, 1.0, 0.0]


def _kl_by_hand(estimator):
  """Schulman's estimators from their definitions, p = π_θ and r = π_ref of each token."""
  p, r = np.exp(LOGP), np.exp(REF_LOGP)
  return {"k1": np.log(p / r), "k2": 0.5 * np.log(p / r) ** 2,
          "k3": r / p - 1 - np.log(r / p)}[estimator]


def _kl_grad_by_hand(estimator):
  """d estimator / d log p, with r held fixed."""
  p, r = np.exp(LOGP), np.exp(REF_LOGP)
  return {"k1": np.ones(4), "k2": np.log(p / r), "k3": 1 - r / p}[estimator]


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_token_kl_is_each_estimator_by_its_definition(estimator):
  got = loss_lib.token_kl(jnp.asarray([LOGP]), jnp.asarray([REF_LOGP]), jnp.asarray([KL_MASK]),
                          estimator=estimator)
  _close(got[0], np.where(KL_MASK, _kl_by_hand(estimator), 0.0))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_in_the_loss_adds_beta_times_the_token_mean_and_its_gradient(estimator):
  args = _tokens(ratio=np.exp(np.asarray(LOGP) + 1.0), weight=[1, 1, 1, 1], adv=[1, -1, 0.5, 2],
                 mask=KL_MASK)
  np.testing.assert_allclose(args[0][0], LOGP, rtol=1e-6)
  beta, n = 0.3, 5  # n: the update's tokens, more than this call's three
  policy_loss, policy_metrics, policy_grad = _run(args, num_tokens=n, eps_clip=0.2)
  loss, metrics, grad = _run(args, num_tokens=n, ref_logp=jnp.asarray([REF_LOGP]),
                             eps_clip=0.2, kl_beta=beta, kl_estimator=estimator)
  kl = np.where(KL_MASK, _kl_by_hand(estimator), 0.0).sum() / n
  _close(metrics["kl"], kl)
  _close(loss, policy_loss + beta * kl)
  _close(grad[0], policy_grad[0] + beta * np.where(KL_MASK, _kl_grad_by_hand(estimator), 0) / n)
  assert metrics.keys() == policy_metrics.keys() | {"kl"}


def test_kl_in_the_reward_leaves_the_loss_as_it_is():
  args = _tokens(ratio=[1.5, 0.5, 1.0, 1.1], weight=[1, 1, 1, 1], adv=[1, -1, 0.5, 2])
  want = _run(args, eps_clip=0.2)
  got = _run(args, ref_logp=jnp.asarray([REF_LOGP]), eps_clip=0.2, kl_beta=0.3, kl_in="reward")
  assert float(got[0]) == float(want[0]) and got[1].keys() == want[1].keys()
  np.testing.assert_array_equal(got[2], want[2])


def test_kl_in_the_loss_without_reference_log_probs_says_so():
  fn = loss_lib.make_loss("decoupled_ppo", eps_clip=0.2, kl_beta=0.1)
  with pytest.raises(ValueError, match="ref_logp"):
    fn(*_random_batch(0))


def test_entropy_bonus_subtracts_coef_times_the_mean_entropy_with_its_gradient():
  # The bonus's gradient reaches the logits through the policy's entropy:
  # dH/dz_j = -p_j (log p_j + H).
  logits_BTV = np.asarray([[[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [1.0, 3.0, -2.0]]], np.float32)
  args = _tokens(ratio=[1.2, 0.7, 1.0], weight=[1, 1, 1], adv=[1, -1, 0.5], mask=[1, 1, 0])
  coef, n = 0.1, 4

  def loss_of_logits(fn, logits_BTV):
    return fn(*args, n, policy.entropy(logits_BTV, 1.0))[0]

  plain = loss_lib.make_loss("decoupled_ppo", eps_clip=0.2)
  bonus = loss_lib.make_loss("decoupled_ppo", eps_clip=0.2, entropy_coef=coef)
  want_policy = loss_of_logits(plain, logits_BTV)
  loss, grad = jax.jit(jax.value_and_grad(functools.partial(loss_of_logits, bonus)))(logits_BTV)
  z = logits_BTV[0].astype(np.float64)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  H = -(p * np.log(p)).sum(-1)
  mask = np.asarray([1.0, 1.0, 0.0])
  _close(loss, want_policy - coef * (mask * H).sum() / n)
  _close(grad[0], coef / n * mask[:, None] * p * (np.log(p) + H[:, None]), rtol=1e-5)


def test_garbage_in_masked_reference_and_entropy_does_not_leak():
  clean = _tokens(ratio=[1.5, 0.9], weight=[1.2, 0.8], adv=[1, -1])
  dirty = [jnp.concatenate([c, jnp.zeros((1, 2), c.dtype)], axis=1) for c in clean[:4]]
  dirty += [jnp.asarray([[1, 1, 0, 0]], jnp.float32), jnp.ones((1, 4), jnp.int32)]
  ref = jnp.asarray([[-1.2, -0.3, jnp.nan, -jnp.inf]], jnp.float32)
  entropy = jnp.asarray([[0.2, 0.4, jnp.nan, jnp.inf]], jnp.float32)
  hparams = dict(eps_clip=0.2, kl_beta=0.5, kl_estimator="k3", entropy_coef=0.1)
  want, want_metrics, want_grad = _run(clean, entropy=entropy[:, :2], ref_logp=ref[:, :2],
                                       **hparams)
  got, got_metrics, got_grad = _run(dirty, entropy=entropy, ref_logp=ref, **hparams)
  assert np.isfinite(float(got))
  _close(got, want)
  _close(got_grad[:, :2], want_grad)
  np.testing.assert_array_equal(got_grad[:, 2:], np.zeros((1, 2), np.float32))
  _close(got_metrics["kl"], want_metrics["kl"])


def test_the_defaults_and_zero_coefficients_are_exactly_the_policy_loss():
  batch = _random_batch(7)
  rng = np.random.default_rng(7)
  entropy = jnp.asarray(rng.random(batch[0].shape), jnp.float32)
  ref = batch[0] + jnp.asarray(rng.normal(0, 0.3, batch[0].shape), jnp.float32)
  policy_only = jax.jit(functools.partial(loss_lib.decoupled_ppo_loss, eps_clip=0.2))
  want, want_metrics = policy_only(*batch, num_tokens=30, entropy=entropy)
  for fn in (loss_lib.from_config(PPOConfig()),
             loss_lib.make_loss("decoupled_ppo", eps_clip=0.2, kl_beta=0.0, kl_estimator="k1",
                                entropy_coef=0.0)):
    got, got_metrics = jax.jit(fn)(*batch, 30, entropy, ref)
    assert float(got) == float(want)
    assert got_metrics.keys() == want_metrics.keys()
    assert all(float(got_metrics[k]) == float(want_metrics[k]) for k in want_metrics)
