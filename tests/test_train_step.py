"""Train step: micro-batched == full batch, non-finite skip (the version protocol), no
recompilation; the KL and entropy terms through the step, the reference policy kept."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from async_rl import batching, loss, models, off_policy, sharding, train_step
from async_rl.cpu import train_step as cpu_train_step
from async_rl.config import MeshConfig, OptimizerConfig
from async_rl.trajectory import Trajectory
from conftest import compiles, two_layer_model

CFG = two_layer_model(53)
LOSS = loss.make_loss("decoupled_ppo", eps_clip=0.2, c_clip=3.0, rejection_upper=5.0)
KL_BETA, ENTROPY_COEF = 0.5, 0.05
REG_LOSS = loss.make_loss("decoupled_ppo", eps_clip=0.2, c_clip=3.0, rejection_upper=5.0,
                          kl_beta=KL_BETA, kl_estimator="k2", entropy_coef=ENTROPY_COEF)


def _seqs(n, seed=0):
  """n random single-turn trajectories and their advantages."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    p, c = int(rng.integers(2, 6)), int(rng.integers(1, 12))
    tokens = rng.integers(0, 53, p + c)
    out.append(Trajectory.from_completion(tokens[:p], tokens[p:], rng.normal(-3.0, 0.3, c),
                                          np.zeros(c, np.int32), "stop"))
  return out, rng.normal(size=n)


def _pack_dynamic(n, seed=0, **kw):
  return batching.pack_dynamic(*_seqs(n, seed), **kw)


def _state(mesh, tx):
  return train_step.create_train_state(CFG, tx, mesh, jax.random.key(0))[0]


def _prox(batch, params):
  prox = train_step.recompute_logp(params, batch, model_cfg=CFG)
  return np.asarray(prox) + 0.05 * batch.loss_mask


def _with_ref(batch):
  """`batch` with reference log-probs under another init, so that the KL is not 0."""
  ref_params = models.init_params(CFG, jax.random.key(1))
  return batch.replace(ref_logp=np.asarray(train_step.recompute_logp(ref_params, batch,
                                                                     model_cfg=CFG)))


def _update(mesh, batch, tx, loss_fn=LOSS):
  state = _state(mesh, tx)
  step = train_step.jit_train_step(mesh, train_step.train_state_shardings(
      jax.eval_shape(lambda: state), mesh), model_cfg=CFG, loss_fn=loss_fn)
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = step(state, batch, _prox(batch, state.params))
  return jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, before), metrics, step


def test_micro_batched_update_equals_full_batch():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  seqs, adv = _seqs(12)
  whole = batching.pack(seqs, adv, [list(range(12))], rows_per_mb=1, row_len=256)
  groups = batching.ffd_allocate([len(s) for s in seqs], 24)
  split = batching.pack(seqs, adv, groups, rows_per_mb=2, row_len=24)
  assert split.tokens.shape[0] > 2
  tx = optax.sgd(1.0)
  delta_whole, m_whole, _ = _update(mesh, whole, tx)
  delta_split, m_split, _ = _update(mesh, split, tx)
  for a, b in zip(jax.tree.leaves(delta_whole), jax.tree.leaves(delta_split)):
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a)
  for k in ("loss", "clip_fraction", "approx_kl", "entropy", "num_tokens"):
    np.testing.assert_allclose(m_split[k], m_whole[k], rtol=1e-5, atol=1e-7)
  assert int(m_whole["skipped"]) == 0


@pytest.mark.parametrize("poison", ["advantages", "behav_logp", "prox"])
def test_non_finite_step_changes_nothing_but_the_step_count(poison):
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = _pack_dynamic(6, max_tokens_per_mb=32, num_shards=1, row_buckets=(32,))
  state = _state(mesh, train_step.make_optimizer(OptimizerConfig()))
  # Without the behaviour-weight cap: the cap masks a token whose weight is NaN.
  step = jax.jit(functools.partial(train_step.train_step, model_cfg=CFG,
                                   loss_fn=loss.make_loss("decoupled_ppo", eps_clip=0.2)))
  prox = _prox(batch, state.params)
  state, metrics = step(state, batch, prox)  # one good step, so the moments are non-zero
  assert int(metrics["skipped"]) == 0 and int(state.step) == 1
  nan_on_mask = np.where(batch.loss_mask > 0, np.nan, 0.0).astype(np.float32)
  if poison == "prox":
    bad, bad_prox = batch, nan_on_mask
  else:
    bad, bad_prox = batch.replace(**{poison: nan_on_mask}), prox
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  new, metrics = step(state, bad, bad_prox)
  assert int(metrics["skipped"]) == 1
  assert int(new.step) == 2, "a skipped step still counts as a training step"
  after = jax.tree.map(np.asarray, (new.params, new.opt_state))
  count_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(before)[0]]
  for path, a, b in zip(count_paths, jax.tree.leaves(after), jax.tree.leaves(before)):
    name = jax.tree_util.keystr(path)
    if "notfinite" in name or "last_finite" in name:
      continue  # apply_if_finite's own counters record the skip
    np.testing.assert_array_equal(a, b, err_msg=name)
  assert int(new.opt_state.total_notfinite) == 1
  new, metrics = step(new, batch, prox)
  assert int(metrics["skipped"]) == 0 and int(new.step) == 3
  assert int(new.opt_state.notfinite_count) == 0


