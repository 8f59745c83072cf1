"""Supervised warm start: the loss, the sequences, and that it learns the targets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from async_rl import batching, sharding, sft, train_step
from async_rl.tasks import TrainStream
from rl_test_utils import small_config


def test_sft_loss_is_the_mean_nll_of_masked_tokens():
  logp = np.array([[-1.0, -2.0, -30.0], [-4.0, 0.0, 0.0]])
  mask = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  loss, metrics = sft.sft_loss(logp, None, None, None, mask)
  np.testing.assert_allclose(loss, 7.0 / 3.0, rtol=1e-6)
  loss, _ = sft.sft_loss(logp, None, None, None, mask, num_tokens=7)
  np.testing.assert_allclose(loss, 1.0, rtol=1e-6)
  assert float(sft.sft_loss(logp, None, None, None, 0 * mask)[0]) == 0.0
  assert int(metrics["num_tokens"]) == 3


def test_sft_sequences_train_on_the_solution_only():
  cfg = small_config()
  prompts = [next(TrainStream(cfg.task)) for _ in range(3)]
  for p, s in zip(prompts, sft.sft_sequences(prompts)):
    assert list(s.tokens) == list(p.tokens) + list(p.target)
    assert s.prompt_len == len(p.tokens) and len(s.behav_logp) == len(p.target)


def test_warm_start_lowers_the_nll_of_reference_solutions():
  cfg = small_config()
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=30, batch_size=16,
                                                         learning_rate=3e-3))
  mesh = sharding.make_mesh(cfg.mesh)
  lines = []
  params = sft.warm_start(cfg, mesh, echo=lines.append)
  assert lines and lines[-1].startswith("sft step 30/30")
  seqs = sft.sft_sequences(next(iter(TrainStream(cfg.task))) for _ in range(16))
  batch = batching.pack_dynamic(seqs, max_tokens_per_mb=64, num_shards=1, row_buckets=(64,))

  def nll(p):
    logp = train_step.recompute_logp(jax.tree.map(jnp.asarray, p), batch, model_cfg=cfg.model)
    return -float(np.sum(np.asarray(logp) * batch.loss_mask) / batch.loss_mask.sum())

  fresh = train_step.create_train_state(cfg.model, train_step.make_optimizer(cfg.optimizer),
                                        mesh, jax.random.key(cfg.seed)).params
  assert nll(params) < 0.7 * nll(fresh)
