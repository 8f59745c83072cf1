"""Per-token log-probs and entropy of the policy on packed rows.

Position t of a packed row holds token t; its log-prob is that of token t given the
tokens before it in its segment, under softmax(logits / temperature), truncated to
the top-k / top-p support (`support`) where the token was sampled with truncation.
Position 0 of each segment has no prediction and gets 0 (it is a prompt token, never
in the loss). The generator records behaviour log-probs with `token_logp` on the
logits of `models.unembed` and the support `support` gives them, and the trainer takes
the same log-softmax of the same head's logits of the same hidden states on the support
of the same function, so the two agree to float rounding.

The logits of a whole micro-batch ([B, T, V] in float32) are never formed: the LM head
and the softmax run over chunks of positions in a `lax.map`, and the backward pass
scores each chunk again and takes the gradient of log-prob and entropy in closed form,
so memory grows with the chunk, not T. Given the tokens the caller scores, chunks of
positions that predict none of them (prompts, padding) are skipped.
"""

import jax
import jax.numpy as jnp

from async_rl.config import ModelConfig
from async_rl.models import hidden
from async_rl.models.transformer import rms_norm

# At most this many float32 logits per chunk (2^27: 512 MiB; a few such buffers live
# in the backward pass of one chunk).
MAX_CHUNK_LOGITS = 2**27
# With the positions a caller scores given, a row's positions go in at least this many
# chunks, so that those of prompts and padding can be skipped.
SKIP_CHUNKS = 8

# The most |log π_θ - log π_behav| rounding explains for a token the params being
# trained sampled, per compute dtype (`ModelConfig.dtype`): the decode step and the
# packed forward compute its logits in different orders. Past it, the sampler and the
# trainer score different distributions. Set from the test models, with headroom.
LOGP_ROUNDING = {"float32": 1e-4, "bfloat16": 0.1}


def support_threshold(scaled_V, top_k, top_p):
  """The least temperature-scaled logit that top-k / top-p sampling keeps of one row
  `scaled_V`: the top-k, then the top-p nucleus of what remains; the row's least logit
  when top_k is 0 and top_p 1 (every token kept)."""
  V = scaled_V.shape[-1]
  sorted_V = jnp.sort(scaled_V)[::-1]
  rank_V = jnp.arange(V)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  in_k_V = rank_V < k
  probs_V = jax.nn.softmax(jnp.where(in_k_V, sorted_V, -jnp.inf))
  # A token is in the nucleus if the mass strictly before it is below top_p, so the
  # most likely token is always kept and the kept set is a prefix of the ranking.
  # top_p = 1 keeps everything outright: rounding in the cumsum could drop the tail.
  keep_V = in_k_V & ((jnp.cumsum(probs_V) - probs_V < top_p) | (top_p >= 1))
  return sorted_V[jnp.sum(keep_V) - 1]


def support(scaled_V, top_k, top_p):
  """The tokens top-k / top-p sampling keeps of one row of temperature-scaled logits
  (`support_threshold`). Bool [V]. The sampler draws from this support and the trainer
  scores on it: one function, so both sides see one distribution."""
  return scaled_V >= support_threshold(scaled_V, top_k, top_p)


def _log_softmax(logits_BV, temperature, keep_BV=None):
  """Log-probs [B, V] of softmax(logits / temperature) over `keep_BV` (-inf off it), and
  the log-sum-exp [B] they are taken against; float32."""
  scaled_BV = logits_BV.astype(jnp.float32) / temperature
  if keep_BV is not None:
    scaled_BV = jnp.where(keep_BV, scaled_BV, -jnp.inf)
  max_B1 = jax.lax.stop_gradient(jnp.max(scaled_BV, axis=-1, keepdims=True))
  shifted_BV = scaled_BV - max_B1
  log_sum_B1 = jnp.log(jnp.sum(jnp.exp(shifted_BV), axis=-1, keepdims=True))
  return shifted_BV - log_sum_B1, (max_B1 + log_sum_B1)[..., 0]


def _entropy(logp_BV, keep_BV):
  if keep_BV is None:
    return -jnp.sum(jnp.exp(logp_BV) * logp_BV, axis=-1)
  # Off the support logp is -inf, and 0 * -inf would poison the value and gradient.
  return -jnp.sum(jnp.exp(logp_BV) * jnp.where(keep_BV, logp_BV, 0.0), axis=-1)


