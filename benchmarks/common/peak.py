"""The matmul rate of this machine now ("the peak"), which the benchmarks that time
anything measure in the same run and quote with their figures: float32 on a CPU, and
bfloat16 on a GPU for model FLOPs utilisation."""

import functools
import time

import jax
import jax.numpy as jnp


def matmul_peak(size: int = 1024, reps: int = 10, dtype=jnp.float32) -> float:
  """Best FLOP/s of a jitted [size, size] @ [size, size] in `dtype` over `reps` calls."""
  a = jax.random.normal(jax.random.key(0), (size, size), dtype)
  f = _matmul(size, jnp.dtype(dtype))
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(f(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


@functools.cache
def _matmul(size, dtype):
  f = jax.jit(jnp.matmul)
  a = jnp.ones((size, size), dtype)
  jax.block_until_ready(f(a, a))
  return f


def copy_bandwidth(nbytes: int = 1 << 26, reps: int = 10) -> float:
  """Best bytes/s (read plus written) of a jitted elementwise pass over `nbytes` of
  float32, the ceiling a memory-bound program is measured against."""
  f = jax.jit(lambda x: x + 1)
  x = jnp.zeros(nbytes // 4, jnp.float32)
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - start)
  return 2 * x.nbytes / best
