"""Train step: micro-batched == full batch, non-finite skip, no recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from async_rl import batching, loss, models, sharding, train_step
from async_rl.config import MeshConfig, OptimizerConfig

CFG = models.ModelConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, d_ff=64)
LOSS = loss.make_loss("decoupled_ppo", eps_clip=0.2, c_clip=3.0, behav_imp_weight_cap=5.0)


def _seqs(n, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    p, c = int(rng.integers(2, 6)), int(rng.integers(1, 12))
    out.append(batching.Sequence(
        tokens=rng.integers(0, 53, p + c), prompt_len=p,
        behav_logp=rng.normal(-3.0, 0.3, c).astype(np.float32),
        versions=np.zeros(c, np.int32), advantage=float(rng.normal())))
  return out


def _state(mesh, tx):
  return train_step.create_train_state(CFG, tx, mesh, jax.random.key(0))


def _with_prox(batch, params):
  prox = train_step.recompute_logp(params, batch, model_cfg=CFG)
  return batch.replace(prox_logp=np.asarray(prox) + 0.05 * batch.loss_mask)


def _update(mesh, batch, tx):
  state = _state(mesh, tx)
  step = train_step.jit_train_step(mesh, train_step.train_state_shardings(
      jax.eval_shape(lambda: state), mesh), model_cfg=CFG, loss_fn=LOSS)
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = step(state, _with_prox(batch, state.params))
  return jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, before), metrics, step


def test_micro_batched_update_equals_full_batch():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  seqs = _seqs(12)
  whole = batching.pack(seqs, [list(range(12))], rows_per_mb=1, row_len=256)
  groups = batching.ffd_allocate([len(s) for s in seqs], 24)
  split = batching.pack(seqs, groups, rows_per_mb=2, row_len=24)
  assert split.tokens.shape[0] > 2
  tx = optax.sgd(1.0)
  delta_whole, m_whole, _ = _update(mesh, whole, tx)
  delta_split, m_split, _ = _update(mesh, split, tx)
  for a, b in zip(jax.tree.leaves(delta_whole), jax.tree.leaves(delta_split)):
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a)
  for k in ("loss", "clip_fraction", "approx_kl", "entropy", "num_tokens"):
    np.testing.assert_allclose(m_split[k], m_whole[k], rtol=1e-5, atol=1e-7)
  assert int(m_whole["skipped"]) == 0


def test_non_finite_gradient_skips_update():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = batching.pack_dynamic(_seqs(6), max_tokens_per_mb=32, num_shards=1,
                                row_buckets=(32,))
  state = _state(mesh, train_step.make_optimizer(OptimizerConfig()))
  batch = _with_prox(batch, state.params)
  bad = batch.replace(advantages=np.where(batch.loss_mask > 0, np.nan, 0.0).astype(np.float32))
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = train_step.train_step(state, bad, model_cfg=CFG, loss_fn=LOSS)
  assert int(metrics["skipped"]) == 1 and int(new.step) == 0
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  new, metrics = train_step.train_step(state, batch, model_cfg=CFG, loss_fn=LOSS)
  assert int(metrics["skipped"]) == 0 and int(new.step) == 1


def test_all_empty_batch_is_a_finite_no_op_gradient():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = batching.pack(_seqs(2), [[], []], rows_per_mb=1, row_len=16)
  delta, metrics, _ = _update(mesh, batch, optax.sgd(1.0))
  assert float(metrics["loss"]) == 0.0 and int(metrics["skipped"]) == 0
  assert all(np.all(d == 0) for d in jax.tree.leaves(delta))


def test_no_recompilation_for_a_second_batch_in_the_same_bucket():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  tx = train_step.make_optimizer(OptimizerConfig())
  state = _state(mesh, tx)
  shardings = train_step.train_state_shardings(jax.eval_shape(lambda: state), mesh)
  step = train_step.jit_train_step(mesh, shardings, model_cfg=CFG, loss_fn=LOSS)
  kw = dict(max_tokens_per_mb=32, num_shards=1, row_buckets=(32,))
  b1 = batching.pack_dynamic(_seqs(5, seed=1), **kw)
  b2 = batching.pack_dynamic(_seqs(5, seed=2), **kw)
  assert b1.tokens.shape == b2.tokens.shape
  state, _ = step(state, b1)
  state, _ = step(state, b2)
  assert step._cache_size() == 1
  assert int(state.step) == 2
