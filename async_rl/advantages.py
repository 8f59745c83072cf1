"""Outcome-reward advantages: shaping, DAPO overlong penalty, group normalisation.

Host-side numpy, like packing: the trainer computes one advantage per sample before the
batch goes to the device. Statistics are taken in float64 and the result is float32.
"""

import dataclasses
import operator

import numpy as np

from async_rl.config import ADVANTAGE_LEVELS



def _float64(x):
  return np.asarray(x, np.float64)


def _check_normalize_args(mean_level, std_level, leave_one_out, eps):
  if mean_level not in ADVANTAGE_LEVELS:
    raise ValueError(f"mean_level must be one of {ADVANTAGE_LEVELS}, got {mean_level!r}")
  if std_level not in ADVANTAGE_LEVELS:
    raise ValueError(f"std_level must be one of {ADVANTAGE_LEVELS}, got {std_level!r}")
  if leave_one_out and mean_level is None:
    raise ValueError("leave_one_out needs a mean_level ('group' or 'batch'), got None")
  if not eps >= 0:
    raise ValueError(f"eps must be >= 0, got {eps}")


def _check_shape_args(scale, clip, prefix=""):
  if not scale > 0:
    raise ValueError(f"{prefix}scale must be > 0, got {scale}")
  if clip is not None and not clip > 0:
    raise ValueError(f"{prefix}clip must be > 0 or None, got {clip}")


def _check_overlong_args(max_len, cache_len, factor, prefix=""):
  if not max_len > 0:
    raise ValueError(f"{prefix}max_len must be > 0, got {max_len}")
  if not 0 < cache_len <= max_len:
    raise ValueError(f"{prefix}cache_len must be in (0, {prefix}max_len={max_len}], "
                     f"got {cache_len}")
  if not factor >= 0:
    raise ValueError(f"{prefix}factor must be >= 0, got {factor}")


def group_normalize(rewards, group_size, *, mean_level="group", std_level="group",
                    leave_one_out=False, eps=1e-6):
  """Normalises per-sample rewards within groups of consecutive samples.

  With L_mean(i) and L_std(i) the samples of sample i's group or of the whole batch,
  as `mean_level` and `std_level` say:

    m_i = mean of r_j over j in L_mean(i)            (leave_one_out: j != i; None: 0)
    c_i = r_i - m_i
    s_i = sqrt(sum of c_j^2 over j in L_std(i) / (|L_std(i)| - 1))
    A_i = c_i / (s_i + eps)                          (std_level None: A_i = c_i)

  The std is the unbiased spread around the mean that is actually subtracted, c_j
  being each sample's own centred value (AReaL, `areal/utils/data.py`,
  `Normalization`), so every mode keeps |A_i| <= sqrt(|L_std(i)| - 1):
  - group mean, group std: GRPO. With leave-one-out (RLOO) c_i is n/(n-1) times the
    plain c_i, which the std of the same group cancels.
  - group mean, batch std: each sample's distance from its group mean, scaled by the
    spread of those distances over the batch.
  - batch mean, group std: the distance from the batch mean, scaled by the group's
    root-mean-square distance from the batch mean (an all-equal group is not divided
    by its zero spread).
  - no mean, with a std: r_i over the root-mean-square reward of its level.
  - std None (Dr.GRPO): no scaling and no eps.
  A mean-level set whose rewards are all equal is centred to exactly 0 (its mean is
  its common value, whatever the rounding of the sum), and a std of 0 with eps = 0
  gives 0 (its c_j are then all 0), so equal rewards never become noise.

  AReaL returns a std of 1 and a leave-one-out mean of 0 for sets of one sample; this
  raises instead, since those configurations are mistakes.

  Args:
    rewards: [N] rewards; samples g * group_size ... (g + 1) * group_size - 1 form
      group g.
    group_size: samples per group; must divide N.
    mean_level: "group", "batch" or None.
    std_level: "group", "batch" or None.
    leave_one_out: exclude each sample from its own mean.
    eps: added to the std, >= 0.

  Returns:
    [N] float32 advantages (numpy).

  Raises:
    ValueError: bad level, N not a multiple of group_size, or a mean or std that
      needs at least two samples at its level.
  """
  _check_normalize_args(mean_level, std_level, leave_one_out, eps)
  rewards_N = _float64(rewards)
  if rewards_N.ndim != 1:
    raise ValueError(f"rewards must be 1-D [N], got shape {rewards_N.shape}")
  num_samples = rewards_N.shape[0]
  try:
    group_size = operator.index(group_size)
  except TypeError:
    raise ValueError(f"group_size must be an int, got {group_size!r}") from None
  if group_size < 1 or num_samples % group_size:
    raise ValueError(f"group_size must be >= 1 and divide N={num_samples}, got {group_size}")
  sizes = {"group": group_size, "batch": num_samples}
  axes = {"group": 1, "batch": None}
  if leave_one_out and sizes[mean_level] < 2:
    raise ValueError(f"leave_one_out at mean_level={mean_level!r} needs >= 2 samples, "
                     f"got {sizes[mean_level]}")
  if std_level is not None and sizes[std_level] < 2:
    raise ValueError(f"std_level={std_level!r} needs >= 2 samples for an unbiased std, "
                     f"got {sizes[std_level]}")

  rewards_BG = rewards_N.reshape(-1, group_size)
  centred_BG = rewards_BG
  if mean_level is not None:
    axis, n = axes[mean_level], sizes[mean_level]
    total = rewards_BG.sum(axis=axis, keepdims=True)
    mean_BG = (total - rewards_BG) / (n - 1) if leave_one_out else total / n
    equal = np.ptp(rewards_BG, axis=axis, keepdims=True) == 0
    centred_BG = np.where(equal, 0.0, rewards_BG - mean_BG)
  if std_level is not None:
    axis = axes[std_level]
    sum_sq = np.square(centred_BG).sum(axis=axis, keepdims=True)
    denom = np.sqrt(sum_sq / (sizes[std_level] - 1)) + eps
    centred_BG = np.divide(centred_BG, denom, out=np.zeros_like(centred_BG),
                           where=np.broadcast_to(denom > 0, centred_BG.shape))
  return centred_BG.reshape(num_samples).astype(np.float32)


