"""Attention of packed rows: every implementation equals the dense masked reference.

The reference is the dense T x T attention the generation path uses
(`transformer._attention`) under the packed-row mask: same nonzero segment, key at or
before the query. Padding outputs are implementation-defined, so values and
gradients are compared through a loss that reads valid positions only.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl.models import attention
from async_rl.models.transformer import _attention as dense_reference


def _rows(T, lengths_per_row, H=4, K=2, E=8, seed=0):
  """q, k, v and segment ids for rows holding sequences of the given lengths, then padding."""
  B = len(lengths_per_row)
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (B, T, H, E))
  k = jax.random.normal(ks[1], (B, T, K, E))
  v = jax.random.normal(ks[2], (B, T, K, E))
  seg = np.zeros((B, T), np.int32)
  for b, lengths in enumerate(lengths_per_row):
    start = 0
    for i, n in enumerate(lengths):
      seg[b, start:start + n] = i + 1
      start += n
  return q, k, v, jnp.asarray(seg)


def _reference(q, k, v, seg):
  T = seg.shape[1]
  mask = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
          & jnp.tril(jnp.ones((T, T), bool)))
  return dense_reference(q, k, v, mask)


def _loss(fn, seg):
  def loss(q, k, v):
    out = fn(q, k, v, seg)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.sum(jnp.where((seg > 0)[..., None, None], out * w, 0.0))
  return loss


def _assert_matches_reference(fn, q, k, v, seg, tol):
  valid = np.asarray(seg > 0)
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v, seg))[valid],
                             np.asarray(jax.jit(_reference)(q, k, v, seg))[valid],
                             atol=tol, rtol=tol)
  got = jax.jit(jax.grad(_loss(fn, seg), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(_loss(_reference, seg), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


def test_num_blocks():
  assert attention.num_blocks(40) == 1  # too short to split
  assert attention.num_blocks(128) == 2
  assert attention.num_blocks(256) == 4
  assert attention.num_blocks(1024) == 16
  assert attention.num_blocks(16384) == 16  # at most 16 blocks, here of 1024
  assert attention.num_blocks(200) == 2  # 200 = 2 x 100; 4 x 50 is under 64


@pytest.mark.parametrize("T, rows", [
    (40, [[7, 5, 20], [40]]),                # one block: the dense case
    (256, [[100, 90, 30], [256], [3, 64, 64, 64, 50]]),  # 4 blocks; segments span blocks
    (200, [[130, 60]]),                      # 2 blocks of 100
])
def test_blockwise_matches_dense_reference(T, rows):
  q, k, v, seg = _rows(T, rows)
  # float32 rounding of softmax and matmuls over up to T keys.
  _assert_matches_reference(attention.blockwise, q, k, v, seg, tol=2e-5)


def test_attention_on_cpu_is_blockwise():
  q, k, v, seg = _rows(128, [[60, 60], [128]])
  np.testing.assert_array_equal(jax.jit(attention.attention)(q, k, v, seg),
                                jax.jit(attention.blockwise)(q, k, v, seg))


def _flash_interpreted(q, k, v, seg):
  return attention.flash_gpu(q, k, v, seg, interpret=True)


def test_gpu_flash_kernel_interpreted_matches_dense_reference():
  # T = 40 is padded to the 64-token tile: the padding path runs too.
  q, k, v, seg = _rows(40, [[7, 5, 20], [40]], E=16)
  _assert_matches_reference(_flash_interpreted, q, k, v, seg, tol=2e-5)


def test_gpu_flash_kernel_lowers_for_cuda():
  """The Triton kernel and its backward compile to a CUDA module without a GPU."""
  seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
  grad = jax.grad(lambda q, k, v, s: attention.flash_gpu(q, k, v, s).astype(jnp.float32).sum(),
                  argnums=(0, 1, 2))
  lowered = jax.jit(grad).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",))
  kernels = re.findall(r'name = "(mha_\w+)"', lowered.as_text())
  assert sorted(kernels) == ["mha_backward", "mha_forward", "mha_preprocess_backward"]
