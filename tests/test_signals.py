"""SIGTERM / SIGINT: the first sets the stop event at once, even while the main thread
is inside a long call that holds no Python bytecode (a compile); a second exits at
once with 128 + its number."""

import os
import signal
import subprocess
import sys

import pytest

# The main thread spends minutes in one C call (as in an XLA compile); a thread
# reports when the stop event is set.
_BUSY = """
import hashlib, sys, threading
from async_rl.rl.signals import StopOnSignals
signals = StopOnSignals(threading.Event())
def report():
  signals.stop.wait()
  print("stop", signals.received, signals.exit_status, flush=True)
threading.Thread(target=report, daemon=True).start()
print("busy", flush=True)
hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)
print("the call ended", flush=True)
"""


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM),
                                           (signal.SIGINT, signal.SIGINT),
                                           (signal.SIGTERM, signal.SIGINT)])
def test_first_signal_sets_stop_and_second_exits_at_once_while_main_is_busy(first, second):
  proc = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=os.getcwd())
  try:
    assert proc.stdout.readline() == "busy\n"
    proc.send_signal(first)
    assert proc.stdout.readline() == f"stop {int(first)} {128 + first}\n"
    proc.send_signal(second)
    proc.wait(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + second
  err = proc.stderr.read()
  assert f"{first.name}: stopping" in err
  assert f"{second.name}, a second signal: exiting at once with status {128 + second}" in err
  assert "the call ended" not in proc.stdout.read()


def test_the_first_signal_alone_exits_when_the_stop_does_not_end_the_run_in_time():
  # The main thread never reaches the stop (as a checkpoint write that hangs).
  busy = _BUSY.replace("StopOnSignals(threading.Event())",
                       "StopOnSignals(threading.Event(), grace_s=1.0)")
  proc = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=os.getcwd())
  try:
    assert proc.stdout.readline() == "busy\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == f"stop {int(signal.SIGTERM)} 143\n"
    proc.wait(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == 143
  err = proc.stderr.read()
  assert "SIGTERM: stopping" in err and "(within 1 s)" in err
  assert "SIGTERM: the stop did not end the run within 1 s: exiting with status 143" in err
  assert "the call ended" not in proc.stdout.read()
