"""The benchmarks' one timer: wall-clock seconds of a call until its result is ready on
the device (JAX dispatches asynchronously, so a call returns before its work is done)."""

import time
from typing import Any, Callable

import jax
import numpy as np


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """`fn()` and the seconds it took, its result ready on the device."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def median_s(fn: Callable[[], Any], repeats: int) -> float:
  """Median seconds of `repeats` calls of `fn`, after one untimed call (it compiles)."""
  jax.block_until_ready(fn())
  return float(np.median([timed(fn)[1] for _ in range(repeats)]))
