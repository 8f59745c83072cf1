"""Tasks by name: `cfg.task_kind` is a key of `TASKS` or "module:attr".

"module:attr" names a factory `f(cfg: ExperimentConfig) -> Task` (`tasks.protocol`)
that the trainer's and every rollout worker's process can import; it reads its own
options from `cfg.task_options` and checks them itself. A built-in task also has a
`check(cfg)`, run with the config's other checks before anything is built
(`config_check`), so that a bad value stops a binary at once.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

from async_rl import named
from async_rl.tasks import arithmetic_task, code_task, math_task, tool_task


class _Entry(NamedTuple):
  make: Callable[[Any], Any]
  check: Callable[[Any], None]


TASKS: dict[str, _Entry] = {
    "arithmetic": _Entry(arithmetic_task.make, arithmetic_task.check),
    "arithmetic_tool": _Entry(tool_task.make, arithmetic_task.check),
    "code": _Entry(code_task.make, code_task.check),
    "math": _Entry(math_task.make, math_task.check),
}
# What a run uses of a task (see `tasks.protocol.Task`).
_MEMBERS = ("tokenizer", "reward_fn", "workflow", "stream", "heldout", "reference")


def resolve_task(name: str) -> Callable[[Any], Any]:
  """The factory of the task called `name`; raises ValueError for an unknown one."""
  if name in TASKS:
    return TASKS[name].make
  factory = named.load_named(name, "task_kind", "task factory")
  if factory is None:
    raise ValueError(f"task_kind must be one of {sorted(TASKS)} or 'module:attr' naming a "
                     f"task factory, got {name!r}")
  return factory


def check_task(cfg) -> None:
  """The checks `cfg.task_kind` owns; for "module:attr", that the factory loads."""
  if cfg.task_kind in TASKS:
    TASKS[cfg.task_kind].check(cfg)
  else:
    resolve_task(cfg.task_kind)


def make_task(cfg):
  """The task of `cfg.task_kind`, built from `cfg`.

  Raises:
    ValueError: an unknown name, or a factory's result that lacks a member of a task.
  """
  task = resolve_task(cfg.task_kind)(cfg)
  missing = [m for m in _MEMBERS if not hasattr(task, m)]
  if missing:
    raise ValueError(f"task_kind {cfg.task_kind!r} made a {type(task).__name__} without "
                     f"{', '.join(missing)} (see async_rl.tasks.protocol.Task)")
  return task
