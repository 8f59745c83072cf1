"""A Qwen2-family decoder-only transformer as pure functions over a params pytree.

RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, optional q/k/v bias,
optional q/k RMSNorm (Qwen3) and optional tied embeddings. Layers are stacked on a
leading L axis and applied with `lax.scan`, so compile time does not grow with depth.

Two entry points share one layer body:
  * `forward`: packed training rows with segment ids and positions; attention never
    crosses a segment and padding (segment 0) attends nowhere useful.
  * `prefill` / `decode`: a KV cache for generation, one slot per row.
"""

from typing import Any

import jax
import jax.numpy as jnp

from async_rl.models.config import ModelConfig

Params = dict[str, Any]

_NEG_INF = -1e30


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
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


def rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x_BTHE, positions_BT, theta):
  """Rotary embedding in the half-split layout used by Qwen2 checkpoints."""
  E = x_BTHE.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
  angles = positions_BT[..., None].astype(jnp.float32) * inv_freq
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHE.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHE.dtype)


def _attention(q_BTHE, k_BSKE, v_BSKE, mask_BTS):
  """Grouped-query attention; `mask_BTS` is True where query t may see key s."""
  B, T, H, E = q_BTHE.shape
  K = k_BSKE.shape[2]
  q_BTKGE = q_BTHE.reshape(B, T, K, H // K, E)
  scores = jnp.einsum("btkge,bske->bkgts", q_BTKGE, k_BSKE,
                      preferred_element_type=jnp.float32) * (E ** -0.5)
  scores = jnp.where(mask_BTS[:, None, None], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKE.dtype)
  out = jnp.einsum("bkgts,bske->btkge", probs, v_BSKE)
  return out.reshape(B, T, H, E)


def _project_qkv(lp, cfg, h_BTD, positions_BT):
  q = jnp.einsum("btd,dhe->bthe", h_BTD, lp["q"].astype(h_BTD.dtype))
  k = jnp.einsum("btd,dke->btke", h_BTD, lp["k"].astype(h_BTD.dtype))
  v = jnp.einsum("btd,dke->btke", h_BTD, lp["v"].astype(h_BTD.dtype))
  if cfg.qkv_bias:
    q = q + lp["q_bias"].astype(q.dtype)
    k = k + lp["k_bias"].astype(k.dtype)
    v = v + lp["v_bias"].astype(v.dtype)
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_eps)
  return rope(q, positions_BT, cfg.rope_theta), rope(k, positions_BT, cfg.rope_theta), v


def _mlp(lp, h_BTD):
  gate = jnp.einsum("btd,df->btf", h_BTD, lp["gate"].astype(h_BTD.dtype))
  up = jnp.einsum("btd,df->btf", h_BTD, lp["up"].astype(h_BTD.dtype))
  return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lp["down"].astype(h_BTD.dtype))


def _block(lp, cfg, x_BTD, positions_BT, attend):
  """One layer; `attend(q, k, v) -> (attn_out, aux)` decides where keys come from."""
  h = rms_norm(x_BTD, lp["attn_norm"], cfg.rms_eps)
  q, k, v = _project_qkv(lp, cfg, h, positions_BT)
  attn, aux = attend(q, k, v)
  x_BTD = x_BTD + jnp.einsum("bthe,hed->btd", attn, lp["o"].astype(attn.dtype))
  x_BTD = x_BTD + _mlp(lp, rms_norm(x_BTD, lp["mlp_norm"], cfg.rms_eps))
  return x_BTD, aux


def _embed(params, cfg, tokens_BT):
  return params["embed"][tokens_BT].astype(cfg.dtype)


def _logits(params, cfg, x_BTD):
  x = rms_norm(x_BTD, params["final_norm"], cfg.rms_eps)
  head_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  return jnp.einsum("btd,dv->btv", x, head_DV.astype(x.dtype),
                    preferred_element_type=jnp.float32)


