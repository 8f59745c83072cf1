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

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from async_rl import named

RewardFn = Callable[[str | Sequence[int], Any], float]


class _ByPath(Mapping[str, RewardFn]):
  """Names to "module:function" paths, each function imported when it is looked up, so
  that a reward worker imports only the modules of the functions it calls."""

  def __init__(self, paths: dict[str, str]):
    self._paths = paths

  def __getitem__(self, name: str) -> RewardFn:
    return named.load_named(self._paths[name], "REWARD_FNS", "reward function")

  def __iter__(self) -> Iterator[str]:
    return iter(self._paths)

  def __len__(self) -> int:
    return len(self._paths)


REWARD_FNS: Mapping[str, RewardFn] = _ByPath({
    "arithmetic": "async_rl.tasks.arithmetic:verify",
    "arithmetic_steps": "async_rl.tasks.arithmetic:step_credit",
    "arithmetic_chat": "async_rl.tasks.chat_arithmetic:strict_answer",
    "arithmetic_chat_lenient": "async_rl.tasks.chat_arithmetic:lenient_answer",
    "code_tests": "async_rl.rewards.code_tests:code_tests_reward",
    "code_tests_all": "async_rl.rewards.code_tests:code_tests_all_reward",
    "math": "async_rl.tasks.math_data:math_reward",
})


def resolve_reward_fn(name: str | RewardFn, field: str = "reward_fn") -> RewardFn:
  """The reward function called `name` (a function is itself); raises ValueError for
  an unknown name, naming the config `field` it came from."""
  if callable(name):
    return name
  if not isinstance(name, str):
    raise ValueError(f"{field}: a reward function must be a name or a callable, got {name!r}")
  return named.lookup(REWARD_FNS, name, field, "reward function")
