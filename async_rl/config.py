"""The experiment configuration: typed, frozen sections, every field declared once.

Config files (`configs/*.py`) return an `ml_collections.ConfigDict` built from
`config_dict()`; a binary converts it once with `from_dict`, and library code only sees
these dataclasses, each component the section it owns. A field's bounds that concern the
config alone are checked here, naming the field; a bound that a component owns (the
loss's clip ranges, a task's lengths) is checked by that component, and the builder
(`rl.build.preflight`) runs those checks before anything is compiled. Every set of names
a field may take lives here as a tuple.

This module is a leaf: it imports only the standard library (`config_dict` imports
ml_collections, `parse_flags` absl, when called), and it reads no files: resolving a
Hugging Face directory or checking a data path is the builder's job.
"""

import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from typing import Any, Optional

# The names fields may take.
DTYPES = ("float32", "bfloat16", "float16")
# Per layer and token, what `model.remat_saves` may keep from the forward pass (the
# rest is recomputed in the backward pass), and the matmul that keeping it saves
# recomputing: the rotated q, k and v (D (H + 2K) E elements; their projection), the
# residual stream between attention and MLP (D; the output projection), and the MLP's
# gate and up projections (F each; their matmuls).
REMAT_SAVES = ("qkv", "residual", "mlp_gate", "mlp_up")
SCHEDULES = ("constant", "cosine")
LOSSES = ("decoupled_ppo",)
PROX_LOGP = ("recompute", "loglinear", "behav")
IMPORTANCE_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("token", "sequence")
REJECTION_ACTIONS = ("mask", "clamp")
REJECTION_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
ADVANTAGE_LEVELS = ("group", "batch", None)
UPDATE_MODES = ("retract", "keep", "drain")
ON_STALE = ("drop", "mask_tokens", "admit")
PLACEMENTS = ("in_process", "ray")
# Fields of `model` that stay the run's own with `hf_model_dir`: numerics and length,
# not architecture.
HF_RUN_MODEL_FIELDS = ("max_seq_len", "dtype", "param_dtype", "remat", "remat_saves")


def fail(field: str, value, why: str):
  """Raises the ValueError a config field's bad value gets."""
  raise ValueError(f"{field} {why}, got {value!r}")


def _check_choice(field, value, choices):
  if value not in choices:
    fail(field, value, f"must be one of {choices}")


