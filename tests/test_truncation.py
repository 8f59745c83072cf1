"""One distribution on both sides: top-k / top-p samples scored by the trainer on the
support they were drawn from, through the real engine -> trajectory -> packing ->
policy path; and the step's mismatch metrics, within the rounding bound of the dtype."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

from async_rl import batching, loss, models, policy, sharding, train_step
from async_rl.config import MeshConfig, ModelConfig
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.rl import entry
from async_rl.trajectory import Trajectory
from rl_test_utils import small_config

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=8, d_ff=64)
ROW = 64
LOSS = loss.make_loss("decoupled_ppo", eps_clip=0.2)


def _generate(cfg, params, sampling, seed=0):
  engine = Engine(cfg, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=40,
                  steps_per_call=8)
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, cfg.vocab_size, rng.integers(2, 12)).tolist() for _ in range(3)]
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(Request(i, p, n=2, sampling=sampling)) for i, p in enumerate(prompts)]
    return [t for f in futures for t in f.result(timeout=120)]


def _pack(trajs):
  return batching.pack_dynamic(trajs, np.ones(len(trajs), np.float32), max_tokens_per_mb=ROW,
                               num_shards=1, row_buckets=(ROW,), with_versions=True)


def _step(cfg, params, batch, temperature):
  """The decoupled-PPO step on `batch` at version 0, from `params`; its metrics and
  the proximal log-probs it was given."""
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  state, _ = train_step.create_train_state(cfg, optax.sgd(0.1), mesh, jax.random.key(0),
                                           params=params)
  prox = train_step.recompute_logp(state.params, batch, model_cfg=cfg, temperature=temperature)
  step = jax.jit(lambda s, b, p: train_step.train_step(s, b, p, model_cfg=cfg, loss_fn=LOSS,
                                                       temperature=temperature))
  return jax.device_get(step(state, batch, prox)[1]), np.asarray(prox)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_behaviour_and_recomputed_logp_agree_under_truncation(dtype):
  cfg = dataclasses.replace(CFG, dtype=dtype)
  params = models.init_params(cfg, jax.random.key(3))
  sampling = SamplingParams(temperature=0.8, top_k=12, top_p=0.7, max_new_tokens=20, seed=5)
  trajs = _generate(cfg, params, sampling)
  assert all((t.top_k, t.top_p) == (12, 0.7) for t in trajs)
  batch = _pack(trajs)
  assert batch.top_k is not None
  metrics, prox = _step(cfg, params, batch, 0.8)
  mask = batch.loss_mask > 0
  bound = policy.LOGP_ROUNDING[dtype]
  assert np.abs(prox[mask] - batch.behav_logp[mask]).max() <= bound
  # Every trained token was made by the step's version (0): all are measured.
  assert metrics["mismatch_tokens"] == mask.sum()
  assert metrics["mismatch_abs_max"] <= bound
  assert abs(metrics["mismatch_mean"]) <= bound and 0 <= metrics["mismatch_k3"] <= bound ** 2
  # Truncation matters here: the full softmax scores the same tokens far lower.
  full = train_step.recompute_logp(params, batch.replace(top_k=None, top_p=None),
                                   model_cfg=cfg, temperature=0.8)
  assert np.mean(np.asarray(full)[mask] - batch.behav_logp[mask]) < -0.1


def test_a_drawn_token_is_always_in_the_trainers_support():
  params = models.init_params(CFG, jax.random.key(4))
  sampling = SamplingParams(temperature=1.0, top_k=6, top_p=0.6, max_new_tokens=24, seed=9)
  batch = _pack(_generate(CFG, params, sampling, seed=1))
  tokens, mask = batch.tokens[0], batch.loss_mask[0] > 0
  x = models.hidden(params, CFG, tokens, batch.positions[0], batch.segment_ids[0])
  scaled = np.asarray(models.unembed(params, CFG, x), np.float32)[:, :-1]  # temperature 1
  R, T1, V = scaled.shape
  keep = np.asarray(jax.vmap(policy.support)(scaled.reshape(-1, V),
                                             batch.top_k[0][:, 1:].reshape(-1),
                                             batch.top_p[0][:, 1:].reshape(-1))).reshape(R, T1, V)
  in_support = np.take_along_axis(keep, tokens[:, 1:, None], -1)[..., 0]
  assert mask[:, 1:].sum() > 20 and in_support[mask[:, 1:]].all()
  # The support is a real truncation: far fewer than V tokens.
  assert keep[mask[:, 1:]].sum(-1).max() <= 6


def test_full_softmax_flag_records_and_scores_the_full_softmax():
  params = models.init_params(CFG, jax.random.key(3))
  sampling = SamplingParams(temperature=0.8, top_k=12, top_p=0.7, max_new_tokens=20, seed=5,
                            truncated_logp=False)
  trajs = _generate(CFG, params, sampling)
  assert all(not t.truncated for t in trajs)
  batch = _pack(trajs)
  assert batch.top_k is None  # today's computation: no truncation in the trainer
  metrics, _ = _step(CFG, params, batch, 0.8)
  assert metrics["mismatch_abs_max"] <= policy.LOGP_ROUNDING["float32"]


def test_mismatch_metrics_hand_case():
  logp = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
  behav = np.array([[-1.1, -2.0, -0.3, -9.0]], np.float32)
  on = np.array([[True, True, True, False]])
  m = train_step.mismatch(logp, behav, on, 4.0)
  d = np.array([0.1, 0.0, -0.2])
  np.testing.assert_allclose(m["mismatch_mean"], d.sum() / 4, rtol=1e-5)
  np.testing.assert_allclose(m["mismatch_k3"], (np.exp(d) - 1 - d).sum() / 4, rtol=1e-4)
  np.testing.assert_allclose(m["mismatch_abs_max"], 0.2, rtol=1e-5)
  np.testing.assert_allclose(m["mismatch_tokens"], 3 / 4)


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_the_step_measures_the_mismatch_of_its_own_versions_tokens(num_minibatches):
  params = models.init_params(CFG, jax.random.key(5))
  rng = np.random.default_rng(0)
  trajs = [dataclasses.replace(t, top_k=7) for t in (
      Trajectory.from_completion(rng.integers(0, 61, 3), rng.integers(0, 61, 6),
                                          np.zeros(6), np.full(6, v), "stop")
      for v in (0, 0, 1, 0))]
  batch = batching.pack(trajs, np.ones(4), [[0], [1], [2], [3]], rows_per_mb=1, row_len=16,
                        with_versions=True)
  exact = np.asarray(train_step.recompute_logp(params, batch, model_cfg=CFG, temperature=0.8))
  # Behaviour log-probs off by a known d per micro-batch (by -0.1, 0.2, 5, 0.3).
  offset = np.array([-0.1, 0.2, 5.0, 0.3])[:, None, None]
  batch = batch.replace(behav_logp=(exact - offset) * batch.loss_mask)
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  state, _ = train_step.create_train_state(CFG, optax.sgd(0.1), mesh, jax.random.key(0),
                                           params=params)
  metrics = jax.device_get(jax.jit(lambda s, b, p: train_step.train_step(
      s, b, p, model_cfg=CFG, loss_fn=LOSS, temperature=0.8,
      num_minibatches=num_minibatches))(state, batch, exact)[1])
  # Micro-batch 2 holds version 1 (not the step's); with two minibatches, micro-batches
  # 1 and 3 are the second update's, after the params moved.
  d = np.array([-0.1, 0.2, 0.3]) if num_minibatches == 1 else np.array([-0.1])
  assert metrics["mismatch_tokens"] == 6 * d.size
  np.testing.assert_allclose(metrics["mismatch_mean"], d.mean(), atol=1e-5)
  np.testing.assert_allclose(metrics["mismatch_abs_max"], np.abs(d).max(), atol=1e-5)
  np.testing.assert_allclose(metrics["mismatch_k3"], np.mean(np.exp(d) - 1 - d), atol=1e-5)


def test_a_run_with_top_p_trains_on_the_drawn_support_and_logs_the_mismatch(tmp_path):
  cfg = small_config(**{"generation.top_p": 0.9, "generation.top_k": 20,
                        "staleness.max_staleness": 0, "generation.update_mode": "drain",
                        "num_steps": 2})
  lines = []
  entry.run(cfg, str(tmp_path), progress=False, echo=lines.append)
  steps = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [s for s in steps if "mismatch_tokens" in s]
  assert len(steps) == 2
  for s in steps:
    # Synchronous: the step's version made every token it trains.
    assert s["mismatch_tokens"] == s["trained_tokens"] > 0
    assert s["mismatch_abs_max"] <= policy.LOGP_ROUNDING[cfg.model.dtype]
  assert sum("logp_mismatch=" in line for line in lines) == 2
