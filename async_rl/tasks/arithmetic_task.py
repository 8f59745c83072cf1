"""The arithmetic task of a run: worked solutions of `tasks.arithmetic` problems.

Single-turn: the policy writes the whole scratchpad. `tasks.tool` is the same problems
with a calculator tool.
"""

import dataclasses
from collections.abc import Iterator
from typing import Optional

from async_rl.tasks.arithmetic import TaskConfig
from async_rl.tasks.dataset import Prompt, TrainStream, heldout_set
from async_rl.tasks.protocol import RewardFnLike, supervised
from async_rl.tasks.tokenizer import CharTokenizer
from async_rl.trajectory import Trajectory

# Each rollout worker draws from its own stream; the warm start from another one, so RL
# does not begin on memorised prompts.
WORKER_SEED_STRIDE = 1000
SFT_SEED_OFFSET = 7919


@dataclasses.dataclass
class ArithmeticTask:
  """Arithmetic problems whose reference is the `Problem` (what the verifiers check).

  Attributes:
    cfg: the problem distribution and split.
    reward_fn: "arithmetic" (the exact worked solution), "arithmetic_steps" (credit
      per correct leading step), or any reward function.
  """
  cfg: TaskConfig
  reward_fn: RewardFnLike = "arithmetic"
  tokenizer: CharTokenizer = dataclasses.field(default_factory=CharTokenizer)
  workflow = None

  @staticmethod
  def reference(prompt: Prompt):
    return prompt.problem

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0) -> TrainStream:
    """The training prompts of rollout worker `worker_index` (each has its own seed)."""
    cfg = dataclasses.replace(self.cfg, seed=self.cfg.seed + WORKER_SEED_STRIDE * worker_index)
    return TrainStream.resume(cfg, state) if state else TrainStream(cfg)

  def heldout(self, n: int) -> list[Prompt]:
    return heldout_set(self.cfg, n)

  def sft_examples(self) -> Iterator[Trajectory]:
    """Prompts of their own stream with their reference solutions, all trained on."""
    stream = TrainStream(dataclasses.replace(self.cfg, seed=self.cfg.seed + SFT_SEED_OFFSET))
    return (supervised(p.tokens, p.target) for p in stream)


def check_char_task(cfg, *, max_prompt_tokens: int, max_target_tokens: int) -> None:
  """The checks of a run on a character-tokenized task whose prompts and reference
  solutions are at most the given lengths (BOS and EOS included)."""
  if cfg.hf_model_dir is not None:
    raise ValueError(f"hf_model_dir needs task_kind='math': the {cfg.task_kind} task's "
                     f"character tokenizer does not share a pretrained model's vocabulary, "
                     f"got {cfg.hf_model_dir!r}")
  if max_prompt_tokens > cfg.generation.max_prompt_len:
    raise ValueError(f"generation.max_prompt_len must hold the task's longest prompt "
                     f"({max_prompt_tokens} tokens), got {cfg.generation.max_prompt_len}")
  longest = max_prompt_tokens + max_target_tokens
  if cfg.sft.steps and cfg.batching.max_tokens_per_mb < longest:
    raise ValueError(f"batching.max_tokens_per_mb must hold the longest warm-start sequence "
                     f"({longest} tokens) when sft.steps > 0, got "
                     f"{cfg.batching.max_tokens_per_mb}")


def check(cfg) -> None:
  """The run's checks for the arithmetic tasks (with or without the tool)."""
  check_char_task(cfg, max_prompt_tokens=cfg.task.max_prompt_tokens,
                  max_target_tokens=cfg.task.max_solution_tokens)


def make(cfg) -> ArithmeticTask:
  return ArithmeticTask(cfg.task)
