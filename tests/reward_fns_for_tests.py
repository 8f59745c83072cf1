"""Reward functions for tests/test_rewards.py, importable by the reward workers."""

import ctypes
import os
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

