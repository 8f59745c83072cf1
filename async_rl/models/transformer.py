"""A Qwen2/Qwen3/Llama decoder-only transformer as pure functions over a params pytree.

RMSNorm, rotary embeddings (optionally with Llama 3's frequency scaling), grouped-query
attention, SwiGLU MLP, optional q/k/v bias (Qwen2), optional q/k RMSNorm (Qwen3) and
optional tied embeddings; a Llama layer has neither extra. Layers are stacked on a
leading L axis and applied with `lax.scan` (unrolled for training without remat, see
`hidden`). Weight matmuls go through `_matmul`, whose backward pass orders the
weight-gradient operands for XLA:CPU.

A layer's params may carry low-rank adapters beside its projections (`models.lora`),
whose term the projection adds.

Two entry points share one layer body:
  * `forward` (`hidden`, then `unembed`): packed training rows with segment ids and
    positions; attention (`models/attention.py`) never crosses a segment, and its cost
    grows with the row length, not with the square of the micro-batch.
  * `prefill` / `decode`: a KV cache for generation, one slot per row and one buffer
    per layer; the layers are unrolled, and `split_layers` gives the params a layout
    (one dict per layer) they need not slice. `decode` keeps a dense cache of the
    longest length per slot; the generator's engine decodes through `decode_layers` on
    a paged one (`generation.paged`) and inserts `prefill`'s cache into its blocks.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from async_rl.models.attention import attention

Params = dict[str, Any]

_NEG_INF = -1e30


def init_params(cfg, key: jax.Array) -> Params:
  """Random params (truncated-normal scaled by fan-in); pure, so `jax.eval_shape` works."""
  D, F, H, K, E, L, V = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, cfg.n_layers, cfg.vocab_size)
  dtype = jnp.dtype(cfg.param_dtype)
  keys = iter(jax.random.split(key, 9))

  def dense(shape, fan_in):
    std = fan_in ** -0.5
    return (std * jax.random.truncated_normal(next(keys), -2, 2, shape)).astype(dtype)

  layers = {
      "attn_norm": jnp.ones((L, D), dtype),
      "q": dense((L, D, H, E), D),
      "k": dense((L, D, K, E), D),
      "v": dense((L, D, K, E), D),
      "o": dense((L, H, E, D), H * E),
      "mlp_norm": jnp.ones((L, D), dtype),
      "gate": dense((L, D, F), D),
      "up": dense((L, D, F), D),
      "down": dense((L, F, D), F),
  }
  if cfg.qkv_bias:
    layers["q_bias"] = jnp.zeros((L, H, E), dtype)
    layers["k_bias"] = jnp.zeros((L, K, E), dtype)
    layers["v_bias"] = jnp.zeros((L, K, E), dtype)
  if cfg.qk_norm:
    layers["q_norm"] = jnp.ones((L, E), dtype)
    layers["k_norm"] = jnp.ones((L, E), dtype)
  params = {
      "embed": dense((V, D), 1.0),
      "layers": layers,
      "final_norm": jnp.ones((D,), dtype),
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = dense((D, V), D)
  return params


def abstract_params(cfg):
  """The params' shapes and dtypes (`jax.ShapeDtypeStruct`s), nothing allocated: what
  shardings are derived from and checkpoints or HF files are read into."""
  return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg):
  """The E/2 rotary frequencies (float32) of `cfg.rope_theta`, scaled as `cfg.rope_scaling`
  says: "llama3" divides those whose wavelength exceeds original_max_len / low_freq_factor
  by the factor, keeps those under original_max_len / high_freq_factor, and between
  interpolates linearly in original_max_len / wavelength."""
  E = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
  if cfg.rope_scaling == "none":
    return inv_freq
  factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  context = cfg.rope_original_max_len
  wavelength = 2 * math.pi / inv_freq
  smooth = (context / wavelength - low) / (high - low)
  blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  return jnp.where(wavelength > context / low, inv_freq / factor,
                   jnp.where(wavelength < context / high, inv_freq, blended))


def rope(x_BTHE, positions_BT, inv_freq):
  """Rotary embedding in the half-split layout of Qwen2 and Llama checkpoints, at the
  frequencies `inv_freq` (`rope_frequencies`)."""
  angles = positions_BT[..., None].astype(jnp.float32) * inv_freq
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHE.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHE.dtype)


def _decode_attention(q_S1HE, k_SKTE, v_SKTE, mask_ST):
  """Grouped-query attention of one query per slot against a cache laid out [S, K, T, E];
  `mask_ST` is True where slot s may see position t."""
  S, _, H, E = q_S1HE.shape
  K = k_SKTE.shape[1]
  q_SKQE = q_S1HE.reshape(S, K, H // K, E)
  scores = jnp.einsum("skqe,skte->skqt", q_SKQE, k_SKTE,
                      preferred_element_type=jnp.float32) * (E ** -0.5)
  scores = jnp.where(mask_ST[:, None, None], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_SKTE.dtype)
  return jnp.einsum("skqt,skte->skqe", probs, v_SKTE).reshape(S, 1, H, E)


@jax.custom_vjp
def _matmul(x_NI, w_IO):
  return x_NI @ w_IO


def _matmul_fwd(x_NI, w_IO):
  return x_NI @ w_IO, (x_NI, w_IO)


def _matmul_bwd(res, g_NO):
  x_NI, w_IO = res
  # The weight gradient contracts over the N tokens. XLA:CPU copies the operand it
  # puts first into a transposed layout, fusing that operand's producer (e.g. the
  # SwiGLU backward) into the copy; strided reads made such copies cost more than
  # the matmuls. So the narrower of x and g goes first.
  if x_NI.shape[1] <= g_NO.shape[1]:
    dw_IO = jnp.einsum("ni,no->io", x_NI, g_NO)
  else:
    dw_IO = jnp.einsum("no,ni->oi", g_NO, x_NI).T
  return jnp.einsum("no,io->ni", g_NO, w_IO), dw_IO


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _linear(x, w, n_in=1):
  """Contracts the last `n_in` dims of x with the first `n_in` of w (cast to x's dtype)."""
  lead, out = x.shape[:x.ndim - n_in], w.shape[n_in:]
  size_in = math.prod(w.shape[:n_in])
  y = _matmul(x.reshape(-1, size_in), w.astype(x.dtype).reshape(size_in, -1))
  return y.reshape(*lead, *out)


def _adapted(lp, name, x, y, n_in=1):
  """`y`, x's projection by weight `name`, plus the low-rank term x A B of an adapter
  on that weight where the layer carries one (`models.lora.attach`, which folds the
  adapter's scale into B)."""
  a = lp.get(f"{name}_lora_a")
  if a is None:
    return y
  return y + _linear(_linear(x, a, n_in), lp[f"{name}_lora_b"]).astype(y.dtype)


def _project_qkv(lp, cfg, h_BTD, positions_BT):
  """q, k and v in one matmul: each kv head's query group, key and value side by side.

  The weights are joined per call as [D, K, Q + 2, E] (Q = H / K query heads per kv
  head): joining along Q keeps the K axis, which tensor parallelism shards, where it
  was. One matmul instead of three (and one input gradient instead of a sum of three)
  is faster on a CPU.
  """
  H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  Q = H // K
  join = lambda q, k, v: jnp.concatenate(
      [q.reshape(*q.shape[:-2], K, Q, E), k[..., None, :], v[..., None, :]], axis=-2)
  qkv = _linear(h_BTD, join(lp["q"], lp["k"], lp["v"]))
  if cfg.qkv_bias:
    qkv = qkv + join(lp["q_bias"], lp["k_bias"], lp["v_bias"]).astype(qkv.dtype)
  q = qkv[..., :Q, :].reshape(*qkv.shape[:-3], H, E)
  k, v = qkv[..., Q, :], qkv[..., Q + 1, :]
  q, k, v = (_adapted(lp, name, h_BTD, y) for name, y in (("q", q), ("k", k), ("v", v)))
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_eps)
  inv_freq = rope_frequencies(cfg)
  return rope(q, positions_BT, inv_freq), rope(k, positions_BT, inv_freq), v