def test_non_finite_steps_are_skipped_however_many_in_a_row():
  # apply_if_finite would apply a non-finite update after max_consecutive_errors
  # skips; the train step never lets it (the loop stops the run instead).
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = _pack_dynamic(3, max_tokens_per_mb=32, num_shards=1, row_buckets=(32,))
  state = _state(mesh, optax.sgd(1.0))
  bad = batch.replace(advantages=np.full_like(batch.advantages, np.inf))
  step = jax.jit(functools.partial(train_step.train_step, model_cfg=CFG, loss_fn=LOSS))
  before = jax.tree.map(np.asarray, state.params)
  for _ in range(12):
    state, metrics = step(state, bad, batch.behav_logp)
    assert int(metrics["skipped"]) == 1
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)


def test_all_empty_batch_is_a_finite_no_op_gradient():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = batching.pack(*_seqs(2), [[], []], rows_per_mb=1, row_len=16)
  delta, metrics, _ = _update(mesh, batch, optax.sgd(1.0))
  assert float(metrics["loss"]) == 0.0 and int(metrics["skipped"]) == 0
  assert all(np.all(d == 0) for d in jax.tree.leaves(delta))


def test_learning_rate_zero_leaves_the_params_as_they_are():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = _pack_dynamic(6, max_tokens_per_mb=32, num_shards=1, row_buckets=(32,))
  tx = train_step.make_optimizer(OptimizerConfig(learning_rate=0.0, weight_decay=0.1))
  delta, metrics, _ = _update(mesh, batch, tx)
  assert float(metrics["loss"]) != 0.0 and int(metrics["skipped"]) == 0
  assert all(np.all(d == 0) for d in jax.tree.leaves(delta))


def test_no_recompilation_for_a_second_batch_in_the_same_bucket():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  tx = train_step.make_optimizer(OptimizerConfig())
  state = _state(mesh, tx)
  shardings = train_step.train_state_shardings(jax.eval_shape(lambda: state), mesh)
  step = train_step.jit_train_step(mesh, shardings, model_cfg=CFG, loss_fn=LOSS)
  kw = dict(max_tokens_per_mb=32, num_shards=1, row_buckets=(32,))
  b1 = _pack_dynamic(5, seed=1, **kw)
  b2 = _pack_dynamic(5, seed=2, **kw)
  assert b1.tokens.shape == b2.tokens.shape
  with compiles("train_step") as programs:
    state, _ = step(state, b1, b1.behav_logp)
    state, _ = step(state, b2, b2.behav_logp)
  assert len(programs) == 1
  assert int(state.step) == 2


@pytest.mark.parametrize("kernels", [None, "gpu"])
def test_the_step_traces_the_kernels_it_is_built_with(kernels):
  """By default those of the mesh's CPU devices (plain XLA); built with "gpu", the
  Pallas kernel, on this CPU-only host all the same."""
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  state = _state(mesh, optax.sgd(0.1))
  shardings = train_step.train_state_shardings(jax.eval_shape(lambda: state), mesh)
  fns = train_step.jit_steps(mesh, shardings, model_cfg=CFG, loss_fn=LOSS, kernels=kernels)
  batch = _pack_dynamic(3, max_tokens_per_mb=32, num_shards=1, row_buckets=(32,))
  for traced in (fns.step.trace(state, batch, batch.behav_logp),
                 fns.recompute.trace(state.params, batch)):
    assert ("pallas_call" in str(traced.jaxpr)) == (kernels == "gpu")