def shape_rewards(rewards, *, bias=0.0, scale=1.0, clip=None):
  """Returns `clip((rewards + bias) * scale, -clip, clip)` in float64; `clip=None` skips it."""
  _check_shape_args(scale, clip)
  shaped = (_float64(rewards) + bias) * scale
  return shaped if clip is None else np.clip(shaped, -clip, clip)


def overlong_penalty(lengths, *, max_len, cache_len, factor):
  """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476).

  0 up to `max_len - cache_len` tokens, then falling linearly to `-factor` at
  `max_len`, and `-factor` beyond.

  Args:
    lengths: [N] generated lengths.
    max_len: the generation budget, > 0.
    cache_len: width of the soft-penalty band, 0 < cache_len <= max_len.
    factor: the largest penalty, >= 0.

  Returns:
    [N] float64 penalties, <= 0.
  """
  _check_overlong_args(max_len, cache_len, factor)
  lengths_N = _float64(lengths)
  start = max_len - cache_len
  soft_N = (start - lengths_N) / cache_len * factor
  return np.where(lengths_N <= start, 0.0, np.where(lengths_N <= max_len, soft_N, -factor))


def make_advantage_fn(*, reward_bias=0.0, reward_scale=1.0, reward_clip=None,
                      overlong_max_len=None, overlong_cache_len=None, overlong_factor=1.0,
                      zero_truncated=False, mean_level="group", std_level="group",
                      leave_one_out=False, eps=1e-6):
  """Returns `fn(rewards_N, lengths_N, truncated_N, group_size) -> advantages_N`.

  In order: `shape_rewards`; if `zero_truncated`, truncated samples' shaped reward
  becomes 0; if `overlong_max_len` is set, `overlong_penalty` is added (after the
  zeroing, so a truncated sample still carries its length penalty); then
  `group_normalize`. Host numpy, float64 inside; the advantages are float32.

  The keyword names are those of `config.AdvantageConfig`, so an error names the field.

  Args:
    reward_bias, reward_scale, reward_clip: `bias`, `scale`, `clip` of `shape_rewards`.
    overlong_max_len, overlong_cache_len, overlong_factor: see `overlong_penalty`;
      the penalty is off unless both lengths are given.
    zero_truncated: zero the reward of samples cut at the length budget.
    mean_level, std_level, leave_one_out, eps: see `group_normalize`.

  Raises:
    ValueError: an invalid argument, named in the message.
  """
  _check_shape_args(reward_scale, reward_clip, prefix="reward_")
  if (overlong_max_len is None) != (overlong_cache_len is None):
    raise ValueError("overlong_max_len and overlong_cache_len must be given together, got "
                     f"{overlong_max_len} and {overlong_cache_len}")
  overlong = overlong_max_len is not None
  if overlong:
    _check_overlong_args(overlong_max_len, overlong_cache_len, overlong_factor,
                         prefix="overlong_")
  _check_normalize_args(mean_level, std_level, leave_one_out, eps)

  def advantage_fn(rewards_N, lengths_N, truncated_N, group_size):
    shaped_N = shape_rewards(rewards_N, bias=reward_bias, scale=reward_scale, clip=reward_clip)
    if zero_truncated:
      shaped_N = np.where(np.asarray(truncated_N, bool), 0.0, shaped_N)
    if overlong:
      shaped_N = shaped_N + overlong_penalty(lengths_N, max_len=overlong_max_len,
                                             cache_len=overlong_cache_len,
                                             factor=overlong_factor)
    return group_normalize(shaped_N, group_size, mean_level=mean_level,
                           std_level=std_level, leave_one_out=leave_one_out, eps=eps)

  return advantage_fn


def from_config(cfg, max_new_tokens: int):
  """The advantage function of a `config.AdvantageConfig`; the DAPO overlong penalty
  (when `overlong_cache_len` is set) ends at the generation budget `max_new_tokens`.

  Raises:
    ValueError: an invalid field, named `advantage.<field>`.
  """
  fields = dataclasses.asdict(cfg)
  if fields["overlong_cache_len"] is not None:
    fields["overlong_max_len"] = max_new_tokens
  try:
    return make_advantage_fn(**fields)
  except ValueError as e:
    raise ValueError(f"advantage.{e}") from None
