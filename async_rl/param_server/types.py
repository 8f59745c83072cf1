"""Scored prompt groups: what the rollout side offers to the parameter server."""

import dataclasses
from collections.abc import Hashable

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ScoredSample:
  """One scored completion of a prompt, on the host.

  Attributes:
    prompt_P: int32 prompt token ids (at least one).
    completion_T: int32 generated token ids (may be empty).
    behav_logp_T: float32 behaviour log-prob of each generated token.
    versions_T: int32 version (>= 0) of the params that generated each token.
    reward: the sample's scalar reward.
    finish_reason: why generation stopped ("stop", "length", ...).
  """
  prompt_P: np.ndarray
  completion_T: np.ndarray
  behav_logp_T: np.ndarray
  versions_T: np.ndarray
  reward: float
  finish_reason: str

  def __post_init__(self):
    prompt_P = np.asarray(self.prompt_P)
    completion_T = np.asarray(self.completion_T)
    versions_T = np.asarray(self.versions_T)
    behav_logp_T = np.asarray(self.behav_logp_T, dtype=np.float32)
    for name, arr in (("prompt_P", prompt_P), ("completion_T", completion_T)):
      if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"ScoredSample.{name} must be a 1-D integer array, got dtype "
                         f"{arr.dtype} and shape {arr.shape}")
    if prompt_P.size == 0:
      raise ValueError("ScoredSample.prompt_P must hold at least one token")
    num_generated = completion_T.size
    for name, arr in (("behav_logp_T", behav_logp_T), ("versions_T", versions_T)):
      if arr.shape != (num_generated,):
        raise ValueError(f"ScoredSample.{name} must have shape ({num_generated},) (one entry "
                         f"per generated token), got {arr.shape}")
    if num_generated and not np.issubdtype(versions_T.dtype, np.integer):
      raise ValueError(f"ScoredSample.versions_T must be integers, got dtype {versions_T.dtype}")
    if num_generated and versions_T.min() < 0:
      raise ValueError(f"ScoredSample.versions_T must be >= 0 (only prompt tokens carry -1), "
                       f"got {versions_T.min()}")
    if not isinstance(self.finish_reason, str):
      raise ValueError(f"ScoredSample.finish_reason must be a str, got {self.finish_reason!r}")
    object.__setattr__(self, "prompt_P", prompt_P.astype(np.int32))
    object.__setattr__(self, "completion_T", completion_T.astype(np.int32))
    object.__setattr__(self, "behav_logp_T", behav_logp_T)
    object.__setattr__(self, "versions_T", versions_T.astype(np.int32))
    object.__setattr__(self, "reward", float(self.reward))


@dataclasses.dataclass(frozen=True, eq=False)
class ScoredGroup:
  """The scored samples of one prompt: the unit the staleness gate and buffer count.

  Attributes:
    prompt_id: identifies the prompt (for logging and data bookkeeping).
    samples: the prompt's scored samples; together they hold at least one generated
      token, since a group without one carries nothing to train on.
    min_version: the oldest version among all generated tokens; the group's
      staleness at trainer version v is `v - min_version`.
    max_version: the newest version among all generated tokens.
  """
  prompt_id: Hashable
  samples: tuple[ScoredSample, ...]
  min_version: int = dataclasses.field(init=False)
  max_version: int = dataclasses.field(init=False)

  def __post_init__(self):
    samples = tuple(self.samples)
    for i, sample in enumerate(samples):
      if not isinstance(sample, ScoredSample):
        raise ValueError(f"group {self.prompt_id!r}: samples[{i}] must be a ScoredSample, "
                         f"got {type(sample).__name__}")
    versions = [s.versions_T for s in samples if s.versions_T.size]
    if not versions:
      raise ValueError(f"group {self.prompt_id!r} holds no generated token "
                       f"({len(samples)} samples)")
    object.__setattr__(self, "samples", samples)
    object.__setattr__(self, "min_version", int(min(v.min() for v in versions)))
    object.__setattr__(self, "max_version", int(max(v.max() for v in versions)))
