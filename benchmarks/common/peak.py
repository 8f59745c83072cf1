"""The float32 matmul rate of this machine now ("the peak"), which the benchmarks that
time anything measure in the same run and quote with their figures."""

import functools
import time

import jax
import jax.numpy as jnp


def matmul_peak(size: int = 1024, reps: int = 10) -> float:
  """Best float32 FLOP/s of a jitted [size, size] @ [size, size] over `reps` calls."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  f = _matmul(size)
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(f(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


@functools.cache
def _matmul(size):
  f = jax.jit(jnp.matmul)
  a = jnp.ones((size, size), jnp.float32)
  jax.block_until_ready(f(a, a))
  return f
