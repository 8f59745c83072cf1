"""Run untrusted Python (model-written programs) in a sandbox it cannot see out of.

A policy rewarded for passing tests is a determined attacker: it will print a
readable answer file, or leave one for a later sample. So, on Linux with bubblewrap
(`bwrap`, 0.8 or newer) and unprivileged user namespaces, `run_sandboxed` enforces:
  * Identity: the program runs as the calling user, or as `nobody` (uid 65534) when
    the caller is root (bwrap itself is started as `nobody`), in a user namespace of
    its own, with no capabilities and no way to gain any (no_new_privs). So it holds
    no more rights on the host than `nobody` (or the caller) does: a file it could
    not read there it cannot read here.
  * Files: a private root holding only read-only binds of what the interpreter needs:
    its executable, its standard-library directories (with any site-packages
    directory inside them covered by an empty read-only tmpfs) and the directories of
    the shared libraries `ldd` lists for the executable and the standard library's
    extension modules (on Debian, /usr/lib/x86_64-linux-gnu and /usr/lib64), plus the
    symlinks that lead to them (/lib, /lib64). Nothing else of the host exists inside:
    no /etc, /home, /root, /work, no other temporary files, no project. A new /proc
    (of its own PID namespace) and a minimal read-only /dev (null, zero, random, ...).
    The only writable places are a fresh tmpfs at /tmp and one at its working
    directory `/sandbox` (holding `main.py`), each of at most `max_output_mb`; the
    rest of the root is read-only.
  * No channel between runs: every run has new mount, PID, IPC, network, UTS and
    cgroup namespaces, its tmpfs vanish with it, and the kernel keyrings are closed
    (below), so nothing it writes survives it or is seen by another run, concurrent
    or later. Timing and load (CPU, memory pressure) remain observable, as always.
  * Network: its own network namespace, holding only its own loopback interface: the
    host's network, the host's 127.0.0.1 and abstract sockets, and other sandboxes
    are out of reach.
  * Time: at `timeout_s` bwrap and its process group are SIGKILLed; the program runs
    under bwrap's PID 1 with a parent-death signal, so every process it started dies
    too, including one that left the group.
  * Memory: RLIMIT_AS caps each process's address space at `memory_mb`.
  * Output: RLIMIT_FSIZE caps stdout, stderr and each file written at `max_output_mb`.
  * Processes: RLIMIT_NPROC caps the processes and threads of the sandbox at
    `max_processes`, counted in its own user namespace (bwrap's PID 1 and the
    program are two of them).
  * System calls: a seccomp filter (seccomp.py) refuses namespaces, mounts, keyrings,
    ptrace, bpf, userfaultfd, perf events and io_uring; bwrap also forbids nested user
    namespaces. The filter exists for x86_64 and aarch64 only (`Isolation.seccomp`).
  * Environment: `python -I -S` (no site-packages, no user site, no PYTHON*
    variables) and an environment holding only PATH.
Not enforced: CPU share, disk or memory bandwidth and the number of files (bounded
only by the tmpfs sizes); a kernel bug can still break any namespace sandbox.

Where bwrap or user namespaces are missing (`isolation().missing` says what), the
sandbox is weak: the same limits (the time limit kills the process group only),
the environment, `nobody` when the caller is root, a private host temporary
working directory and death with its caller; but the host's filesystem view (it can
read what `nobody` or the caller can, and write to /tmp), network and processes.
`run_sandboxed` then refuses to run code unless called with `allow_weak=True`, and
warns once naming what is missing.
"""

import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from absl import logging

from async_rl.rewards import seccomp

