"""The trajectory: the one host record of a sample, from the generator to the packer.

The generator pool (or a user's workflow) builds it, the reward service scores it,
the parameter server admits its group, and the trainer takes advantages from the
group's rewards and packs it. It is checked once, where it enters (`validate`, for
records that do not come from the pool), and trusted after.

All per-token arrays have one length T: the prompt, then everything after it
(policy tokens and, in multi-turn episodes, environment tokens):

  tokens_T     int32 token ids.
  loss_mask_T  bool, True on the tokens the loss trains (never the first token,
               which nothing predicts).
  logp_T       float32 behaviour log-prob of each policy token; 0 elsewhere.
  versions_T   int32 version of the params that produced each policy token; -1 on
               prompt and environment tokens.

The behaviour log-probs are taken under the distribution the policy tokens were drawn
from: softmax(logits / temperature) truncated to the top-k / top-p support that
`top_k` and `top_p` (per sample) give `policy.support`; 0 and 1 mean the full
softmax. The trainer scores the tokens on the support the same function gives.

Policy tokens are exactly those with `versions_T >= 0`. The loss mask is usually the
policy tokens; it can hold fewer (a policy token too stale to train on) or, for a
supervised sequence, non-policy tokens. Staleness at trainer version v is
`v - versions_T` over policy tokens, computed only by `staleness_T`.
"""

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
  """One sample; see the module docstring for the per-token arrays.

  Attributes:
    tokens_T, loss_mask_T, logp_T, versions_T: the per-token arrays.
    prompt_len: P, the number of leading prompt tokens (at least 1).
    finish_reason: why generation stopped: "stop", "length", "aborted", or a
      workflow's own reason.
    reward: the scalar reward, None until scored.
    metadata: anything the task or workflow attaches (not read by the trainer).
    top_k, top_p: the truncation `logp_T` is taken under (the sampling's
      `SamplingParams.logp_truncation`); 0 and 1: none.
  """
  tokens_T: np.ndarray
  loss_mask_T: np.ndarray
  logp_T: np.ndarray
  versions_T: np.ndarray
  prompt_len: int
  finish_reason: str
  reward: Optional[float] = None
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  top_k: int = 0
  top_p: float = 1.0

  @classmethod
  def from_completion(cls, prompt_P, completion_C, logp_C, versions_C, finish_reason: str,
                      **kwargs) -> "Trajectory":
    """A single-turn sample: a prompt, then C generated (policy, trained) tokens."""
    P, C = len(prompt_P), len(completion_C)
    return cls(tokens_T=np.concatenate([np.asarray(prompt_P, np.int32),
                                        np.asarray(completion_C, np.int32)]),
               loss_mask_T=np.arange(P + C) >= P,
               logp_T=np.concatenate([np.zeros(P, np.float32), np.asarray(logp_C, np.float32)]),
               versions_T=np.concatenate([np.full(P, -1, np.int32),
                                          np.asarray(versions_C, np.int32)]),
               prompt_len=P, finish_reason=finish_reason, **kwargs)

  def __len__(self) -> int:
    return self.tokens_T.size

  @property
  def prompt_P(self) -> np.ndarray:
    return self.tokens_T[:self.prompt_len]

  @property
  def completion_C(self) -> np.ndarray:
    """Everything after the prompt (policy and environment tokens)."""
    return self.tokens_T[self.prompt_len:]

  @property
  def num_policy_tokens(self) -> int:
    return int(np.count_nonzero(self.versions_T >= 0))

  @property
  def truncated(self) -> bool:
    """Whether `logp_T` is taken under a truncated distribution."""
    return self.top_k > 0 or self.top_p < 1

  def with_reward(self, reward: float) -> "Trajectory":
    return dataclasses.replace(self, reward=float(reward))


