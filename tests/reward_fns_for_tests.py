"""Reward functions for tests/test_rewards.py, importable by the reward workers."""

import ctypes
import os
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