def _mlp(lp, h_BTD):
  gate = checkpoint_name(_adapted(lp, "gate", h_BTD, _linear(h_BTD, lp["gate"])), "mlp_gate")
  up = checkpoint_name(_adapted(lp, "up", h_BTD, _linear(h_BTD, lp["up"])), "mlp_up")
  act = jax.nn.silu(gate) * up
  return _adapted(lp, "down", act, _linear(act, lp["down"]))


def _block(lp, cfg, x_BTD, positions_BT, attend):
  """One layer; `attend(q, k, v) -> (attn_out, aux)` decides where keys come from."""
  # The scopes name the ops in profiles (benchmarks/profile_step.py).
  h = rms_norm(x_BTD, lp["attn_norm"], cfg.rms_eps)
  with jax.named_scope("qkv"):
    q, k, v = (checkpoint_name(a, "qkv") for a in _project_qkv(lp, cfg, h, positions_BT))
  with jax.named_scope("attention"):
    attn, aux = attend(q, k, v)
  with jax.named_scope("out_proj"):
    out = _adapted(lp, "o", attn, _linear(attn, lp["o"], n_in=2), n_in=2)
    x_BTD = checkpoint_name(x_BTD + out, "residual")
  with jax.named_scope("mlp"):
    x_BTD = x_BTD + _mlp(lp, rms_norm(x_BTD, lp["mlp_norm"], cfg.rms_eps))
  return x_BTD, aux


