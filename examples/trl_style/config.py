"""A TRL-style data set trained from the command line: a JSONL file with `prompt` and
`solution` columns, TRL-style batched rewards (rewards.py), UTF-8 byte tokens and a
micro model (seconds per step on a CPU).

  python -m launch.train --config=examples/trl_style/config.py --workdir=$(mktemp -d)

A warm start on the solutions, then RL on the weighted sum of the two rewards; held-out
accuracy counts the completions that `correctness_reward` scores 1. A few steps do not
teach it to add; the run shows the pieces working together.
"""

from async_rl.cli import config_dict

REWARDS = "examples.trl_style.rewards:"


def get_config():
  c = config_dict()
  c.task.name = "data"
  c.task.data.update(train_path="examples/trl_style/train.jsonl",
                     heldout_path="examples/trl_style/heldout.jsonl",
                     prompt_key="prompt", answer_key="solution", tokenizer="bytes")
  c.rollout.update(reward_fn=f"{REWARDS}correctness_reward,{REWARDS}format_reward",
                   reward_weights=(1.0, 0.1))
  c.eval.update(correct_fn=f"{REWARDS}correctness_reward", num_prompts=8, pass_k=2)
  c.sft.update(steps=200, batch_size=16, learning_rate=3e-3, log_every=50)
  c.num_steps = 4
  c.batch_groups = 2
  c.model.update(vocab_size=259, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1,
                 head_dim=16, d_ff=128, max_seq_len=32)
  c.generation.update(max_prompt_len=16, max_new_tokens=8, group_size=4, num_slots=8)
  c.batching.max_tokens_per_mb = 32
  return c
