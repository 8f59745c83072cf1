"""RewardService (timeouts, crashes, worker replacement, threads) and the sandbox."""

import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from async_rl.rewards import code_tests, sandbox
from async_rl.rewards.service import OutputLimiter
from async_rl.rewards import (REWARD_FNS, RewardService, RewardTask, code_tests_all_reward,
                              code_tests_reward, resolve_reward_fn, run_sandboxed)
from conftest import wait_until

H = "reward_fns_for_tests:"  # Top-level functions the workers import by name.
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def service():
  with RewardService(num_workers=2, timeout_s=20.0) as svc:
    yield svc


def _task(fn, reference=None, completion="x"):
  return RewardTask(fn=H + fn, completion=completion, reference=reference)


def _delta(svc, before):
  return {k: v - before[k] for k, v in svc.metrics().items() if k != "mean_latency_s"}


def test_correct_fn_returns_its_value(service):
  before = service.metrics()
  assert service.score_batch([_task("echo", 0.25), _task("length", completion="abc"),
                              _task("echo", 1)]) == [0.25, 3.0, 1.0]
  assert _delta(service, before) == dict(calls=3, errors=0, timeouts=0,
                                         worker_restarts=0)
  assert service.metrics()["mean_latency_s"] > 0


@pytest.mark.parametrize("value", ["1.0", None, float("nan"), float("inf")])
def test_bad_return_value_scores_zero_and_counts_an_error(service, value):
  before = service.metrics()
  assert service.submit(_task("echo", value)).result() == 0.0
  assert _delta(service, before)["errors"] == 1


def test_raising_fn_scores_zero_and_counts_an_error(service):
  before = service.metrics()
  assert service.score_batch([_task("raises"), _task("echo", 0.5)]) == [0.0, 0.5]
  assert _delta(service, before) == dict(calls=2, errors=1, timeouts=0,
                                         worker_restarts=0)


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_recent_failures_counts_over_the_window_and_keeps_the_first_error(caplog):
  with RewardService(num_workers=1, timeout_s=TIMEOUT_S, error_window=4) as svc:
    assert svc.recent_failures() == (0, 0, None)
    svc.score_batch([RewardTask("reward_fns_for_tests:raises", f"c{i}", None) for i in range(5)])
    failed, calls, first = svc.recent_failures()
    assert (failed, calls) == (4, 4)
    assert first == "reward_fns_for_tests:raises: failed: RuntimeError: bad completion 'c0'"
    svc.score_batch([RewardTask("reward_fns_for_tests:length", "ab", None)] * 3)
    assert svc.recent_failures() == (1, 4, first)  # the window moved on; the first stays
  # The 1st, 2nd and 4th of the five failures were logged, not each one.
  logged = [r for r in caplog.records if "failed calls so far" in r.getMessage()]
  assert [r.getMessage().rsplit("(", 1)[1] for r in logged] == [
      "1 failed calls so far)", "2 failed calls so far)", "4 failed calls so far)"]


def test_hanging_fn_is_killed_and_its_worker_replaced():
  with RewardService(num_workers=1, timeout_s=TIMEOUT_S) as svc:
    pid = svc.submit(_task("worker_pid")).result()
    start = time.monotonic()
    assert svc.submit(_task("hangs")).result() == 0.0
    assert time.monotonic() - start < TIMEOUT_S + 2.0
    assert not _alive(int(pid))
    new_pid = svc.submit(_task("worker_pid")).result()
    assert new_pid != pid
    assert svc.metrics()["timeouts"] == 1
    assert svc.metrics()["worker_restarts"] == 1
    assert svc.metrics()["errors"] == 0


@pytest.mark.parametrize("fn", ["exits", "segfaults"])
def test_dying_worker_scores_zero_and_is_replaced(fn):
  with RewardService(num_workers=1, timeout_s=TIMEOUT_S) as svc:
    pid = svc.submit(_task("worker_pid")).result()
    start = time.monotonic()
    assert svc.submit(_task(fn)).result() == 0.0
    assert time.monotonic() - start < TIMEOUT_S
    assert svc.submit(_task("worker_pid")).result() not in (pid, 0.0)
    m = svc.metrics()
    assert (m["errors"], m["timeouts"], m["worker_restarts"]) == (1, 0, 1)


