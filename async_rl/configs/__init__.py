"""The shipped experiments, usable by name wherever the package is installed.

Each module's `get_config(variant=None)` returns the ConfigDict of an experiment. A
binary's `--config` takes a name, `--config=tiny` or `--config=tiny:long_reasoning` (a
variant after the colon), or a config file, `--config=my_experiment.py[:variant]`; in a
clone of the repository `configs/` links here, so `--config=configs/tiny.py` is the same
experiment.
"""

import os

_DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> tuple[str, ...]:
  """The shipped configs' names."""
  return tuple(sorted(f.removesuffix(".py") for f in os.listdir(_DIR)
                      if f.endswith(".py") and f != "__init__.py"))


def config_file(spec: str) -> str:
  """`--config`'s value as ml_collections loads it: a shipped config's `NAME[:VARIANT]`
  becomes its file's `PATH[:VARIANT]`; a file (a name ending in .py, or a path) stays.

  Raises:
    ValueError: `spec` names no shipped config, or a file that does not exist.
  """
  name, colon, variant = spec.partition(":")
  shipped = f"the shipped configs, by name: {', '.join(names())}"
  if name.endswith(".py") or os.sep in name:
    if not os.path.isfile(name):
      raise ValueError(f"no config file {name!r} in {os.getcwd()}; {shipped}")
    return spec
  if name not in names():
    raise ValueError(f"no shipped config {name!r}; {shipped} (or a file, PATH.py)")
  return os.path.join(_DIR, f"{name}.py") + colon + variant