def _embed(params, cfg, tokens_BT):
  return params["embed"][tokens_BT].astype(cfg.dtype)


def unembed(params: Params, cfg, x_BTD):
  """Final RMSNorm and LM head: float32 logits [B, T, V] of hidden states [B, T, D]."""
  x = rms_norm(x_BTD, params["final_norm"], cfg.rms_eps)
  head_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  return jnp.einsum("btd,dv->btv", x, head_DV.astype(x.dtype),
                    preferred_element_type=jnp.float32)


# `prefill` and `decode` call it by its earlier private name.
_logits = unembed


def hidden(params: Params, cfg, tokens_BT, positions_BT, segment_ids_BT, *, rows=None,
           kernels: str = "xla"):
  """Hidden states [B, T, D] of packed rows after the last layer, before `unembed`.

  Query t sees key s iff both are in the same non-padding segment and s <= t
  (`attention.attention`, by the `kernels` it names). `rows`, a sharding of
  the residual stream (a trainer's rows over its data-parallel axes), holds every
  layer to it: left to itself, XLA keeps weights that are sharded over those axes
  in place and computes every row on every device.
  """
  constrain = ((lambda x: x) if rows is None
               else lambda x: jax.lax.with_sharding_constraint(x, rows))

  def layer(x, lp):
    x, _ = _block(lp, cfg, constrain(x), positions_BT,
                  lambda q, k, v: (attention(q, k, v, segment_ids_BT, positions_BT,
                                             kernels=kernels), None))
    return constrain(x), None

  # Without remat a scan would stack every intermediate of every layer into [L, ...]
  # buffers and slice them back in the backward pass: copies that took a fifth of the
  # CPU train step. Unrolled, they stay where they are. Under remat only the layer
  # inputs are kept, and the scan keeps compile time flat in depth.
  x, _ = jax.lax.scan(_remat(layer, cfg), _embed(params, cfg, tokens_BT), params["layers"],
                      unroll=not cfg.remat)
  return x


def forward(params: Params, cfg, tokens_BT, positions_BT, segment_ids_BT, *,
            kernels: str = "xla"):
  """Logits [B, T, V] (float32) for packed rows: `unembed` of `hidden`."""
  return unembed(params, cfg, hidden(params, cfg, tokens_BT, positions_BT, segment_ids_BT,
                                     kernels=kernels))


def _remat(fn, cfg):
  if not cfg.remat:
    return fn
  if not cfg.remat_saves:
    return jax.checkpoint(fn)
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(
      *cfg.remat_saves))


def split_layers(params: Params) -> Params:
  """The serving layout of `params`: "layers" as a tuple of L per-layer dicts.

  `prefill` and `decode` take either layout; with the stacked one they slice each
  layer's weights out of the [L, ...] arrays on every call (copies a decode step
  does not need). Training keeps the stacked layout.
  """
  layers = params["layers"]
  if isinstance(layers, tuple):
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return dict(params, layers=tuple(jax.tree.map(lambda w: w[l], layers) for l in range(n)))


def _layer_list(params: Params):
  return split_layers(params)["layers"]


def init_cache(cfg, num_slots: int, max_len: int):
  """Empty KV cache: k and v are tuples of L arrays [S, K, T, E] in the compute dtype.

  One buffer per layer: decoding's attention reads (and its scatter updates) the
  layer's own buffer in place, where a stacked [L, ...] cache was copied out of for
  every layer on every step. Heads before positions: the attention contracts each (slot, head)'s
  keys, and with (slot, head) leading they are batch dimensions XLA needs no copy
  for (with T before K, XLA:CPU transposed each layer's cache on every decode step).
  """
  shape = (num_slots, cfg.n_kv_heads, max_len, cfg.head_dim)
  zeros = lambda: tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers))
  return {"k": zeros(), "v": zeros()}