def validate(traj: Trajectory, *, vocab_size: Optional[int] = None) -> Trajectory:
  """Checks a trajectory built outside the pool; returns it with canonical dtypes.

  Raises:
    ValueError: naming the first field that is malformed.
  """
  if not isinstance(traj, Trajectory):
    raise ValueError(f"expected a Trajectory, got {type(traj).__name__}")
  tokens_T = np.asarray(traj.tokens_T)
  if tokens_T.ndim != 1 or not np.issubdtype(tokens_T.dtype, np.integer):
    raise ValueError(f"Trajectory.tokens_T must be a 1-D integer array, got dtype "
                     f"{tokens_T.dtype} and shape {tokens_T.shape}")
  T = tokens_T.size
  arrays = {"loss_mask_T": np.asarray(traj.loss_mask_T), "logp_T": np.asarray(traj.logp_T),
            "versions_T": np.asarray(traj.versions_T)}
  for name, arr in arrays.items():
    if arr.shape != (T,):
      raise ValueError(f"Trajectory.{name} must have shape ({T},) like tokens_T, got "
                       f"{arr.shape}")
  if not np.issubdtype(arrays["versions_T"].dtype, np.integer):
    raise ValueError(f"Trajectory.versions_T must be integers, got "
                     f"{arrays['versions_T'].dtype}")
  if T and arrays["versions_T"].min() < -1:
    raise ValueError("Trajectory.versions_T must be >= 0 on policy tokens and -1 elsewhere, "
                     f"got {arrays['versions_T'].min()}")
  if not 1 <= traj.prompt_len <= T:
    raise ValueError(f"Trajectory.prompt_len must lie in [1, {T}], got {traj.prompt_len}")
  if (arrays["versions_T"][:traj.prompt_len] != -1).any():
    raise ValueError("Trajectory.versions_T must be -1 on the prompt's tokens")
  mask_T = arrays["loss_mask_T"].astype(bool)
  if T and mask_T[0]:
    raise ValueError("Trajectory.loss_mask_T must be False on the first token (nothing "
                     "predicts it)")
  if vocab_size is not None and T and not (0 <= tokens_T.min() and tokens_T.max() < vocab_size):
    raise ValueError(f"Trajectory.tokens_T must lie in [0, {vocab_size})")
  if not isinstance(traj.finish_reason, str):
    raise ValueError(f"Trajectory.finish_reason must be a str, got {traj.finish_reason!r}")
  if traj.reward is not None and not np.isreal(traj.reward):
    raise ValueError(f"Trajectory.reward must be a real number or None, got {traj.reward!r}")
  if not (isinstance(traj.top_k, (int, np.integer)) and traj.top_k >= 0):
    raise ValueError(f"Trajectory.top_k must be an int >= 0 (0: none), got {traj.top_k!r}")
  if not 0 < traj.top_p <= 1:
    raise ValueError(f"Trajectory.top_p must lie in (0, 1] (1: none), got {traj.top_p!r}")
  return dataclasses.replace(
      traj, tokens_T=tokens_T.astype(np.int32), loss_mask_T=mask_T,
      logp_T=np.where(arrays["versions_T"] >= 0, arrays["logp_T"], 0).astype(np.float32),
      versions_T=arrays["versions_T"].astype(np.int32), prompt_len=int(traj.prompt_len),
      reward=None if traj.reward is None else float(traj.reward), top_k=int(traj.top_k),
      top_p=float(traj.top_p))


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
  """The scored trajectories of one prompt: the unit the gate, buffer and trainer count.

  Attributes:
    prompt_id: identifies the prompt (logging and data bookkeeping).
    trajectories: every one scored; together they hold at least one policy token.
    min_version, max_version: the oldest and newest version of its policy tokens.
  """
  prompt_id: Hashable
  trajectories: tuple[Trajectory, ...]
  min_version: int = dataclasses.field(init=False)
  max_version: int = dataclasses.field(init=False)

  def __post_init__(self):
    trajectories = tuple(self.trajectories)
    for i, t in enumerate(trajectories):
      if not isinstance(t, Trajectory):
        raise ValueError(f"group {self.prompt_id!r}: trajectories[{i}] must be a Trajectory, "
                         f"got {type(t).__name__}")
      if t.reward is None:
        raise ValueError(f"group {self.prompt_id!r}: trajectories[{i}] has no reward")
    versions = [t.versions_T[t.versions_T >= 0] for t in trajectories]
    versions = [v for v in versions if v.size]
    if not versions:
      raise ValueError(f"group {self.prompt_id!r} holds no policy token "
                       f"({len(trajectories)} trajectories)")
    object.__setattr__(self, "trajectories", trajectories)
    object.__setattr__(self, "min_version", int(min(v.min() for v in versions)))
    object.__setattr__(self, "max_version", int(max(v.max() for v in versions)))


def staleness_T(traj: Trajectory, version: int) -> np.ndarray:
  """`version - versions_T` over the trajectory's policy tokens (the one definition)."""
  versions = traj.versions_T
  return version - versions[versions >= 0]


def staleness_counts(groups: Sequence[Group], version: int) -> np.ndarray:
  """counts[k] = trained policy tokens (those in the loss mask) of `groups` whose
  staleness at `version` is k."""
  stale = [staleness_T(t, version)[np.asarray(t.loss_mask_T, bool)[t.versions_T >= 0]]
           for g in groups for t in g.trajectories]
  stale = np.concatenate(stale) if stale else np.zeros(0, np.int64)
  return np.bincount(stale) if stale.size else np.zeros(0, np.int64)


def split_turns(traj: Trajectory) -> list[Trajectory]:
  """One sample per policy turn of `traj` (a maximal run of policy tokens): the episode
  up to the turn's end, whose earlier tokens are its prompt. Each keeps the turn's
  loss mask, log-probs and versions, and the episode's reward; all but the last end
  in "stop". A trajectory without policy tokens is returned as it is."""
  policy = np.concatenate([[0], (traj.versions_T >= 0).astype(np.int8), [0]])
  edges = np.flatnonzero(np.diff(policy))
  starts, ends = edges[::2], edges[1::2]
  out = []
  for k, (start, end) in enumerate(zip(starts, ends)):
    out.append(Trajectory(
        tokens_T=traj.tokens_T[:end], loss_mask_T=_within(traj.loss_mask_T, start, end, False),
        logp_T=_within(traj.logp_T, start, end, 0),
        versions_T=_within(traj.versions_T, start, end, -1), prompt_len=int(start),
        finish_reason=traj.finish_reason if k == len(starts) - 1 else "stop",
        reward=traj.reward, metadata={**traj.metadata, "turn": k}, top_k=traj.top_k,
        top_p=traj.top_p))
  return out or [traj]


def _within(a: np.ndarray, start: int, end: int, fill) -> np.ndarray:
  """`a[:end]` with everything before `start` replaced by `fill`."""
  b = np.full(end, fill, a.dtype)
  b[start:end] = a[start:end]
  return b
