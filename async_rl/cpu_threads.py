"""Device calls dispatched from several threads, so that they run at once on the CPU.

XLA:CPU runs the programs dispatched from one thread one after another, and a small
program's ops mostly one at a time on one core; programs dispatched from different
threads run at the same time. The generator engine's slot groups
(`generation.decode_threads`) and the trainer's gradient threads
(`train.grad_threads`) each dispatch one group's calls from one of these threads, as
many as the cores each side may count on (`cores_per_side`).
"""

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


def cores() -> int:
  """The CPU cores this process may run on."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def cores_per_side(max_staleness) -> int:
  """The cores a run's generator and its trainer may each count on in one process: all
  of them when the two take turns (η = `max_staleness` = 0), half each when they run
  at once (BENCHMARKS.md, "Both cores for decoding and for the gradients": the quick
  start ran slower with both sides on every core)."""
  return cores() if max_staleness == 0 else max(1, cores() // 2)


class Dispatchers:
  """`n` threads; `map` dispatches call i from thread i and returns what each returned
  (with JAX's asynchronous dispatch, arrays that may still be computing)."""

  def __init__(self, n: int, name: str):
    self._threads = [ThreadPoolExecutor(1, thread_name_prefix=name) for _ in range(n)]

  def __len__(self) -> int:
    return len(self._threads)

  def map(self, fn: Callable, args: Sequence[tuple]) -> list[Any]:
    calls = [t.submit(fn, *a) for t, a in zip(self._threads, args, strict=True)]
    return [c.result() for c in calls]