def _versioned_batch(n_seqs, num_shards, budget, seed=3):
  """A batch whose tokens have versions 0..2 (the step runs at version 2)."""
  trajs, adv = _seqs(n_seqs, seed)
  rng = np.random.default_rng(seed)
  trajs = [dataclasses.replace(t, versions_T=np.where(
      t.versions_T >= 0, rng.integers(0, 3, len(t)), -1).astype(np.int32)) for t in trajs]
  return batching.pack_dynamic(trajs, adv, max_tokens_per_mb=budget, num_shards=num_shards,
                               row_buckets=(budget,), with_versions=True)


def _at_version(state, v):
  return state.replace(step=jnp.asarray(v, jnp.int32))


def test_minibatches_are_sequential_updates_on_strided_micro_batches():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = _versioned_batch(12, num_shards=1, budget=24)
  M = batch.tokens.shape[0]
  assert M % 2 == 0 and M >= 4
  state = _state(mesh, optax.sgd(1.0))
  prox = _prox(batch, state.params)
  step = jax.jit(functools.partial(train_step.train_step, model_cfg=CFG, loss_fn=LOSS),
                 static_argnames="num_minibatches")
  both, metrics = step(state, batch, prox, num_minibatches=2)
  assert int(both.step) == 1 and int(metrics["applied_updates"]) == 2
  manual = state
  for k in range(2):
    sub = jax.tree.map(lambda x: x[k::2], batch)
    manual, _ = step(manual, sub, prox[k::2])
  for a, b in zip(jax.tree.leaves(both.params), jax.tree.leaves(manual.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert float(metrics["num_tokens"]) == float(batch.loss_mask.sum())
  with pytest.raises(ValueError, match="do not split into 3 minibatches"):
    step(state, batch, prox, num_minibatches=3)
  padded = batching.pad_micro_batches(batch, 3)
  assert padded.tokens.shape[0] % 3 == 0
  _, metrics = step(state, padded, batching.pad_micro_batches(
      batch.replace(behav_logp=prox), 3).behav_logp, num_minibatches=3)
  assert int(metrics["applied_updates"]) == 3 and int(metrics["skipped"]) == 0


def test_loglinear_with_one_minibatch_equals_recompute():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = _versioned_batch(8, num_shards=2, budget=32)
  state = _at_version(_state(mesh, optax.sgd(1.0)), 2)
  step = functools.partial(train_step.train_step, model_cfg=CFG, loss_fn=LOSS)
  exact = train_step.recompute_logp(state.params, batch, model_cfg=CFG)
  a, ma = step(state, batch, exact)
  b, mb = step(state, batch, None)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-5)


def test_loglinear_second_minibatch_interpolates_from_the_moved_params():
  # Reference: update 1 with the exact π_prox, then update 2 with log π_behav +
  # α (log π_θ1 - log π_behav), α = lag / (lag + 1/2), log π_θ1 recomputed.
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = _versioned_batch(12, num_shards=1, budget=24)
  state = _at_version(_state(mesh, optax.sgd(1.0)), 2)
  step = functools.partial(train_step.train_step, model_cfg=CFG, loss_fn=LOSS)
  got, _ = step(state, batch, None, num_minibatches=2)
  first = jax.tree.map(lambda x: x[0::2], batch)
  second = jax.tree.map(lambda x: x[1::2], batch)
  ref, _ = step(state, first, train_step.recompute_logp(state.params, first, model_cfg=CFG))
  theta1 = train_step.recompute_logp(ref.params, second, model_cfg=CFG)
  prox2 = off_policy.loglinear_prox_logp(theta1, second.behav_logp, second.versions,
                                         prox_version=2, theta_version=2.5)
  ref, _ = step(ref, second, prox2)
  for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("threads, n, prox_mode", [(2, 1, "recompute"), (3, 2, "loglinear"),
                                                   (2, 2, "behav"), (1, 1, "behav")])
def test_threaded_step_equals_the_fused_step(threads, n, prox_mode):
  # cpu.grad_threads: each update's micro-batches shared among threads, then summed.
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = batching.pad_micro_batches(_versioned_batch(14, num_shards=1, budget=24), n * threads)
  assert batch.tokens.shape[0] >= 2 * n * threads and not batch.loss_mask[-1].any()
  tx = train_step.make_optimizer(OptimizerConfig())
  state = _at_version(_state(mesh, tx), 2)
  shardings = train_step.train_state_shardings(jax.eval_shape(lambda: state), mesh)
  prox = {"recompute": _prox(batch, state.params), "behav": batch.behav_logp,
          "loglinear": None}[prox_mode]
  fused = train_step.jit_train_step(mesh, shardings, model_cfg=CFG, loss_fn=LOSS,
                                    num_minibatches=n)
  threaded = cpu_train_step.ThreadedTrainStep(mesh, shardings, threads=threads, model_cfg=CFG,
                                              loss_fn=LOSS, num_minibatches=n)
  copy = functools.partial(jax.tree.map, jnp.copy)  # Each step donates its state.
  bad = batch.replace(advantages=np.where(batch.loss_mask, np.inf, 0.0).astype(np.float32))
  for b in (batch, bad, batch):
    (want, want_m), (got, got_m) = fused(copy(state), b, prox), threaded(copy(state), b, prox)
    assert int(got.step) == int(want.step) == 3
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    assert got_m.keys() == want_m.keys()
    for k in want_m:
      np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert int(got_m["skipped"]) == (b is bad)
    state = got.replace(step=state.step)
  assert int(want_m["applied_updates"]) == n
  if n * threads > 1:
    with pytest.raises(ValueError, match="do not split"):
      threaded(state, jax.tree.map(lambda x: x[:-1], batch), None)


@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_recompute_equals_recompute_logp(threads):
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = batching.pad_micro_batches(_versioned_batch(14, num_shards=1, budget=24), threads)
  params = _state(mesh, optax.sgd(1.0)).params
  threaded = cpu_train_step.ThreadedRecompute(threads=threads, model_cfg=CFG)
  np.testing.assert_allclose(threaded(params, batch),
                             train_step.recompute_logp(params, batch, model_cfg=CFG),
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="do not split"):
    threaded(params, jax.tree.map(lambda x: x[:-1], batch))


def test_kl_and_entropy_terms_reach_the_update_and_micro_batch_like_the_loss():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  seqs, adv = _seqs(12)
  whole = _with_ref(batching.pack(seqs, adv, [list(range(12))], rows_per_mb=1, row_len=256))
  split = _with_ref(batching.pack(seqs, adv, batching.ffd_allocate([len(s) for s in seqs], 24),
                                  rows_per_mb=2, row_len=24))
  tx = optax.sgd(1.0)
  delta_plain, m_plain, _ = _update(mesh, whole, tx)
  delta_whole, m_whole, _ = _update(mesh, whole, tx, REG_LOSS)
  delta_split, m_split, _ = _update(mesh, split, tx, REG_LOSS)
  for a, b in zip(jax.tree.leaves(delta_whole), jax.tree.leaves(delta_split)):
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a)
  for k in ("loss", "kl", "entropy", "num_tokens"):
    np.testing.assert_allclose(m_split[k], m_whole[k], rtol=1e-5, atol=1e-7)
  assert float(m_whole["kl"]) > 0.01
  np.testing.assert_allclose(
      m_whole["loss"],
      m_plain["loss"] + KL_BETA * m_whole["kl"] - ENTROPY_COEF * m_whole["entropy"], rtol=1e-5)
  moved = sum(np.linalg.norm(a - b) for a, b in zip(jax.tree.leaves(delta_whole),
                                                      jax.tree.leaves(delta_plain)))
  assert moved > 1e-3 * sum(np.linalg.norm(a) for a in jax.tree.leaves(delta_plain))


