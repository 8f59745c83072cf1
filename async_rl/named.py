"""Names in a config: a registry's key, or "module:attr" for a user's own callable.

Losses (`loss.LOSSES`), tasks (`tasks.registry.TASKS`) and reward functions
(`rewards.REWARD_FNS`) are all looked up the same way (`lookup`).
"""

import importlib
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def load_named(name: str, field: str, kind: str) -> Callable | None:
  """The callable that `name` ("module:attr", attr possibly dotted) names, or None
  if `name` is not of that form.

  Raises:
    ValueError: the module or attribute does not load, or is not callable; the
      message names the config `field`, the name and the `kind` of callable wanted.
  """
  module_name, sep, attr = name.partition(":")
  if not (sep and module_name and attr):
    return None
  try:
    target = importlib.import_module(module_name)
    for part in attr.split("."):
      target = getattr(target, part)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"{field} {name!r}: cannot load the {kind}: {e}") from e
  if not callable(target):
    raise ValueError(f"{field} {name!r} is not callable; it must name the {kind}")
  return target


def lookup(table: Mapping[str, T], name: str, field: str, kind: str) -> T | Callable:
  """`table[name]`, or the callable "module:attr" names: how a config names a loss, a
  task or a reward function.

  Raises:
    ValueError: `name` is neither, naming `field` and the names `table` knows.
  """
  if name in table:
    return table[name]
  found = load_named(name, field, kind) if isinstance(name, str) else None
  if found is None:
    raise ValueError(f"{field} must be one of {sorted(table)} or 'module:attr' naming a "
                     f"{kind}, got {name!r}")
  return found
