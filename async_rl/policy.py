"""Per-token log-probs and entropy of the policy on packed rows.

Position t of a packed row holds token t; its log-prob is that of token t given the
tokens before it in its segment, under softmax(logits / temperature). Position 0 of
each segment has no prediction and gets 0 (it is a prompt token, never in the loss).
The generator records behaviour log-probs with `token_logp` on the same logits, so
the two agree to float rounding.
"""

import jax
import jax.numpy as jnp

from async_rl.models import ModelConfig, forward


def token_logp(logits_BV, tokens_B, temperature):
  """Log-prob of `tokens_B` under softmax(logits / temperature); float32."""
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32) / temperature, axis=-1)
  return jnp.take_along_axis(logp_BV, tokens_B[..., None], axis=-1)[..., 0]


def entropy(logits_BV, temperature):
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32) / temperature, axis=-1)
  return -jnp.sum(jnp.exp(logp_BV) * logp_BV, axis=-1)


def logp_and_entropy(params, cfg: ModelConfig, tokens_BT, positions_BT, segment_ids_BT, *,
                     temperature: float = 1.0):
  """Returns (logp_BT, entropy_BT), aligned so position t scores token t.

  entropy_BT[t] is the entropy of the distribution that predicted token t.
  """
  logits_BTV = forward(params, cfg, tokens_BT, positions_BT, segment_ids_BT)[:, :-1]
  logp = token_logp(logits_BTV, tokens_BT[:, 1:], temperature)
  ent = entropy(logits_BTV, temperature)
  # Position 0 of a segment follows another segment (or padding) in the row; it is
  # zeroed so nothing downstream can mistake it for a prediction.
  first_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
  pad = ((0, 0), (1, 0))
  return (jnp.pad(jnp.where(first_BT, 0.0, logp), pad),
          jnp.pad(jnp.where(first_BT, 0.0, ent), pad))
