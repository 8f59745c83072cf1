"""Per-token log-probs and entropy of the policy on packed rows.

Position t of a packed row holds token t; its log-prob is that of token t given the
tokens before it in its segment, under softmax(logits / temperature), truncated to
the top-k / top-p support (`support`) where the token was sampled with truncation.
Position 0 of each segment has no prediction and gets 0 (it is a prompt token, never
in the loss). The generator records behaviour log-probs with `token_logp` on its
logits and the support `support` gives them, and the trainer applies the same two
functions to the same `models.unembed` of the same hidden states, so the two agree to
float rounding.

The logits of a whole micro-batch ([B, T, V] in float32) are never formed: the final
norm, the LM head and the softmax run over chunks of positions in a `lax.map`, each
chunk rematerialised in the backward pass, so memory grows with the chunk, not T.
"""

import jax
import jax.numpy as jnp

from async_rl.config import ModelConfig
from async_rl.models import hidden, unembed

# At most this many float32 logits per chunk (2^27: 512 MiB; a few such buffers live
# in the backward pass of one chunk).
MAX_CHUNK_LOGITS = 2**27

# The most |log π_θ - log π_behav| rounding explains for a token the params being
# trained sampled, per compute dtype (`ModelConfig.dtype`): the decode step and the
# packed forward compute its logits in different orders. Past it, the sampler and the
# trainer score different distributions. Set from the test models, with headroom.
LOGP_ROUNDING = {"float32": 1e-4, "bfloat16": 0.1}


def support(scaled_V, top_k, top_p):
  """The tokens top-k / top-p sampling keeps of one row of temperature-scaled logits:
  the top-k, then the top-p nucleus of what remains; every token when top_k is 0 and
  top_p 1. Bool [V]. The sampler draws from this support and the trainer scores on
  it: one function, so both sides see one distribution."""
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
  threshold = sorted_V[jnp.sum(keep_V) - 1]
  return scaled_V >= threshold


def _log_softmax(logits_BV, temperature, keep_BV=None):
  scaled_BV = logits_BV.astype(jnp.float32) / temperature
  if keep_BV is not None:
    scaled_BV = jnp.where(keep_BV, scaled_BV, -jnp.inf)
  return jax.nn.log_softmax(scaled_BV, axis=-1)


def token_logp(logits_BV, tokens_B, temperature, keep_BV=None):
  """Log-prob of `tokens_B` under softmax(logits / temperature), renormalised over
  the tokens of `keep_BV` (a `support`) when given; float32."""
  logp_BV = _log_softmax(logits_BV, temperature, keep_BV)
  return jnp.take_along_axis(logp_BV, tokens_B[..., None], axis=-1)[..., 0]


def entropy(logits_BV, temperature, keep_BV=None):
  logp_BV = _log_softmax(logits_BV, temperature, keep_BV)
  if keep_BV is None:
    return -jnp.sum(jnp.exp(logp_BV) * logp_BV, axis=-1)
  # Off the support logp is -inf, and 0 * -inf would poison the value and gradient.
  return -jnp.sum(jnp.exp(logp_BV) * jnp.where(keep_BV, logp_BV, 0.0), axis=-1)


def scoring_support(logits_BCV, next_BC, temperature, top_k_BC, top_p_BC):
  """The trainer's support for scoring `next_BC`: `support` of each position's logits
  at its token's truncation, and the token itself. At equal params the token is in
  the support it was drawn from, and the sampler and trainer compute that support
  with one function; under other params (a later version) it may fall out, and is
  kept so that its log-prob stays finite. No gradient flows through the choice."""
  B, C, V = logits_BCV.shape
  scaled_NV = jax.lax.stop_gradient(logits_BCV.astype(jnp.float32) / temperature)
  keep_NV = jax.vmap(support)(scaled_NV.reshape(B * C, V), top_k_BC.reshape(-1),
                              top_p_BC.reshape(-1))
  return keep_NV.reshape(B, C, V) | (jnp.arange(V) == next_BC[..., None])


def chunk_len(B: int, T: int, V: int, max_logits: int = MAX_CHUNK_LOGITS) -> int:
  """Positions per chunk: the largest divisor of T with B * chunk * V <= max_logits (>= 1)."""
  return max((c for c in range(1, T + 1) if T % c == 0 and B * c * V <= max_logits), default=1)


def _next_logp_and_entropy(params, cfg, x_BTD, next_BT, temperature, max_logits, truncation):
  """Log-prob of `next_BT` and the entropy, predicted at every position of `x_BTD`;
  `truncation` is () or (top_k_BT, top_p_BT) of the tokens `next_BT`."""
  @jax.named_scope("logp")
  def one(x_BCD, next_BC, *truncation_BC):
    logits_BCV = unembed(params, cfg, x_BCD)
    keep_BCV = (scoring_support(logits_BCV, next_BC, temperature, *truncation_BC)
                if truncation_BC else None)
    return (token_logp(logits_BCV, next_BC, temperature, keep_BCV),
            entropy(logits_BCV, temperature, keep_BCV))

  B, T, D = x_BTD.shape
  # The support's sort and cumulative sum about double the [B, C, V] buffers a chunk holds.
  C = chunk_len(B, T, cfg.vocab_size, max_logits // 2 if truncation else max_logits)
  if C == T:
    return one(x_BTD, next_BT, *truncation)
  # Chunks run along T, so each holds every row and keeps the rows' sharding.
  to_chunks = lambda a_BT: a_BT.reshape(B, T // C, C, *a_BT.shape[2:]).swapaxes(0, 1)
  logp_nBC, ent_nBC = jax.lax.map(lambda xs: jax.checkpoint(one)(*xs),
                                  tuple(map(to_chunks, (x_BTD, next_BT, *truncation))))
  return logp_nBC.swapaxes(0, 1).reshape(B, T), ent_nBC.swapaxes(0, 1).reshape(B, T)


def logp_and_entropy(params, cfg: ModelConfig, tokens_BT, positions_BT, segment_ids_BT, *,
                     temperature: float = 1.0, top_k_BT=None, top_p_BT=None,
                     max_chunk_logits: int = MAX_CHUNK_LOGITS, rows=None,
                     kernels: str = "xla"):
  """Returns (logp_BT, entropy_BT), aligned so position t scores token t.

  entropy_BT[t] is the entropy of the distribution that predicted token t. With
  `top_k_BT` and `top_p_BT` (both or neither: the truncation each token was sampled
  with, 0 and 1 for none), both are of that distribution truncated to
  `scoring_support`; without, of the full softmax, at no cost for truncation. At most
  `max_chunk_logits` float32 logits exist at a time (see `chunk_len`). `rows` and
  `kernels`: as `models.hidden`'s.
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
  logp, ent = _next_logp_and_entropy(params, cfg, x_BTD, next_BT, temperature,
                                     max_chunk_logits, truncation)
  # Position 0 of a segment follows another segment (or padding) in the row; it is
  # zeroed so nothing downstream can mistake it for a prediction.
  first_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
  pad = ((0, 0), (1, 0))
  return (jnp.pad(jnp.where(first_BT, 0.0, logp[:, :-1]), pad),
          jnp.pad(jnp.where(first_BT, 0.0, ent[:, :-1]), pad))
