"""Small builders shared by the trainer and rollout sides of a run."""

from async_rl import cpu_threads
from async_rl.config import ExperimentConfig
from async_rl.generation import Engine, SamplingParams
from async_rl.generation.engine import default_decode_threads
from async_rl.tasks.protocol import RewardFnLike, Task


def make_engine(cfg: ExperimentConfig) -> Engine:
  """The generator engine. Its prefill takes whole episodes so far, not only prompts:
  a multi-turn workflow's next turn holds everything before it."""
  g = cfg.generation
  longest = g.max_prompt_len + g.max_new_tokens
  return Engine(cfg.model, max_concurrent_decodes=g.num_slots,
                max_prefill_length=longest - 1, max_target_length=longest,
                steps_per_call=g.steps_per_call,
                decode_threads=g.decode_threads or default_decode_threads(
                    g.num_slots, cores=cpu_threads.cores_per_side(cfg.staleness.max_staleness)))


def sampling_params(cfg: ExperimentConfig, task: Task) -> SamplingParams:
  g = cfg.generation
  return SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                        max_new_tokens=g.max_new_tokens,
                        stop_token_ids=task.tokenizer.stop_ids)


def reward_fn(cfg: ExperimentConfig, task: Task) -> RewardFnLike:
  """`rollout.reward_fn` when set, else the task's own reward function."""
  return cfg.rollout.reward_fn or task.reward_fn