NOBODY = 65534
WORKDIR = "/sandbox"
_PATH = "/usr/local/bin:/usr/bin:/bin"
_LIMITS = ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CORE")
# Sets the limits (inside the namespaces, so RLIMIT_NPROC counts the sandbox's own
# processes), then runs main.py in this interpreter's own __main__ module, cleaned of
# the prelude's names (pickle and dataclasses look classes up there).
_PRELUDE = """
import resource as _r, sys as _s
for _n, _v in zip(%r, map(int, _s.argv[1:])):
  _r.setrlimit(getattr(_r, _n), (_v, _v))
_s.argv = ["main.py"]
__file__ = "main.py"
with open("main.py", "rb") as _f:
  _c = compile(_f.read(), "main.py", "exec")
del _r, _s, _n, _v, _f
exec(globals().pop("_c"))
""" % (_LIMITS,)
# The weak sandbox has no bwrap to kill the program when its caller dies.
_PARENT_DEATH = """
import ctypes, os
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != %d:
  os._exit(1)
del ctypes, os
"""
# The interpreter's own view of where it lives, asked with the flags the program gets.
_LAYOUT = ("import json, os, site, sys, sysconfig; print(json.dumps([os.path.realpath("
           "sys.executable), sys.path, site.getsitepackages() + [sysconfig.get_path(k) "
           "for k in ('purelib', 'platlib')]]))")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What a sandboxed program did.

  Attributes:
    stdout: its standard output, decoded as UTF-8 (invalid bytes replaced).
    stderr: its standard error, decoded likewise.
    returncode: its exit status; -9 when killed at the timeout. A signal that ends
      it inside bwrap shows as 128 + the signal's number, in the weak sandbox as
      minus the number.
    limit: the limit that stopped it, when one did: "timeout" (killed at
      `timeout_s`), "output" (stdout or stderr reached `max_output_mb` and was cut
      there), or, read from the exception that ended it, "output" too (a file past
      `max_output_mb`, or a full tmpfs), "memory" (MemoryError: an allocation past
      `memory_mb`) or "processes" (fork or thread creation refused by
      `max_processes`). None otherwise.
  """
  stdout: str
  stderr: str
  returncode: int
  limit: str | None

  @property
  def timed_out(self) -> bool:
    return self.limit == "timeout"


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What `run_sandboxed` can enforce on this machine.

  Attributes:
    missing: what keeps the full sandbox (see the module docstring) from running
      here, one sentence each; empty when it runs.
    user: the uid the program runs as; None when it runs as the caller.
    python: the interpreter that runs the program.
    seccomp: whether the seccomp filter is loaded (full sandbox, known architecture).
  """
  missing: tuple[str, ...]
  user: int | None
  python: str
  seccomp: bool

  @property
  def process_limit_enforced(self) -> bool:
    """Whether the kernel applies `max_processes` (it does not to root)."""
    return not self.missing or self.user is not None or os.geteuid() != 0


def _as_user(user: int | None) -> dict:
  return {} if user is None else dict(user=user, group=user, extra_groups=[])


def _succeeds(cmd: list[str], **kwargs) -> bool:
  try:
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=30, **kwargs).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@functools.cache
def _interpreter_and_user() -> tuple[str, int | None]:
  if os.geteuid() != 0:
    return sys.executable, None
  # The interpreter must be runnable by `nobody`; a per-user install under /root
  # is not, a system python usually is.
  for python in filter(None, [sys.executable, shutil.which("python3", path=_PATH)]):
    if _succeeds([python, "-I", "-S", "-c", "pass"], cwd="/", **_as_user(NOBODY)):
      return python, NOBODY
  return sys.executable, None


def _resolve(path: str, links: dict[str, str]) -> str:
  """`path` without symlinks; records each symlink met (path -> target) in `links`."""
  parts = path.strip("/").split("/")
  current = ""
  for i, part in enumerate(parts):
    step = f"{current}/{part}"
    if os.path.islink(step):
      if len(links) > 40:
        raise OSError(f"too many symlinks resolving {path}")
      links[step] = os.readlink(step)
      return _resolve(os.path.normpath(os.path.join(current or "/", links[step],
                                                    *parts[i + 1:])), links)
    current = step
  return current or "/"


def _under(path: str, dirs) -> bool:
  return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@functools.cache
