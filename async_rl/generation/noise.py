"""The sampler's Gumbel noise: `jax.random.gumbel` of the sample's key, bit for bit,
with the Threefry-2x32 hash written out in `jnp`.

On the CPU backend jax lowers its threefry primitive as a rolled loop of five
iterations, and each `fold_in` is another such loop, so drawing a decode step's noise
runs as many tiny ops inside the decode loop. Written out, the hash is one elementwise
fusion. The hash is Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), keyed and counted as jax's partitionable
threefry keys and draws, so the noise equals jax's (a test checks it).
"""

import jax
import jax.numpy as jnp
import numpy as np

# Rotation constants of Threefry-2x32, used in turn by groups of four rounds.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x, r: int):
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32 of the counter pair (x0, x1) under the key (k0, k1); uint32 arrays
  that broadcast together."""
  ks = (k0, k1, k0 ^ k1 ^ _PARITY)
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def _fold_in(k0, k1, data):
  return threefry2x32(k0, k1, jnp.zeros_like(data), data)


def gumbel(seed_S, index_S, positions_S, V: int):
  """Standard Gumbel noise [S, V] float32: row s equals `jax.random.gumbel(key, (V,))`
  with key `fold_in(fold_in(key(seed_S[s]), index_S[s]), positions_S[s])`."""
  as_u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  seed_S, index_S, positions_S = map(as_u32, (seed_S, index_S, positions_S))
  # key(seed) of a 32-bit seed is the pair (0, seed).
  k0, k1 = _fold_in(jnp.zeros_like(seed_S), seed_S, index_S)
  k0, k1 = _fold_in(k0, k1, positions_S)
  counts_1V = jnp.arange(V, dtype=jnp.uint32)[None]
  b0, b1 = threefry2x32(k0[:, None], k1[:, None], jnp.zeros_like(counts_1V), counts_1V)
  # 23 random mantissa bits under the exponent of 1.0 give a float in [1, 2).
  mantissa = ((b0 ^ b1) >> np.uint32(9)) | np.uint32(0x3F800000)
  uniform = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1)
  tiny = np.float32(np.finfo(np.float32).tiny)
  uniform = jnp.maximum(tiny, uniform * (np.float32(1) - tiny) + tiny)
  return -jnp.log(-jnp.log(uniform))
