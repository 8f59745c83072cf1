"""Reward functions for the tests, importable by name by the reward workers (and by Ray's
actors, which share the driver's sys.path)."""

import ctypes
import os
import signal
import sys
import time


def echo(completion, reference):
  del completion
  return reference


def length(completion, reference):
  del reference
  return float(len(completion))


def worker_pid(completion, reference):
  del completion, reference
  return float(os.getpid())


def raises(completion, reference):
  raise RuntimeError(f"bad completion {completion!r}")


def hangs(completion, reference):
  del completion, reference
  time.sleep(1000)


def exits(completion, reference):
  del completion, reference
  os._exit(3)


def segfaults(completion, reference):
  del completion, reference
  ctypes.string_at(0)



def allocates_mb(completion, reference):
  """Allocates `reference` MB (a bytearray, so the pages are touched); scores 1."""
  del completion
  block = bytearray(int(reference) << 20)
  return float(len(block) > 0)


def prints(completion, reference):
  """Prints `reference` numbered lines to stdout and one to stderr; scores 1."""
  del completion
  for i in range(int(reference)):
    print(f"reward says {i}", flush=True)
  print("reward complains", file=sys.stderr, flush=True)
  return 1.0


def zero(completion, reference):
  del completion, reference
  return 0.0


IN_FLIGHT_DIR_ENV = "TEST_REWARD_IN_FLIGHT_DIR"


def sleeps(completion, reference):
  """Scores the completion's length after a 20 ms sleep, so that a run has reward calls
  in flight; while a call runs, a file named by its worker's pid stands in the
  directory $TEST_REWARD_IN_FLIGHT_DIR (when set), for a test to see it."""
  del reference
  marks = os.environ.get(IN_FLIGHT_DIR_ENV)
  mark = os.path.join(marks, str(os.getpid())) if marks else None
  if mark:
    open(mark, "w").close()
  time.sleep(0.02)
  if mark:
    os.remove(mark)
  return float(len(completion))


KILL_COUNT_ENV, KILL_AT_ENV = "TEST_REWARD_KILL_COUNT", "TEST_REWARD_KILL_AT"


def kills_its_rollout_worker(completion, reference):
  """Scores the completion's length, except that call number $TEST_REWARD_KILL_AT made
  for a Ray rollout worker (counted in the file $TEST_REWARD_KILL_COUNT) SIGKILLs that
  worker's process while it is scoring a group."""
  del reference
  parent = os.getppid()
  with open(f"/proc/{parent}/cmdline", "rb") as f:
    if not f.read().startswith(b"ray::RolloutWorker"):
      return float(len(completion))
  path = os.environ[KILL_COUNT_ENV]
  calls = (int(open(path).read() or 0) if os.path.exists(path) else 0) + 1
  with open(path, "w") as f:
    f.write(str(calls))
  if calls == int(os.environ[KILL_AT_ENV]):
    os.kill(parent, signal.SIGKILL)
    time.sleep(60)  # this process ends with its parent
  return float(len(completion))
