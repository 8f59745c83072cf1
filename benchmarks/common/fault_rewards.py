"""Reward functions that fail on purpose, for the fault injection of `benchmarks/faults.py`.

The reward workers import this module by its name ("benchmarks.common.fault_rewards:flaky",
with the repository root on their sys.path), so it imports nothing heavy.
"""

import hashlib
import os
import signal
import time

RAISE_EVERY = 4  # a completion whose hash is 0 mod this raises
HANG_EVERY = 11  # one whose hash is 1 mod this never returns


def _hash(completion) -> int:
  return int.from_bytes(hashlib.blake2b(str(completion).encode(), digest_size=8).digest(), "big")


def _score(completion) -> float:
  # Varied rewards within a group, so that a good step changes the params.
  return len(completion) / 16


def flaky(completion, reference):
  """Raises for about one completion in RAISE_EVERY, never returns for one in
  HANG_EVERY, else scores the completion's length."""
  del reference
  h = _hash(completion)
  if h % RAISE_EVERY == 0:
    raise RuntimeError("injected: this reward function raises")
  if h % HANG_EVERY == 1:
    time.sleep(10 ** 6)
  return _score(completion)


def kills_its_rollout_worker(completion, reference):
  """Scores the length, except that call number $FAULTS_KILL_AT made for a Ray rollout
  worker (counted in the file $FAULTS_KILL_COUNT) SIGKILLs that worker's process while
  it is scoring a group."""
  del reference
  parent = os.getppid()
  with open(f"/proc/{parent}/cmdline", "rb") as f:
    if not f.read().startswith(b"ray::RolloutWorker"):
      return _score(completion)
  path = os.environ["FAULTS_KILL_COUNT"]
  calls = (int(open(path).read() or 0) if os.path.exists(path) else 0) + 1
  with open(path, "w") as f:
    f.write(str(calls))
  if calls == int(os.environ["FAULTS_KILL_AT"]):
    os.kill(parent, signal.SIGKILL)
    time.sleep(60)  # this process ends with its parent
  return _score(completion)
