"""Reward functions by name: each is `fn(completion, reference) -> float`, or TRL's or
verl's form (`rewards.adapters` calls each in its style).

`completion` is the generated text (or token ids, for a function that wants them)
and `reference` whatever the task checks it against. Functions run in the reward
workers, which look a name up there, so it must resolve the same way: a key of
`REWARD_FNS`, or "module:function" naming a top-level function that the workers
(which share the caller's sys.path) can import. A function object can be given
instead of a name (`RewardService` ships it to the workers by value, so one defined
in a notebook cell works too).
"""

from collections.abc import Callable, Sequence
from typing import Any

from async_rl import named
from async_rl.rewards.code_tests import code_tests_all_reward, code_tests_reward
from async_rl.tasks.arithmetic import step_credit
from async_rl.tasks.arithmetic import verify as arithmetic_reward
from async_rl.tasks.math_data import math_reward

RewardFn = Callable[[str | Sequence[int], Any], float]

REWARD_FNS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_reward,
    "arithmetic_steps": step_credit,
    "code_tests": code_tests_reward,
    "code_tests_all": code_tests_all_reward,
    "math": math_reward,
}


def resolve_reward_fn(name: str | RewardFn, field: str = "reward_fn") -> RewardFn:
  """The reward function called `name` (a function is itself); raises ValueError for
  an unknown name, naming the config `field` it came from."""
  if callable(name):
    return name
  if not isinstance(name, str):
    raise ValueError(f"{field}: a reward function must be a name or a callable, got {name!r}")
  return named.lookup(REWARD_FNS, name, field, "reward function")
