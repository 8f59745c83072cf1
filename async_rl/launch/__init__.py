"""The binaries: train, eval, export_hf, serve_jetstream, plan and fetch.

Installed, each is a console script (`async-rl-train`, `async-rl-eval`,
`async-rl-export`, `async-rl-serve`, `async-rl-plan`, `async-rl-fetch`); `python -m async_rl.launch.NAME`
runs the same binary, and so does `python -m launch.NAME` in a clone of the repository
(`launch/` links here).
"""

import sys
from collections.abc import Callable

from absl import app, flags

from async_rl import cli, configs

CONFIG_HELP = ("The experiment: a shipped config's name (" + ", ".join(configs.names()) +
               "; NAME:VARIANT for a variant) or a config file (PATH.py[:VARIANT]).")


def parse_flags(argv: list[str]) -> list[str]:
  """`cli.parse_flags` for a binary: `--config=NAME[:VARIANT]` names a shipped config
  (`configs.config_file`), `--print_config` prints the resolved config's keys
  (`cli.format_keys`) and exits 0, and a bad flag exits with status 2 and one line,
  without the usage text."""
  try:
    rest = cli.parse_flags(_shipped_configs(argv))
    if flags.FLAGS.print_config:
      try:
        text = cli.format_keys(cli.from_dict(flags.FLAGS.config))
      except ValueError as e:
        raise cli.FlagsError(f"invalid config: {e}") from None
  except cli.FlagsError as e:
    print(f"FATAL flags parsing error: {e}", file=sys.stderr)
    sys.exit(2)
  if not flags.FLAGS.print_config:
    return rest
  try:
    print(text, flush=True)
  except BrokenPipeError:  # `| head` closed the pipe: what it read is what was asked
    sys.stdout = None
  sys.exit(0)


def _shipped_configs(argv: list[str]) -> list[str]:
  """`argv` with a shipped config's `--config=NAME[:VARIANT]` replaced by its file."""
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
      raise cli.FlagsError(f"--config: {e}") from None
  return args


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
  module = sys.modules[module_name]
  stub = sys.modules["__main__"]
  if stub is not module:
    stub.__doc__ = module.__doc__
    for flag in flags.FLAGS.get_key_flags_for_module(module_name):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main, **({"flags_parser": parse_flags} if has_config else {}))
