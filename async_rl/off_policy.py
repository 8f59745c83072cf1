"""Off-policy corrections of the decoupled PPO loss: per-sequence means in packed rows,
AReaL's rejection-sampling family for the behaviour weight, and the log-linear estimate
of the proximal log-probs.

Pure jnp on arrays of one shape [..., T] whose last axis is a packed row: a row holds
several sequences, told apart by `segment_ids` (1, 2, ... per row, 0 on padding), so a
sequence is (row, segment).
"""

import jax
import jax.numpy as jnp

from async_rl.config import REJECTION_ACTIONS, REJECTION_LEVELS, REJECTION_METRICS


def check_correction(*, level="token", action="mask", metric="ratio", lower=None, upper=None,
                     prefix="rejection_"):
  """Raises ValueError, naming `prefix + field`, for an invalid correction.

  The bounds follow AReaL's `RejectionSamplingConfig`: for the ratio metric
  upper > 1 and 0 < lower, and (here also) lower < 1, since a bound on the wrong side
  of 1 would reject or clamp the tokens whose policies agree; for kl_k2 and kl_k3
  upper > 0; lower <= upper; clamping only bounds a ratio.
  """
  for name, value, allowed in (("level", level, REJECTION_LEVELS),
                               ("action", action, REJECTION_ACTIONS),
                               ("metric", metric, REJECTION_METRICS)):
    if value not in allowed:
      raise ValueError(f"{prefix}{name} must be one of {allowed}, got {value!r}")
  if action == "clamp" and metric != "ratio":
    raise ValueError(f"{prefix}action='clamp' bounds the weight itself, so it needs "
                     f"{prefix}metric='ratio', got {metric!r} (use {prefix}action='mask')")
  if lower is not None and upper is not None and not lower <= upper:
    raise ValueError(f"{prefix}lower must be <= {prefix}upper={upper}, got {lower}")
  if metric == "ratio":
    if upper is not None and not upper > 1:
      raise ValueError(f"{prefix}upper must be > 1 for the ratio metric, got {upper}")
    if lower is not None and not 0 < lower < 1:
      raise ValueError(f"{prefix}lower must lie in (0, 1) for the ratio metric, got {lower}")
  elif metric in ("kl_k2", "kl_k3") and upper is not None and not upper > 0:
    raise ValueError(f"{prefix}upper must be > 0 for {metric}, got {upper}")


def sequence_mean(x, weight, segment_ids):
  """Per token, the `weight`-weighted mean of `x` over the tokens of its sequence.

  A sequence whose weights are all 0 gets 0. Shapes [..., T]; computed per row with
  one segment sum, so rows stay independent (and shard as the batch does).
  """
  shape = jnp.shape(x)
  row_len = shape[-1]

  def row(x_T, w_T, seg_T):
    total = jax.ops.segment_sum(x_T * w_T, seg_T, num_segments=row_len + 1)
    count = jax.ops.segment_sum(w_T, seg_T, num_segments=row_len + 1)
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)[seg_T]

  flat = [jnp.reshape(a, (-1, row_len)) for a in (x, jnp.asarray(weight, x.dtype),
                                                  jnp.asarray(segment_ids, jnp.int32))]
  return jax.vmap(row)(*flat).reshape(shape)


def divergence(log_weight, metric):
  """AReaL's metrics of ρ = π_prox / π_behav from log ρ (its `KLEstimator` conventions).

  ratio: ρ; kl_k1: log ρ (may be negative); kl_k2: (log ρ)² / 2; kl_k3: 1/ρ - 1 + log ρ.
  """
  if metric == "ratio":
    return jnp.exp(log_weight)
  if metric == "kl_k1":
    return log_weight
  if metric == "kl_k2":
    return 0.5 * jnp.square(log_weight)
  return jnp.expm1(-log_weight) + log_weight