def cache_len(cache) -> int:
  """The positions T a KV cache (`init_cache`, `prefill`) holds per slot."""
  return cache["k"][0].shape[2]


def prefill(params: Params, cfg, tokens_BT, lengths_B, *, kernels: str = "xla"):
  """Runs right-padded prompts; returns (logits [B, V] float32 after each prompt's last
  token, cache for those rows).

  Row b holds `lengths_B[b]` real tokens at positions 0..len-1, segment 1 to
  `attention.attention` with `kernels` (padding is segment 0, which no real token sees).
  The cache (laid out as `init_cache`'s, with B rows) has the prompt's own length T;
  `insert` copies it into a slot of a longer cache. Only the last real token's
  logits are computed, and attention's temporaries grow linearly in long rows, so
  that a sequence of reasoning length can be prefilled again. Layers are unrolled,
  as in `decode`.
  """
  B, T = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(T), tokens_BT.shape)
  segment_ids_BT = (positions_BT < lengths_B[:, None]).astype(jnp.int32)
  heads_first = lambda c: jnp.transpose(c, (0, 2, 1, 3))  # [B, T, K, E] -> [B, K, T, E]
  x, ks, vs = _embed(params, cfg, tokens_BT), [], []
  for lp in _layer_list(params):
    x, (k, v) = _block(lp, cfg, x, positions_BT,
                       lambda q, k, v: (attention(q, k, v, segment_ids_BT, positions_BT,
                                                  kernels=kernels), (k, v)))
    ks.append(heads_first(k))
    vs.append(heads_first(v))
  last_B1D = x[jnp.arange(B), lengths_B - 1][:, None]
  return _logits(params, cfg, last_B1D)[:, 0], {"k": tuple(ks), "v": tuple(vs)}


def decode(params: Params, cfg, cache, tokens_S, positions_S):
  """One token per slot: writes its K/V at `positions_S` and attends to positions <= it.

  Returns (logits [S, V] float32, updated cache). Slots whose position is past the
  cache end write nowhere (the update is dropped), so idle slots are harmless. Each
  layer scatters only its new row into its own buffer, so with a donated cache XLA
  updates it in place: no pass over the cache per step beyond what attention reads.
  """
  S, Tmax = tokens_S.shape[0], cache_len(cache)
  slots_S = jnp.arange(S)
  mask_ST = jnp.arange(Tmax)[None, :] <= positions_S[:, None]

  def attend(q, k, v, kv):
    # k[:, 0] is [S, K, E]: slot s's new row goes to [s, :, positions_S[s]].
    k_SKTE, v_SKTE = (c.at[slots_S, :, positions_S].set(x[:, 0].astype(c.dtype), mode="drop")
                      for c, x in zip(kv, (k, v)))
    return _decode_attention(q, k_SKTE, v_SKTE, mask_ST), (k_SKTE, v_SKTE)

  logits_SV, kv = decode_layers(params, cfg, tuple(zip(cache["k"], cache["v"])), tokens_S,
                                positions_S, attend)
  ks, vs = zip(*kv)
  return logits_SV, {"k": ks, "v": vs}


def decode_layers(params: Params, cfg, caches, tokens_S, positions_S, attend):
  """`decode`'s step over a KV layout the caller keeps: one entry of `caches` per layer.

  `attend(q_S1HE, k_S1KE, v_S1KE, cache) -> (out_S1HE, cache)` writes the token's key
  and value into its layer's cache and attends to positions <= `positions_S`; the rest
  of the layer is `decode`'s, so a paged cache (`generation.paged`) gets the same
  numerics. Returns (logits [S, V] float32, the L updated caches).
  """
  x = _embed(params, cfg, tokens_S[:, None])
  positions_S1 = positions_S[:, None]
  updated = []
  for lp, cache in zip(_layer_list(params), caches):
    x, cache = _block(lp, cfg, x, positions_S1,
                      lambda q, k, v, cache=cache: attend(q, k, v, cache))
    updated.append(cache)
  return _logits(params, cfg, x)[:, 0], tuple(updated)
