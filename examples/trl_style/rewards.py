"""Reward functions written as for TRL's GRPOTrainer: batched, with the data set's
other columns as keyword arguments (here `solution`, the column of train.jsonl).

The run calls each with one completion at a time, in its reward workers, under
`rollout.reward_timeout_s`; nothing here knows about the library.
"""


def correctness_reward(completions, solution, **kwargs):
  """1.0 for each completion that is its solution, else 0.0."""
  return [float(c.strip() == s) for c, s in zip(completions, solution)]


def format_reward(completions, **kwargs):
  """1.0 for each completion that is a number alone, else 0.0."""
  return [float(c.strip().isdigit()) for c in completions]
