"""Tiny model on CPU: the default config of the quick start and the tests.

  python -m launch.train --config=configs/tiny.py --workdir=/tmp/async_rl_tiny

Runs in minutes on a 2-core CPU.
"""

import ml_collections

from async_rl.models import PRESETS


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.batch_groups = 8
  c.num_steps = 20
  c.model = dict(PRESETS["tiny"], vocab_size=64, max_seq_len=256)
  c.optimizer = dict(learning_rate=3e-4, warmup_steps=2, grad_clip=1.0)
  c.ppo = dict(loss="decoupled_ppo", eps_clip=0.2, behav_imp_weight_cap=5.0)
  c.advantage = dict(mean_level="group", std_level="group")
  c.batching = dict(max_tokens_per_mb=256)
  c.mesh = dict(data=1, fsdp=-1, tensor=1)
  c.generation = dict(max_prompt_len=32, max_new_tokens=64, group_size=4, num_slots=32,
                      update_mode="retract")
  c.staleness = dict(max_staleness=4, max_concurrent=32)
  return ml_collections.ConfigDict(c)