def token_logp(logits_BV, tokens_B, temperature, keep_BV=None):
  """Log-prob of `tokens_B` under softmax(logits / temperature), renormalised over
  the tokens of `keep_BV` (a `support`) when given; float32."""
  logp_BV, _ = _log_softmax(logits_BV, temperature, keep_BV)
  return jnp.take_along_axis(logp_BV, tokens_B[..., None], axis=-1)[..., 0]


def entropy(logits_BV, temperature, keep_BV=None):
  return _entropy(_log_softmax(logits_BV, temperature, keep_BV)[0], keep_BV)


def _scoring_keep(scaled_NV, next_N, threshold_N):
  """The trainer's support for scoring `next_N`: the tokens at or above each position's
  `support_threshold`, and the token itself; None without truncation (every token). At
  equal params the token is in the support it was drawn from, and the sampler and
  trainer compute that support with one function; under other params (a later version)
  it may fall out, and is kept so that its log-prob stays finite."""
  if threshold_N is None:
    return None
  return (scaled_NV >= threshold_N[:, None]) | (jnp.arange(scaled_NV.shape[-1])
                                                 == next_N[:, None])


def chunk_len(B: int, T: int, V: int, max_logits: int = MAX_CHUNK_LOGITS) -> int:
  """Positions per chunk: the largest divisor of T with B * chunk * V <= max_logits (>= 1)."""
  return max((c for c in range(1, T + 1) if T % c == 0 and B * c * V <= max_logits), default=1)


