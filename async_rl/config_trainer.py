"""The trainer's parts of the experiment configuration (`config.ExperimentConfig`).

The optimizer, the PPO objective, advantages, micro-batching, the device mesh and the
training loop; `config` re-exports them. Bounds are checked as in `config`.
"""

import dataclasses
from typing import Optional

SCHEDULES = ("constant", "cosine")


def fail(field, value, why):
  """Raises the ValueError a config field's bad value gets."""
  raise ValueError(f"{field} {why}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with global-norm clipping and a warmup + constant/cosine schedule."""
  learning_rate: float = 1e-4
  warmup_steps: int = 0
  schedule: str = "constant"
  decay_steps: int = 1000
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  grad_clip: float = 1.0

  def __post_init__(self):
    if self.learning_rate <= 0:
      fail("optimizer.learning_rate", self.learning_rate, "must be > 0")
    if self.warmup_steps < 0:
      fail("optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
    if self.schedule not in SCHEDULES:
      fail("optimizer.schedule", self.schedule, f"must be one of {SCHEDULES}")
    if self.decay_steps < 1:
      fail("optimizer.decay_steps", self.decay_steps, "must be >= 1")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      fail("optimizer.b1/b2", (self.b1, self.b2), "must lie in [0, 1)")
    if self.weight_decay < 0:
      fail("optimizer.weight_decay", self.weight_decay, "must be >= 0")
    if self.grad_clip <= 0:
      fail("optimizer.grad_clip", self.grad_clip, "must be > 0")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
  """The decoupled PPO objective of DESIGN.md; `loss.check_hparams` validates it.

  Log-probs are taken at the sampling temperature (`generation.temperature`, or 1
  for greedy), so the trainer's recomputation matches the recorded behaviour ones.

  Attributes:
    loss: the objective, a name of `loss.LOSSES`.
    prox_logp: where π_prox comes from: "recompute" (a forward pass under the params
      at the start of the step), "loglinear" (AReaL's estimate from the per-token
      versions, no forward pass) or "behav" (π_behav itself: naive PPO, w = 1).
    num_minibatches: PPO updates per training step (AReaL's ppo_n_minibatches); π_prox
      is taken once, before the first, and each is the mean over its own tokens.
    eps_clip: PPO clip range below 1.
    eps_clip_higher: clip range above 1 (DAPO clip-higher); None: eps_clip.
    c_clip: dual-clip constant for negative advantages; None: no dual clip.
    importance_level: "token" (PPO's ratio per token) or "sequence" (GSPO's ratio
      per sequence).
    rejection_level: the behaviour-weight correction judges each "token" or each
      "sequence" (geometric mean of its tokens' weights).
    rejection_action: "mask" drops what is out of bounds from the loss; "clamp"
      clips the weight into the bounds (truncated importance sampling).
    rejection_metric: what is bounded: "ratio" (π_prox / π_behav) or a KL estimate
      "kl_k1", "kl_k2", "kl_k3".
    rejection_upper: upper bound of the metric; None: none.
    rejection_lower: lower bound of the metric; None: none. With neither bound, the
      weight is not corrected.
  """
  loss: str = "decoupled_ppo"
  prox_logp: str = "recompute"
  num_minibatches: int = 1
  eps_clip: float = 0.2
  eps_clip_higher: Optional[float] = None
  c_clip: Optional[float] = None
  importance_level: str = "token"
  rejection_level: str = "token"
  rejection_action: str = "mask"
  rejection_metric: str = "ratio"
  rejection_upper: Optional[float] = None
  rejection_lower: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Reward shaping, DAPO overlong penalty and group/batch normalisation; checked by
  `advantages.from_config`, which names its keywords after these fields."""
  reward_bias: float = 0.0
  reward_scale: float = 1.0
  reward_clip: Optional[float] = None
  overlong_cache_len: Optional[int] = None
  overlong_factor: float = 1.0
  zero_truncated: bool = False
  mean_level: Optional[str] = "group"
  std_level: Optional[str] = "group"
  leave_one_out: bool = False


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
  """Token-budget micro-batching; `row_buckets` empty means `default_row_buckets`.

  `reuse_slack`: a batch packs into a shape the train step already compiled when that
  costs at most this share more than its cheapest shape (`batching.pack_dynamic`'s
  estimate); 0 compiles every cheapest shape.
  """
  max_tokens_per_mb: int = 1024
  row_buckets: tuple[int, ...] = ()
  reuse_slack: float = 0.1

  def __post_init__(self):
    if self.max_tokens_per_mb < 1:
      fail("batching.max_tokens_per_mb", self.max_tokens_per_mb, "must be >= 1")
    if any(b < 1 or b > self.max_tokens_per_mb for b in self.row_buckets):
      fail("batching.row_buckets", self.row_buckets,
            "must lie in [1, batching.max_tokens_per_mb]")
    if not self.reuse_slack >= 0:
      fail("batching.reuse_slack", self.reuse_slack, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axis sizes; one axis may be -1 to take the remaining devices."""
  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if sum(v == -1 for v in sizes.values()) > 1:
      fail("mesh", sizes, "may have at most one axis of -1")
    for name, v in sizes.items():
      if v == 0 or v < -1:
        fail(f"mesh.{name}", v, "must be >= 1 or -1")

  def axis_sizes(self, num_devices: int) -> dict[str, int]:
    """Resolves -1 and checks that the axes multiply to `num_devices`."""
    sizes = dataclasses.asdict(self)
    known = 1
    for v in sizes.values():
      known *= v if v > 0 else 1
    for name, v in sizes.items():
      if v == -1:
        if num_devices % known:
          fail(f"mesh.{name}", v, f"cannot fill {num_devices} devices with the other "
                f"axes' product {known}")
        sizes[name] = num_devices // known
    product = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    if product != num_devices:
      fail("mesh (data*fsdp*tensor)", sizes, f"must multiply to the {num_devices} devices")
    return sizes


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop: after `max_consecutive_skips` non-finite steps in a row the run
  stops with an error (each skipped step leaves the params as they were)."""
  max_consecutive_skips: int = 5
  # Threads that share each update's micro-batches (`train_step.ThreadedTrainStep`);
  # 0 picks `train_step.default_grad_threads`: one per core on one CPU device (half the
  # cores when the generator runs at once, η > 0: `cpu_threads.cores_per_side`), else 1.
  grad_threads: int = 0

  def __post_init__(self):
    if self.max_consecutive_skips < 1:
      fail("train.max_consecutive_skips", self.max_consecutive_skips, "must be >= 1")
    if self.grad_threads < 0:
      fail("train.grad_threads", self.grad_threads, "must be >= 0 (0: automatic)")
