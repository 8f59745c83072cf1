"""Token-level PPO policy losses: AReaL's decoupled objective and a naive baseline."""

import jax
import jax.numpy as jnp

_HPARAMS = ("eps_clip", "eps_clip_higher", "c_clip", "behav_imp_weight_cap")


def _check_hparams(eps_clip, eps_clip_higher=None, c_clip=None, behav_imp_weight_cap=None):
  if not eps_clip > 0:
    raise ValueError(f"eps_clip must be > 0, got {eps_clip}")
  if eps_clip_higher is not None and not eps_clip_higher >= 0:
    raise ValueError(f"eps_clip_higher must be >= 0 or None, got {eps_clip_higher}")
  if c_clip is not None and not c_clip > 1:
    raise ValueError(f"c_clip must be > 1 or None, got {c_clip}")
  if behav_imp_weight_cap is not None and not behav_imp_weight_cap > 0:
    raise ValueError(f"behav_imp_weight_cap must be > 0 or None, got {behav_imp_weight_cap}")


def decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, *, eps_clip,
                       eps_clip_higher=None, c_clip=None, behav_imp_weight_cap=None,
                       num_tokens=None, entropy=None):
  """Decoupled PPO loss (AReaL): clip against π_prox, reweight by π_prox / π_behav.

  Per token, with r = π_θ / π_prox and w = stop_gradient(π_prox / π_behav):
  `l = w * max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_higher))`, then
  `l = min(l, w * c_clip * |A|)` where A < 0 (dual clip). Tokens with
  w > behav_imp_weight_cap are dropped from the numerator only. All arrays share
  one shape (e.g. [B, T]); reductions run over every axis in float32 or wider.

  Masked tokens may hold any values, inf and NaN included: they are replaced
  before any exp, so they touch neither the loss nor its gradient.

  Args:
    logp: log π_θ of the sampled tokens (differentiated).
    prox_logp: log π_prox, recomputed at the start of the training step.
    behav_logp: log π_behav, recorded by the generator.
    advantages: per-token advantages.
    mask: nonzero on tokens that count.
    eps_clip: lower clip range, > 0.
    eps_clip_higher: upper clip range (DAPO clip-higher); defaults to eps_clip.
    c_clip: dual-clip constant, > 1; None disables dual clip.
    behav_imp_weight_cap: tokens with w above it are masked; None disables.
    num_tokens: denominator of the loss. Defaults to this call's valid-token count.
      Pass the whole training batch's valid-token count (all micro-batches, all
      shards) so that summing per-micro-batch losses and gradients gives the
      whole-batch mean. Counted before capping.
    entropy: optional per-token entropy, only reported as a metric.

  Returns:
    `(loss, metrics)`, scalars. Mean-type metrics (`clip_fraction`,
    `dual_clip_fraction`, `approx_kl`, `behav_weight_mean`, `capped_fraction`,
    `entropy`) are sums over this call's valid tokens divided by the loss
    denominator, so summing them over micro-batches sharing one `num_tokens` gives
    the batch mean. `behav_weight_max` is a maximum over valid tokens before
    capping (0 if none): combine with max. `num_tokens` is this call's valid-token
    count: combine with sum. The clip fractions count uncapped tokens where the
    bound changes the token's loss. `approx_kl` is the k3 estimator of
    KL(π_θ || π_prox): mean of (ρ - 1) - log ρ with ρ = π_prox / π_θ.
  """
  _check_hparams(eps_clip, eps_clip_higher, c_clip, behav_imp_weight_cap)
  eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
  dtype = jnp.promote_types(jnp.result_type(logp), jnp.float32)
  valid_BT = jnp.asarray(mask) != 0

  def masked(x):
    return jnp.where(valid_BT, jnp.asarray(x, dtype), 0.0)

  count = valid_BT.sum(dtype=dtype)
  denom = jnp.maximum(count if num_tokens is None else jnp.asarray(num_tokens, dtype), 1.0)
  log_ratio_BT = masked(jnp.asarray(logp, dtype) - jnp.asarray(prox_logp, dtype))
  log_weight_BT = jax.lax.stop_gradient(
      masked(jnp.asarray(prox_logp, dtype) - jnp.asarray(behav_logp, dtype)))
  adv_BT = masked(advantages)
  ratio_BT = jnp.exp(log_ratio_BT)
  weight_BT = jnp.exp(log_weight_BT)

  keep_BT = valid_BT
  if behav_imp_weight_cap is not None:
    keep_BT = valid_BT & (weight_BT <= behav_imp_weight_cap)

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

  metrics = {
      "clip_fraction": clip_active_BT.sum(dtype=dtype) / denom,
      "dual_clip_fraction": dual_active_BT.sum(dtype=dtype) / denom,
      "approx_kl": mean(jnp.exp(-log_ratio_BT) - 1.0 + log_ratio_BT),
      "behav_weight_mean": mean(weight_BT),
      "behav_weight_max": jnp.where(valid_BT, weight_BT, 0.0).max(initial=0.0),
      "capped_fraction": (valid_BT & ~keep_BT).sum(dtype=dtype) / denom,
      "num_tokens": count,
  }
  if entropy is not None:
    metrics["entropy"] = mean(masked(entropy))
  return loss, metrics


def naive_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, *, eps_clip,
                   eps_clip_higher=None, c_clip=None, behav_imp_weight_cap=None,
                   num_tokens=None, entropy=None):
  """Standard PPO loss that treats π_behav as π_prox (so w ≡ 1); for ablations.

  Same arguments and metrics as `decoupled_ppo_loss`; `prox_logp` is ignored.
  """
  del prox_logp
  return decoupled_ppo_loss(
      logp, behav_logp, behav_logp, advantages, mask, eps_clip=eps_clip,
      eps_clip_higher=eps_clip_higher, c_clip=c_clip,
      behav_imp_weight_cap=behav_imp_weight_cap, num_tokens=num_tokens, entropy=entropy)


LOSSES = {"decoupled_ppo": decoupled_ppo_loss, "naive_ppo": naive_ppo_loss}


def make_loss(name, **hparams):
  """Returns the loss registered as `name` with its hyper-parameters bound.

  Args:
    name: a key of `LOSSES`.
    **hparams: `eps_clip` (required), `eps_clip_higher`, `c_clip`,
      `behav_imp_weight_cap`; see `decoupled_ppo_loss`.

  Returns:
    `fn(logp, prox_logp, behav_logp, advantages, mask, num_tokens=None,
    entropy=None) -> (loss, metrics)`.

  Raises:
    ValueError: unknown name, unknown or missing hyper-parameter, invalid value.
  """
  if name not in LOSSES:
    raise ValueError(f"unknown loss {name!r}; known losses: {sorted(LOSSES)}")
  unknown = sorted(set(hparams) - set(_HPARAMS))
  if unknown:
    raise ValueError(f"unknown hyper-parameters {unknown} for loss {name!r}; "
                     f"known: {list(_HPARAMS)}")
  if "eps_clip" not in hparams:
    raise ValueError(f"loss {name!r} requires eps_clip")
  _check_hparams(**hparams)
  loss_fn = LOSSES[name]

  def fn(logp, prox_logp, behav_logp, advantages, mask, num_tokens=None, entropy=None):
    return loss_fn(logp, prox_logp, behav_logp, advantages, mask,
                   num_tokens=num_tokens, entropy=entropy, **hparams)

  return fn