def _root_view(python: str, user: int | None) -> tuple[str, tuple[str, ...]]:
  """The interpreter's real path, and the bwrap arguments for the read-only root that
  holds it, its standard library and its shared libraries."""
  layout = subprocess.run([python, "-I", "-S", "-c", _LAYOUT], capture_output=True,
                          text=True, check=True, timeout=30, cwd="/", **_as_user(user))
  executable, stdlib, sites = json.loads(layout.stdout)
  stdlib = [p for p in stdlib if os.path.exists(p)]
  modules = [f for d in stdlib for f in glob.glob(os.path.join(d, "*.so"))]
  ldd = subprocess.run(["ldd", executable, *modules], capture_output=True, text=True,
                       timeout=60)
  libraries = set(re.findall(r"(/\S+) \(0x", ldd.stdout))
  if not libraries:
    raise OSError(f"ldd listed no libraries for {executable}: {ldd.stderr.strip()}")
  links = {}
  binds = {_resolve(executable, links), *(_resolve(p, links) for p in stdlib)}
  for library in libraries:
    binds.add(_resolve(os.path.dirname(library), links))
    binds.add(os.path.dirname(_resolve(library, links)))
  binds = {b for b in binds if not _under(b, binds - {b})}
  args = []
  for link, target in sorted(links.items()):
    if not _under(link, binds):
      args += ["--symlink", target, link]
  for bind in sorted(binds):
    args += ["--ro-bind", bind, bind]
  for site in sorted({_resolve(s, {}) for s in sites if os.path.isdir(s)}):
    if _under(site, binds) and site not in binds:
      args += ["--tmpfs", site, "--remount-ro", site]
  return executable, tuple(args)


