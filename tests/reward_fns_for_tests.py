"""Reward functions for tests/test_rewards.py, importable by the reward workers."""

import ctypes
import os
import signal
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


def kills_its_rollout_worker(completion, reference):
  """`length`, except that the call numbered $KILL_AT among those made for a Ray rollout
  worker (counted in the file $KILL_COUNT) SIGKILLs that worker's process, while its
  group is running."""
  parent = os.getppid()
  with open(f"/proc/{parent}/cmdline", "rb") as f:
    if not f.read().startswith(b"ray::RolloutWorker"):
      return length(completion, reference)
  path = os.environ["KILL_COUNT"]
  calls = int(open(path).read() or 0) + 1 if os.path.exists(path) else 1
  with open(path, "w") as f:
    f.write(str(calls))
  if calls == int(os.environ["KILL_AT"]):
    os.kill(parent, signal.SIGKILL)
    time.sleep(60)  # this process ends with its parent
  return length(completion, reference)
