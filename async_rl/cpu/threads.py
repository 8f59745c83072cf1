"""Device calls dispatched from several threads, so that they run at once on the CPU."""

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


def cores() -> int:
  """The CPU cores this process may run on."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def default_threads() -> int:
  """Threads for each of the generator and the trainer of one process when not
  configured (`config.CPUConfig`): half the cores each, since the two run at once."""
  return max(1, cores() // 2)


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
