"""A workdir belongs to one run: `hold` locks it for the run's process, naming the holder.

The lock is `run.lock` in the workdir: an advisory `flock` on the file, which the kernel
drops when the holding process ends, however it ends (SIGKILL, the OOM killer), so
a lock outlives no process. The file's contents name the holder (host, pid, start
time, run id): a run refused the lock reports them, and a run that takes the lock
while the file still names a holder (one that ended without releasing it) says that
it takes over from it. On a file system without `flock` (some network file systems)
the contents decide: a holder on this host whose process is gone is taken over; a
live one, or one on another host, keeps the workdir.

The run's resolved config is `config.json` in the workdir (`write_config`): a run resumed
there must keep it, and a replay of the run must run it, but for
`config.RESUMABLE_FIELDS` (`check_resume`, `check_replay`).
"""

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import secrets
import socket
import time
from typing import Callable, Iterator, Optional

from async_rl import cli, config
from async_rl.config import ExperimentConfig
from async_rl.rl.errors import ConfigError, WorkdirInUseError

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.json"
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


@dataclasses.dataclass(frozen=True)
class Holder:
  """The run that holds a workdir: its id, host, process and start time (local, ISO)."""
  run_id: str
  host: str
  pid: int
  started: str

  def __str__(self) -> str:
    return f"run {self.run_id} (host {self.host}, pid {self.pid}, started {self.started})"


def new_run_id() -> str:
  """A run id, one per process start: its start time and a few random hex digits."""
  return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@contextlib.contextmanager
def hold(workdir: str, echo: Callable[[str], None] = print) -> Iterator[Holder]:
  """Holds `workdir` (created if needed) for this process until the block ends.

  Yields:
    This run as the lock file names it, with a new run id.

  Raises:
    WorkdirInUseError: another run holds it; the message names that run.
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    previous = _take(fd, path)
    if previous is not None:
      echo(f"taking over workdir {workdir} from {previous}, which ended without "
           f"releasing it")
    me = Holder(run_id=new_run_id(), host=socket.gethostname(), pid=os.getpid(),
                started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(dataclasses.asdict(me)).encode() + b"\n", 0)
    os.fsync(fd)
    try:
      yield me
    finally:
      os.ftruncate(fd, 0)  # no holder named; closing the file drops the flock
  finally:
    os.close(fd)


def _take(fd: int, path: str) -> Optional[Holder]:
  """Locks `fd`; returns the holder its file named before (one that ended without
  releasing it), or None."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    locked = True
  except BlockingIOError:
    raise WorkdirInUseError(_in_use(path, read_holder(path))) from None
  except OSError as e:
    if e.errno not in _NO_FLOCK:
      raise
    locked = False
  previous = read_holder(path)
  if not locked and previous is not None and not _gone(previous):
    raise WorkdirInUseError(
        _in_use(path, previous) + f"; this file system has no locks, so if that run has "
        f"ended, delete {path}")
  return previous


def read_holder(path: str) -> Optional[Holder]:
  """The holder a lock file names; None if it names none (released, or being written)."""
  try:
    with open(path) as f:
      return Holder(**json.loads(f.read()))
  except (OSError, ValueError, TypeError):
    return None


def _in_use(path, holder):
  who = holder if holder is not None else "another run (whose record is being written)"
  return (f"workdir {os.path.dirname(path)} is in use by {who}; one workdir holds one "
          f"run: wait for it to end, stop it, or choose another --workdir")


def _gone(holder: Holder) -> bool:
  """Whether `holder`'s process has certainly ended: it ran on this host, and its pid
  is free."""
  if holder.host != socket.gethostname():
    return False
  try:
    os.kill(holder.pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:  # someone else's process
    return False
  return False


def write_config(workdir: str, cfg: ExperimentConfig) -> None:
  """Writes `cfg` (resolved) as the run's `config.json` in `workdir`."""
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    json.dump(cli.to_dict(cfg), f, indent=2)


def check_resume(cfg: ExperimentConfig, workdir: str) -> None:
  """A run resumed from `workdir` must keep the config in its `config.json` but for
  `config.RESUMABLE_FIELDS` (or `run.allow_config_change`).

  Raises:
    ConfigError: naming every field that differs from the run's own.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path) or cfg.run.allow_config_change:
    return
  changed = _fixed_fields_changed(path, cfg)
  if changed:
    raise ConfigError(f"{workdir} holds a run whose config differs in {len(changed)} "
                      f"field(s): {'; '.join(changed)}. Resume with the run's own config "
                      f"(or --config.run.allow_config_change=true), or use a new workdir")


def check_replay(cfg: ExperimentConfig, recorded: str) -> None:
  """A replay must run the recorded run's config but for `config.RESUMABLE_FIELDS`.

  Raises:
    ConfigError: `recorded` holds no run, or naming every field that differs.
  """
  path = os.path.join(recorded, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"--replay needs the workdir of a recorded run; {recorded} holds no "
                      f"{CONFIG_FILE}")
  changed = _fixed_fields_changed(path, cfg)
  if changed:
    raise ConfigError(f"a replay runs the recorded run's config; this one differs from "
                      f"{path} in {len(changed)} field(s): {'; '.join(changed)}")


def _fixed_fields_changed(path: str, cfg: ExperimentConfig) -> list[str]:
  """`key: old -> new` of each field outside `config.RESUMABLE_FIELDS` where `cfg`
  differs from the config in the JSON file `path`."""
  with open(path) as f:
    old = json.load(f)
  return [f"{key}: {a!r} -> {b!r}" for key, a, b in _differences(old, cli.to_dict(cfg))
          if not any(key == r or key.startswith(r + ".") for r in config.RESUMABLE_FIELDS)]


def _differences(old, new, prefix=""):
  """(dotted key, old value, new value) of every leaf where two config dicts differ."""
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      yield from _differences(a, b, f"{prefix}{key}.")
    elif json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
      yield prefix + key, a, b
