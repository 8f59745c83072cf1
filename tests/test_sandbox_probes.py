"""The code sandbox probed as a reward-hacking policy would probe it.

Each test runs a hostile program through `run_sandboxed` and checks that the host
is out of its reach and that the result says why the program stopped. They need the
full sandbox (bubblewrap and user namespaces; `.ci/run` installs bubblewrap) and fail,
naming what is missing, where it cannot run.
"""

import errno
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from async_rl.rewards import RewardService, RewardTask, code_tests, sandbox, seccomp
from async_rl.rewards import code_tests_reward, isolation, run_sandboxed
from conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]
TESTS = [{"input": "2 3\n", "output": "5\n"}]
ADD = "a, b = map(int, input().split())\nprint(a + b)"


def _json_run(code, **kwargs):
  result = run_sandboxed(code, **kwargs)
  assert result.returncode == 0, result.stderr
  return json.loads(result.stdout)


def _host_processes_named(comm):
  """Host pids whose command name is `comm` (a name the sandboxed program set)."""
  pids = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
        pids.append(int(pid))
    except OSError:
      pass
  return pids


def test_the_full_sandbox_runs_here():
  iso = isolation()
  assert not iso.missing, f"the full sandbox cannot run here: {iso.missing}"
  assert iso.user == (sandbox.NOBODY if os.geteuid() == 0 else None)
  assert iso.process_limit_enforced


def test_planted_files_in_tmp_and_the_project_cannot_be_read():
  token, secret = uuid.uuid4().hex, uuid.uuid4().hex
  planted = [Path("/tmp") / f"async_rl_probe_{token}", ROOT / f"async_rl_probe_{token}"]
  for path in planted:
    path.write_text(f"expected output {secret}")
    path.chmod(0o644)
  code = f"""
import json, os
out = {{}}
for path in {[str(p) for p in planted]!r} + ["/etc/shadow", "/etc/passwd", "/root"]:
  try:
    out[path] = open(path).read()
  except OSError as e:
    out[path] = type(e).__name__
for path in ["/tmp", {str(ROOT)!r}, "/work", "/home", "/root", "/etc", "/"]:
  try:
    out["ls " + path] = sorted(os.listdir(path))
  except OSError as e:
    out["ls " + path] = type(e).__name__
print(json.dumps(out))
"""
  try:
    out = _json_run(code)
  finally:
    for path in planted:
      path.unlink()
  assert secret not in json.dumps(out)
  for path in [*map(str, planted), "/etc/shadow", "/etc/passwd", "/root"]:
    assert out[path] == "FileNotFoundError", path
  for path in [str(ROOT), "/work", "/home", "/root", "/etc"]:
    assert out["ls " + path] == "FileNotFoundError", path
  assert out["ls /tmp"] == []
  assert set(out["ls /"]) <= {"dev", "lib", "lib64", "proc", "sandbox", "tmp", "usr", "bin",
                              "sbin", "opt"}


def _readable_by(st, uid, gid):
  if uid == 0:
    return True
  if st.st_uid == uid:
    return bool(st.st_mode & stat.S_IRUSR)
  if st.st_gid == gid:
    return bool(st.st_mode & stat.S_IRGRP)
  return bool(st.st_mode & stat.S_IROTH)


def test_it_reads_nothing_its_host_user_could_not():
  """Every file it can open is one the unprivileged host user may read anyway."""
  code = """
import json, os
readable = []
for top in os.listdir("/"):
  if top in ("proc", "dev", "tmp", "sandbox"):
    continue
  for root, _, files in os.walk("/" + top):
    for name in files:
      path = os.path.join(root, name)
      try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        readable.append(path)
      except OSError:
        pass
print(json.dumps(readable))
"""
  readable = _json_run(code, timeout_s=30)
  assert len(readable) > 100  # The interpreter's own files, at least.
  uid = sandbox.NOBODY if os.geteuid() == 0 else os.getuid()
  gid = sandbox.NOBODY if os.geteuid() == 0 else os.getgid()
  unreadable = [p for p in readable if not _readable_by(os.stat(p), uid, gid)]
  assert not unreadable


def test_it_runs_unprivileged_on_the_host():
  token = f"probe{uuid.uuid4().hex[:8]}"  # comm names hold 15 characters.
  code = f"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, {token.encode()!r})  # PR_SET_NAME
