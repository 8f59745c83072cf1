"""Policy log-probs: hand-checked alignment, packed == unpacked, temperature, chunked ==
unchunked (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np

from async_rl import models, policy
from conftest import two_layer_model


def _setup():
  cfg = two_layer_model(37)
  return cfg, models.init_params(cfg, jax.random.key(0))


# One program per length, not the forward's every primitive compiled op by op for each.
_forward = jax.jit(models.forward, static_argnums=1)


def _single(params, cfg, seq, temperature):
  T = len(seq)
  logits = _forward(params, cfg, seq[None], np.arange(T)[None], np.ones((1, T), int))[0]
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64) / temperature, axis=-1)
  return np.array([0.0] + [float(logp[t - 1, seq[t]]) for t in range(1, T)])


def test_packed_logp_equals_unpacked():
  cfg, params = _setup()
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, 37, n) for n in (6, 9, 3)]
  row = np.zeros(20, int); pos = np.zeros(20, int); seg = np.zeros(20, int)
  start = 0
  for i, s in enumerate(seqs):
    row[start:start + len(s)] = s
    pos[start:start + len(s)] = np.arange(len(s))
    seg[start:start + len(s)] = i + 1
    start += len(s)
  for temperature in (1.0, 0.7):
    logp, ent = policy.logp_and_entropy(params, cfg, row[None], pos[None], seg[None],
                                        temperature=temperature)
    start = 0
    for s in seqs:
      np.testing.assert_allclose(logp[0, start:start + len(s)],
                                 _single(params, cfg, s, temperature), atol=2e-5)
      assert np.all(ent[0, start + 1:start + len(s)] > 0)
      start += len(s)
    assert logp[0, 0] == 0 and ent[0, 0] == 0


def test_entropy_of_uniform_logits_is_log_vocab():
  np.testing.assert_allclose(policy.entropy(np.zeros((2, 37)), 1.0), np.log(37), rtol=1e-6)
  np.testing.assert_allclose(policy.token_logp(np.zeros((1, 37)), np.array([3]), 0.5),
                             -np.log(37), rtol=1e-6)


def test_chunk_len():
  # The largest divisor of T whose chunk keeps B * C * V logits under the cap.
  assert policy.chunk_len(B=2, T=20, V=37, max_logits=2 * 20 * 37) == 20
  assert policy.chunk_len(B=2, T=20, V=37, max_logits=2 * 19 * 37) == 10
  assert policy.chunk_len(B=2, T=20, V=37, max_logits=2 * 4 * 37) == 4
  assert policy.chunk_len(B=2, T=7, V=37, max_logits=2 * 6 * 37) == 1
  assert policy.chunk_len(B=16, T=1024, V=151936) == 32  # 2^27 float32 logits


def test_chunked_logp_and_gradients_equal_unchunked():
  cfg, params = _setup()
  rng = np.random.default_rng(1)
  B, T = 2, 20
  tokens = rng.integers(0, 37, (B, T))
  pos = np.concatenate([np.arange(12), np.arange(8)])[None].repeat(B, 0)
  seg = np.concatenate([np.full(12, 1), np.full(8, 2)])[None].repeat(B, 0)
  weights = rng.normal(size=(2, B, T))

  def loss(params, max_chunk_logits):
    logp, ent = policy.logp_and_entropy(params, cfg, tokens, pos, seg, temperature=0.7,
                                        max_chunk_logits=max_chunk_logits)
    return jnp.sum(weights[0] * logp + weights[1] * ent), (logp, ent)

  run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, (logp_1, ent_1)), grads_1 = run(params, B * T * 37)      # one chunk: T positions
  (_, (logp_5, ent_5)), grads_5 = run(params, B * 4 * 37)      # five chunks of 4
  assert policy.chunk_len(B, T, 37, B * 4 * 37) == 4
  np.testing.assert_allclose(logp_5, logp_1, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(ent_5, ent_1, atol=1e-6, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_5), jax.tree.leaves(grads_1)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
  # Both equal the logits path the generator's `token_logp` uses.
  for row in range(B):
    start = 0
    for n in (12, 8):
      s = tokens[row, start:start + n]
      np.testing.assert_allclose(logp_5[row, start:start + n], _single(params, cfg, s, 0.7),
                                 atol=2e-5)
      start += n


def test_truncated_scoring_renormalises_over_the_support_chunked_as_unchunked():
  cfg, params = _setup()
  rng = np.random.default_rng(2)
  B, T = 2, 20
  tokens = rng.integers(0, 37, (B, T))
  pos = np.arange(T)[None].repeat(B, 0)
  seg = np.ones((B, T), int)
  top_k = np.where(rng.random((B, T)) < 0.5, 5, 0).astype(np.int32)
  top_p = np.where(rng.random((B, T)) < 0.5, 0.6, 1.0).astype(np.float32)
  weights = rng.normal(size=(2, B, T))

  def loss(params, max_chunk_logits):
    logp, ent = policy.logp_and_entropy(params, cfg, tokens, pos, seg, temperature=0.7,
                                        top_k_BT=top_k, top_p_BT=top_p,
                                        max_chunk_logits=max_chunk_logits)
    return jnp.sum(weights[0] * logp + weights[1] * ent), (logp, ent)

  run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, (logp_1, ent_1)), grads_1 = run(params, 2 * B * T * 37)
  (_, (logp_5, ent_5)), grads_5 = run(params, 2 * B * 4 * 37)
  np.testing.assert_allclose(logp_5, logp_1, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(ent_5, ent_1, atol=1e-6, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_5), jax.tree.leaves(grads_1)):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
  # By hand: softmax over the support of each position's logits, plus the token.
  logits = np.asarray(models.forward(params, cfg, tokens, pos, seg), np.float64) / 0.7
  for b in range(B):
    for t in range(1, T):
      scaled = logits[b, t - 1]
      order = np.argsort(-scaled)
      k = top_k[b, t] or 37
      probs = np.exp(scaled[order[:k]] - scaled[order[:k]].max())
      probs /= probs.sum()
      kept = order[:k][np.cumsum(probs) - probs < top_p[b, t]] if top_p[b, t] < 1 else order[:k]
      keep = set(kept.tolist()) | {int(tokens[b, t])}
      z = np.log(np.sum(np.exp(scaled[list(keep)])))
      np.testing.assert_allclose(logp_1[b, t], scaled[tokens[b, t]] - z, atol=2e-5)
  # Without truncation fields the full softmax: the truncated log-probs are no lower.
  full, _ = policy.logp_and_entropy(params, cfg, tokens, pos, seg, temperature=0.7)
  assert np.all(np.asarray(logp_1) >= np.asarray(full) - 1e-6)
  truncated = (top_k > 0) | (top_p < 1)
  assert np.all(np.asarray(logp_1)[~truncated] == np.asarray(full)[~truncated])


def test_scored_tokens_only_equal_every_token_and_skip_the_rest():
  cfg, params = _setup()
  rng = np.random.default_rng(3)
  B, T = 2, 32
  tokens = rng.integers(0, 37, (B, T))
  pos = np.concatenate([np.arange(20), np.arange(12)])[None].repeat(B, 0)
  seg = np.concatenate([np.full(20, 1), np.full(12, 2)])[None].repeat(B, 0)
  # Prompts of 10 and 4 tokens, and one row's second sequence unscored.
  scored = np.concatenate([np.arange(20) >= 10, np.arange(12) >= 4])[None].repeat(B, 0)
  scored[1, 20:] = False
  weights = rng.normal(size=(2, B, T))

  def loss(params, scored_BT):
    logp, ent = policy.logp_and_entropy(params, cfg, tokens, pos, seg, temperature=0.7,
                                        scored_BT=scored_BT)
    return jnp.sum(jnp.where(scored, weights[0] * logp + weights[1] * ent, 0.0)), (logp, ent)

  run = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, (logp_all, ent_all)), grads_all = run(params, None)
  (_, (logp, ent)), grads = run(params, scored)
  np.testing.assert_allclose(np.where(scored, logp_all, 0.0), logp, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(np.where(scored, ent_all, 0.0), ent, atol=1e-6, rtol=1e-6)
  # The chunks differ (4 positions, in another order, against 32), so the head's gradient
  # sums its 64 positions' terms in another order: float32 rounding of a few 1e-6.
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_all)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # Chunks of T / SKIP_CHUNKS = 4 positions: the 18 columns some row needs (the
  # predictions at 9..18 and 23..30) first, in 5 chunks; the other 3 are skipped.
  needed = np.pad(scored[:, 1:], ((0, 0), (0, 1)))
  C, order, active = policy.chunk_plan(B, T, 37, policy.MAX_CHUNK_LOGITS, needed)
  assert C == 4 and list(active) == [True] * 5 + [False] * 3
  assert list(order[:18]) == list(range(9, 19)) + list(range(23, 31))
