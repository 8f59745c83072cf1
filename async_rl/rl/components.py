"""Small builders shared by the trainer and rollout sides of a run."""

import dataclasses
from typing import Any

from async_rl.config import ExperimentConfig
from async_rl.generation import Engine, SamplingParams
from async_rl.tasks import CharTokenizer, TrainStream, heldout_set


def make_engine(cfg: ExperimentConfig) -> Engine:
  g = cfg.generation
  return Engine(cfg.model, max_concurrent_decodes=g.num_slots,
                max_prefill_length=g.max_prompt_len,
                max_target_length=g.max_prompt_len + g.max_new_tokens)


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


def sampling_params(cfg: ExperimentConfig, task) -> SamplingParams:
  g = cfg.generation
  return SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                        max_new_tokens=g.max_new_tokens, stop_token_ids=task.stop_ids)