def _check_finite(section, obj):
  """Every float field of `obj` must be finite (NaN passes every `<` check)."""
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if isinstance(value, float) and not math.isfinite(value):
      fail(f"{section}.{f.name}", value, "must be finite")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Qwen2-family decoder.

  `dtype` is the compute dtype, `param_dtype` the storage dtype of the params.
  `qk_norm` adds the per-head q/k RMSNorm of Qwen3. `remat` recomputes each layer's
  activations in the backward pass instead of storing them, except those named in
  `remat_saves` (`REMAT_SAVES`): memory traded for the FLOPs of recomputing them
  (`python -m benchmarks.memory --saves=...` prints both from the compiler).
  """
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 512
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  qkv_bias: bool = True
  qk_norm: bool = False
  tie_embeddings: bool = False
  max_seq_len: int = 512
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  remat_saves: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "remat_saves", tuple(self.remat_saves))
    unknown = set(self.remat_saves) - set(REMAT_SAVES)
    if unknown:
      raise ValueError(f"model.remat_saves: unknown {sorted(unknown)}; known: "
                       f"{sorted(REMAT_SAVES)}")
    if self.remat_saves and not self.remat:
      raise ValueError(f"model.remat_saves={self.remat_saves} needs model.remat=True")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        fail(f"model.{name}", getattr(self, name), "must be >= 1")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of "
                       f"model.n_kv_heads ({self.n_kv_heads})")
    if self.head_dim % 2:
      fail("model.head_dim", self.head_dim, "must be even for rotary embeddings")
    for name in ("dtype", "param_dtype"):
      _check_choice(f"model.{name}", getattr(self, name), DTYPES)
    _check_finite("model", self)
    if self.rope_theta <= 0 or self.rms_eps <= 0:
      raise ValueError("model.rope_theta and model.rms_eps must be > 0")

  def num_params(self) -> int:
    D, F, H, K, E, V = (self.d_model, self.d_ff, self.n_heads, self.n_kv_heads,
                        self.head_dim, self.vocab_size)
    per_layer = 2 * D * H * E + 2 * D * K * E + 3 * D * F + 2 * D
    per_layer += (H + 2 * K) * E if self.qkv_bias else 0
    per_layer += 2 * E if self.qk_norm else 0
    return self.n_layers * per_layer + V * D * (1 if self.tie_embeddings else 2) + D


_QWEN = dict(rope_theta=1e6, qkv_bias=True, max_seq_len=32768, dtype="bfloat16",
             param_dtype="bfloat16", remat=True)

MODEL_PRESETS = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512),
    "small": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, d_ff=1408),
    "qwen2.5-0.5b": dict(_QWEN, vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                         n_kv_heads=2, head_dim=64, d_ff=4864, tie_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN, vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                         n_kv_heads=2, head_dim=128, d_ff=8960, tie_embeddings=True),
    "qwen2.5-7b": dict(_QWEN, vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                       n_kv_heads=4, head_dim=128, d_ff=18944, tie_embeddings=False),
}


def model_preset(name: str, **overrides) -> ModelConfig:
  """The named size preset, with field overrides (for example `vocab_size`)."""
  if name not in MODEL_PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}")
  return ModelConfig(**{**MODEL_PRESETS[name], **overrides})


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
    _check_finite("optimizer", self)
    if self.learning_rate <= 0:
      fail("optimizer.learning_rate", self.learning_rate, "must be > 0")
    if self.warmup_steps < 0:
      fail("optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
    _check_choice("optimizer.schedule", self.schedule, SCHEDULES)
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
    loss: the objective, a name of `LOSSES`.
    prox_logp: where π_prox comes from (`PROX_LOGP`): "recompute" (a forward pass
      under the params at the start of the step), "loglinear" (AReaL's estimate from
      the per-token versions, no forward pass) or "behav" (π_behav itself: naive PPO,
      w = 1).
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

  def __post_init__(self):
    _check_finite("ppo", self)


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

  def __post_init__(self):
    _check_finite("advantage", self)


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

  def __post_init__(self):
    if self.max_consecutive_skips < 1:
      fail("train.max_consecutive_skips", self.max_consecutive_skips, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """Sampling and generator-pool settings; `group_size` samples per prompt.

  `steps_per_call` decode steps run per host round trip; new samples, aborts and
  weight updates (`update_mode`, one of `UPDATE_MODES`) apply between two of them.
  The KV cache of each generator engine is `kv_blocks` blocks of `kv_block_size`
  tokens, shared by the samples in flight (a sample that finds none free is preempted
  and resumed later); 0 blocks: enough for every slot at `max_length`. A budget holds
  at least one sequence of `max_length`.
  """
  max_prompt_len: int = 64
  max_new_tokens: int = 128
  group_size: int = 8
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  num_slots: int = 32
  update_mode: str = "retract"
  steps_per_call: int = 8
  kv_blocks: int = 0
  kv_block_size: int = 16

  def __post_init__(self):
    for name in ("max_prompt_len", "max_new_tokens", "group_size", "num_slots",
                 "steps_per_call", "kv_block_size"):
      if getattr(self, name) < 1:
        fail(f"generation.{name}", getattr(self, name), "must be >= 1")
    if self.kv_blocks and self.kv_blocks < self.sequence_blocks:
      fail("generation.kv_blocks", self.kv_blocks,
           f"must be 0 (every slot at full length) or hold one sequence of max_length: "
           f"at least {self.sequence_blocks} blocks of generation.kv_block_size="
           f"{self.kv_block_size} for {self.max_length} tokens")
    _check_finite("generation", self)
    if self.temperature < 0:
      fail("generation.temperature", self.temperature, "must be >= 0")
    if self.top_k < 0:
      fail("generation.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
    if not 0 < self.top_p <= 1:
      fail("generation.top_p", self.top_p, "must lie in (0, 1]")
    _check_choice("generation.update_mode", self.update_mode, UPDATE_MODES)

  @property
  def logp_temperature(self) -> float:
    """The temperature of the recorded log-probs (greedy records them at 1)."""
    return self.temperature or 1.0

  @property
  def max_length(self) -> int:
    """The longest sequence: prompt plus completion."""
    return self.max_prompt_len + self.max_new_tokens

  @property
  def sequence_blocks(self) -> int:
    """KV blocks of one sequence of `max_length`."""
    return -(-self.max_length // self.kv_block_size)

  @property
  def kv_cache_blocks(self) -> int:
    """KV blocks of one generator engine: `kv_blocks`, or every slot at full length."""
    return self.kv_blocks or self.num_slots * self.sequence_blocks


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
  """η = `max_staleness` (None = unbounded); groups are counted in prompts.

  `on_stale` (one of `ON_STALE`) says what happens to a group holding a token older
  than v - η: "drop" it, "mask_tokens" (train it without those tokens) or "admit" it
  as it is.
  """
  max_staleness: Optional[int] = 4
  on_stale: str = "drop"
  max_concurrent: int = 64

  def __post_init__(self):
    if self.max_staleness is not None and self.max_staleness < 0:
      fail("staleness.max_staleness", self.max_staleness, "must be >= 0 or None")
    if self.max_concurrent < 1:
      fail("staleness.max_concurrent", self.max_concurrent, "must be >= 1")
    _check_choice("staleness.on_stale", self.on_stale, ON_STALE)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Rewards and group handling: `reward_fn` is a name from `rewards.REWARD_FNS` or
  "module:function" that replaces the task's own reward function (None: the task's);
  `allow_weak_sandbox` lets code rewards run without bubblewrap (rewards/sandbox.py)."""
  reward_fn: Optional[str] = None
  reward_timeout_s: float = 10.0
  reward_workers: int = 1
  dynamic_filter: bool = False
  allow_weak_sandbox: bool = False

  def __post_init__(self):
    _check_finite("rollout", self)
    if self.reward_timeout_s <= 0:
      fail("rollout.reward_timeout_s", self.reward_timeout_s, "must be > 0")
    if self.reward_workers < 1:
      fail("rollout.reward_workers", self.reward_workers, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Deadlines on the run's blocking waits, and rollout-worker restarts.

  A wait longer than `warn_after_s` is logged, naming what is awaited (again at
  each doubling); one longer than `stall_timeout_s` checkpoints and stops the run
  with an error naming the stalled component. A rollout worker whose process dies
  (Ray placement) is restarted up to `max_worker_restarts` times in all.
  """
  warn_after_s: float = 60.0
  stall_timeout_s: float = 600.0
  max_worker_restarts: int = 10

  def __post_init__(self):
    _check_finite("run", self)
    if self.warn_after_s <= 0:
      fail("run.warn_after_s", self.warn_after_s, "must be > 0")
    if self.stall_timeout_s <= self.warn_after_s:
      fail("run.stall_timeout_s", self.stall_timeout_s,
           f"must exceed run.warn_after_s={self.warn_after_s}")
    if self.max_worker_restarts < 0:
      fail("run.max_worker_restarts", self.max_worker_restarts, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Checkpoint every `every_steps` updates (and at the end and on SIGTERM)."""
  every_steps: int = 10
  keep: int = 3

  def __post_init__(self):
    if self.every_steps < 1:
      fail("checkpoint.every_steps", self.every_steps, "must be >= 1")
    if self.keep < 1:
      fail("checkpoint.keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation: greedy accuracy, and pass@k with `pass_k` samples at T=1.

  Runs every `every_steps` updates (0: only before and after training).
  """
  every_steps: int = 0
  num_prompts: int = 200
  pass_k: int = 4

  def __post_init__(self):
    if self.every_steps < 0:
      fail("eval.every_steps", self.every_steps, "must be >= 0")
    if self.num_prompts < 1:
      fail("eval.num_prompts", self.num_prompts, "must be >= 1")
    if self.pass_k < 1:
      fail("eval.pass_k", self.pass_k, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised warm start on reference solutions before RL (0 steps: none)."""
  steps: int = 0
  batch_size: int = 64
  learning_rate: float = 1e-3
  log_every: int = 50

  def __post_init__(self):
    _check_finite("sft", self)
    if self.steps < 0:
      fail("sft.steps", self.steps, "must be >= 0")
    if self.batch_size < 1:
      fail("sft.batch_size", self.batch_size, "must be >= 1")
    if self.learning_rate <= 0:
      fail("sft.learning_rate", self.learning_rate, "must be > 0")
    if self.log_every < 1:
      fail("sft.log_every", self.log_every, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
  """The arithmetic task distribution and its train / held-out split (`tasks.arithmetic`).

  Attributes:
    min_terms: fewest operands in a problem (>= 2: at least one step).
    max_terms: most operands in a problem.
    tail_exponent: P(steps = s) ∝ s^-tail_exponent; smaller is a heavier tail.
    max_operand: operands are drawn uniformly from [0, max_operand].
    max_value: running values stay in [0, max_value]; must be >= 2 * max_operand so
      that one of `+`, `-` always keeps the value in range.
    heldout_fraction: share of all prompt strings reserved for the held-out split.
    seed: seeds the training stream (the held-out set does not depend on it).
  """
  min_terms: int = 2
  max_terms: int = 8
  tail_exponent: float = 1.5
  max_operand: int = 9
  max_value: int = 99
  heldout_fraction: float = 0.1
  seed: int = 0

  def __post_init__(self):
    name = "task.arithmetic."
    _check_finite(name[:-1], self)
    if self.min_terms < 2:
      fail(name + "min_terms", self.min_terms, "must be >= 2")
    if self.max_terms < self.min_terms:
      fail(name + "max_terms", self.max_terms, f"must be >= {name}min_terms ({self.min_terms})")
    if self.tail_exponent < 0:
      fail(name + "tail_exponent", self.tail_exponent, "must be >= 0")
    if self.max_operand < 1:
      fail(name + "max_operand", self.max_operand, "must be >= 1")
    if self.max_value < 2 * self.max_operand:
      fail(name + "max_value", self.max_value,
           f"must be >= 2 * {name}max_operand ({2 * self.max_operand})")
    if not 0 < self.heldout_fraction < 1:
      fail(name + "heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if self.seed < 0:
      fail(name + "seed", self.seed, "must be >= 0")


DEFAULT_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class MathConfig:
  """The math task (`task.name="math"`): its JSONL files and how a prompt is written.

  Attributes:
    train_path: JSONL file of training problems (see `tasks.math_data.load_jsonl`).
    heldout_path: JSONL file of held-out problems; None holds out a hashed
      `heldout_fraction` of the training file's questions instead.
    heldout_fraction: the held-out share of the training file without `heldout_path`.
    template: the user text, `{question}` replaced by the question.
    chat: wrap the text in the model's chat template; false for a base model, which
      then sees the template's text alone.
    system: the chat's system turn; "" leaves it out.
    seed: seeds the training order (rollout worker i uses seed + 1000 i).

  The builder checks that the paths are files and makes them absolute (Ray actors may
  run elsewhere).
  """
  train_path: Optional[str] = None
  heldout_path: Optional[str] = None
  heldout_fraction: float = 0.1
  template: str = "{question}"
  chat: bool = True
  system: str = DEFAULT_MATH_SYSTEM
  seed: int = 0

  def __post_init__(self):
    _check_finite("task.math", self)
    if not 0 < self.heldout_fraction < 1:
      fail("task.math.heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if "{question}" not in self.template:
      fail("task.math.template", self.template, "must contain '{question}'")
    if self.seed < 0:
      fail("task.math.seed", self.seed, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class CodeConfig:
  """The code task's problems: programs that read n and print an expression of it with
  `min_ops` to `max_ops` operations, `num_tests` test cases each; a hashed
  `heldout_fraction` of the prompts is held out."""
  min_ops: int = 1
  max_ops: int = 2
  num_tests: int = 3
  heldout_fraction: float = 0.1
  seed: int = 0

  def __post_init__(self):
    _check_finite("task.code", self)
    if self.min_ops < 1:
      fail("task.code.min_ops", self.min_ops, "must be >= 1")
    if self.max_ops < self.min_ops:
      fail("task.code.max_ops", self.max_ops, f"must be >= task.code.min_ops ({self.min_ops})")
    if self.num_tests < 1:
      fail("task.code.num_tests", self.num_tests, "must be >= 1")
    if not 0 < self.heldout_fraction < 1:
      fail("task.code.heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if self.seed < 0:
      fail("task.code.seed", self.seed, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """What the run learns: a built-in task by name, or a user's.

  Attributes:
    name: a key of `tasks.registry.TASKS` — "arithmetic" (`arithmetic`, the character
      tokenizer), "arithmetic_tool" (the same problems with a calculator tool over
      several turns), "code" (`code`, small programs run in the sandbox), "math"
      (`math`, GSM8K/MATH JSONL files, the tokenizer of `hf_model_dir`) — or
      "module:attr" naming a user's task factory, called with this section.
    options: a user task's own options (plain data: strings, numbers, bools, None,
      lists and mappings, as config.json holds them); the factory checks them.
    arithmetic, math, code: the built-in tasks' sections.
    tokenizer_dir: a Hugging Face directory with tokenizer files, for tasks that use
      one; None: `hf_model_dir` (the builder fills it in).
    max_prompt_len: a task drops prompts longer than this (and says how many); None:
      `generation.max_prompt_len` (the builder fills it in).
    max_turns: the most policy turns of a multi-turn episode; None: the task's own
      (for "arithmetic_tool", `arithmetic.max_terms`: one call per step and the answer).
    sample_per_turn: train each policy turn of an episode as a sample of its own, the
      episode before it as its prompt (`trajectory.split_turns`), instead of the whole
      episode as one sample. Advantages stay the episode's.
  """
  name: str = "arithmetic"
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  arithmetic: ArithmeticConfig = ArithmeticConfig()
  math: MathConfig = MathConfig()
  code: CodeConfig = CodeConfig()
  tokenizer_dir: Optional[str] = None
  max_prompt_len: Optional[int] = None
  max_turns: Optional[int] = None
  sample_per_turn: bool = False

  def __post_init__(self):
    try:
      json.dumps(self.options, allow_nan=False)
    except (TypeError, ValueError) as e:
      fail("task.options", self.options, f"must hold plain data ({e})")
    if self.max_turns is not None and self.max_turns < 1:
      fail("task.max_turns", self.max_turns, "must be >= 1 or None")


@dataclasses.dataclass(frozen=True)
class CPUConfig:
  """XLA:CPU only (`async_rl.cpu`): programs dispatched from several threads run at
  once, one per core, where one program's small ops mostly use one core.

  `decode_threads`: slot groups of the generator, each decoded from its own thread;
  `grad_threads`: threads that share each update's micro-batches. 0 picks half the
  cores this process may use for each (the generator and the trainer share them).
  Ignored on accelerators.
  """
  decode_threads: int = 0
  grad_threads: int = 0

  def __post_init__(self):
    for name in ("decode_threads", "grad_threads"):
      if getattr(self, name) < 0:
        fail(f"cpu.{name}", getattr(self, name), "must be >= 0 (0: automatic)")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything one run needs; `batch_groups` prompt groups make one training batch.

  `hf_model_dir` is a local Hugging Face Qwen2/Qwen3 directory whose weights a fresh
  run starts from; the builder then reads the architecture fields of `model` from its
  `config.json`, and only `HF_RUN_MODEL_FIELDS` stay as configured.
  """
  seed: int = 0
  batch_groups: int = 8
  num_steps: int = 100
  hf_model_dir: Optional[str] = None
  model: ModelConfig = ModelConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  ppo: PPOConfig = PPOConfig()
  advantage: AdvantageConfig = AdvantageConfig()
  batching: BatchingConfig = BatchingConfig()
  mesh: MeshConfig = MeshConfig()
  generation: GenerationConfig = GenerationConfig()
  staleness: StalenessConfig = StalenessConfig()
  task: TaskConfig = TaskConfig()
  rollout: RolloutConfig = RolloutConfig()
  train: TrainConfig = TrainConfig()
  run: RunConfig = RunConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()
  sft: SFTConfig = SFTConfig()
  cpu: CPUConfig = CPUConfig()

  def __post_init__(self):
    for name in ("batch_groups", "num_steps"):
      if getattr(self, name) < 1:
        fail(name, getattr(self, name), "must be >= 1")
    longest = self.generation.max_length
    if self.rollout.reward_timeout_s >= self.run.stall_timeout_s:
      fail("rollout.reward_timeout_s", self.rollout.reward_timeout_s,
           f"must be below run.stall_timeout_s={self.run.stall_timeout_s} (a reward call "
           f"that hangs is killed and scores 0; it must not stall the run first)")
    if self.batching.max_tokens_per_mb < longest:
      fail("batching.max_tokens_per_mb", self.batching.max_tokens_per_mb,
           f"must hold the longest allowed sequence (generation.max_prompt_len + "
           f"generation.max_new_tokens = {longest})")
    if longest > self.model.max_seq_len:
      fail("model.max_seq_len", self.model.max_seq_len,
           f"must be >= generation.max_prompt_len + generation.max_new_tokens = {longest}")


def config_dict():
  """Every field of `ExperimentConfig` with its default, as an `ml_collections.ConfigDict`.

  Config files start from this so that every field can be overridden from the
  command line (`--config.ppo.c_clip=3`); optional fields are typed placeholders.
  """
  import ml_collections  # noqa: PLC0415 - only config files and binaries need it
  from ml_collections.config_dict import placeholder  # noqa: PLC0415

  def convert(cls):
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      hint = hints[f.name]
      if dataclasses.is_dataclass(hint):
        out[f.name] = convert(hint)
      elif typing.get_origin(hint) is dict:
        out[f.name] = ml_collections.ConfigDict(f.default_factory())
      elif f.default is None:
        out[f.name] = placeholder(_optional_type(hint))
      else:
        out[f.name] = f.default
    return ml_collections.ConfigDict(out)

  return convert(ExperimentConfig)


def from_dict(values) -> ExperimentConfig:
  """Converts a ConfigDict (or nested mapping) to an `ExperimentConfig`, strictly: an
  unknown key or a value of the wrong type raises ValueError naming the field."""
  return _build(ExperimentConfig, _to_plain(values), "")


def to_dict(cfg) -> dict:
  """The config as plain nested dicts (for logging and saving)."""
  return dataclasses.asdict(cfg)


def keys() -> list[str]:
  """Every leaf field of `ExperimentConfig` as a dotted path."""
  def walk(cls, prefix):
    for f in dataclasses.fields(cls):
      hint = typing.get_type_hints(cls)[f.name]
      if dataclasses.is_dataclass(hint):
        yield from walk(hint, f"{prefix}{f.name}.")
      else:
        yield prefix + f.name
  return sorted(walk(ExperimentConfig, ""))


def unknown_key_message(key: str, known) -> str:
  """An error for an unknown config key that names the nearest valid ones."""
  known = list(known)
  near = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
  if near:
    return f"unknown config key {key!r}; did you mean {', '.join(near)}?"
  section = key.rpartition(".")[0]
  here = ([k for k in known if k.startswith(section + ".")] if section
          else sorted({k.split(".")[0] for k in known}))
  return f"unknown config key {key!r}; valid keys there: {', '.join(here)}"


def parse_flags(argv):
  """absl's flag parsing, with a readable error for an unknown `--config.x=` override.

  ml_collections raises a bare `AttributeError: "'x'"` for an override of a key the
  config does not have; this names the key and the nearest valid ones instead, and
  exits with status 2 as other flag errors do. Pass as `app.run(main,
  flags_parser=parse_flags)`.
  """
  from absl import flags  # noqa: PLC0415 - only binaries parse flags
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError):
    overrides = [a.split("=", 1)[0][len("--config."):] for a in argv[1:]
                 if a.startswith("--config.")]
    known = keys()
    bad = next((k for k in overrides if k not in known and not any(
        known_key.startswith(k + ".") for known_key in known)), None)
    if bad is None:
      raise
    print(f"FATAL flags parsing error: {unknown_key_message(bad, known)}", file=sys.stderr)
    sys.exit(2)


def _optional_type(hint):
  return next(a for a in typing.get_args(hint) if a is not type(None))


def _to_plain(x):
  if hasattr(x, "to_dict"):
    return x.to_dict()
  return x


def _build(cls, values, prefix):
  if not isinstance(values, typing.Mapping):
    fail(prefix.rstrip(".") or "config", values, "must be a mapping")
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(unknown_key_message(prefix + unknown[0], [prefix + n for n in names]))
  kwargs = {k: _coerce(hints[k], v, prefix + k) for k, v in values.items()}
  return cls(**kwargs)


def _coerce(hint, value, path):
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    if value is None:
      return None
    hint = _optional_type(hint)
  if dataclasses.is_dataclass(hint):
    return _build(hint, _to_plain(value), path + ".")
  if typing.get_origin(hint) is dict:  # A free-form section (task.options): plain data.
    value = _to_plain(value)
    if not isinstance(value, typing.Mapping) or not all(isinstance(k, str) for k in value):
      fail(path, value, "must be a mapping with string keys")
    return dict(value)
  if typing.get_origin(hint) is tuple:
    if not isinstance(value, (list, tuple)):
      fail(path, value, "must be a sequence")
    (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
    return tuple(_coerce(item, v, path) for v in value)
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint is int and isinstance(value, float) and value.is_integer():
    return int(value)
  if value is None or not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
    fail(path, value, f"must be of type {hint.__name__}")
  return value
