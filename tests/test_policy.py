"""Policy log-probs: hand-checked alignment, packed == unpacked, temperature."""

import jax
import numpy as np

from async_rl import models, policy


def _setup():
  cfg = models.ModelConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, d_ff=64)
  return cfg, models.init_params(cfg, jax.random.key(0))


def _single(params, cfg, seq, temperature):
  T = len(seq)
  logits = models.forward(params, cfg, seq[None], np.arange(T)[None], np.ones((1, T), int))[0]
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
