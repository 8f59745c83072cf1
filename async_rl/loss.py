"""The decoupled PPO policy loss (AReaL), with its off-policy corrections and GSPO, and
the regularisers any registered loss may take: a KL penalty to a frozen reference
policy and an entropy bonus.

`check_hparams` is the one place where the PPO hyper-parameters (the fields of
`config.PPOConfig`) are validated; the config delegates to it.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from async_rl import named, off_policy
from async_rl.config import IMPORTANCE_LEVELS, KL_ESTIMATORS, KL_PLACEMENTS, PROX_LOGP

_LOSS_HPARAMS = ("eps_clip", "eps_clip_higher", "c_clip", "importance_level",
                 "rejection_level", "rejection_action", "rejection_metric", "rejection_upper",
                 "rejection_lower")
# The regularisers `make_loss` adds to whichever policy loss it binds.
_REG_HPARAMS = ("kl_beta", "kl_estimator", "kl_in", "entropy_coef")
# Fields of the PPO section that shape the train step rather than the loss.
_STEP_HPARAMS = ("prox_logp", "num_minibatches")
_HPARAMS = ("loss",) + _STEP_HPARAMS + _LOSS_HPARAMS + _REG_HPARAMS


def check_hparams(*, prefix="", **hparams):
  """Raises ValueError naming `prefix + name` for an unknown or invalid hyper-parameter.

  Takes any subset of `config.PPOConfig`'s fields as keywords: `loss`, `prox_logp`
  (see `config.PROX_LOGP`), `eps_clip` > 0, `eps_clip_higher` >= 0 or None,
  `c_clip` > 1 or None, `importance_level` (see `IMPORTANCE_LEVELS`), the
  `rejection_*` fields (see `off_policy.check_correction`), `kl_beta` >= 0,
  `kl_estimator` (see `KL_ESTIMATORS`), `kl_in` (see `KL_PLACEMENTS`) and
  `entropy_coef` >= 0.
  """
  unknown = sorted(set(hparams) - set(_HPARAMS))
  if unknown:
    raise ValueError(f"unknown PPO hyper-parameters {[prefix + k for k in unknown]}; "
                     f"known: {[prefix + k for k in _HPARAMS]}")
  h = hparams
  if "loss" in h:
    named.lookup(LOSSES, h["loss"], f"{prefix}loss", "loss function")
  if "prox_logp" in h and h["prox_logp"] not in PROX_LOGP:
    raise ValueError(f"{prefix}prox_logp must be one of {PROX_LOGP}, "
                     f"got {h['prox_logp']!r}")
  if "num_minibatches" in h and not (isinstance(h["num_minibatches"], int)
                                     and h["num_minibatches"] >= 1):
    raise ValueError(f"{prefix}num_minibatches must be an int >= 1, got {h['num_minibatches']!r}")
  if "eps_clip" in h and not h["eps_clip"] > 0:
    raise ValueError(f"{prefix}eps_clip must be > 0, got {h['eps_clip']}")
  if h.get("eps_clip_higher") is not None and not h["eps_clip_higher"] >= 0:
    raise ValueError(f"{prefix}eps_clip_higher must be >= 0 or None, got {h['eps_clip_higher']}")
  if h.get("c_clip") is not None and not h["c_clip"] > 1:
    raise ValueError(f"{prefix}c_clip must be > 1 or None, got {h['c_clip']}")
  if "importance_level" in h and h["importance_level"] not in IMPORTANCE_LEVELS:
    raise ValueError(f"{prefix}importance_level must be one of {IMPORTANCE_LEVELS}, "
                     f"got {h['importance_level']!r}")
  for name in ("kl_beta", "entropy_coef"):
    if name in h and not h[name] >= 0:
      raise ValueError(f"{prefix}{name} must be >= 0, got {h[name]!r}")
  for name, allowed in (("kl_estimator", KL_ESTIMATORS), ("kl_in", KL_PLACEMENTS)):
    if name in h and h[name] not in allowed:
      raise ValueError(f"{prefix}{name} must be one of {allowed}, got {h[name]!r}")
  correction = {k[len("rejection_"):]: v for k, v in h.items() if k.startswith("rejection_")}
  off_policy.check_correction(prefix=prefix + "rejection_", **correction)


def decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, segment_ids, *,
                       eps_clip, eps_clip_higher=None, c_clip=None, importance_level="token",
                       rejection_level="token", rejection_action="mask",
                       rejection_metric="ratio", rejection_upper=None, rejection_lower=None,
                       num_tokens=None, entropy=None):
  """Decoupled PPO loss (AReaL): clip against π_prox, reweight by π_prox / π_behav.

  Per token, with r = π_θ / π_prox and w the behaviour weight (no gradient):
  `l = w * max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_higher))`, then
  `l = min(l, w * c_clip * |A|)` where A < 0 (dual clip); the loss is the sum of l
  over the tokens kept, over `num_tokens`. w is π_prox / π_behav after the off-policy
  correction `off_policy.behaviour_weight` (the `rejection_*` arguments: AReaL's
  rejection-sampling family, which may drop tokens or sequences from the numerator,
  or clamp w).

  `importance_level="sequence"` is GSPO (Zheng et al. 2025, arXiv 2507.18071): r is
  the sequence's ratio s = exp(mean of log r_t over its kept tokens), in the paper's
  GSPO-token form `sg(s) * π_θ(y_t) / sg(π_θ(y_t))`: the value (and so the clip
  decision) is the sequence's, and token t's gradient is w_t s ∇log π_θ(y_t). Where
  the advantage and w are constant over each sequence (w = 1 for naive PPO, or a
  sequence-level ratio correction) this is the gradient of GSPO through the sequence
  mean, as AReaL (`ppo_actor_loss_fn`) computes it; otherwise each token keeps its
  own w, where AReaL's form gives every token of a sequence the sequence's mean w.
  As in AReaL, token losses are summed over the token count rather than averaged
  per sequence as in the paper.

  All arrays share one shape [..., T]; a row of the last axis may pack several
  sequences (`segment_ids`, needed by the sequence-level options). Reductions run in
  float32 or wider. Masked tokens may hold any values, inf and NaN included: they are
  replaced before any exp, so they touch neither the loss nor its gradient.

  Args:
    logp: log π_θ of the sampled tokens (differentiated).
    prox_logp: log π_prox (recomputed, estimated, or log π_behav for naive PPO).
    behav_logp: log π_behav, recorded by the generator.
    advantages: per-token advantages.
    mask: nonzero on tokens that count.
    segment_ids: int 1, 2, ... per sequence of a row, 0 on padding.
    eps_clip: lower clip range, > 0.
    eps_clip_higher: upper clip range (DAPO clip-higher); defaults to eps_clip.
    c_clip: dual-clip constant, > 1; None disables dual clip.
    importance_level: "token" (PPO) or "sequence" (GSPO).
    rejection_level, rejection_action, rejection_metric, rejection_upper,
      rejection_lower: the correction of w; no bound, no correction.
    num_tokens: denominator of the loss. Defaults to this call's valid-token count.
      Pass the whole training batch's valid-token count (all micro-batches, all
      shards) so that summing per-micro-batch losses and gradients gives the
      whole-batch mean. Counted before the correction drops any token.
    entropy: optional per-token entropy, only reported as a metric.

  Returns:
    `(loss, metrics)`, scalars. Mean-type metrics (`clip_fraction`,
    `dual_clip_fraction`, `approx_kl`, `behav_weight_mean`, `capped_fraction`,
    `entropy`) are sums over this call's valid tokens divided by the loss
    denominator, so summing them over micro-batches sharing one `num_tokens` gives
    the batch mean. `behav_weight_mean` and `behav_weight_max` (a maximum, 0 if no
    token: combine with max) are of the per-token π_prox / π_behav before any
    correction; `capped_fraction` counts the valid tokens whose w the correction
    dropped or clamped. `num_tokens` is this call's valid-token count: combine with
    sum. The clip fractions count kept tokens where the bound changes the token's
    loss. `approx_kl` is the k3 estimator of KL(π_θ || π_prox) per token: mean of
    (ρ - 1) - log ρ with ρ = π_prox / π_θ.
  """
  rejection = dict(level=rejection_level, action=rejection_action, metric=rejection_metric,
                   lower=rejection_lower, upper=rejection_upper)
  check_hparams(eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, c_clip=c_clip,
                importance_level=importance_level,
                **{"rejection_" + k: v for k, v in rejection.items()})
  eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
  dtype = jnp.promote_types(jnp.result_type(logp), jnp.float32)
  valid_BT = jnp.asarray(mask) != 0

  def masked(x):
    return jnp.where(valid_BT, jnp.asarray(x, dtype), 0.0)

  count = valid_BT.sum(dtype=dtype)
  denom = jnp.maximum(count if num_tokens is None else jnp.asarray(num_tokens, dtype), 1.0)
  token_log_ratio_BT = masked(jnp.asarray(logp, dtype) - jnp.asarray(prox_logp, dtype))
  log_weight_BT = jax.lax.stop_gradient(
      masked(jnp.asarray(prox_logp, dtype) - jnp.asarray(behav_logp, dtype)))
  adv_BT = masked(advantages)
  weight_BT, keep_BT, corrected_BT = off_policy.behaviour_weight(
      log_weight_BT, valid_BT, segment_ids, **rejection)

  log_ratio_BT = token_log_ratio_BT
  if importance_level == "sequence":
    token_sg_BT = jax.lax.stop_gradient(token_log_ratio_BT)
    log_seq_BT = off_policy.sequence_mean(token_sg_BT, keep_BT, segment_ids)
    log_ratio_BT = log_seq_BT + token_log_ratio_BT - token_sg_BT
  ratio_BT = jnp.exp(log_ratio_BT)

  unclipped_BT = -adv_BT * ratio_BT
  clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - eps_clip, 1.0 + eps_high)
  per_token_BT = jnp.maximum(unclipped_BT, clipped_BT)
  clip_active_BT = keep_BT & (clipped_BT > unclipped_BT)
  dual_active_BT = jnp.zeros_like(valid_BT)
  if c_clip is not None:
    bound_BT = c_clip * jnp.abs(adv_BT)
    dual_active_BT = keep_BT & (adv_BT < 0) & (per_token_BT > bound_BT)
    per_token_BT = jnp.where(dual_active_BT, bound_BT, per_token_BT)
  per_token_BT = jnp.where(keep_BT, weight_BT, 0.0) * per_token_BT
  loss = per_token_BT.sum() / denom

  def mean(x):
    return jnp.where(valid_BT, x, 0.0).sum() / denom

  token_weight_BT = jnp.exp(log_weight_BT)
  metrics = {
      "clip_fraction": clip_active_BT.sum(dtype=dtype) / denom,
      "dual_clip_fraction": dual_active_BT.sum(dtype=dtype) / denom,
      "approx_kl": mean(jnp.expm1(-token_log_ratio_BT) + token_log_ratio_BT),
      "behav_weight_mean": mean(token_weight_BT),
      "behav_weight_max": jnp.where(valid_BT, token_weight_BT, 0.0).max(initial=0.0),
      "capped_fraction": corrected_BT.sum(dtype=dtype) / denom,
      "num_tokens": count,
  }
  if entropy is not None:
    metrics["entropy"] = mean(masked(entropy))
  return loss, metrics


LOSSES = {"decoupled_ppo": decoupled_ppo_loss}


def token_kl(logp, ref_logp, mask, *, estimator):
  """Schulman's estimate of KL(π || π_ref) at each token, 0 off the mask.

  With d = log π - log π_ref of the sampled token: k1 = d, k2 = d² / 2,
  k3 = exp(-d) - 1 + d (`off_policy.divergence`'s kl_k1..3 of d). For tokens drawn
  from π, k1 and k3 are unbiased (k1 of either sign, k3 >= 0 and usually of lower
  variance) and k2 is biased but of low variance. Masked tokens may hold any values:
  d is 0 there (before the exp), where every estimator is 0. Float32 or wider.
  """
  valid = jnp.asarray(mask) != 0
  dtype = jnp.promote_types(jnp.result_type(logp), jnp.float32)
  d = jnp.where(valid, jnp.asarray(logp, dtype) - jnp.asarray(ref_logp, dtype), 0.0)
  return off_policy.divergence(d, f"kl_{estimator}")


def regulariser(logp, ref_logp, entropy, mask, *, kl_beta=0.0, kl_estimator="k3",
                entropy_coef=0.0, num_tokens=None):
  """`kl_beta * KL - entropy_coef * H`: the KL penalty and the entropy bonus, as the
  policy loss averages, over the tokens in `mask` divided by `num_tokens` (default:
  their count).

  KL is the token mean of `token_kl(logp, ref_logp)`, its gradient through `logp`
  only (`ref_logp` is a constant). Under sampling from π_θ, k2's gradient is that of
  KL(π_θ || π_ref), k3's that of KL(π_ref || π_θ), and k1's is zero in expectation. H
  is the token mean of `entropy`, the policy's entropy at each token (differentiated).
  A coefficient of 0 leaves its term out (and `ref_logp` or `entropy` may be None).

  Returns:
    `(penalty, metrics)`: `metrics["kl"]` (the token mean of the estimate, divided
    like the loss, so that micro-batches add up) when `kl_beta` > 0.
  """
  valid = jnp.asarray(mask) != 0
  dtype = jnp.promote_types(jnp.result_type(logp), jnp.float32)
  count = valid.sum(dtype=dtype)
  denom = jnp.maximum(count if num_tokens is None else jnp.asarray(num_tokens, dtype), 1.0)
  penalty, metrics = jnp.zeros((), dtype), {}
  if kl_beta:
    if ref_logp is None:
      raise ValueError("the KL penalty in the loss (kl_beta > 0, kl_in='loss') needs the "
                       "reference log-probs, got ref_logp=None")
    metrics["kl"] = token_kl(logp, ref_logp, mask, estimator=kl_estimator).sum() / denom
    penalty = penalty + kl_beta * metrics["kl"]
  if entropy_coef:
    entropy_mean = jnp.where(valid, jnp.asarray(entropy, dtype), 0.0).sum() / denom
    penalty = penalty - entropy_coef * entropy_mean
  return penalty, metrics


def make_loss(name, *, kl_beta=0.0, kl_estimator="k3", kl_in="loss", entropy_coef=0.0,
              **hparams):
  """Returns the loss registered as `name` with its hyper-parameters bound, plus the
  regularisers.

  Args:
    name: a key of `LOSSES`, or "module:attr" naming a function with
      `decoupled_ppo_loss`'s arguments.
    kl_beta, kl_estimator, kl_in, entropy_coef: `regulariser`'s terms, added to the
      policy loss (the KL term only with `kl_in="loss"`: in the reward it is the
      trainer's). With both coefficients 0 the loss is the policy loss alone.
    **hparams: `eps_clip` (required) and the other keyword arguments of
      `decoupled_ppo_loss` before `num_tokens`.

  Returns:
    `fn(logp, prox_logp, behav_logp, advantages, mask, segment_ids, num_tokens=None,
    entropy=None, ref_logp=None) -> (loss, metrics)`: `ref_logp`, the reference
    policy's log-probs, is needed when the KL term is in the loss; `entropy` when
    `entropy_coef` > 0.

  Raises:
    ValueError: unknown name, unknown or missing hyper-parameter, invalid value.
  """
  check_hparams(loss=name)
  unknown = sorted(set(hparams) - set(_LOSS_HPARAMS))
  if unknown:
    raise ValueError(f"unknown hyper-parameters {unknown} for loss {name!r}; "
                     f"known: {list(_LOSS_HPARAMS + _REG_HPARAMS)}")
  if "eps_clip" not in hparams:
    raise ValueError(f"loss {name!r} requires eps_clip")
  reg = dict(kl_beta=kl_beta, kl_estimator=kl_estimator, entropy_coef=entropy_coef)
  check_hparams(kl_in=kl_in, **reg, **hparams)
  if kl_in != "loss":
    reg["kl_beta"] = 0.0
  loss_fn = named.lookup(LOSSES, name, "loss", "loss function")

  def fn(logp, prox_logp, behav_logp, advantages, mask, segment_ids, num_tokens=None,
         entropy=None, ref_logp=None):
    loss, metrics = loss_fn(logp, prox_logp, behav_logp, advantages, mask, segment_ids,
                            num_tokens=num_tokens, entropy=entropy, **hparams)
    if not (reg["kl_beta"] or reg["entropy_coef"]):
      return loss, metrics
    penalty, more = regulariser(logp, ref_logp, entropy, mask, num_tokens=num_tokens, **reg)
    return loss + penalty, {**metrics, **more}

  return fn


def from_config(ppo) -> Callable:
  """The loss of a `config.PPOConfig`, every field checked (errors name `ppo.<field>`)."""
  fields = dataclasses.asdict(ppo)
  check_hparams(prefix="ppo.", **fields)
  name = fields.pop("loss")
  for step_field in _STEP_HPARAMS:  # the train step's, not the loss's
    del fields[step_field]
  return make_loss(name, **fields)
