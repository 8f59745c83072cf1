"""Causal attention within the segments of packed rows; one entry point for every backend.

A packed row holds whole sequences back to back (segment ids 1, 2, ... in row order,
then 0 on padding), so query t sees key s iff both carry the same nonzero segment id
and s <= t: causal order within a segment is row order, and positions are not needed.

`attention` runs the implementation its `kernels` argument names, which the builder of a
program decides from the devices it runs on (`kernels_for`), not from the default backend:
  * "gpu": `flash_gpu`, the Pallas (Triton) flash-attention kernel of
    `jax.experimental.pallas.ops.gpu.attention.mha`, which masks by segment ids and
    skips the key blocks above the diagonal. cuDNN is not used: the public
    `jax.nn.dot_product_attention(implementation="cudnn")` takes a causal flag and
    per-row lengths, not segment ids, so it could serve only one sequence per row, or
    a dense [R, T, T] mask that it adds as a bias without skipping blocks. (cuDNN's
    packed layout, `q_offsets` / `kv_offsets`, is reachable only through the private
    `jax._src.cudnn` module, on Hopper and later.)
  * "xla", on any backend, rows of up to `LONG_ROW` tokens: `blockwise`, plain XLA: the row
    is cut into at most `_MAX_BLOCKS` query blocks and block i scores only the keys of
    blocks 0..i, so about (n + 1) / 2n of the dense T x T work runs (Z = T / n tokens
    per block); and when the micro-batch's longest sequence is short, only a band of
    key blocks that holds it (`windows`). Its temporaries grow as T^2 / n.
  * "xla", longer rows (reasoning-length sequences, in training or in the
    generator's prefill): `chunked`, flash attention in plain XLA, whose temporaries
    grow linearly in T.

Work grows with the row length T, not with the micro-batch: the packer chooses T per
batch (`batching.pack_dynamic`), the shortest bucket that pays.
"""

import functools

import jax
import jax.numpy as jnp

_NEG_INF = -1e30
_MAX_BLOCKS = 16
_MIN_BLOCK = 64
# `chunked`'s tokens per block: one block's [Z, Z] scores per kv head's query group.
_CHUNK = 512
# The longest rows `blockwise` takes; longer ones go to `chunked`.
LONG_ROW = 2048
# Triton tiles: a power of two up to 128 along the sequence for the forward kernel,
# up to 32 for the backward kernels (the kernel's defaults).
_GPU_BLOCK, _GPU_BWD_BLOCK = 128, 32


KERNELS = ("xla", "gpu")


def kernels_for(devices) -> str:
  """The attention kernels of a program on `devices`: "gpu" (Pallas Triton) when they
  are all GPUs, else "xla" (plain XLA, which runs on every backend)."""
  return "gpu" if all(d.platform == "gpu" for d in devices) else "xla"


def attention(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, *, kernels: str = "xla"):
  """Grouped-query attention of packed rows, by the implementation `kernels` names.

  Args:
    q_BTHE: queries; H must be a multiple of K.
    k_BTKE: keys.
    v_BTKE: values.
    segment_ids_BT: int32, 1, 2, ... per sequence of a row, 0 on padding.
    positions_BT: int32 position of each token in its sequence (0 on padding).
    kernels: one of `KERNELS` (static): "gpu" for `flash_gpu`, "xla" for `blockwise` or
      `chunked` by row length.

  Returns:
    [B, T, H, E] in the dtype of `v_BTKE`. Rows at padding positions hold values
    that depend on the implementation; nothing valid reads them.
  """
  if kernels not in KERNELS:
    raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
  if kernels == "gpu":
    return flash_gpu(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT)
  if q_BTHE.shape[1] > LONG_ROW:
    return chunked(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT)
  return blockwise(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT)


