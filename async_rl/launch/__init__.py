"""The binaries: train, eval, export_hf, serve_jetstream and plan.

Installed, each is a console script (`async-rl-train`, `async-rl-eval`,
`async-rl-export`, `async-rl-serve`, `async-rl-plan`); `python -m async_rl.launch.NAME`
runs the same binary, and so does `python -m launch.NAME` in a clone of the repository
(`launch/` links here).
"""

import sys
from collections.abc import Callable

from async_rl import config, configs

CONFIG_HELP = ("The experiment: a shipped config's name (" + ", ".join(configs.names()) +
               "; NAME:VARIANT for a variant) or a config file (PATH.py[:VARIANT]).")


def parse_flags(argv: list[str]) -> list[str]:
  """`config.parse_flags`, with `--config=NAME[:VARIANT]` naming a shipped config
  (`configs.config_file`); an unknown name exits with status 2 and one line."""
  args = list(argv)
  for i in range(1, len(args)):
    if args[i] == "--":  # absl reads no flag after it
      break
    try:
      if args[i].startswith("--config="):
        args[i] = "--config=" + configs.config_file(args[i].removeprefix("--config="))
      elif args[i] == "--config" and i + 1 < len(args):
        args[i + 1] = configs.config_file(args[i + 1])
    except ValueError as e:
      print(f"FATAL flags parsing error: --config: {e}", file=sys.stderr)
      sys.exit(2)
  return config.parse_flags(args)


def run(main: Callable[[list[str]], None], module_name: str, *, has_config: bool = True):
  """Runs a binary's `main` under absl however it was started: as `__main__`, or from
  its console script, whose `__main__` is a stub.

  absl's `--help` prints `__main__`'s docstring and the flags of the module named
  `sys.argv[0]`, so a binary started from its script lends its own to them.

  Args:
    main: the binary's `main(argv)`.
    module_name: the binary module's `__name__`.
    has_config: the binary defines `--config` (its flags go through `parse_flags`).
  """
  from absl import app, flags  # noqa: PLC0415 - only binaries parse flags
  module = sys.modules[module_name]
  stub = sys.modules["__main__"]
  if stub is not module:
    stub.__doc__ = module.__doc__
    for flag in flags.FLAGS.get_key_flags_for_module(module_name):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main, **({"flags_parser": parse_flags} if has_config else {}))
