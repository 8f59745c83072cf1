"""Attention of packed rows: every implementation equals the dense masked reference.

The reference is dense T x T grouped-query attention under the packed-row mask: same
nonzero segment, key at or before the query. Padding outputs are
implementation-defined, so values and gradients are compared through a loss that reads
valid positions only.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import models, policy
from async_rl.config import ModelConfig
from async_rl.models import attention


def _rows(T, lengths_per_row, H=4, K=2, E=8, seed=0):
  """q, k, v, segment ids and positions for rows of sequences of these lengths, then padding."""
  B = len(lengths_per_row)
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (B, T, H, E))
  k = jax.random.normal(ks[1], (B, T, K, E))
  v = jax.random.normal(ks[2], (B, T, K, E))
  seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
  for b, lengths in enumerate(lengths_per_row):
    start = 0
    for i, n in enumerate(lengths):
      seg[b, start:start + n] = i + 1
      pos[b, start:start + n] = np.arange(n)
      start += n
  return q, k, v, jnp.asarray(seg), jnp.asarray(pos)


def _reference(q, k, v, seg, pos):
  del pos
  (B, T, H, E), K = q.shape, k.shape[2]
  mask = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
          & jnp.tril(jnp.ones((T, T), bool)))
  scores = jnp.einsum("btkqe,bske->bkqts", q.reshape(B, T, K, H // K, E), k) * E ** -0.5
  probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -1e30), axis=-1)
  return jnp.einsum("bkqts,bske->btkqe", probs, v).reshape(B, T, H, E)


def _loss(fn, seg, pos):
  def loss(q, k, v):
    out = fn(q, k, v, seg, pos)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.sum(jnp.where((seg > 0)[..., None, None], out * w, 0.0))
  return loss


def _assert_matches_reference(fn, q, k, v, seg, pos, tol):
  valid = np.asarray(seg > 0)
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v, seg, pos))[valid],
                             np.asarray(jax.jit(_reference)(q, k, v, seg, pos))[valid],
                             atol=tol, rtol=tol)
  got = jax.jit(jax.grad(_loss(fn, seg, pos), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(_loss(_reference, seg, pos), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


def test_num_blocks():
  assert attention.num_blocks(40) == 1  # too short to split
  assert attention.num_blocks(128) == 2
  assert attention.num_blocks(256) == 4
  assert attention.num_blocks(1024) == 16
  assert attention.num_blocks(16384) == 16  # at most 16 blocks, here of 1024
  assert attention.num_blocks(200) == 2  # 200 = 2 x 100; 4 x 50 is under 64


def test_windows():
  # 16 blocks of 64: bands of 2 and 4 blocks back (48 and 80 block pairs) beat the
  # causal triangle (136); 8 back (144) does not.
  assert attention.windows(1024) == (128, 256, 1024)
  # 4 blocks: 32 is under a block; 64 (8 pairs) beats the triangle (10), 128 (12) not.
  assert attention.windows(256) == (64, 256)
  assert attention.windows(40) == (40,)


@pytest.mark.parametrize("T, rows", [
    (40, [[7, 5, 20], [40]]),                # one block: the dense case
    (256, [[100, 90, 30], [256], [3, 64, 64, 64, 50]]),  # 4 blocks; whole-row window
    (256, [[64, 64, 64, 64], [30, 34, 60, 2]]),  # window 64: one block back
    (1024, [[128] * 8, [100, 28, 128, 7, 121] + [128] * 5]),  # window 128: 2 blocks back
    (1024, [[256] * 4, [200, 56] + [128] * 6]),  # window 256: 4 blocks back
    (200, [[130, 60]]),                      # 2 blocks of 100
])
def test_blockwise_matches_dense_reference(T, rows):
  q, k, v, seg, pos = _rows(T, rows)
  # float32 rounding of softmax and matmuls over up to T keys.
  _assert_matches_reference(attention.blockwise, q, k, v, seg, pos, tol=2e-5)


def test_blockwise_band_leaves_out_keys_beyond_the_window():
  # The band is work left undone, not a mask: forced to a 64-token window, a row that
  # one 256-token sequence fills loses the keys more than a block back, so late
  # queries differ from the reference while the first two blocks still match it.
  q, k, v, seg, pos = _rows(256, [[256]])
  banded = attention._band(q, k, v, seg, window=64)
  ref = _reference(q, k, v, seg, pos)
  np.testing.assert_allclose(banded[:, :128], ref[:, :128], atol=2e-5, rtol=2e-5)
  assert np.abs(banded[:, 128:] - ref[:, 128:]).max() > 1e-2


def test_kernels_follow_the_devices_not_the_default_backend():
  gpu, cpu = (types.SimpleNamespace(platform=p) for p in ("gpu", "cpu"))
  assert jax.default_backend() == "cpu"
  assert attention.kernels_for([gpu, gpu]) == "gpu"
  assert attention.kernels_for([cpu]) == attention.kernels_for([gpu, cpu]) == "xla"
  q, k, v, seg, pos = _rows(64, [[64]], E=16)
  traced = lambda kernels: str(jax.make_jaxpr(functools.partial(
      attention.attention, kernels=kernels))(q, k, v, seg, pos))
  assert "pallas_call" in traced("gpu") and "pallas_call" not in traced("xla")
  with pytest.raises(ValueError, match="kernels must be one of"):
    traced("cuda")


def test_attention_on_cpu_is_blockwise():
  q, k, v, seg, pos = _rows(128, [[60, 60], [128]])
  np.testing.assert_array_equal(jax.jit(attention.attention)(q, k, v, seg, pos),
                                jax.jit(attention.blockwise)(q, k, v, seg, pos))


@pytest.mark.parametrize("T, block, rows", [
    (40, 512, [[7, 5, 20], [40]]),           # one block, shorter than `block`
    (256, 64, [[100, 90, 30], [256], [3, 64, 64, 64, 50]]),  # 4 blocks
    (200, 64, [[130, 60], [200]]),           # padded to 4 blocks of 64
    (256, 64, [[100], [256]]),               # blocks of padding only in row 0
    (1024, 64, [[128] * 8, [100, 28, 128, 7, 121] + [128] * 5]),  # starts past block 0
])
def test_chunked_matches_dense_reference(T, block, rows):
  q, k, v, seg, pos = _rows(T, rows)
  fn = functools.partial(attention.chunked, block=block)
  assert np.isfinite(np.asarray(jax.jit(fn)(q, k, v, seg, pos))).all()  # padding too
  _assert_matches_reference(fn, q, k, v, seg, pos, tol=2e-5)


def test_attention_on_cpu_is_chunked_past_long_rows():
  T = attention.LONG_ROW + 64
  q, k, v, seg, pos = _rows(T, [[T - 100, 50]], H=2, K=1, E=4)
  np.testing.assert_array_equal(jax.jit(attention.attention)(q, k, v, seg, pos),
                                jax.jit(attention.chunked)(q, k, v, seg, pos))


def test_chunked_forward_and_backward_hold_no_row_by_row_scores():
  """Compiled from abstract shapes at a 7B model's heads (28 query heads, 4 kv heads
  of 128) in bfloat16, nothing allocated: the gradient's temporaries at a row of 32k
  are smaller than one head's [T, T] float32 scores, and double from 16k, where any
  [B, T, T] buffer would quadruple them."""
  def temp(T):
    q = jax.ShapeDtypeStruct((1, T, 28, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, 4, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, T), jnp.int32)
    loss = lambda q, k, v, s, p: attention.chunked(q, k, v, s, p).astype(jnp.float32).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(grad).lower(q, kv, kv, seg, seg).compile().memory_analysis(
        ).temp_size_in_bytes
  one_head_scores = 32768 ** 2 * 4
  assert temp(32768) < one_head_scores / 2
  assert temp(32768) < 2.2 * temp(16384)


def test_the_models_gradient_at_a_32k_row_holds_no_row_by_row_scores():
  """The train step's differentiated forward pass (the model, remat on, and its
  chunked log-probs) on one row of 32k tokens, compiled, nothing allocated: its
  temporaries are less than one head's [T, T] float32 scores."""
  T = 32768
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, d_ff=128, max_seq_len=T, remat=True)
  params = models.abstract_params(cfg)
  row = jax.ShapeDtypeStruct((1, T), jnp.int32)
  loss = lambda p, tokens, pos, seg: policy.logp_and_entropy(p, cfg, tokens, pos, seg)[0].sum()
  temp = jax.jit(jax.grad(loss)).lower(params, row, row, row).compile().memory_analysis(
      ).temp_size_in_bytes
  assert temp < T * T * 4 / 2


def _flash_interpreted(q, k, v, seg, pos):
  del pos  # the kernel masks by segment ids and row order
  return attention.flash_gpu(q, k, v, seg, interpret=True)


def test_gpu_flash_kernel_interpreted_matches_dense_reference():
  # T = 40 is padded to the 64-token tile: the padding path runs too.
  q, k, v, seg, pos = _rows(40, [[7, 5, 20], [40]], E=16)
  _assert_matches_reference(_flash_interpreted, q, k, v, seg, pos, tol=2e-5)


@pytest.mark.usefixtures("gpu_target")
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
