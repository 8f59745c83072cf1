"""The user task of examples/sums.py on a micro model (seconds per step on a CPU).

  python -m launch.train --config=examples/sums_config.py --workdir=$(mktemp -d)

Two RL steps do not teach it to add; the run shows the pieces working together.
"""

from async_rl.cli import config_dict


def get_config():
  c = config_dict()
  c.task.name = "examples.sums:make_task"
  c.task.options = {"train": "examples/sums_train.jsonl",
                    "heldout": "examples/sums_heldout.jsonl"}
  c.num_steps = 2
  c.batch_groups = 2
  c.model.update(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                 head_dim=16, d_ff=64, max_seq_len=32)
  c.generation.update(max_prompt_len=8, max_new_tokens=8, group_size=4, num_slots=8)
  c.batching.max_tokens_per_mb = 32
  c.eval.update(num_prompts=4, pass_k=2)
  return c