try:
  os.setuid(0)
  print("became root")
except OSError:  # EINVAL: uid 0 is not even mapped in its namespace.
  print("no root")
time.sleep(2)
"""
  found = {}

  def look():
    for pid in _host_processes_named(token):
      status = Path(f"/proc/{pid}/status").read_text()
      found.update(line.split(":\t", 1) for line in status.splitlines()
                   if line.startswith(("Uid", "Gid", "CapEff", "CapPrm", "NoNewPrivs")))
    return bool(found)

  watcher = threading.Thread(target=wait_until, args=(look,),
                             kwargs=dict(timeout=2.0, interval=0.05))
  watcher.start()
  result = run_sandboxed(code, timeout_s=10)
  watcher.join()
  assert result.stdout == "no root\n", result.stderr
  uid = sandbox.NOBODY if os.geteuid() == 0 else os.getuid()
  assert found["Uid"].split() == [str(uid)] * 4
  assert int(found["CapEff"], 16) == int(found["CapPrm"], 16) == 0
  assert found["NoNewPrivs"].strip() == "1"


def test_it_sees_no_other_process():
  code = f"""
import json, os
procs = {{p: open(f"/proc/{{p}}/cmdline").read().split("\\0")[0]
          for p in os.listdir("/proc") if p.isdigit()}}
try:
  os.kill({os.getpid()}, 0)
  alive = "visible"
except ProcessLookupError:
  alive = "absent"
print(json.dumps([procs, os.getpid(), alive]))
"""
  procs, pid, host_pid = _json_run(code)
  assert host_pid == "absent"
  assert sorted(procs) == sorted({"1", str(pid)}), procs
  assert os.path.basename(procs["1"]) == "bwrap"
  assert os.path.basename(procs[str(pid)]).startswith("python")


def test_it_cannot_reach_a_listening_socket_on_the_host():
  tcp = socket.socket()
  tcp.bind(("127.0.0.1", 0))
  tcp.listen()
  tcp.settimeout(0)
  unix = socket.socket(socket.AF_UNIX)
  abstract = f"\0async_rl_probe_{uuid.uuid4().hex}"
  unix.bind(abstract)
  unix.listen()
  unix.settimeout(0)
  code = f"""
import json, socket
out = [[name for _, name in socket.if_nameindex()]]
for family, address in [(socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})),
                        (socket.AF_UNIX, {abstract!r})]:
  try:
    socket.socket(family).connect(address)
    out.append("connected")
  except OSError as e:
    out.append(type(e).__name__)
print(json.dumps(out))
"""
  try:
    interfaces, tcp_outcome, unix_outcome = _json_run(code)
    for listener in (tcp, unix):
      with pytest.raises(BlockingIOError):
        listener.accept()
  finally:
    tcp.close()
    unix.close()
  # Its loopback is its own: nothing listens there, and the host's is out of reach.
  assert interfaces == ["lo"]
  assert tcp_outcome == unix_outcome == "ConnectionRefusedError"


# Tries to create `name` in every directory it can see; prints where it could.
_WRITE_EVERYWHERE = """
import json, os, time
wrote = []
for root, dirs, _ in os.walk("/"):
  if root == "/proc":
    dirs.clear()
    continue
  try:
    with open(os.path.join(root, {name!r}), "w") as f:
      f.write("answer: 42")
    wrote.append(root)
  except OSError:
    pass
"""
_LOOK_EVERYWHERE = """
def look():
  found = []
  for root, dirs, files in os.walk("/"):
    if root == "/proc":
      dirs.clear()
    found += [os.path.join(root, f) for f in files if f.startswith({prefix!r})]
  return found
"""


def test_writes_reach_only_its_own_tmpfs_and_vanish_with_it():
  name = f"async_rl_probe_{uuid.uuid4().hex}"
  result = run_sandboxed(_WRITE_EVERYWHERE.format(name=name) + "print(json.dumps(wrote))",
                         timeout_s=20)
  assert set(json.loads(result.stdout)) == {"/tmp", sandbox.WORKDIR}, result.stderr
  assert not [p for d in ("/tmp", "/dev/shm", str(ROOT), "/") for p in Path(d).glob(name)]


def test_no_channel_between_concurrent_or_later_programs():
  """A writes files wherever it can and listens on an abstract socket; B, running
  meanwhile, and C, after A, look everywhere and try the socket."""
  token = uuid.uuid4().hex
  name, prefix = f"async_rl_probe_{token}", "async_rl_probe_"
  writer = _WRITE_EVERYWHERE.format(name=name) + f"""
