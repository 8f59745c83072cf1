"""Small builders shared by the trainer and rollout sides of a run."""

import dataclasses
from typing import Any, Callable, Union

from async_rl.config import ExperimentConfig
from async_rl.generation import Engine, SamplingParams
from async_rl.tasks import CharTokenizer, TrainStream, heldout_set
from async_rl.tasks.math_task import MathTask


def make_engine(cfg: ExperimentConfig) -> Engine:
  g = cfg.generation
  return Engine(cfg.model, max_concurrent_decodes=g.num_slots,
                max_prefill_length=g.max_prompt_len,
                max_target_length=g.max_prompt_len + g.max_new_tokens,
                steps_per_call=g.steps_per_call)


@dataclasses.dataclass
class ArithmeticTask:
  """What a run needs from a task: prompt streams, text, the reward reference and the
  generator's stop ids."""
  cfg: Any
  tokenizer: CharTokenizer = dataclasses.field(default_factory=CharTokenizer)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.tokenizer.eos_id,)

  def decode(self, tokens) -> str:
    return self.tokenizer.decode(tokens, strict=False)

  @staticmethod
  def reference(prompt):
    return prompt.problem

  def stream(self, state=None, *, worker_index: int = 0) -> TrainStream:
    """The training prompts of rollout worker `worker_index` (each has its own seed)."""
    if state:
      return TrainStream.resume(self._worker_cfg(worker_index), state)
    return TrainStream(self._worker_cfg(worker_index))

  def _worker_cfg(self, worker_index):
    return dataclasses.replace(self.cfg, seed=self.cfg.seed + 1000 * worker_index)

  def heldout(self, n):
    return heldout_set(self.cfg, n)


Task = Union[ArithmeticTask, MathTask]


def _math_task(cfg: ExperimentConfig) -> MathTask:
  task = MathTask(cfg.math, cfg.hf_model_dir, max_prompt_len=cfg.generation.max_prompt_len)
  if task.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"hf_model_dir {cfg.hf_model_dir!r}: its tokenizer has "
                     f"{task.tokenizer.vocab_size} tokens, more than model.vocab_size="
                     f"{cfg.model.vocab_size}")
  return task


TASKS: dict[str, Callable[[ExperimentConfig], Task]] = {
    "arithmetic": lambda cfg: ArithmeticTask(cfg.task),
    "math": _math_task,
}


def make_task(cfg: ExperimentConfig) -> Task:
  """The task named by `cfg.task_kind`; raises ValueError for an unknown name."""
  if cfg.task_kind not in TASKS:
    raise ValueError(f"unknown task_kind {cfg.task_kind!r}; known: {sorted(TASKS)}")
  return TASKS[cfg.task_kind](cfg)


def sampling_params(cfg: ExperimentConfig, task: Task) -> SamplingParams:
  g = cfg.generation
  return SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                        max_new_tokens=g.max_new_tokens, stop_token_ids=task.stop_ids)
