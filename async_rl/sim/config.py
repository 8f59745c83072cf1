"""Configuration of the discrete-event simulator, and its output-length sampler."""

import dataclasses
from typing import Optional

import numpy as np

from async_rl.config import UPDATE_MODES

MODES = ("sync", "async")
LENGTH_DISTS = ("constant", "lognormal", "pareto", "empirical")


@dataclasses.dataclass(frozen=True)
class DecodeCost:
  """The time of one decode step of an engine, in seconds: a roofline of its reads and
  its compute, each linear in the active slots `a` and the live tokens `c` their KV
  cache holds (prompts and tokens so far):

    step_s(a, c) = max(base + per_slot a + per_token c,
                       compute_per_slot a + compute_per_token c)

  `plan.costs.decode_cost` derives the coefficients from a model's shapes and a
  hardware row; a measured engine gives `base` and `per_slot` alone.
  """
  base: float
  per_slot: float = 0.0
  per_token: float = 0.0
  compute_per_slot: float = 0.0
  compute_per_token: float = 0.0

  def __post_init__(self):
    for name in ("base", "per_slot", "per_token", "compute_per_slot", "compute_per_token"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"DecodeCost.{name} must be >= 0, got {getattr(self, name)}")
    if not self.step_s(1, 0) > 0:
      raise ValueError(f"DecodeCost: a step of one slot must take time (base + per_slot or "
                       f"compute_per_slot > 0), got {self}")

  def step_s(self, active: int, live_tokens: int) -> float:
    """The time of one step with `active` slots holding `live_tokens`."""
    return max(self.base + self.per_slot * active + self.per_token * live_tokens,
               self.compute_per_slot * active + self.compute_per_token * live_tokens)

  @property
  def grows_with_live_tokens(self) -> bool:
    """Whether the step's time depends on the live tokens (not only on the slots)."""
    return self.per_token > 0 or self.compute_per_token > 0


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated system. Times in seconds, lengths in tokens.

  `mode="sync"`: generation and training alternate on the same accelerators;
  generation runs on `num_generators` of them and training on `trainer_accelerators`
  (usually both equal to the whole cluster), and `max_staleness` must be 0, so the
  alternation comes from the gate itself (η = 0 is the synchronous baseline).
  `mode="async"`: `num_generators` and `trainer_accelerators` are disjoint and run
  concurrently. `accelerators` is the hardware either mode occupies.

  Costs: a decode step of a generator with `a` active slots holding `c` live tokens
  (prompts and tokens so far) takes `decode.step_s(a, c)` (a `DecodeCost`) and yields
  one token per active slot; starting a sample costs
  `prefill_per_token` per token it holds (its prompt, and its tokens so far when it
  resumes); under `retract` every in-flight sample is re-prefilled (prompt and tokens
  so far) at each weight update; with `kv_tokens` > 0 a generator's live tokens may
  not exceed it: a sample that finds no room waits, and when the slots' growth fills
  it the newest sample is preempted back to the queue and re-prefilled when it resumes;
  a generator runs its decode steps in chunks of `steps_per_call` (one host round trip
  each): a sample that ends within a chunk holds its slot to the chunk's end, and
  samples join, and new weights apply, only between chunks;
  applying new weights costs a generator `weight_sync`; a finished group is scored
  `reward_latency` later; a training step costs `trainer_step_base +
  trainer_per_token * (prompt + output tokens) / trainer_accelerators`.

  Output lengths: `length_dist` "constant" (`length_median` every time), "lognormal"
  (median `length_median`, log-sd `length_sigma`) or "pareto" (minimum
  `length_median / 2 ** (1 / length_alpha)`, so its median is `length_median`, tail
  index `length_alpha`), rounded and clipped to [1, `max_length`], or "empirical"
  (drawn with replacement from `length_samples`, e.g. lengths a real run produced).
  """
  mode: str = "async"
  num_generators: int = 4
  trainer_accelerators: int = 1
  slots: int = 16
  decode: DecodeCost = DecodeCost(base=0.02, per_slot=0.0005)
  prefill_per_token: float = 1e-5
  prompt_tokens: int = 128
  kv_tokens: int = 0
  reward_latency: float = 0.0
  trainer_per_token: float = 3e-4
  trainer_step_base: float = 0.0
  weight_sync: float = 0.0
  steps_per_call: int = 1
  max_staleness: Optional[int] = 4
  batch_groups: int = 8
  group_size: int = 8
  update_mode: str = "retract"
  length_dist: str = "lognormal"
  length_median: float = 256.0
  length_sigma: float = 1.0
  length_alpha: float = 1.5
  max_length: int = 4096
  length_samples: tuple[int, ...] = ()

  def __post_init__(self):
    _check_choice("mode", self.mode, MODES)
    _check_choice("update_mode", self.update_mode, UPDATE_MODES)
    _check_choice("length_dist", self.length_dist, LENGTH_DISTS)
    for name in ("num_generators", "trainer_accelerators", "slots", "prompt_tokens",
                 "batch_groups", "group_size", "max_length", "steps_per_call"):
      _check(name, isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
             "an int >= 1")
    _check("decode", isinstance(self.decode, DecodeCost), "a DecodeCost")
    for name in ("prefill_per_token", "reward_latency", "trainer_per_token",
                 "trainer_step_base", "weight_sync"):
      _check(name, getattr(self, name) >= 0, ">= 0")
    _check("kv_tokens", isinstance(self.kv_tokens, int) and (
        self.kv_tokens == 0 or self.kv_tokens >= self.prompt_tokens + self.max_length),
           "0 (unbounded) or an int holding one sequence (prompt_tokens + max_length)")
    if self.length_dist != "empirical":
      _check("length_median", 1 <= self.length_median <= self.max_length,
             "in [1, max_length]")
    _check("length_sigma", self.length_sigma >= 0, ">= 0")
    _check("length_alpha", self.length_alpha > 0, "> 0")
    if self.length_dist == "empirical":
      _check("length_samples", len(self.length_samples) > 0 and all(
          1 <= n <= self.max_length for n in self.length_samples),
             "non-empty, each in [1, max_length], when length_dist is 'empirical'")
    if self.max_staleness is not None:
      _check("max_staleness", isinstance(self.max_staleness, int) and self.max_staleness >= 0,
             "an int >= 0 or None")
    if self.mode == "sync":
      _check("max_staleness", self.max_staleness == 0,
             "0 in sync mode (generation and training alternate)")

  @property
  def accelerators(self) -> int:
    """The accelerators the system occupies: shared in sync mode, disjoint in async."""
    if self.mode == "sync":
      return max(self.num_generators, self.trainer_accelerators)
    return self.num_generators + self.trainer_accelerators


def _check(name, ok, what):
  if not ok:
    raise ValueError(f"SimConfig.{name} must be {what}")


def _check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"SimConfig.{name} must be one of {choices}, got {value!r}")


def sample_lengths(cfg: SimConfig, rng: np.random.Generator, n: int) -> np.ndarray:
  """`n` output lengths drawn from `cfg`'s distribution, as ints in [1, max_length]."""
  if cfg.length_dist == "constant":
    raw = np.full(n, cfg.length_median)
  elif cfg.length_dist == "empirical":
    raw = rng.choice(np.asarray(cfg.length_samples), n)
  elif cfg.length_dist == "lognormal":
    raw = cfg.length_median * np.exp(cfg.length_sigma * rng.standard_normal(n))
  else:
    scale = cfg.length_median / 2 ** (1 / cfg.length_alpha)
    raw = scale * (1 + rng.pareto(cfg.length_alpha, n))
  return np.clip(np.rint(raw), 1, cfg.max_length).astype(np.int64)