def test_the_reference_is_a_frozen_copy_that_the_fused_and_threaded_steps_carry():
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  batch = _with_ref(batching.pad_micro_batches(_versioned_batch(14, num_shards=1, budget=24), 2))
  tx = train_step.make_optimizer(OptimizerConfig())
  state, shardings = train_step.create_train_state(CFG, tx, mesh, jax.random.key(0),
                                                   reference=True)
  ref = jax.tree.map(np.asarray, state.ref_params)
  for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(x, y)
  fused = train_step.jit_train_step(mesh, shardings, model_cfg=CFG, loss_fn=REG_LOSS)
  threaded = cpu_train_step.ThreadedTrainStep(mesh, shardings, threads=2, model_cfg=CFG,
                                              loss_fn=REG_LOSS)
  prox = _prox(batch, state.params)
  copy = functools.partial(jax.tree.map, jnp.copy)  # Each step donates its state.
  (want, want_m), (got, got_m) = fused(copy(state), batch, prox), threaded(state, batch, prox)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got_m["kl"], want_m["kl"], rtol=1e-5)
  for x, y, p in zip(jax.tree.leaves(ref), jax.tree.leaves(got.ref_params),
                     jax.tree.leaves(got.params)):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, p) for x, p in zip(jax.tree.leaves(ref),
                                                      jax.tree.leaves(got.params)))
