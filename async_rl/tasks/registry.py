"""Tasks by name: `task.name` is a key of `TASKS` or "module:attr".

A task is made from its config section (`config.TaskConfig`). "module:attr" names a
factory `f(cfg: TaskConfig) -> Task` (`tasks.protocol`) that the trainer's and every
rollout worker's process can import; it reads its own options from `cfg.options` and
checks them itself. A built-in task also has a `check(cfg: ExperimentConfig)` of how it
fits the rest of the run, which the builder runs before anything is compiled
(`rl.build.preflight`), so that a bad value stops a binary at once.

The agent task (`agents.task`) builds its inner task through this registry, so its
entry names its functions as "module:attr", loaded when used: `tasks/` imports nothing
from `agents/`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

from async_rl import named
from async_rl.tasks import (arithmetic, chat_arithmetic, code_task, data_task, math_task,
                            tool_task)


class _Entry(NamedTuple):
  """A built-in task's factory and checks: each a function or its "module:attr"."""
  make: Callable[[Any], Any] | str
  check: Callable[[Any], None] | str


TASKS: dict[str, _Entry] = {
    "agent": _Entry("async_rl.agents.task:make", "async_rl.agents.task:check"),
    "arithmetic": _Entry(arithmetic.make, arithmetic.check),
    "arithmetic_chat": _Entry(chat_arithmetic.make, chat_arithmetic.check),
    "arithmetic_tool": _Entry(tool_task.make, arithmetic.check),
    "code": _Entry(code_task.make, code_task.check),
    "data": _Entry(data_task.make, data_task.check),
    "math": _Entry(math_task.make, math_task.check),
}
# What a run uses of a task (see `tasks.protocol.Task`).
_MEMBERS = ("tokenizer", "reward_fn", "workflow", "stream", "heldout", "reference")


def _loaded(member: Callable | str, kind: str) -> Callable:
  return named.load_named(member, "task.name", kind) if isinstance(member, str) else member


def resolve_task(name: str) -> Callable[[Any], Any]:
  """The factory of the task called `name`; raises ValueError for an unknown one."""
  found = named.lookup(TASKS, name, "task.name", "task factory")
  return _loaded(found.make, "task factory") if isinstance(found, _Entry) else found


def check_task(cfg) -> None:
  """The checks `cfg.task.name` owns; for "module:attr", that the factory loads."""
  if cfg.task.name in TASKS:
    _loaded(TASKS[cfg.task.name].check, "task check")(cfg)
  else:
    resolve_task(cfg.task.name)


def make_task(cfg):
  """The task `cfg.task.name` of a `config.TaskConfig`, built from it.

  Raises:
    ValueError: an unknown name, or a factory's result that lacks a member of a task.
  """
  task = resolve_task(cfg.name)(cfg)
  missing = [m for m in _MEMBERS if not hasattr(task, m)]
  if missing:
    raise ValueError(f"task.name {cfg.name!r} made a {type(task).__name__} without "
                     f"{', '.join(missing)} (see async_rl.tasks.protocol.Task)")
  return task
