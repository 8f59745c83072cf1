"""Supervised warm start: the loss, the sequences, and that it learns the targets."""

import dataclasses
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import batching, sft, sharding, train_step
from async_rl.tasks import TrainStream, supervised
from async_rl.tasks.arithmetic import ArithmeticTask, SFT_SEED_OFFSET
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


def _warm_start(cfg, mesh, echo, record=lambda step, metrics: None):
  return sft.warm_start(ArithmeticTask(cfg.task.arithmetic), cfg.model, cfg.sft, cfg.batching,
                        mesh, seed=cfg.seed, echo=echo, record=record)


def test_sft_examples_train_on_the_solution_only():
  cfg = small_config()
  arithmetic = cfg.task.arithmetic
  stream = TrainStream(dataclasses.replace(arithmetic, seed=arithmetic.seed + SFT_SEED_OFFSET))
  prompts = [next(stream) for _ in range(3)]
  for p, s in zip(prompts, ArithmeticTask(cfg.task.arithmetic).sft_examples()):
    assert list(s.tokens_T) == list(p.tokens) + list(p.target)
    assert s.prompt_len == len(p.tokens)
    np.testing.assert_array_equal(s.loss_mask_T, np.arange(len(s)) >= len(p.tokens))
    assert (s.versions_T == -1).all(), "reference solutions are no policy's tokens"


def test_warm_start_lowers_the_nll_of_reference_solutions(monkeypatch):
  cfg = small_config()
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=30, batch_size=16,
                                                         learning_rate=3e-3, log_every=10))
  mesh = sharding.make_mesh(cfg.mesh)
  shapes, jit_train_step = set(), train_step.jit_train_step

  def recording(*args, **kwargs):
    step = jit_train_step(*args, **kwargs)

    def run(state, batch, behav_logp):
      shapes.add(batch.tokens.shape)
      return step(state, batch, behav_logp)
    return run

  monkeypatch.setattr(train_step, "jit_train_step", recording)
  lines, records = [], []
  params = _warm_start(cfg, mesh, echo=lines.append,
                       record=lambda step, metrics: records.append((step, metrics)))
  assert len(lines) == 3
  assert re.fullmatch(r"\S+ \S+ sft step 30/30 nll=\d\.\d{4} lr=0\.003 \(\d+s\)", lines[-1])
  # Ten steps of warmup (`min(10, steps)`): step i trains at 3e-3 * min(i - 1, 10) / 10.
  assert [step for step, _ in records] == [10, 20, 30]
  np.testing.assert_allclose([m["lr"] for _, m in records], [2.7e-3, 3e-3, 3e-3], rtol=1e-6)
  losses = [m["loss"] for _, m in records]  # each the mean over its ten steps
  assert losses[2] < losses[1] < losses[0]
  assert len(shapes) == 1, "the warm start compiles its train step once"
  seqs = [supervised(p.tokens, p.target)
          for p in itertools.islice(TrainStream(cfg.task.arithmetic), 16)]
  batch = batching.pack_dynamic(seqs, np.zeros(len(seqs)), max_tokens_per_mb=64, num_shards=1,
                                row_buckets=(64,))

  def nll(p):
    logp = train_step.recompute_logp(jax.tree.map(jnp.asarray, p), batch, model_cfg=cfg.model)
    return -float(np.sum(np.asarray(logp) * batch.loss_mask) / batch.loss_mask.sum())

  fresh = train_step.create_train_state(cfg.model, train_step.make_optimizer(cfg.optimizer),
                                        mesh, jax.random.key(cfg.seed))[0].params
  assert nll(params) < 0.7 * nll(fresh)


def test_warm_start_batches_pack_into_one_shape_that_holds_each():
  cfg = small_config()
  examples = ArithmeticTask(cfg.task.arithmetic).sft_examples()
  batches = [[next(examples) for _ in range(16)] for _ in range(30)]
  buckets = batching.default_row_buckets(256, smallest=32)
  pack = functools.partial(batching.pack_dynamic, max_tokens_per_mb=256, num_shards=1)
  own = [pack(seqs, np.zeros(16), row_buckets=buckets) for seqs in batches]
  assert len({b.tokens.shape for b in own}) > 1  # so the test shows something
  M, R, T = shape = sft._one_shape(pack, batches, buckets, attention_len=math.inf)
  assert T in buckets
  for seqs, b in zip(batches, own):
    packed = pack(seqs, np.zeros(16), row_buckets=(T,), compiled=(shape,),
                  reuse_slack=math.inf)
    assert packed.tokens.shape == shape
    np.testing.assert_array_equal(np.sort(packed.tokens[packed.loss_mask > 0]),
                                  np.sort(b.tokens[b.loss_mask > 0]))
  # The least slots of the shapes that hold every batch: at the other row lengths,
  # the most rows and micro-batches any batch needs cost more.
  for other in buckets:
    if other != T and other >= max(len(x) for seqs in batches for x in seqs):
      shapes = [pack(seqs, np.zeros(16), row_buckets=(other,)).tokens.shape
                for seqs in batches]
      assert max(s[0] for s in shapes) * max(s[1] for s in shapes) * other >= M * R * T


def test_warm_start_needs_a_bucket_that_holds_its_longest_example():
  pack = functools.partial(batching.pack_dynamic, max_tokens_per_mb=64, num_shards=1)
  with pytest.raises(ValueError, match="no row bucket"):
    sft._one_shape(pack, [[supervised([1] * 40, [2] * 40)]], (64,), attention_len=math.inf)


def test_a_warm_start_of_no_steps_returns_the_initial_params():
  cfg = small_config()
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=0))
  mesh = sharding.make_mesh(cfg.mesh)
  params = _warm_start(cfg, mesh, echo=lambda _: None)
  fresh = train_step.create_train_state(cfg.model, train_step.make_optimizer(cfg.optimizer),
                                        mesh, jax.random.key(cfg.seed))[0].params
  jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(fresh))
