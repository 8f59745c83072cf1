"""A workdir belongs to one run: `hold` locks it for the run's process, naming the holder.

The lock is `run.lock` in the workdir: an advisory `flock` on the file, which the kernel
drops when the holding process ends, however it ends (SIGKILL, the OOM killer), so
a lock outlives no process. The file's contents name the holder (host, pid, start
time, run id): a run refused the lock reports them, and a run that takes the lock
while the file still names a holder (one that ended without releasing it) says that
it takes over from it. On a file system without `flock` (some network file systems)
the contents decide: a holder on this host whose process is gone is taken over; a
live one, or one on another host, keeps the workdir.
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

from async_rl.rl.errors import WorkdirInUseError

LOCK_FILE = "run.lock"
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