import socket
s = socket.socket(socket.AF_UNIX)
s.bind("\\0" + {name!r})
s.listen()
written = time.time()
time.sleep(3)
print(json.dumps([wrote, written, time.time()]))
"""
  reader = f"""
import json, os, socket, time
{_LOOK_EVERYWHERE.format(prefix=prefix)}
searches, found = [], []
deadline = time.time() + {{seconds}}
while True:
  found += look()
  try:
    socket.socket(socket.AF_UNIX).connect("\\0" + {name!r})
    found.append("socket")
  except OSError:
    pass
  searches.append(time.time())
  if time.time() > deadline:
    break
print(json.dumps([found, searches]))
"""
  results = {}
  a = threading.Thread(target=lambda: results.update(a=run_sandboxed(writer, timeout_s=20)))
  a.start()
  time.sleep(1.0)
  b = _json_run(reader.format(seconds=1.5), timeout_s=20)
  a.join()
  c = _json_run(reader.format(seconds=0), timeout_s=20)
  wrote, written, a_end = json.loads(results["a"].stdout)
  assert set(wrote) == {"/tmp", sandbox.WORKDIR}
  (b_found, b_searches), (c_found, _) = b, c
  assert b_found == [] and c_found == []
  assert any(written < t < a_end for t in b_searches), "B did not search while A ran"
  assert not [p for d in ("/tmp", "/dev/shm", str(ROOT)) for p in Path(d).glob(name)]


def test_fork_bomb_is_stopped_by_the_process_limit():
  result = run_sandboxed("import os\nwhile True:\n  os.fork()", max_processes=8,
                         timeout_s=10)
  assert result.limit == "processes" and result.returncode != 0, result


def test_fork_bomb_that_survives_errors_and_leaves_its_group_is_killed():
  token = f"bomb{uuid.uuid4().hex[:8]}"
  code = f"""
import ctypes, os
ctypes.CDLL(None).prctl(15, {token.encode()!r})
if os.fork() == 0:
  os.setsid()
while True:
  try:
    os.fork()
  except OSError:
    pass
"""
  start = time.monotonic()
  result = run_sandboxed(code, max_processes=8, timeout_s=1.5)
  assert result.limit == "timeout" and result.timed_out and result.returncode == -9
  assert time.monotonic() - start < 4.0
  # The kernel reaps a dead PID namespace promptly.
  wait_until(lambda: not _host_processes_named(token), timeout=2.0, interval=0.05)


def test_allocating_past_the_memory_limit_fails_with_memory():
  result = run_sandboxed("x = bytearray(1 << 30)\nprint('allocated')", memory_mb=256)
  assert result.limit == "memory" and "allocated" not in result.stdout


def test_printing_100_mb_is_cut_at_the_output_limit():
  code = "import sys\nfor _ in range(100):\n  sys.stdout.write('x' * (1 << 20))"
  result = run_sandboxed(code, max_output_mb=4)
  assert result.limit == "output" and result.returncode != 0
  assert len(result.stdout) == 4 << 20


def test_filling_its_tmpfs_fails_with_output():
  code = ("for i in range(100):\n"
          "  open(f'/tmp/{i}', 'wb').write(b'x' * (1 << 20))")
  result = run_sandboxed(code, max_output_mb=8)
  assert result.limit == "output" and "No space left" in result.stderr


def test_sleeping_past_the_timeout_is_killed():
  start = time.monotonic()
  result = run_sandboxed("import time\ntime.sleep(60)", timeout_s=1.0)
  assert result.limit == "timeout" and result.returncode == -9
  assert time.monotonic() - start < 3.0


def test_seccomp_refuses_keyrings_io_uring_and_new_namespaces():
  numbers = seccomp.syscall_numbers()
  if numbers is None:
    pytest.skip("no seccomp filter for this architecture")
  assert isolation().seccomp
  code = f"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
out = {{}}
for name, args in [("keyctl", (0, -3)), ("io_uring_setup", (1, ctypes.create_string_buffer(120))),
                   ("unshare", ({0x10000000},)), ("ptrace", (0, 0, 0, 0)),
                   ("clone", ({0x40000000 | 17}, 0, 0, 0, 0)), ("clone3", (0, 0))]:
  ctypes.set_errno(0)
  out[name] = [libc.syscall({numbers}[name], *args), ctypes.get_errno()]
print(json.dumps(out))
"""
  out = _json_run(code)
  # clone with CLONE_NEWNET | SIGCHLD; clone3 must fail as absent (ENOSYS).
  assert out == {**{name: [-1, errno.EPERM] for name in ("keyctl", "io_uring_setup",
                                                         "unshare", "ptrace", "clone")},
                 "clone3": [-1, errno.ENOSYS]}


