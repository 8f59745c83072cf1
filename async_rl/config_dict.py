"""Between `ml_collections.ConfigDict`s (config files, command-line overrides) and the
typed `ExperimentConfig`: one strict conversion each way.

Binaries call `from_config_dict` once; library code only sees the frozen dataclasses.
"""

import dataclasses
import difflib
import sys
import types
import typing
from typing import Any

from async_rl import config_check
from async_rl.config import ExperimentConfig

# Keys the config once had: what to write instead.
_REMOVED_KEYS = {
    "ppo.behav_imp_weight_cap": "write ppo.rejection_upper=<the cap> instead (with the "
                                "default rejection_level='token', rejection_action='mask' "
                                "and rejection_metric='ratio' it masks the same tokens)",
}


def from_config_dict(cd: Any) -> ExperimentConfig:
  """Converts a ConfigDict (or nested mapping) to an `ExperimentConfig`, strictly.

  Every value is checked, by the config and by the components that own it
  (`config_check`); an error names the field.
  """
  return config_check.check(_build(ExperimentConfig, _to_plain(cd), ""))


def _to_plain(x):
  if hasattr(x, "to_dict"):
    return x.to_dict()
  return x


def _build(cls, values, prefix):
  if not isinstance(values, typing.Mapping):
    raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(unknown_key_message(prefix + unknown[0], [prefix + n for n in names]))
  kwargs = {k: _coerce(hints[k], v, prefix + k) for k, v in values.items()}
  return cls(**kwargs)


def _coerce(hint, value, path):
  optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
  if optional:
    if value is None:
      return None
    hint = next(a for a in typing.get_args(hint) if a is not type(None))
  if dataclasses.is_dataclass(hint):
    return _build(hint, _to_plain(value), path + ".")
  if typing.get_origin(hint) is dict:  # A free-form section (task_options): plain data.
    value = _to_plain(value)
    if not isinstance(value, typing.Mapping) or not all(isinstance(k, str) for k in value):
      raise ValueError(f"{path} must be a mapping with string keys, got {value!r}")
    return dict(value)
  if typing.get_origin(hint) is tuple:
    if not isinstance(value, (list, tuple)):
      raise ValueError(f"{path} must be a sequence, got {value!r}")
    (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
    return tuple(_coerce(item, v, path) for v in value)
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint is int and isinstance(value, float) and value.is_integer():
    return int(value)
  if value is None or not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
    raise ValueError(f"{path} must be of type {hint.__name__}, got {value!r}")
  return value


def default_config_dict():
  """Every field of `ExperimentConfig` with its default, as a ConfigDict.

  Config files start from this so that every field can be overridden from the
  command line (`--config.ppo.c_clip=3`); optional fields are typed placeholders.
  """
  import ml_collections  # only config files and binaries need it
  from ml_collections.config_dict import placeholder

  def convert(cls):
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      hint = hints[f.name]
      if dataclasses.is_dataclass(hint):
        out[f.name] = convert(hint)
      elif typing.get_origin(hint) is dict:
        out[f.name] = ml_collections.ConfigDict(f.default_factory())
      elif f.default is None:
        out[f.name] = placeholder(next(a for a in typing.get_args(hint) if a is not type(None)))
      else:
        out[f.name] = f.default
    return ml_collections.ConfigDict(out)

  return convert(ExperimentConfig)


def to_dict(cfg) -> dict:
  """The resolved config as plain nested dicts (for logging and saving)."""
  return dataclasses.asdict(cfg)


def config_keys(cd=None) -> list[str]:
  """Every leaf field of a config as a dotted path (default: `default_config_dict()`)."""
  def walk(d, prefix):
    for k, v in d.items():
      if hasattr(v, "items"):
        yield from walk(v, f"{prefix}{k}.")
      else:
        yield prefix + k
  return sorted(walk(default_config_dict() if cd is None else cd, ""))


def unknown_key_message(key: str, known) -> str:
  """An error for an unknown config key that names the nearest valid ones (or, for a
  key the config once had, what to write instead)."""
  if key in _REMOVED_KEYS:
    return f"config key {key} was removed: {_REMOVED_KEYS[key]}"
  known = list(known)
  near = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
  if near:
    return f"unknown config key {key!r}; did you mean {', '.join(near)}?"
  section = key.rpartition(".")[0]
  here = ([k for k in known if k.startswith(section + ".")] if section
          else sorted({k.split(".")[0] for k in known}))
  return f"unknown config key {key!r}; valid keys there: {', '.join(here)}"


def parse_flags(argv):
  """absl's flag parsing, with a readable error for an unknown `--config.x=` override.

  ml_collections raises a bare `AttributeError: "'x'"` for an override of a key the
  config does not have; this names the key and the nearest valid ones instead, and
  exits with status 2 as other flag errors do. Pass as `app.run(main,
  flags_parser=parse_flags)`.
  """
  from absl import flags  # only binaries parse flags
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    overrides = [a.split("=", 1)[0][len("--config."):] for a in argv[1:]
                 if a.startswith("--config.")]
    known = config_keys()
    bad = next((k for k in overrides if k not in known and not any(
        known_key.startswith(k + ".") for known_key in known)), None)
    if bad is None:
      raise
    print(f"FATAL flags parsing error: {unknown_key_message(bad, known)}", file=sys.stderr)
    sys.exit(2)