def behaviour_weight(log_weight, valid, segment_ids, *, level="token", action="mask",
                     metric="ratio", lower=None, upper=None):
  """The behaviour weight w of each token after AReaL's rejection-sampling family.

  `log_weight` is log ρ = log π_prox - log π_behav per token, `valid` the loss mask.
  With neither bound set there is no correction: w = ρ per token. Otherwise the metric
  (`divergence`) is judged per token, or per sequence (`level="sequence"`: its mean
  over the sequence's valid tokens, which for the ratio is taken in log space, the
  geometric mean, and then also replaces each token's ρ as the sequence's w; a KL
  metric keeps the token ρ as w). Against [lower, upper] (either may be None):
  - `mask`: tokens (or whole sequences) outside are dropped from the loss;
  - `clamp` (truncated importance sampling, ratio only): w is clipped into the bounds.
  Unlike AReaL, where the weight is applied only when a rejection config is given,
  the weight is always applied, as the decoupled objective of the paper has it.

  Args:
    log_weight: log ρ, 0 (or anything finite) off the mask; [..., T].
    valid: bool loss mask.
    segment_ids: the packing's segment ids.
    level, action, metric, lower, upper: as checked by `check_correction`.

  Returns:
    `(weight, keep, corrected)`: w; the tokens that stay in the loss; the valid tokens
    whose w was masked or clamped.
  """
  token_weight = jnp.exp(log_weight)
  if lower is None and upper is None:
    return token_weight, valid, jnp.zeros_like(valid)
  weight = token_weight
  if level == "token":
    value = token_weight if metric == "ratio" else divergence(log_weight, metric)
  elif metric == "ratio":
    weight = jnp.exp(sequence_mean(log_weight, valid, segment_ids))
    value = weight
  else:
    value = sequence_mean(divergence(log_weight, metric), valid, segment_ids)
  if action == "clamp":
    clamped = jnp.clip(weight, lower, upper)
    return clamped, valid, valid & (clamped != weight)
  inside = jnp.ones_like(valid)
  if upper is not None:
    inside &= value <= upper
  if lower is not None:
    inside &= value >= lower
  return weight, valid & inside, valid & ~inside


def loglinear_prox_logp(logp, behav_logp, versions, *, prox_version, theta_version):
  """AReaL's log-linear estimate of log π_prox, which saves the recompute forward.

  `log π_prox ≈ log π_behav + α (stop_gradient(log π_θ) - log π_behav)` with
  `α = clip((v_prox - v_behav) / (v_θ - v_behav), 0, 1)` per token: log-probs are taken
  to move linearly in the version between the behaviour policy and θ
  (`areal/trainer/ppo/actor.py`, `compute_prox_logp_approximations`).

  Version convention. `v` counts training steps; the step that turns version v into
  v + 1 starts from the params of version v, the ones that generated the tokens tagged
  v. So π_prox, the params at the start of the step, is exactly version v:
  `prox_version = v`. With n PPO minibatch updates in the step, θ before minibatch k
  (k = 0 .. n - 1) has made k of the n updates that together move one version:
  `theta_version = v + k / n`. For k = 0, θ is π_prox and α = 1 for every token, so the
  estimate is exact (with one minibatch it equals recomputation); a token tagged
  v_θ itself also gets α = 1, where the formula's 0 / 0 stands for three equal policies.
  AReaL instead takes v_θ = its current version (our v) and v_prox = v - 1 for every
  minibatch, one version behind the π_prox that its own recomputation would give: its
  α is 0 for tokens up to one step stale, and does not follow θ within the step.

  Args:
    logp: log π_θ of the sampled tokens; only its value is used.
    behav_logp: log π_behav, recorded by the generator.
    versions: int version of the weights that produced each token, -1 off the loss
      mask (those tokens get log π_behav).
    prox_version: v_prox, a scalar (may be traced).
    theta_version: v_θ >= v_prox, a scalar (may be traced and fractional).

  Returns:
    log π_prox estimates, shaped like `logp`, with no gradient.
  """
  dtype = jnp.promote_types(jnp.result_type(logp), jnp.float32)
  versions = jnp.asarray(versions)
  generated = versions >= 0
  # Lag and advance separately: the lag is an exact integer, the advance a fraction.
  lag = (prox_version - versions).astype(dtype)
  gap = lag + jnp.asarray(theta_version - prox_version, dtype)
  alpha = jnp.where(gap > 0, jnp.clip(lag / jnp.where(gap > 0, gap, 1.0), 0.0, 1.0), 1.0)
  behav = jnp.asarray(behav_logp, dtype)
  estimate = behav + alpha * (jax.lax.stop_gradient(jnp.asarray(logp, dtype)) - behav)
  return jnp.where(generated, estimate, behav)