def chunk_plan(B: int, T: int, V: int, max_logits: int, needed_BT=None):
  """How the LM head runs over [B, T] positions: (C, order_T, active_n).

  Chunks of C positions along T (`chunk_len`), taken in the order `order_T` (None: in
  order), of which chunk i runs only where `active_n[i]`. Given `needed_BT` (the
  positions whose prediction is needed), the columns some row needs come first, in
  chunks of at most T / SKIP_CHUNKS positions, and the chunks of columns no row needs
  (prompts, padding) are not active.
  """
  if needed_BT is None:
    C = chunk_len(B, T, V, max_logits)
    return C, None, jnp.ones(T // C, bool)
  C = chunk_len(B, T, V, min(max_logits, B * max(T // SKIP_CHUNKS, 1) * V))
  needed_T = jnp.any(needed_BT, axis=0)
  order_T = jnp.argsort(~needed_T, stable=True)
  return C, order_T, jnp.any(needed_T[order_T].reshape(T // C, C), axis=1)


def _head_logits(h_ND, head, tied):
  """Float32 logits [N, V] of normed hidden states: `models.unembed` after its norm."""
  spec = "nd,vd->nv" if tied else "nd,dv->nv"
  return jnp.einsum(spec, h_ND, head.astype(h_ND.dtype), preferred_element_type=jnp.float32)


def _chunk_scores(h_BCD, head, next_BC, truncation_BC, *, temperature, tied):
  """Log-prob of `next_BC` and the entropy at each position of one chunk, and what the
  backward pass needs to score it again: the log-sum-exp and the support's threshold
  (-inf without truncation)."""
  B, C, D = h_BCD.shape
  next_N = next_BC.reshape(-1)
  logits_NV = _head_logits(h_BCD.reshape(B * C, D), head, tied)
  threshold_N, keep_NV = jnp.full((B * C,), -jnp.inf), None
  if truncation_BC:
    # The support's sort and cumulative sum see no gradient: the choice is constant.
    scaled_NV = jax.lax.stop_gradient(logits_NV / temperature)
    threshold_N = jax.vmap(support_threshold)(scaled_NV,
                                              *(a.reshape(-1) for a in truncation_BC))
    keep_NV = _scoring_keep(scaled_NV, next_N, threshold_N)
  logp_NV, lse_N = _log_softmax(logits_NV, temperature, keep_NV)
  logp_N = jnp.take_along_axis(logp_NV, next_N[:, None], axis=-1)[:, 0]
  return tuple(a.reshape(B, C) for a in (logp_N, _entropy(logp_NV, keep_NV), lse_N,
                                         threshold_N))


def _chunk_grads(h_BCD, head, next_BC, lse_BC, ent_BC, threshold_BC, g_logp_BC, g_ent_BC, *,
                 temperature, tied, truncated):
  """The chunk's logits scored again, and the gradients of sum(g_logp logp + g_ent
  entropy) with respect to its hidden states and (as [D, V]) the head."""
  B, C, D = h_BCD.shape
  h_ND = h_BCD.reshape(B * C, D)
  col = lambda a_BC: a_BC.reshape(-1, 1)
  scaled_NV = _head_logits(h_ND, head, tied) / temperature
  logp_NV = scaled_NV - col(lse_BC)
  if truncated:
    keep_NV = _scoring_keep(scaled_NV, next_BC.reshape(-1), threshold_BC.reshape(-1))
    logp_NV = jnp.where(keep_NV, logp_NV, -jnp.inf)
  p_NV = jnp.exp(logp_NV)
  # With z = logits / temperature: d logp(t) / dz = onehot(t) - p, and d entropy / dz =
  # -p (logp + entropy), 0 off the support (where p is 0 and logp -inf).
  onehot_NV = jnp.arange(scaled_NV.shape[-1]) == col(next_BC)
  d_ent_NV = p_NV * ((jnp.where(keep_NV, logp_NV, 0.0) if truncated else logp_NV) + col(ent_BC))
  d_NV = ((col(g_logp_BC) * (onehot_NV - p_NV) - col(g_ent_BC) * d_ent_NV)
          / temperature).astype(h_ND.dtype)
  dh_ND = jnp.einsum("nv,vd->nd" if tied else "nv,dv->nd", d_NV, head.astype(h_ND.dtype),
                     preferred_element_type=jnp.float32)
  # The narrow operand first: XLA:CPU copies the first operand into the layout a
  # contraction over N wants, and [N, V] is the wide one (as `models.transformer._matmul`).
  dhead_DV = jnp.einsum("nd,nv->dv", h_ND, d_NV, preferred_element_type=jnp.float32)
  return dh_ND.astype(h_BCD.dtype).reshape(B, C, D), dhead_DV


def _head_scores(h_nBCD, head, next_nBC, truncation_nBC, active_n, *, temperature, tied):
  """Log-probs and entropies [n, B, C] of n chunks of normed hidden states under the LM
  head `head` ([V, D] when `tied`, else [D, V]); chunks not `active_n` are skipped (0).

  The gradient is written out: the backward pass scores each chunk's logits again from
  its log-sum-exp, entropy and support threshold, kept per position, and takes the
  gradient of log-prob and entropy in closed form, so that a chunk's logits never
  outlive it and are read in a few fused passes. The head's gradient is summed over
  the chunks as [D, V] and laid out as the head once, at the end.
  """
  kw = dict(temperature=temperature, tied=tied)
  B, C = next_nBC.shape[1:]
  zeros_BC = jnp.zeros((B, C), jnp.float32)

  def forward(h_nBCD, head):
    def one(xs):
      active, h, nxt, *trunc = xs
      return jax.lax.cond(active, lambda: _chunk_scores(h, head, nxt, trunc, **kw),
                          lambda: (zeros_BC,) * 4)
    return jax.lax.map(one, (active_n, h_nBCD, next_nBC, *truncation_nBC))

  @jax.custom_vjp
  def scores(h_nBCD, head):
    return forward(h_nBCD, head)[:2]

  def scores_fwd(h_nBCD, head):
    logp, ent, lse, threshold = forward(h_nBCD, head)
    return (logp, ent), (h_nBCD, head, lse, ent, threshold)

  def scores_bwd(res, g):
    h_nBCD, head, lse, ent, threshold = res
    D = h_nBCD.shape[-1]
    zeros = (jnp.zeros((B, C, D), h_nBCD.dtype), jnp.zeros((D, head.size // D), jnp.float32))

    def one(dhead_DV, xs):
      active, h, *chunk = xs
      dh, d = jax.lax.cond(active, lambda: _chunk_grads(h, head, *chunk, **kw,
                                                        truncated=bool(truncation_nBC)),
                           lambda: zeros)
      return dhead_DV + d, dh

    dhead_DV, dh = jax.lax.scan(one, zeros[1], (active_n, h_nBCD, next_nBC, lse, ent, threshold,
                                                *g))
    return dh, (dhead_DV.T if tied else dhead_DV).astype(head.dtype)

  scores.defvjp(scores_fwd, scores_bwd)
  return scores(h_nBCD, head)


def _next_logp_and_entropy(params, cfg, x_BTD, next_BT, temperature, max_logits, truncation,
                           needed_BT):
  """Log-prob of `next_BT` and the entropy, predicted at every position of `x_BTD`, or 0
  where `needed_BT` (if not None) is False; `truncation` is () or (top_k_BT, top_p_BT)
  of the tokens `next_BT`."""
  B, T, D = x_BTD.shape
  # The support's sort and cumulative sum about double the [B, C, V] buffers a chunk holds.
  C, order_T, active_n = chunk_plan(B, T, cfg.vocab_size,
                                    max_logits // 2 if truncation else max_logits, needed_BT)

  def to_chunks(a_BT):
    a_BT = a_BT if order_T is None else a_BT[:, order_T]
    # Chunks run along T, so each holds every row and keeps the rows' sharding.
    return a_BT.reshape(B, T // C, C, *a_BT.shape[2:]).swapaxes(0, 1)

  with jax.named_scope("logp"):
    h_BTD = rms_norm(x_BTD, params["final_norm"], cfg.rms_eps)
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    out = _head_scores(to_chunks(h_BTD), head, to_chunks(next_BT),
                       tuple(map(to_chunks, truncation)), active_n, temperature=temperature,
                       tied=cfg.tie_embeddings)
  logp_BT, ent_BT = (a.swapaxes(0, 1).reshape(B, T) for a in out)
  if order_T is None:
    return logp_BT, ent_BT
  inverse_T = jnp.argsort(order_T)
  return tuple(jnp.where(needed_BT, a_BT[:, inverse_T], 0.0) for a_BT in (logp_BT, ent_BT))


def logp_and_entropy(params, cfg: ModelConfig, tokens_BT, positions_BT, segment_ids_BT, *,
                     temperature: float = 1.0, top_k_BT=None, top_p_BT=None,
                     max_chunk_logits: int = MAX_CHUNK_LOGITS, scored_BT=None, rows=None,
                     kernels: str = "xla"):
  """Returns (logp_BT, entropy_BT), aligned so position t scores token t.

  entropy_BT[t] is the entropy of the distribution that predicted token t. With
  `top_k_BT` and `top_p_BT` (both or neither: the truncation each token was sampled
  with, 0 and 1 for none), both are of that distribution truncated to its support
  (`support`, and the token itself); without, of the full softmax, at no cost for
  truncation. At most `max_chunk_logits` float32 logits exist at a time (see
  `chunk_len`). With `scored_BT` (bool: the tokens the caller scores, such as a loss
  mask), both are 0 at the other tokens, and the LM head skips the chunks of positions
  that predict none of them (prompts, padding). `rows` and `kernels`: as
  `models.hidden`'s.
  """
  if (top_k_BT is None) != (top_p_BT is None):
    raise ValueError("logp_and_entropy takes top_k_BT and top_p_BT together, or neither")
  x_BTD = hidden(params, cfg, tokens_BT, positions_BT, segment_ids_BT, rows=rows,
                 kernels=kernels)
  # The prediction at the last position has no next token: it scores token 0 and
  # is dropped by the shift below.
  next_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))
  truncation = () if top_k_BT is None else (
      jnp.pad(top_k_BT[:, 1:], ((0, 0), (0, 1))),
      jnp.pad(top_p_BT[:, 1:], ((0, 0), (0, 1)), constant_values=1.0))
  needed_BT = None if scored_BT is None else jnp.pad(scored_BT[:, 1:], ((0, 0), (0, 1)))
  logp, ent = _next_logp_and_entropy(params, cfg, x_BTD, next_BT, temperature,
                                     max_chunk_logits, truncation, needed_BT)
  # Position 0 of a segment follows another segment (or padding) in the row; it is
  # zeroed so nothing downstream can mistake it for a prediction.
  first_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
  pad = ((0, 0), (1, 0))
  return (jnp.pad(jnp.where(first_BT, 0.0, logp[:, :-1]), pad),
          jnp.pad(jnp.where(first_BT, 0.0, ent[:, :-1]), pad))
