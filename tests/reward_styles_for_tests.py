"""Reward functions in TRL's and verl's styles, for tests/test_reward_styles.py and
tests/test_data_task.py; top-level, so the reward workers import them by name."""


def trl_correctness(completions, solution, **kwargs):
  """TRL's batched style, as the issue's user wrote it."""
  return [float(c.strip() == s) for c, s in zip(completions, solution)]


def trl_seen(prompts, completions, **columns):
  """Everything a TRL-style function receives, as one number: for inspection."""
  return [len(repr((prompts, completions, sorted(columns.items()))))]


def trl_length(completions, **kwargs):
  return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def trl_not_applicable(completions, **kwargs):
  return [None for _ in completions]


def trl_returns_a_number(completions, **kwargs):
  return 1.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  """verl's style: 1 for the ground truth, plus 10 for a data source named "bonus"."""
  bonus = 10.0 if data_source == "bonus" else 0.0
  return {"score": float(solution_str == str(ground_truth)) + bonus, "extra": extra_info}


def single_returns_a_list(completion, reference):
  return [1.0]


def exact(completion, reference):
  return float(completion.strip() == str(reference))