def num_blocks(T: int) -> int:
  """Query blocks of `blockwise`: the most, up to 16, that divide T into >= 64 tokens."""
  return max((n for n in range(1, _MAX_BLOCKS + 1) if T % n == 0 and T // n >= _MIN_BLOCK),
             default=1)


def windows(T: int) -> tuple[int, ...]:
  """Key windows `blockwise` chooses among: T, and those of T/8, T/4, T/2 whose band
  (n blocks, each over b + 1 blocks of keys) costs less than the causal triangle."""
  n = num_blocks(T)
  Z = T // n
  band = lambda w: -(-(w - 1) // Z)
  return tuple(w for w in (T // 8, T // 4, T // 2) if w >= Z and T % w == 0
               and n * (band(w) + 1) < n * (n + 1) // 2) + (T,)


def blockwise(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT):
  """Query block i attends to key blocks i - band .. i only; the rest is never computed.

  No sequence of the micro-batch is longer than its longest, so a query never sees a
  key more than that many tokens back. Of `windows(T)`, the smallest that holds the
  longest sequence sets the band (a `lax.switch` between static programs, one per
  window, so the choice is made on device for each micro-batch). With the whole row
  as window, block i sees blocks 0..i (`_causal_blocks`); with a shorter one every
  block sees the same number of blocks before it (`_band`).
  """
  T = positions_BT.shape[1]
  options = windows(T)
  longest = jnp.max(positions_BT) + 1
  index = jnp.minimum(jnp.searchsorted(jnp.array(options), longest), len(options) - 1)
  branches = [_causal_blocks if w == T else functools.partial(_band, window=w)
              for w in options]
  return jax.lax.switch(index, branches, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT)


def _scores_to_out(q, k, v, mask, spec_qk, spec_pv):
  E = q.shape[-1]
  scores = jnp.einsum(spec_qk, q, k, preferred_element_type=jnp.float32) * (E ** -0.5)
  # An additive bias rather than `where`: the backward pass then keeps no mask
  # broadcast to every head (XLA:CPU materialised one the size of the scores).
  scores = scores + jnp.where(mask, 0.0, _NEG_INF)
  return jnp.einsum(spec_pv, jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)


def _causal_blocks(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT):
  B, T, H, E = q_BTHE.shape
  K = k_BTKE.shape[2]
  n = num_blocks(T)
  Z = T // n
  q_BTKQE = q_BTHE.reshape(B, T, K, H // K, E)
  out = []
  # A static loop: block i has its own key length (i + 1) Z, and n <= 16 keeps the
  # program small.
  for i in range(n):
    keys = slice(0, (i + 1) * Z)
    seg_q, seg_k = segment_ids_BT[:, i * Z:(i + 1) * Z], segment_ids_BT[:, keys]
    causal_ZS = i * Z + jnp.arange(Z)[:, None] >= jnp.arange((i + 1) * Z)[None, :]
    mask_BZS = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] > 0) & causal_ZS
    out.append(_scores_to_out(q_BTKQE[:, i * Z:(i + 1) * Z], k_BTKE[:, keys],
                              v_BTKE[:, keys], mask_BZS[:, None, None],
                              "bzkqe,bske->bkqzs", "bkqzs,bske->bzkqe"))
  return jnp.concatenate(out, axis=1).reshape(B, T, H, E)


def _band(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, *, window):
  """All query blocks at once, each over its own b + 1 key blocks (b = blocks back)."""
  B, T, H, E = q_BTHE.shape
  K = k_BTKE.shape[2]
  n = num_blocks(T)
  Z = T // n
  b = -(-(window - 1) // Z)  # blocks back
  # Front padding is segment 0, which no query sees; slot s of block i's window is
  # key i Z - b Z + s.
  def windows_of(x):
    x = jnp.pad(x, ((0, 0), (b * Z, 0)) + ((0, 0),) * (x.ndim - 2))
    return jnp.concatenate([x[:, j * Z:(j + n) * Z].reshape(B, n, Z, *x.shape[2:])
                            for j in range(b + 1)], axis=2)
  k_BnSKE, v_BnSKE, seg_BnS = (windows_of(x) for x in (k_BTKE, v_BTKE, segment_ids_BT))
  seg_BnZ = segment_ids_BT.reshape(B, n, Z)
  causal_ZS = jnp.arange(Z)[:, None] + b * Z >= jnp.arange((b + 1) * Z)[None, :]
  mask_BnZS = ((seg_BnZ[..., :, None] == seg_BnS[..., None, :]) & (seg_BnS[..., None, :] > 0)
               & causal_ZS)
  out = _scores_to_out(q_BTHE.reshape(B, n, Z, K, H // K, E), k_BnSKE, v_BnSKE,
                       mask_BnZS[:, :, None, None], "bnzkqe,bnske->bnkqzs",
                       "bnkqzs,bnske->bnzkqe")
  return out.reshape(B, T, H, E)


def flash_gpu(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, *, interpret: bool = False):
  """The Pallas Triton flash kernel with segment ids; `interpret` runs it on any backend.

  The kernel wants as many key heads as query heads, so K/V heads are repeated, and
  a row length that its tiles divide, so rows are padded with segment 0 (which no
  real query sees) and the padding is cut off again.
  """
  # Imported here: the Pallas GPU modules add half a second to every CPU process.
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  B, T, H, E = q_BTHE.shape
  Q = H // k_BTKE.shape[2]
  block = min(_GPU_BLOCK, 1 << max(T - 1, 15).bit_length())
  pad = -T % block
  k_BTHE, v_BTHE = (jnp.repeat(x, Q, axis=2) for x in (k_BTKE, v_BTKE))
  padded = [jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q_BTHE, k_BTHE, v_BTHE)]
  bwd = min(block, _GPU_BWD_BLOCK)
  sizes = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=bwd,
                                      block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
  out = pallas_attention.mha(*padded, jnp.pad(segment_ids_BT, ((0, 0), (0, pad))),
                             sm_scale=E ** -0.5, causal=True, block_sizes=sizes,
                             interpret=interpret)
  return out[:, :T]


def chunked(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, *, block: int = _CHUNK):
  """Flash attention in plain XLA: temporaries linear in T, for rows too long for
  `blockwise`.

  Query blocks of `block` tokens run one at a time, each over the key blocks it can
  see with a running softmax, so one block's [block, block] scores are all that exist
  of the T x T; the backward pass keeps only the output and each query's
  log-sum-exp, and scores each block pair again. A query block reads the key blocks
  from the one where its first token's sequence starts through its own (none for a
  block of padding only): the loops' trip counts are traced, which is why the
  backward pass is written out (`jax.custom_vjp`). Rows are padded to whole blocks
  with segment 0, which no query sees.
  """
  return _flash(block, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT)


def _to_blocks(x_BT, Z):
  """[B, T, ...] -> [n, B, Z, ...]: T cut into n blocks of Z, zeros after its end."""
  pad = -x_BT.shape[1] % Z
  x_BT = jnp.pad(x_BT, ((0, 0), (0, pad)) + ((0, 0),) * (x_BT.ndim - 2))
  return jnp.moveaxis(x_BT.reshape(x_BT.shape[0], -1, Z, *x_BT.shape[2:]), 1, 0)


def _from_blocks(x_nBZ, T):
  n, B, Z = x_nBZ.shape[:3]
  return jnp.moveaxis(x_nBZ, 0, 1).reshape(B, n * Z, *x_nBZ.shape[3:])[:, :T]


def _key_blocks(seg_nBZ, pos_nBZ, i):
  """The key blocks [start, stop) that query block i sees."""
  Z = seg_nBZ.shape[2]
  starts_B = jnp.where(seg_nBZ[i, :, 0] > 0, (i * Z - pos_nBZ[i, :, 0]) // Z, i)
  start = jnp.maximum(jnp.min(starts_B), 0)
  return start, jnp.where(jnp.any(seg_nBZ[i] > 0), i + 1, start)


def _block_mask(seg_nBZ, i, j):
  """[B, Z, S]: query z of block i sees key s of block j."""
  seg_BZ, seg_BS = seg_nBZ[i], seg_nBZ[j]
  Z = seg_BZ.shape[1]
  causal_ZS = (j < i) | (jnp.arange(Z)[:, None] >= jnp.arange(Z)[None, :])
  return (seg_BZ[:, :, None] == seg_BS[:, None, :]) & (seg_BS[:, None, :] > 0) & causal_ZS


def _block_scores(q_BZKQE, k_BSKE):
  E = q_BZKQE.shape[-1]
  return jnp.einsum("bzkqe,bske->bkqzs", q_BZKQE, k_BSKE,
                    preferred_element_type=jnp.float32) * (E ** -0.5)


def _blocked(block, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT):
  B, T, H, E = q_BTHE.shape
  K = k_BTKE.shape[2]
  Z = min(block, T)
  q = _to_blocks(q_BTHE, Z).reshape(-1, B, Z, K, H // K, E)
  return q, *(_to_blocks(x, Z) for x in (k_BTKE, v_BTKE, segment_ids_BT, positions_BT))


def _flash_fwd(block, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT):
  B, T, H, E = q_BTHE.shape
  q_nBZKQE, k_nBZKE, v_nBZKE, seg_nBZ, pos_nBZ = _blocked(block, q_BTHE, k_BTKE, v_BTKE,
                                                          segment_ids_BT, positions_BT)
  n, _, Z, K, Q, _ = q_nBZKQE.shape

  def query_block(_, i):
    def key_block(j, carry):
      max_BKQZ, sum_BKQZ, out_BKQZE = carry
      scores = jnp.where(_block_mask(seg_nBZ, i, j)[:, None, None],
                         _block_scores(q_nBZKQE[i], k_nBZKE[j]), _NEG_INF)
      new_max = jnp.maximum(max_BKQZ, jnp.max(scores, axis=-1))
      probs = jnp.exp(scores - new_max[..., None])
      rescale = jnp.exp(max_BKQZ - new_max)
      out_BKQZE = out_BKQZE * rescale[..., None] + jnp.einsum(
          "bkqzs,bske->bkqze", probs.astype(v_nBZKE.dtype), v_nBZKE[j],
          preferred_element_type=jnp.float32)
      return new_max, sum_BKQZ * rescale + jnp.sum(probs, axis=-1), out_BKQZE

    zeros = jnp.zeros((B, K, Q, Z), jnp.float32)
    init = (zeros + _NEG_INF, zeros, jnp.zeros((B, K, Q, Z, E), jnp.float32))
    max_BKQZ, sum_BKQZ, out_BKQZE = jax.lax.fori_loop(*_key_blocks(seg_nBZ, pos_nBZ, i),
                                                      key_block, init)
    # A query that sees no key (padding) gets zeros, or the mean of the values it was
    # scored against; the backward pass masks it out.
    seen = sum_BKQZ > 0
    out_BKQZE = out_BKQZE / jnp.where(seen, sum_BKQZ, 1)[..., None]
    lse_BKQZ = jnp.where(seen, max_BKQZ + jnp.log(jnp.where(seen, sum_BKQZ, 1)), 0)
    return None, (jnp.transpose(out_BKQZE, (0, 3, 1, 2, 4)).astype(v_nBZKE.dtype), lse_BKQZ)

  _, (out_nBZKQE, lse_nBKQZ) = jax.lax.scan(query_block, None, jnp.arange(n))
  out_BTHE = _from_blocks(out_nBZKQE.reshape(n, B, Z, H, E), T)
  return out_BTHE, (q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, out_BTHE, lse_nBKQZ)


def _flash_bwd(block, residuals, d_out_BTHE):
  q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, out_BTHE, lse_nBKQZ = residuals
  B, T, H, E = q_BTHE.shape
  q_nBZKQE, k_nBZKE, v_nBZKE, seg_nBZ, pos_nBZ = _blocked(block, q_BTHE, k_BTKE, v_BTKE,
                                                          segment_ids_BT, positions_BT)
  n, _, Z, K, Q, _ = q_nBZKQE.shape
  d_out_nBZKQE = _to_blocks(d_out_BTHE, Z).reshape(q_nBZKQE.shape)
  # D = rowsum(dO * O), the softmax's correction term, per query.
  delta_nBZKQ = jnp.sum(d_out_nBZKQE.astype(jnp.float32)
                        * _to_blocks(out_BTHE, Z).reshape(q_nBZKQE.shape), axis=-1)
  delta_nBKQZ = jnp.transpose(delta_nBZKQ, (0, 1, 3, 4, 2))

  def query_block(carry, i):
    def key_block(j, carry):
      dq_BZKQE, dk_nBZKE, dv_nBZKE = carry
      scores = _block_scores(q_nBZKQE[i], k_nBZKE[j])
      probs = jnp.where(_block_mask(seg_nBZ, i, j)[:, None, None],
                        jnp.exp(scores - lse_nBKQZ[i][..., None]), 0.0)
      d_probs = jnp.einsum("bzkqe,bske->bkqzs", d_out_nBZKQE[i], v_nBZKE[j],
                           preferred_element_type=jnp.float32)
      d_scores = (probs * (d_probs - delta_nBKQZ[i][..., None]) * E ** -0.5).astype(q_nBZKQE.dtype)
      dq_BZKQE = dq_BZKQE + jnp.einsum("bkqzs,bske->bzkqe", d_scores, k_nBZKE[j],
                                       preferred_element_type=jnp.float32)
      dk_nBZKE = dk_nBZKE.at[j].add(jnp.einsum("bkqzs,bzkqe->bske", d_scores, q_nBZKQE[i],
                                               preferred_element_type=jnp.float32))
      dv_nBZKE = dv_nBZKE.at[j].add(jnp.einsum("bkqzs,bzkqe->bske", probs.astype(v_nBZKE.dtype),
                                               d_out_nBZKQE[i], preferred_element_type=jnp.float32))
      return dq_BZKQE, dk_nBZKE, dv_nBZKE

    dq_BZKQE = jnp.zeros((B, Z, K, Q, E), jnp.float32)
    dq_BZKQE, *carry = jax.lax.fori_loop(*_key_blocks(seg_nBZ, pos_nBZ, i), key_block,
                                         (dq_BZKQE, *carry))
    return tuple(carry), dq_BZKQE

  zeros = jnp.zeros(k_nBZKE.shape, jnp.float32)
  (dk_nBZKE, dv_nBZKE), dq_nBZKQE = jax.lax.scan(query_block, (zeros, zeros), jnp.arange(n))
  cast = lambda x, like: _from_blocks(x, T).astype(like.dtype)
  return (cast(dq_nBZKQE.reshape(n, B, Z, H, E), q_BTHE), cast(dk_nBZKE, k_BTKE),
          cast(dv_nBZKE, v_BTKE), None, None)


_flash = jax.custom_vjp(lambda block, *args: _flash_fwd(block, *args)[0], nondiff_argnums=(0,))
_flash.defvjp(_flash_fwd, _flash_bwd)
