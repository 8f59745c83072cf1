"""Supervised warm start: the loss, the sequences, and that it learns the targets."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from async_rl import batching, sharding, sft, train_step
from async_rl.tasks import TrainStream, supervised
from async_rl.tasks.arithmetic_task import SFT_SEED_OFFSET, ArithmeticTask
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


def test_sft_examples_train_on_the_solution_only():
  cfg = small_config()
  stream = TrainStream(dataclasses.replace(cfg.task, seed=cfg.task.seed + SFT_SEED_OFFSET))
  prompts = [next(stream) for _ in range(3)]
  for p, s in zip(prompts, ArithmeticTask(cfg.task).sft_examples()):
    assert list(s.tokens_T) == list(p.tokens) + list(p.target)
    assert s.prompt_len == len(p.tokens)
    np.testing.assert_array_equal(s.loss_mask_T, np.arange(len(s)) >= len(p.tokens))
    assert (s.versions_T == -1).all(), "reference solutions are no policy's tokens"


def test_warm_start_lowers_the_nll_of_reference_solutions():
  cfg = small_config()
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=30, batch_size=16,
                                                         learning_rate=3e-3))
  mesh = sharding.make_mesh(cfg.mesh)
  lines = []
  params = sft.warm_start(cfg, mesh, echo=lines.append)
  assert lines and lines[-1].startswith("sft step 30/30")
  seqs = [supervised(p.tokens, p.target) for p in itertools.islice(TrainStream(cfg.task), 16)]
  batch = batching.pack_dynamic(seqs, np.zeros(len(seqs)), max_tokens_per_mb=64, rows_per_mb=1,
                                row_buckets=(64,))

  def nll(p):
    logp = train_step.recompute_logp(jax.tree.map(jnp.asarray, p), batch, model_cfg=cfg.model)
    return -float(np.sum(np.asarray(logp) * batch.loss_mask) / batch.loss_mask.sum())

  fresh = train_step.create_train_state(cfg.model, train_step.make_optimizer(cfg.optimizer),
                                        mesh, jax.random.key(cfg.seed)).params
  assert nll(params) < 0.7 * nll(fresh)
