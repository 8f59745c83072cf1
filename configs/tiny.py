"""Tiny model on the arithmetic task, on CPU: the default config of the quick start.

  python -m launch.train --config=configs/tiny.py --workdir=/tmp/async_rl_tiny

A supervised warm start (100 steps), then asynchronous RL (η = 2, retract updates,
400 steps of 32 prompts x 8 samples), with held-out evaluation every 100 steps.
RL trains on the shaped reward `arithmetic_steps` (credit for each correct leading
step; `tasks.arithmetic.step_credit`); held-out accuracy still counts only fully
correct worked solutions. About 4.5 to 21 minutes on a 2-core CPU, by VM; see the
README for the measured times and accuracies.
"""

from async_rl.config_dict import default_config_dict
from async_rl.models import PRESETS


def get_config():
  c = default_config_dict()
  c.batch_groups = 32
  c.num_steps = 400
  c.model.update(PRESETS["tiny"])
  c.model.vocab_size = 32
  c.model.max_seq_len = 96
  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 2
  c.ppo.rejection_upper = 5.0
  c.rollout.reward_fn = "arithmetic_steps"
  c.generation.max_prompt_len = 32
  c.generation.max_new_tokens = 64
  c.generation.group_size = 8
  # A CPU decode step costs more per slot as slots are added (BENCHMARKS.md, sync vs
  # async by slot count): with 16 slots instead of 64 the quick start took 6.5 minutes
  # instead of 8.
  c.generation.num_slots = 16
  c.staleness.max_staleness = 2
  c.staleness.max_concurrent = 96
  c.eval.num_prompts = 200
  c.eval.every_steps = 100
  c.sft.steps = 100
  c.checkpoint.every_steps = 50
  return c