def forward(params: Params, cfg: ModelConfig, tokens_BT, positions_BT, segment_ids_BT):
  """Logits [B, T, V] (float32) for packed rows.

  Query t sees key s iff both are in the same non-padding segment and s <= t.
  """
  T = tokens_BT.shape[1]
  causal_TS = jnp.tril(jnp.ones((T, T), bool))
  same_BTS = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]) & (
      segment_ids_BT[:, None, :] > 0)
  mask_BTS = same_BTS & causal_TS

  def layer(x, lp):
    x, _ = _block(lp, cfg, x, positions_BT,
                  lambda q, k, v: (_attention(q, k, v, mask_BTS), None))
    return x, None

  x, _ = jax.lax.scan(_remat(layer, cfg), _embed(params, cfg, tokens_BT), params["layers"])
  return _logits(params, cfg, x)


def _remat(fn, cfg):
  return jax.checkpoint(fn) if cfg.remat else fn


def init_cache(cfg: ModelConfig, num_slots: int, max_len: int):
  """Empty KV cache: k and v are [L, S, T, K, E] in the compute dtype."""
  shape = (cfg.n_layers, num_slots, max_len, cfg.n_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def prefill(params: Params, cfg: ModelConfig, tokens_BT, lengths_B):
  """Runs right-padded prompts; returns (logits [B, T, V], cache for those rows).

  Row b holds `lengths_B[b]` real tokens at positions 0..len-1. The cache has the
  prompt's own length T; `insert` copies it into a slot of a longer cache.
  """
  T = tokens_BT.shape[1]
  positions_BT = jnp.broadcast_to(jnp.arange(T), tokens_BT.shape)
  valid_BT = positions_BT < lengths_B[:, None]
  mask_BTS = jnp.tril(jnp.ones((T, T), bool))[None] & valid_BT[:, None, :]

  def layer(x, lp):
    return _block(lp, cfg, x, positions_BT,
                  lambda q, k, v: (_attention(q, k, v, mask_BTS), (k, v)))

  x, (k_LBTKE, v_LBTKE) = jax.lax.scan(layer, _embed(params, cfg, tokens_BT),
                                       params["layers"])
  return _logits(params, cfg, x), {"k": k_LBTKE, "v": v_LBTKE}


def decode(params: Params, cfg: ModelConfig, cache, tokens_S, positions_S):
  """One token per slot: writes its K/V at `positions_S` and attends to positions <= it.

  Returns (logits [S, V] float32, updated cache). Slots whose position is past the
  cache end write nowhere (the update is dropped), so idle slots are harmless.
  """
  S, Tmax = tokens_S.shape[0], cache["k"].shape[2]
  slots_S = jnp.arange(S)
  positions_S1 = positions_S[:, None]
  mask_S1T = (jnp.arange(Tmax)[None, None, :] <= positions_S1[:, :, None])

  # The whole cache rides in the scan's carry and each layer scatters only its new
  # row into it, so with a donated cache XLA updates it in place: no pass over the
  # cache per step beyond what attention reads.
  def layer(carry, inputs):
    x, k_LSTKE, v_LSTKE = carry
    lp, l = inputs

    def attend(q, k, v):
      k_all = k_LSTKE.at[l, slots_S, positions_S].set(k[:, 0].astype(k_LSTKE.dtype),
                                                      mode="drop")
      v_all = v_LSTKE.at[l, slots_S, positions_S].set(v[:, 0].astype(v_LSTKE.dtype),
                                                      mode="drop")
      return _attention(q, k_all[l], v_all[l], mask_S1T), (k_all, v_all)

    x, (k_LSTKE, v_LSTKE) = _block(lp, cfg, x, positions_S1, attend)
    return (x, k_LSTKE, v_LSTKE), None

  x = _embed(params, cfg, tokens_S[:, None])
  (x, k, v), _ = jax.lax.scan(layer, (x, cache["k"], cache["v"]),
                              (params["layers"], jnp.arange(cfg.n_layers)))
  return _logits(params, cfg, x)[:, 0], {"k": k, "v": v}
