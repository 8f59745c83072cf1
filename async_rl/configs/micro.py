"""A micro model and batch for smoke tests and resume tests: seconds per step on CPU.

  python -m launch.train --config=configs/micro.py --workdir=/tmp/async_rl_micro

It does not learn anything useful; it exercises every component quickly.
"""

from async_rl.cli import config_dict


def get_config():
  c = config_dict()
  c.batch_groups = 2
  c.num_steps = 4
  c.model.update(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                 head_dim=16, d_ff=64, max_seq_len=64)
  c.batching.max_tokens_per_mb = 64
  c.generation.update(max_prompt_len=24, max_new_tokens=16, group_size=2, num_slots=8)
  c.staleness.update(max_staleness=1, max_concurrent=8)
  c.eval.update(num_prompts=4, pass_k=2)
  c.checkpoint.every_steps = 1
  c.task.arithmetic.max_terms = 3
  return c
