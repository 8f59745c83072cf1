"""Typed, frozen experiment configuration.

Config files (`configs/*.py`) return an `ml_collections.ConfigDict`; binaries convert
it once with `config_dict.from_config_dict`, and library code only ever sees these
dataclasses. Every
field is declared here once, with its default, and validated with a message that
names it.
"""

import dataclasses
import os
from typing import Optional

from async_rl.generation.pool import UPDATE_MODES
from async_rl.loss import LOSSES
from async_rl.models.config import ModelConfig
from async_rl.tasks.arithmetic import TaskConfig
from async_rl.tasks.math_task import MathTaskConfig

_LEVELS = ("group", "batch", None)
SCHEDULES = ("constant", "cosine")
TASK_KINDS = ("arithmetic", "math")  # The names of `rl.components.TASKS`.
# Fields of `model` that stay the run's own with `hf_model_dir`: numerics and length,
# not architecture.
HF_RUN_MODEL_FIELDS = ("max_seq_len", "dtype", "param_dtype", "remat")


def _fail(field, value, why):
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
      _fail("optimizer.learning_rate", self.learning_rate, "must be > 0")
    if self.warmup_steps < 0:
      _fail("optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
    if self.schedule not in SCHEDULES:
      _fail("optimizer.schedule", self.schedule, f"must be one of {SCHEDULES}")
    if self.decay_steps < 1:
      _fail("optimizer.decay_steps", self.decay_steps, "must be >= 1")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      _fail("optimizer.b1/b2", (self.b1, self.b2), "must lie in [0, 1)")
    if self.weight_decay < 0:
      _fail("optimizer.weight_decay", self.weight_decay, "must be >= 0")
    if self.grad_clip <= 0:
      _fail("optimizer.grad_clip", self.grad_clip, "must be > 0")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
  """The decoupled PPO objective of DESIGN.md; `loss="naive_ppo"` uses π_behav as π_prox.

  Log-probs are taken at the sampling temperature (`generation.temperature`, or 1
  for greedy), so the trainer's recomputation matches the recorded behaviour ones.
  """
  loss: str = "decoupled_ppo"
  eps_clip: float = 0.2
  eps_clip_higher: Optional[float] = None
  c_clip: Optional[float] = None
  behav_imp_weight_cap: Optional[float] = None

  def __post_init__(self):
    if self.loss not in LOSSES:
      _fail("ppo.loss", self.loss, f"must be one of {sorted(LOSSES)}")
    if self.eps_clip <= 0:
      _fail("ppo.eps_clip", self.eps_clip, "must be > 0")
    if self.eps_clip_higher is not None and self.eps_clip_higher <= 0:
      _fail("ppo.eps_clip_higher", self.eps_clip_higher, "must be > 0")
    if self.c_clip is not None and self.c_clip <= 1:
      _fail("ppo.c_clip", self.c_clip, "must be > 1")
    if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
      _fail("ppo.behav_imp_weight_cap", self.behav_imp_weight_cap, "must be > 1")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Reward shaping, DAPO overlong penalty and group/batch normalisation."""
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
    if self.reward_clip is not None and self.reward_clip <= 0:
      _fail("advantage.reward_clip", self.reward_clip, "must be > 0")
    if self.overlong_cache_len is not None and self.overlong_cache_len < 1:
      _fail("advantage.overlong_cache_len", self.overlong_cache_len, "must be >= 1")
    for name in ("mean_level", "std_level"):
      if getattr(self, name) not in _LEVELS:
        _fail(f"advantage.{name}", getattr(self, name), f"must be one of {_LEVELS}")


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
  """Token-budget micro-batching; `row_buckets` empty means `default_row_buckets`."""
  max_tokens_per_mb: int = 1024
  row_buckets: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_tokens_per_mb < 1:
      _fail("batching.max_tokens_per_mb", self.max_tokens_per_mb, "must be >= 1")
    if any(b < 1 or b > self.max_tokens_per_mb for b in self.row_buckets):
      _fail("batching.row_buckets", self.row_buckets,
            "must lie in [1, batching.max_tokens_per_mb]")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axis sizes; one axis may be -1 to take the remaining devices."""
  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if sum(v == -1 for v in sizes.values()) > 1:
      _fail("mesh", sizes, "may have at most one axis of -1")
    for name, v in sizes.items():
      if v == 0 or v < -1:
        _fail(f"mesh.{name}", v, "must be >= 1 or -1")

  def axis_sizes(self, num_devices: int) -> dict[str, int]:
    """Resolves -1 and checks that the axes multiply to `num_devices`."""
    sizes = dataclasses.asdict(self)
    known = 1
    for v in sizes.values():
      known *= v if v > 0 else 1
    for name, v in sizes.items():
      if v == -1:
        if num_devices % known:
          _fail(f"mesh.{name}", v, f"cannot fill {num_devices} devices with the other "
                f"axes' product {known}")
        sizes[name] = num_devices // known
    product = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    if product != num_devices:
      _fail("mesh (data*fsdp*tensor)", sizes, f"must multiply to the {num_devices} devices")
    return sizes


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """Sampling and generator-pool settings; `group_size` samples per prompt."""
  max_prompt_len: int = 64
  max_new_tokens: int = 128
  group_size: int = 8
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  num_slots: int = 32
  update_mode: str = "retract"
  steps_per_call: int = 8  # Decode steps per host round trip; see BENCHMARKS.md.

  def __post_init__(self):
    for name in ("max_prompt_len", "max_new_tokens", "group_size", "num_slots",
                 "steps_per_call"):
      if getattr(self, name) < 1:
        _fail(f"generation.{name}", getattr(self, name), "must be >= 1")
    if self.temperature < 0:
      _fail("generation.temperature", self.temperature, "must be >= 0")
    if self.top_k < 0:
      _fail("generation.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
    if not 0 < self.top_p <= 1:
      _fail("generation.top_p", self.top_p, "must lie in (0, 1]")
    if self.update_mode not in UPDATE_MODES:
      _fail("generation.update_mode", self.update_mode, f"must be one of {UPDATE_MODES}")

  @property
  def logp_temperature(self) -> float:
    """The temperature of the recorded log-probs (greedy records them at 1)."""
    return self.temperature or 1.0


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
  """η = `max_staleness` (None = unbounded); groups are counted in prompts."""
  max_staleness: Optional[int] = 4
  admit_stale: bool = False
  max_concurrent: int = 64

  def __post_init__(self):
    if self.max_staleness is not None and self.max_staleness < 0:
      _fail("staleness.max_staleness", self.max_staleness, "must be >= 0 or None")
    if self.max_concurrent < 1:
      _fail("staleness.max_concurrent", self.max_concurrent, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Rewards and group handling: `reward_fn` is a name from `rewards.REWARD_FNS`."""
  reward_fn: str = "arithmetic"
  reward_timeout_s: float = 10.0
  reward_workers: int = 1
  dynamic_filter: bool = False

  def __post_init__(self):
    if self.reward_timeout_s <= 0:
      _fail("rollout.reward_timeout_s", self.reward_timeout_s, "must be > 0")
    if self.reward_workers < 1:
      _fail("rollout.reward_workers", self.reward_workers, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Checkpoint every `every_steps` updates (and at the end and on SIGTERM)."""
  every_steps: int = 10
  keep: int = 3

  def __post_init__(self):
    if self.every_steps < 1:
      _fail("checkpoint.every_steps", self.every_steps, "must be >= 1")
    if self.keep < 1:
      _fail("checkpoint.keep", self.keep, "must be >= 1")


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
      _fail("eval.every_steps", self.every_steps, "must be >= 0")
    if self.num_prompts < 1:
      _fail("eval.num_prompts", self.num_prompts, "must be >= 1")
    if self.pass_k < 1:
      _fail("eval.pass_k", self.pass_k, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised warm start on reference solutions before RL (0 steps: none)."""
  steps: int = 0
  batch_size: int = 64
  learning_rate: float = 1e-3
  log_every: int = 50

  def __post_init__(self):
    if self.steps < 0:
      _fail("sft.steps", self.steps, "must be >= 0")
    if self.batch_size < 1:
      _fail("sft.batch_size", self.batch_size, "must be >= 1")
    if self.learning_rate <= 0:
      _fail("sft.learning_rate", self.learning_rate, "must be > 0")
    if self.log_every < 1:
      _fail("sft.log_every", self.log_every, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything one run needs; `batch_groups` is B, prompt groups per training batch.

  `task_kind` names the task: "arithmetic" (`task`, the character tokenizer, random
  or warm-started weights) or "math" (`math`, GSM8K/MATH JSONL files, the tokenizer
  of `hf_model_dir`). `hf_model_dir` is a local Hugging Face Qwen2/Qwen3 directory
  whose weights a fresh run starts from; the architecture fields of `model` are then
  read from its `config.json`, replacing any configured values, and only
  `HF_RUN_MODEL_FIELDS` stay as configured. Paths are made absolute.
  """
  seed: int = 0
  batch_groups: int = 8
  num_steps: int = 100
  hf_model_dir: Optional[str] = None
  task_kind: str = "arithmetic"
  model: ModelConfig = ModelConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  ppo: PPOConfig = PPOConfig()
  advantage: AdvantageConfig = AdvantageConfig()
  batching: BatchingConfig = BatchingConfig()
  mesh: MeshConfig = MeshConfig()
  generation: GenerationConfig = GenerationConfig()
  staleness: StalenessConfig = StalenessConfig()
  task: TaskConfig = TaskConfig()
  math: MathTaskConfig = MathTaskConfig()
  rollout: RolloutConfig = RolloutConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()
  sft: SFTConfig = SFTConfig()

  def __post_init__(self):
    for name in ("batch_groups", "num_steps"):
      if getattr(self, name) < 1:
        _fail(name, getattr(self, name), "must be >= 1")
    if self.hf_model_dir is not None:
      object.__setattr__(self, "hf_model_dir", os.path.abspath(self.hf_model_dir))
      object.__setattr__(self, "model", _model_from_hf(self.model, self.hf_model_dir))
    self._check_task()
    longest = self.generation.max_prompt_len + self.generation.max_new_tokens
    if self.batching.max_tokens_per_mb < longest:
      _fail("batching.max_tokens_per_mb", self.batching.max_tokens_per_mb,
            f"must hold the longest allowed sequence (generation.max_prompt_len + "
            f"generation.max_new_tokens = {longest})")
    if longest > self.model.max_seq_len:
      _fail("model.max_seq_len", self.model.max_seq_len,
            f"must be >= generation.max_prompt_len + generation.max_new_tokens = {longest}")

  def _check_task(self):
    if self.task_kind not in TASK_KINDS:
      _fail("task_kind", self.task_kind, f"must be one of {TASK_KINDS}")
    if self.task_kind == "math":
      if self.math.train_path is None:
        _fail("math.train_path", None, "must name a JSONL file when task_kind='math'")
      if self.hf_model_dir is None:
        _fail("hf_model_dir", None, "must name the model (and tokenizer) directory when "
              "task_kind='math'")
      if self.rollout.reward_fn == "arithmetic":
        _fail("rollout.reward_fn", self.rollout.reward_fn,
              "must not be 'arithmetic' with task_kind='math' (use 'math')")
      if self.sft.steps:
        _fail("sft.steps", self.sft.steps, "must be 0 with task_kind='math': the warm start "
              "trains on arithmetic solutions (a hf_model_dir checkpoint is the start)")
      return
    if self.hf_model_dir is not None:
      _fail("hf_model_dir", self.hf_model_dir, "needs task_kind='math': the arithmetic "
            "task's character tokenizer does not share a pretrained model's vocabulary")
    if self.task.max_prompt_tokens > self.generation.max_prompt_len:
      _fail("generation.max_prompt_len", self.generation.max_prompt_len,
            f"must hold the task's longest prompt ({self.task.max_prompt_tokens} tokens)")
    sft_longest = self.task.max_prompt_tokens + self.task.max_solution_tokens
    if self.sft.steps and self.batching.max_tokens_per_mb < sft_longest:
      _fail("batching.max_tokens_per_mb", self.batching.max_tokens_per_mb,
            f"must hold the longest warm-start sequence ({sft_longest} tokens) when "
            f"sft.steps > 0")


def _model_from_hf(model: ModelConfig, model_dir: str) -> ModelConfig:
  """The architecture in `model_dir`'s config.json with `model`'s HF_RUN_MODEL_FIELDS."""
  from async_rl.models import hf  # hf imports sharding, which imports this module
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    _fail("hf_model_dir", model_dir, "must be a directory holding config.json")
  try:
    hf_model = hf.read_config(model_dir)
  except (KeyError, ValueError) as e:
    _fail("hf_model_dir", model_dir, f"holds a model that cannot be read: {e!r}")
  return dataclasses.replace(hf_model, **{f: getattr(model, f) for f in HF_RUN_MODEL_FIELDS})
