"""Per-token log-probs and entropy of the policy on packed rows.

Position t of a packed row holds token t; its log-prob is that of token t given the
tokens before it in its segment, under softmax(logits / temperature). Position 0 of
each segment has no prediction and gets 0 (it is a prompt token, never in the loss).
The generator records behaviour log-probs with `token_logp` on its logits, and the
trainer applies the same `token_logp` to the same `models.unembed` of the same hidden
states, so the two agree to float rounding.

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


def _log_softmax(logits_BV, temperature):
  return jax.nn.log_softmax(logits_BV.astype(jnp.float32) / temperature, axis=-1)


def token_logp(logits_BV, tokens_B, temperature):
  """Log-prob of `tokens_B` under softmax(logits / temperature); float32."""
  logp_BV = _log_softmax(logits_BV, temperature)
  return jnp.take_along_axis(logp_BV, tokens_B[..., None], axis=-1)[..., 0]


def entropy(logits_BV, temperature):
  logp_BV = _log_softmax(logits_BV, temperature)
  return -jnp.sum(jnp.exp(logp_BV) * logp_BV, axis=-1)


def chunk_len(B: int, T: int, V: int, max_logits: int = MAX_CHUNK_LOGITS) -> int:
  """Positions per chunk: the largest divisor of T with B * chunk * V <= max_logits (>= 1)."""
  return max((c for c in range(1, T + 1) if T % c == 0 and B * c * V <= max_logits), default=1)


def _next_logp_and_entropy(params, cfg, x_BTD, next_BT, temperature, max_logits):
  """Log-prob of `next_BT` and the entropy, predicted at every position of `x_BTD`."""
  @jax.named_scope("logp")
  def one(x_BCD, next_BC):
    logits_BCV = unembed(params, cfg, x_BCD)
    return token_logp(logits_BCV, next_BC, temperature), entropy(logits_BCV, temperature)

  B, T, D = x_BTD.shape
  C = chunk_len(B, T, cfg.vocab_size, max_logits)
  if C == T:
    return one(x_BTD, next_BT)
  # Chunks run along T, so each holds every row and keeps the rows' sharding.
  x_nBCD = x_BTD.reshape(B, T // C, C, D).swapaxes(0, 1)
  next_nBC = next_BT.reshape(B, T // C, C).swapaxes(0, 1)
  logp_nBC, ent_nBC = jax.lax.map(lambda xs: jax.checkpoint(one)(*xs), (x_nBCD, next_nBC))
  return logp_nBC.swapaxes(0, 1).reshape(B, T), ent_nBC.swapaxes(0, 1).reshape(B, T)


def logp_and_entropy(params, cfg: ModelConfig, tokens_BT, positions_BT, segment_ids_BT, *,
                     temperature: float = 1.0, max_chunk_logits: int = MAX_CHUNK_LOGITS,
                     rows=None, kernels: str = "xla"):
  """Returns (logp_BT, entropy_BT), aligned so position t scores token t.

  entropy_BT[t] is the entropy of the distribution that predicted token t. At most
  `max_chunk_logits` float32 logits exist at a time (see `chunk_len`). `rows` and
  `kernels`: as `models.hidden`'s.
  """
  x_BTD = hidden(params, cfg, tokens_BT, positions_BT, segment_ids_BT, rows=rows,
                 kernels=kernels)
  # The prediction at the last position has no next token: it scores token 0 and
  # is dropped by the shift below.
  next_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))
  logp, ent = _next_logp_and_entropy(params, cfg, x_BTD, next_BT, temperature,
                                     max_chunk_logits)
  # Position 0 of a segment follows another segment (or padding) in the row; it is
  # zeroed so nothing downstream can mistake it for a prediction.
  first_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
  pad = ((0, 0), (1, 0))
  return (jnp.pad(jnp.where(first_BT, 0.0, logp[:, :-1]), pad),
          jnp.pad(jnp.where(first_BT, 0.0, ent[:, :-1]), pad))
