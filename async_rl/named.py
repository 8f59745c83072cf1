"""Callables named "module:attr", as configs name user-supplied tasks and rewards."""

import importlib
from collections.abc import Callable


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