def test_seccomp_filter_layout():
  bpf = seccomp.deny_filter()
  if bpf is None:
    pytest.skip("no seccomp filter for this architecture")
  # 3 checks + the x32 guard on x86_64, clone3, one per denied call, 3 for clone,
  # 4 return instructions; 8 bytes each.
  x32 = 1 if os.uname().machine == "x86_64" else 0
  assert len(bpf) == 8 * (3 + x32 + 1 + len(seccomp.DENIED) + 3 + 4)


def _weak(monkeypatch):
  real = isolation()
  monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation(
      missing=("bubblewrap is not installed",), user=real.user, python=real.python,
      seccomp=False))
  sandbox._warn_weak.cache_clear()


def test_weak_sandbox_is_refused_unless_allowed(monkeypatch, caplog):
  _weak(monkeypatch)
  monkeypatch.delenv(code_tests.ALLOW_WEAK_SANDBOX_ENV, raising=False)
  with pytest.raises(RuntimeError, match="refusing.*bubblewrap is not installed"):
    run_sandboxed("print(1)")
  with pytest.raises(RuntimeError, match="bubblewrap is not installed"):
    code_tests_reward(ADD, TESTS)
  monkeypatch.setenv(code_tests.ALLOW_WEAK_SANDBOX_ENV, "1")
  assert code_tests_reward(ADD, TESTS) == 1.0
  assert "WEAK sandbox" in caplog.text and "bubblewrap is not installed" in caplog.text
  result = run_sandboxed("import time\ntime.sleep(60)", timeout_s=0.5, allow_weak=True)
  assert result.limit == "timeout"


def test_weak_sandbox_program_dies_with_its_caller():
  token = f"weak{uuid.uuid4().hex[:8]}"
  code = f"import ctypes, time\nctypes.CDLL(None).prctl(15, {token.encode()!r})\ntime.sleep(60)"
  caller = subprocess.Popen(
      [sys.executable, "-c", "import sys; from async_rl.rewards import run_sandboxed; "
       "run_sandboxed(sys.argv[1], timeout_s=60, allow_weak=True)", code],
      env={**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(ROOT)})
  try:
    wait_until(lambda: _host_processes_named(token) or caller.poll() is not None,
               interval=0.05, message="it never started")
    assert _host_processes_named(token), "it never started"
  finally:
    caller.kill()
    caller.wait()
  wait_until(lambda: not _host_processes_named(token), timeout=2.0, interval=0.05)


def test_allow_weak_sandbox_reaches_the_code_reward_in_the_workers(monkeypatch):
  # Without bwrap on PATH, the workers' sandbox is weak.
  monkeypatch.setenv("PATH", "/nonexistent")
  task = RewardTask("code_tests", ADD, TESTS)
  for allow, reward, errors in ((False, 0.0, 1.0), (True, 1.0, 0.0)):
    with RewardService(num_workers=1, timeout_s=30.0, allow_weak_sandbox=allow) as svc:
      assert svc.submit(task).result() == reward
      assert svc.metrics()["errors"] == errors


def test_benchmark_prints_a_table_and_one_json_line():
  out = subprocess.run([sys.executable, "-m", "benchmarks.sandbox", "--runs=2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["runs"] == 2 and summary["matmul_gflops"] > 0
  assert summary["sandbox_start_ms"] > 0 and summary["python_start_ms"] > 0
  assert "| run_sandboxed (bubblewrap) |" in out.stdout
