"""Run untrusted Python (model-written programs) in a locked-down subprocess.

What `run_sandboxed` enforces on Linux, and what it does not:
  * Time: at `timeout_s` the process group is SIGKILLed. Inside a PID namespace the
    program runs as PID 1, and its death kills every process it started, including
    one that left the group.
  * Memory: RLIMIT_AS caps each process's address space at `memory_mb`.
  * Output and files: RLIMIT_FSIZE caps each file the program writes, stdout and
    stderr included, at `max_output_mb`. The number of files is not capped.
  * Processes: RLIMIT_NPROC caps the processes and threads of the user the program
    runs as. The kernel ignores it for root, so when the caller is root the program
    runs as `nobody` (uid 65534), where it holds. It counts every process of that
    user, so concurrent sandboxes share it.
  * Files: a private temporary working directory, removed afterwards. As `nobody`
    the program cannot write where permissions forbid it, but it can still write to
    world-writable places such as /tmp and read what is world-readable. Run as the
    calling user (not root), it can write wherever the caller can.
  * Network: a new network namespace (`unshare --net`) holding only a loopback
    interface that is down. This needs root or unprivileged user namespaces; where
    neither works the program keeps the host network, and `isolation().namespaces`
    is False.
  * Environment: `python -I` (no user site, no PYTHON* variables) and an environment
    holding only PATH.
There is no seccomp filter and the filesystem view is shared, so this contains
careless or buggy code, not a determined attacker.
"""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from absl import logging

NOBODY = 65534
_PATH = "/usr/local/bin:/usr/bin:/bin"
_NAMESPACES = ["unshare", "--net", "--pid", "--ipc", "--mount-proc", "--fork",
               "--kill-child"]

# Runs first in the sandbox, as root when the caller is root: drops privileges, sets
# the limits, then replaces itself with a fresh interpreter running the program.
_BOOTSTRAP = """
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
if cfg["user"] is not None:
  os.setgroups([])
  os.setgid(cfg["user"])
  os.setuid(cfg["user"])
# A uid change clears the parent-death signal that `unshare --kill-child` set.
ctypes.CDLL(None).prctl(1, 9)
for name, value in cfg["limits"].items():
  resource.setrlimit(getattr(resource, name), (value, value))
os.execv(cfg["python"], [cfg["python"], "-I", "main.py"])
"""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What a sandboxed program did.

  Attributes:
    stdout: its standard output, decoded as UTF-8 (invalid bytes replaced).
    stderr: its standard error, decoded likewise.
    returncode: its exit status; negative for a signal (-9 when killed on timeout).
    timed_out: whether it was killed for running past `timeout_s`.
  """
  stdout: str
  stderr: str
  returncode: int
  timed_out: bool


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What `run_sandboxed` can enforce on this machine.

  Attributes:
    namespaces: the program runs in new network, PID and IPC namespaces.
    user: the uid the program runs as; None when it runs as the caller.
    python: the interpreter that runs the program.
  """
  namespaces: bool
  user: int | None
  python: str

  @property
  def process_limit_enforced(self) -> bool:
    """Whether the kernel applies `max_processes` (it does not to root)."""
    return self.user is not None or os.geteuid() != 0


def _succeeds(cmd: list[str], **kwargs) -> bool:
  try:
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=30, **kwargs).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@functools.cache
def _namespace_prefix() -> tuple[str, ...]:
  # Without root, only a user namespace grants the rights to create the others.
  full = _NAMESPACES if os.geteuid() == 0 else ["unshare", "--map-root-user",
                                                 *_NAMESPACES[1:]]
  for prefix in (full, [arg for arg in full if arg != "--mount-proc"]):
    if shutil.which(prefix[0]) and _succeeds([*prefix, "--", "true"]):
      return (*prefix, "--")
  logging.warning("sandbox: cannot create namespaces here; sandboxed code keeps the "
                  "host network and its processes are killed by process group only")
  return ()


@functools.cache
def _interpreter_and_user() -> tuple[str, int | None]:
  if os.geteuid() != 0:
    return sys.executable, None
  # The interpreter must be runnable by `nobody`; a per-user install under /root
  # is not, a system python usually is.
  candidates = [sys.executable, shutil.which("python3", path=_PATH)]
  for python in filter(None, candidates):
    if _succeeds([python, "-I", "-c", "pass"], user=NOBODY, group=NOBODY,
                 extra_groups=[], cwd="/"):
      return python, NOBODY
  logging.warning("sandbox: no interpreter runnable by nobody; sandboxed code runs as "
                  "root, so neither the process limit nor file permissions hold")
  return sys.executable, None


def isolation() -> Isolation:
  """What the sandbox enforces here; probed once per process."""
  python, user = _interpreter_and_user()
  return Isolation(namespaces=bool(_namespace_prefix()), user=user, python=python)


def _read(f, limit: int) -> str:
  f.seek(0)
  return f.read(limit).decode("utf-8", errors="replace")


def _kill_group(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _remove_tree(path: str):
  if os.geteuid() != 0:
    # The program may have made directories unreadable; root ignores that anyway.
    for root, dirs, _ in os.walk(path):
      for d in dirs:
        p = os.path.join(root, d)
        if not os.path.islink(p):
          try:
            os.chmod(p, 0o700)
          except OSError:
            pass
  shutil.rmtree(path, ignore_errors=True)


def run_sandboxed(code: str, stdin: str = "", *, timeout_s: float = 5.0,
                  memory_mb: int = 512, max_processes: int = 16,
                  max_output_mb: int = 16) -> SandboxResult:
  """Runs the Python program `code` on `stdin` under the limits of this module.

  Args:
    code: the program's source.
    stdin: its standard input.
    timeout_s: wall-clock limit, interpreter start-up included.
    memory_mb: address-space limit per process.
    max_processes: RLIMIT_NPROC (see the module docstring for when it holds).
    max_output_mb: size limit of stdout, stderr and each file written.

  Returns:
    The program's output and exit status. A limit hit shows as a non-zero
    `returncode` (MemoryError, SIGXFSZ, ...) or `timed_out`.
  """
  python, user = _interpreter_and_user()
  limit = max_output_mb << 20
  cfg = {"user": user, "python": python, "limits": {
      "RLIMIT_AS": memory_mb << 20, "RLIMIT_NPROC": max_processes,
      "RLIMIT_FSIZE": limit, "RLIMIT_CORE": 0}}
  workdir = tempfile.mkdtemp(prefix="async_rl_sandbox_")
  try:
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
      f.write(code)
    if user is not None:
      os.chown(workdir, user, user)
    with (tempfile.TemporaryFile() as stdin_f, tempfile.TemporaryFile() as out,
          tempfile.TemporaryFile() as err):
      stdin_f.write(stdin.encode("utf-8"))
      stdin_f.seek(0)
      proc = subprocess.Popen(
          [*_namespace_prefix(), python, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)],
          cwd=workdir, env={"PATH": _PATH}, stdin=stdin_f, stdout=out, stderr=err,
          start_new_session=True)
      try:
        returncode, timed_out = proc.wait(timeout=timeout_s), False
      except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        returncode, timed_out = proc.wait(), True
      # Without a PID namespace, background processes it left would outlive it.
      _kill_group(proc.pid)
      return SandboxResult(_read(out, limit), _read(err, limit), returncode, timed_out)
  finally:
    _remove_tree(workdir)
