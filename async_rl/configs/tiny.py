"""Tiny model on the arithmetic task, on CPU: the default config of the quick start.

  python -m launch.train --config=configs/tiny.py --workdir=/tmp/async_rl_tiny

A supervised warm start (100 steps), then asynchronous RL (η = 2, retract updates,
400 steps of 32 prompts x 8 samples), with held-out evaluation every 100 steps.
RL trains on the shaped reward `arithmetic_steps` (credit for each correct leading
step; `tasks.arithmetic.step_credit`); held-out accuracy still counts only fully
correct worked solutions. BENCHMARKS.md ("The quick start") has its time and
accuracies.

Variants, named after the file (`--config=configs/tiny.py:tool`):

  tool       the same problems with a calculator tool, over several turns
             (`task.name="arithmetic_tool"`): the policy writes each call (`7+2=`) and
             the answer line, the calculator each result.
  long_tail  problems of up to 24 operands instead of 8: solutions of up to 187
             tokens (median about 15), the tail that stalls synchronous RL
             (`python -m benchmarks.sync_vs_async --config=configs/tiny.py:long_tail`).
  long_reasoning
             problems of up to 128 operands with a heavier tail (exponent 1): prompts
             of up to 257 tokens and solutions of up to 1,019 (median about 65, p99
             about 930), within 1,024 new tokens, the generation-bound regime of
             reasoning RL at CPU scale. The generator's KV budget is a quarter of
             every slot at full length: 1,296 blocks of 16 tokens, 16 sequences of the
             full 1,288 or the 64 slots at a mean of 324; longer bursts are preempted
             and resumed.
"""

from async_rl.cli import config_dict
from async_rl.config import MODEL_PRESETS

VARIANTS = ("tool", "long_tail", "long_reasoning")


def get_config(variant=None):
  c = config_dict()
  c.batch_groups = 32
  c.num_steps = 400
  c.model.update(MODEL_PRESETS["tiny"])
  c.model.vocab_size = 32
  c.model.max_seq_len = 96
  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 2
  c.ppo.rejection_upper = 5.0
  c.rollout.reward_fn = "arithmetic_steps"
  c.generation.max_prompt_len = 32
  c.generation.max_new_tokens = 64
  c.generation.group_size = 8
  # A CPU decode step costs more per slot as slots are added; 16 slots keep a small
  # CPU's generator fastest.
  c.generation.num_slots = 16
  c.staleness.max_staleness = 2
  c.staleness.max_concurrent = 96
  c.eval.num_prompts = 200
  c.eval.every_steps = 100
  c.sft.steps = 100
  c.checkpoint.every_steps = 50
  if variant == "tool":
    c.task.name = "arithmetic_tool"
  elif variant == "long_tail":
    c.task.arithmetic.max_terms = 24
    c.model.max_seq_len = 256
    c.generation.max_prompt_len = 56
    c.generation.max_new_tokens = 192
    c.generation.num_slots = 64
  elif variant == "long_reasoning":
    c.task.arithmetic.max_terms = 128
    c.task.arithmetic.tail_exponent = 1.0
    c.model.max_seq_len = 264 + 1024
    c.batching.max_tokens_per_mb = 2048
    c.generation.max_prompt_len = 264
    c.generation.max_new_tokens = 1024
    c.generation.num_slots = 64
    c.generation.kv_blocks = 1296
  elif variant is not None:
    raise ValueError(f"configs/tiny.py has variants {VARIANTS}, got {variant!r}")
  return c