def _bwrap_command(python: str, user: int | None, code_fd: int, seccomp_fd: int | None,
                   size: int) -> list[str]:
  executable, root_view = _root_view(python, user)
  filter_args = [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
  return [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns",
          "--die-with-parent", "--hostname", "sandbox", *root_view,
          "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
          "--size", str(size), "--perms", "1777", "--tmpfs", "/tmp",
          "--size", str(size), "--tmpfs", WORKDIR,
          "--file", str(code_fd), f"{WORKDIR}/main.py", "--chdir", WORKDIR,
          "--remount-ro", "/", *filter_args, "--", executable]


@functools.cache
def isolation() -> Isolation:
  """What the sandbox enforces here; probed once per process (it runs one program)."""
  python, user = _interpreter_and_user()
  missing = []
  if os.geteuid() == 0 and user is None:
    missing.append(f"no Python interpreter that nobody (uid {NOBODY}) can run, so the "
                   "program would run as root: install a system python3")
  if shutil.which("bwrap") is None:
    missing.append("bubblewrap is not installed (Debian/Ubuntu: apt-get install "
                   "bubblewrap)")
  if not missing:
    try:
      probe = _run("import sys; print(sys.flags.isolated)", "", python=python, user=user,
                   sandboxed=True, timeout_s=30, memory_mb=512, max_processes=16,
                   max_output_mb=1)
      error = None if probe.stdout == "1\n" else (probe.stderr.strip() or
                                                 f"exit status {probe.returncode}")
    except (OSError, subprocess.SubprocessError, ValueError) as e:
      error = str(e)
    if error is not None:
      missing.append("bwrap cannot build the sandbox here (it needs bubblewrap 0.8 or "
                     f"newer and unprivileged user namespaces): {error[-300:]}")
  return Isolation(missing=tuple(missing), user=user, python=python,
                   seccomp=not missing and seccomp.deny_filter() is not None)


@functools.cache
def _warn_weak(missing: tuple[str, ...]):
  logging.warning("sandbox: running untrusted code in the WEAK sandbox (limits only; it "
                  "sees the host's files and network): %s", "; ".join(missing))


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


def _limit_hit(returncode: int, stderr: str, sizes: list[int], limit: int) -> str | None:
  if max(sizes) >= limit:
    return "output"
  if returncode != 0 and re.search(r"^OSError: \[Errno (27|28)\]", stderr, re.M):
    return "output"
  if returncode != 0 and re.search(r"^MemoryError\b", stderr, re.M):
    return "memory"
  if returncode != 0 and re.search(r"^(BlockingIOError: \[Errno 11\]|RuntimeError: "
                                   r"can't start new thread)", stderr, re.M):
    return "processes"
  return None


def _run(code: str, stdin: str, *, python: str, user: int | None, sandboxed: bool,
         timeout_s: float, memory_mb: int, max_processes: int,
         max_output_mb: int) -> SandboxResult:
  limit = max_output_mb << 20
  limits = [memory_mb << 20, max_processes, limit, 0]
  prelude = _PRELUDE if sandboxed else _PARENT_DEATH % os.getpid() + _PRELUDE
  interpreter = ["-I", "-S", "-c", prelude, *map(str, limits)]
  workdir = None if sandboxed else tempfile.mkdtemp(prefix="async_rl_sandbox_")
  seccomp_r = None
  try:
    with (tempfile.TemporaryFile() as code_f, tempfile.TemporaryFile() as stdin_f,
          tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err):
      code_f.write(code.encode("utf-8"))
      code_f.seek(0)
      stdin_f.write(stdin.encode("utf-8"))
      stdin_f.seek(0)
      if sandboxed:
        if (bpf := seccomp.deny_filter()) is not None:
          seccomp_r, seccomp_w = os.pipe()
          os.write(seccomp_w, bpf)
          os.close(seccomp_w)
        cmd = [*_bwrap_command(python, user, code_f.fileno(), seccomp_r, limit),
               *interpreter]
        fds = tuple(fd for fd in (code_f.fileno(), seccomp_r) if fd is not None)
      else:
        with open(os.path.join(workdir, "main.py"), "wb") as f:
          shutil.copyfileobj(code_f, f)
        if user is not None:
          os.chown(workdir, user, user)
        cmd, fds = [python, *interpreter], ()
      proc = subprocess.Popen(cmd, cwd=workdir or "/", env={"PATH": _PATH},
                              stdin=stdin_f, stdout=out, stderr=err, pass_fds=fds,
                              start_new_session=True, **_as_user(user))
      try:
        returncode, timed_out = proc.wait(timeout=timeout_s), False
      except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        returncode, timed_out = proc.wait(), True
      # Outside a PID namespace, background processes it left would outlive it.
      _kill_group(proc.pid)
      stderr = _read(err, limit)
      hit = "timeout" if timed_out else _limit_hit(
          returncode, stderr, [os.fstat(f.fileno()).st_size for f in (out, err)], limit)
      return SandboxResult(_read(out, limit), stderr, returncode, hit)
  finally:
    if seccomp_r is not None:
      os.close(seccomp_r)
    if workdir is not None:
      _remove_tree(workdir)


def run_sandboxed(code: str, stdin: str = "", *, timeout_s: float = 5.0,
                  memory_mb: int = 512, max_processes: int = 16,
                  max_output_mb: int = 16, allow_weak: bool = False) -> SandboxResult:
  """Runs the Python program `code` on `stdin` under the limits of this module.

  Args:
    code: the program's source.
    stdin: its standard input.
    timeout_s: wall-clock limit, sandbox and interpreter start-up included.
    memory_mb: address-space limit per process.
    max_processes: RLIMIT_NPROC (see the module docstring for how it counts).
    max_output_mb: size limit of stdout, stderr, each file written, and of each of
      the writable tmpfs.
    allow_weak: run the code even where only the weak sandbox is available.

  Returns:
    The program's output, exit status and the limit it hit, if any.

  Raises:
    RuntimeError: the full sandbox cannot run here and `allow_weak` is False.
  """
  iso = isolation()
  if iso.missing:
    if not allow_weak:
      raise RuntimeError("refusing to run untrusted code: the sandbox is weak here ("
                         + "; ".join(iso.missing) + ")")
    _warn_weak(iso.missing)
  return _run(code, stdin, python=iso.python, user=iso.user, sandboxed=not iso.missing,
              timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes,
              max_output_mb=max_output_mb)
