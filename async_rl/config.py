"""Typed, frozen experiment configuration.

Config files (`configs/*.py`) return an `ml_collections.ConfigDict`; binaries convert
it once with `config_dict.from_config_dict`, and library code only ever sees these
dataclasses. Every field is declared here once, with its default. Bounds that concern
the config alone are checked here; those a component owns (the loss's clip ranges, the
pool's update modes) are checked by that component, and `config_check.check` runs them
with the field's name in the message. This module is a leaf: it imports only other
config dataclasses, never a component.
"""

import dataclasses
import json
import os
from typing import Any, Optional

# The trainer's parts, re-exported: every config dataclass is importable from here.
from async_rl.config_trainer import (AdvantageConfig, BatchingConfig, MeshConfig,  # noqa: F401
                                     OptimizerConfig, PPOConfig, TrainConfig)
from async_rl.config_trainer import fail as _fail
from async_rl.models import hf_config
from async_rl.models.config import ModelConfig
from async_rl.tasks.arithmetic import TaskConfig
from async_rl.tasks.code_task import CodeTaskConfig
from async_rl.tasks.math_task import MathTaskConfig

# Fields of `model` that stay the run's own with `hf_model_dir`: numerics and length,
# not architecture.
HF_RUN_MODEL_FIELDS = ("max_seq_len", "dtype", "param_dtype", "remat", "remat_saves")



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
  # Slot groups decoded at once, each from its own thread (`generation.engine`); 0 picks
  # `engine.default_decode_threads`: one per core on the CPU backend (half the cores when
  # the trainer runs at once, η > 0: `cpu_threads.cores_per_side`), 1 on accelerators.
  decode_threads: int = 0

  def __post_init__(self):
    for name in ("max_prompt_len", "max_new_tokens", "group_size", "num_slots",
                 "steps_per_call"):
      if getattr(self, name) < 1:
        _fail(f"generation.{name}", getattr(self, name), "must be >= 1")
    if self.decode_threads < 0 or (self.decode_threads
                                   and self.num_slots % self.decode_threads):
      _fail("generation.decode_threads", self.decode_threads,
            f"must be 0 (automatic) or divide generation.num_slots ({self.num_slots})")
    if self.temperature < 0:
      _fail("generation.temperature", self.temperature, "must be >= 0")
    if self.top_k < 0:
      _fail("generation.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
    if not 0 < self.top_p <= 1:
      _fail("generation.top_p", self.top_p, "must lie in (0, 1]")

  @property
  def logp_temperature(self) -> float:
    """The temperature of the recorded log-probs (greedy records them at 1)."""
    return self.temperature or 1.0


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
  """η = `max_staleness` (None = unbounded); groups are counted in prompts.

  `on_stale` says what happens to a group holding a token older than v - η
  (`param_server.buffer.ON_STALE`): "drop" it, "mask_tokens" (train it without
  those tokens) or "admit" it as it is.
  """
  max_staleness: Optional[int] = 4
  on_stale: str = "drop"
  max_concurrent: int = 64

  def __post_init__(self):
    if self.max_staleness is not None and self.max_staleness < 0:
      _fail("staleness.max_staleness", self.max_staleness, "must be >= 0 or None")
    if self.max_concurrent < 1:
      _fail("staleness.max_concurrent", self.max_concurrent, "must be >= 1")


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
    if self.reward_timeout_s <= 0:
      _fail("rollout.reward_timeout_s", self.reward_timeout_s, "must be > 0")
    if self.reward_workers < 1:
      _fail("rollout.reward_workers", self.reward_workers, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
  """Multi-turn episodes (`tasks.workflow.MultiTurn`).

  Attributes:
    max_turns: the most policy turns of an episode; None: the task's own (for
      "arithmetic_tool", `task.max_terms`: one call per step and the answer).
    sample_per_turn: train each policy turn as a sample of its own, the episode before
      it as its prompt (`tasks.workflow.split_turns`), instead of the whole episode
      as one sample. Advantages stay the episode's.
  """
  max_turns: Optional[int] = None
  sample_per_turn: bool = False

  def __post_init__(self):
    if self.max_turns is not None and self.max_turns < 1:
      _fail("multi_turn.max_turns", self.max_turns, "must be >= 1 or None")


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
    if self.warn_after_s <= 0:
      _fail("run.warn_after_s", self.warn_after_s, "must be > 0")
    if self.stall_timeout_s <= self.warn_after_s:
      _fail("run.stall_timeout_s", self.stall_timeout_s,
            f"must exceed run.warn_after_s={self.warn_after_s}")
    if self.max_worker_restarts < 0:
      _fail("run.max_worker_restarts", self.max_worker_restarts, "must be >= 0")


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

  `task_kind` names the task (`tasks.registry`): "arithmetic" (`task`, the character
  tokenizer, random or warm-started weights), "arithmetic_tool" (the same problems
  with a calculator tool, over several turns: `multi_turn`), "code" (`code`, small
  programs run in the sandbox), "math" (`math`, GSM8K/MATH JSONL files, the tokenizer
  of `hf_model_dir`), or "module:attr" naming a user's task factory, which reads its
  own options from `task_options` (plain data: strings, numbers, bools, None, lists
  and mappings, as config.json holds them). `hf_model_dir` is a local Hugging Face
  Qwen2/Qwen3 directory whose weights a fresh run starts from; the architecture
  fields of `model` are then read from its `config.json`, replacing any configured
  values, and only `HF_RUN_MODEL_FIELDS` stay as configured. Paths are made absolute.
  """
  seed: int = 0
  batch_groups: int = 8
  num_steps: int = 100
  hf_model_dir: Optional[str] = None
  task_kind: str = "arithmetic"
  task_options: dict[str, Any] = dataclasses.field(default_factory=dict)
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
  code: CodeTaskConfig = CodeTaskConfig()
  multi_turn: MultiTurnConfig = MultiTurnConfig()
  rollout: RolloutConfig = RolloutConfig()
  train: TrainConfig = TrainConfig()
  run: RunConfig = RunConfig()
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
    try:
      json.dumps(self.task_options, allow_nan=False)
    except (TypeError, ValueError) as e:
      _fail("task_options", self.task_options, f"must hold plain data ({e})")
    longest = self.generation.max_prompt_len + self.generation.max_new_tokens
    if self.rollout.reward_timeout_s >= self.run.stall_timeout_s:
      _fail("rollout.reward_timeout_s", self.rollout.reward_timeout_s,
            f"must be below run.stall_timeout_s={self.run.stall_timeout_s} (a reward call "
            f"that hangs is killed and scores 0; it must not stall the run first)")
    if self.batching.max_tokens_per_mb < longest:
      _fail("batching.max_tokens_per_mb", self.batching.max_tokens_per_mb,
            f"must hold the longest allowed sequence (generation.max_prompt_len + "
            f"generation.max_new_tokens = {longest})")
    if longest > self.model.max_seq_len:
      _fail("model.max_seq_len", self.model.max_seq_len,
            f"must be >= generation.max_prompt_len + generation.max_new_tokens = {longest}")


def _model_from_hf(model: ModelConfig, model_dir: str) -> ModelConfig:
  """The architecture in `model_dir`'s config.json with `model`'s HF_RUN_MODEL_FIELDS."""
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    _fail("hf_model_dir", model_dir, "must be a directory holding config.json")
  try:
    hf_model = hf_config.read_config(model_dir)
  except (KeyError, ValueError) as e:
    _fail("hf_model_dir", model_dir, f"holds a model that cannot be read: {e!r}")
  return dataclasses.replace(hf_model, **{f: getattr(model, f) for f in HF_RUN_MODEL_FIELDS})