def test_concurrent_submissions_from_threads(service):
  """Random mixes of good and raising calls from 6 threads: none lost or mixed up."""
  before = service.metrics()
  results, expected = {}, {}

  def client(t):
    rng = random.Random(t)
    tasks = []
    for i in range(15):
      good = rng.random() < 0.8
      expected[t, i] = float(100 * t + i) if good else 0.0
      tasks.append(_task("echo", 100 * t + i) if good else _task("raises"))
    futures = [service.submit(task) for task in tasks]
    for i, f in enumerate(futures):
      results[t, i] = f.result(timeout=30)

  threads = [threading.Thread(target=client, args=(t,)) for t in range(6)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert results == expected
  delta = _delta(service, before)
  assert delta["calls"] == 90
  assert delta["errors"] == sum(v == 0.0 for v in expected.values())


def test_unknown_reward_fn_is_a_value_error(service):
  with pytest.raises(ValueError, match="code_tests"):
    service.submit(RewardTask(fn="no_such_reward", completion="", reference=None))
  with pytest.raises(ValueError, match="cannot load"):
    resolve_reward_fn(H + "no_such_fn")
  with pytest.raises(ValueError, match="cannot load"):
    resolve_reward_fn("no_such_module_xyz:fn")
  assert resolve_reward_fn("math") is REWARD_FNS["math"]


def test_a_reward_worker_imports_no_task_until_it_looks_a_registered_function_up():
  probe = ("import sys\n"
           "from async_rl.rewards import worker\n"
           "before = any(m.startswith('async_rl.tasks') for m in sys.modules)\n"
           "worker.resolve_reward_fn('math')\n"
           "print(before, 'async_rl.tasks.math_data' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120, check=True)
  assert out.stdout.split() == ["False", "True"]


def test_a_function_defined_in_place_runs_by_value_with_the_same_counters():
  offset = 0.5  # A closure over a local: no worker could import it by name.

  def shifted(completion, reference):
    return len(completion) + reference + offset

  def pid(completion, reference):
    return float(os.getpid())

  def raises(completion, reference):
    raise KeyError(completion)

  def hangs(completion, reference):
    time.sleep(1000)

  assert "<locals>" in shifted.__qualname__
  with RewardService(num_workers=1, timeout_s=TIMEOUT_S) as svc:
    assert svc.score_batch([RewardTask(shifted, "abc", 1.0), RewardTask(shifted, "", 0.0)]) == [
        4.5, 0.5]
    worker = svc.submit(RewardTask(pid, "", None)).result()
    assert worker not in (0.0, float(os.getpid()))
    assert svc.submit(RewardTask(raises, "x", None)).result() == 0.0
    assert svc.submit(RewardTask(hangs, "", None)).result() == 0.0
    # The replacement worker receives the function again with its first call.
    assert svc.submit(RewardTask(shifted, "ab", 0.0)).result() == 2.5
    assert svc.submit(RewardTask(pid, "", None)).result() not in (0.0, worker)
    m = svc.metrics()
    assert (m["calls"], m["errors"], m["timeouts"], m["worker_restarts"]) == (7, 1, 1, 1)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="lock"):
      svc.submit(RewardTask(lambda completion, reference: float(lock.locked()), "", None))


def test_closed_service_cancels_queued_calls_and_refuses_new_ones():
  svc = RewardService(num_workers=1, timeout_s=TIMEOUT_S)
  running = svc.submit(_task("hangs"))
  queued = svc.submit(_task("echo", 1.0))
  wait_until(running.running, interval=0.01)
  svc.close()
  assert running.result() == 0.0
  assert queued.cancelled()
  with pytest.raises(RuntimeError, match="closed"):
    svc.submit(_task("echo", 1.0))


def test_a_worker_past_its_memory_limit_scores_zero_as_an_error_and_serves_on():
  with RewardService(num_workers=1, timeout_s=20.0, memory_mb=512) as svc:
    assert svc.submit(_task("allocates_mb", 64)).result() == 1.0
    assert svc.submit(_task("allocates_mb", 1024)).result() == 0.0
    assert svc.submit(_task("allocates_mb", 64)).result() == 1.0
    m = svc.metrics()
    assert (m["calls"], m["errors"], m["worker_restarts"]) == (3, 1, 0)


def _relayed(caplog):
  return [r.getMessage() for r in caplog.records if r.getMessage().startswith("reward worker")]


def test_a_workers_output_goes_into_the_log_not_the_terminal(caplog, capfd):
  with RewardService(num_workers=1, timeout_s=20.0) as svc:
    pid = svc.submit(_task("worker_pid")).result()
    assert svc.submit(_task("prints", 2)).result() == 1.0
  name = f"reward worker 0 (pid {int(pid)})"
  assert _relayed(caplog) == [f"{name}: reward says 0", f"{name}: reward says 1",
                              f"{name}: reward complains"]
  out, err = capfd.readouterr()
  assert "reward says" not in out + err and "reward complains" not in out + err


def test_a_chatty_worker_is_rate_limited_with_a_count_of_what_was_left_out(caplog):
  with RewardService(num_workers=1, timeout_s=20.0, output_lines=5,
                     output_interval_s=600.0) as svc:
    assert svc.submit(_task("prints", 30)).result() == 1.0
  lines = _relayed(caplog)
  assert [line.split(": ", 1)[1] for line in lines[:5]] == [f"reward says {i}" for i in range(5)]
  assert len(lines) == 6 and lines[5].endswith(
      "26 more lines of output left out (at most 5 per 600 s are logged)")


def test_output_limiter_counts_per_interval_and_reports_once_an_interval_ends():
  logged = []
  limiter = OutputLimiter("w", max_lines=2, interval_s=10.0, log=logged.append)
  for t in (0.0, 1.0, 2.0, 3.0):
    limiter.line(f"a{t:g}", t)
  assert logged == ["w: a0", "w: a1"] and limiter.seconds_to_flush(4.0) == 6.0
  limiter.flush(9.0)
  assert len(logged) == 2
  limiter.flush(10.0)
  assert logged[2] == "w: 2 more lines of output left out (at most 2 per 10 s are logged)"
  assert limiter.seconds_to_flush(10.0) is None
  limiter.line("b", 10.5)  # a new interval
  limiter.line("c", 11.0)
  limiter.line("d", 12.0)
  limiter.flush()  # the output ended: the count is due at once
  assert logged[3:] == ["w: b", "w: c",
                        "w: 1 more line of output left out (at most 2 per 10 s are logged)"]


def test_sandbox_runs_code_on_stdin():
  result = run_sandboxed("print(input()[::-1])", "hello", timeout_s=5)
  assert (result.stdout, result.returncode, result.timed_out) == ("olleh\n", 0, False)
  result = run_sandboxed("import sys; sys.exit('boom')", timeout_s=5)
  assert result.returncode == 1 and "boom" in result.stderr


def test_sandbox_isolates_the_environment():
  os.environ["ASYNC_RL_SECRET"] = "x"
  try:
    result = run_sandboxed("import os, sys; print(sorted(os.environ), sys.flags.isolated)")
  finally:
    del os.environ["ASYNC_RL_SECRET"]
  names, isolated = result.stdout.rsplit(" ", 1)
  assert "ASYNC_RL_SECRET" not in names and "PATH" in names
  assert isolated.strip() == "1"


def test_sandbox_times_out_an_infinite_loop():
  start = time.monotonic()
  result = run_sandboxed("while True: pass", timeout_s=1.0)
  assert result.timed_out and result.returncode != 0
  assert time.monotonic() - start < 3.0


def test_sandbox_memory_limit_stops_a_huge_allocation():
  result = run_sandboxed("x = bytearray(4 << 30); print('allocated')", memory_mb=256)
  assert result.returncode != 0 and "MemoryError" in result.stderr
  assert "allocated" not in result.stdout


def test_sandbox_works_in_a_private_directory_that_does_not_outlive_it():
  code = ("import os; print(os.listdir()); open('f.txt', 'w').write('data'); "
          "print(os.getcwd()); print(open('f.txt').read())")
  for _ in range(2):
    result = run_sandboxed(code)
    listing, workdir, data = result.stdout.split()
    assert (listing, workdir, data) == ("['main.py']", sandbox.WORKDIR, "data")
  assert not os.path.exists(workdir)


def test_sandbox_cannot_write_outside(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  tmp_path.chmod(0o755)
  outside.chmod(0o777)
  result = run_sandboxed(f"open({str(outside / 'f')!r}, 'w').write('x')")
  assert "FileNotFoundError" in result.stderr  # The host's directories are not there.
  assert not (outside / "f").exists()


def test_sandbox_limits_processes():
  code = """
import os, time
started = 0
for _ in range(30):
  try:
    pid = os.fork()
  except OSError:
    break
  if pid == 0:
    time.sleep(2)
    os._exit(0)
  started += 1
print(started)
"""
  result = run_sandboxed(code, max_processes=4, timeout_s=5)
  assert int(result.stdout) < 4


def test_sandbox_has_no_network():
  code = """
import socket
print([name for _, name in socket.if_nameindex()])
try:
  socket.create_connection(("1.1.1.1", 80), timeout=2)
  print("connected")
except OSError as e:
  print(type(e).__name__)
"""
  interfaces, outcome = run_sandboxed(code).stdout.splitlines()
  assert interfaces == "['lo']"
  assert outcome != "connected"


TESTS = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"},
         {"input": "1 1\n", "output": "2\n"}]


def test_code_tests_reward(monkeypatch):
  monkeypatch.setattr(code_tests, "CASE_TIMEOUT_S", 0.5)
  right = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
  wrong_on_one = "a, b = map(int, input().split())\nprint(a + b if a < 9 else 0)"
  assert code_tests_reward(right, TESTS) == 1.0
  assert code_tests_reward(wrong_on_one, json.dumps(TESTS)) == pytest.approx(2 / 3)
  assert code_tests_all_reward(right, TESTS) == 1.0
  assert code_tests_all_reward(wrong_on_one, TESTS) == 0.0
  assert code_tests_reward("while True: pass", TESTS[:1]) == 0.0
  with pytest.raises(ValueError, match="test case 0"):
    code_tests_reward(right, [{"input": "1"}])


def test_code_tests_through_the_service(service):
  right = "a, b = map(int, input().split())\nprint(a + b)"
  tasks = [RewardTask("code_tests", right, TESTS), RewardTask("code_tests", "x", TESTS),
           RewardTask("code_tests", right, "not json")]
  assert service.score_batch(tasks) == [1.0, 0.0, 0.0]

