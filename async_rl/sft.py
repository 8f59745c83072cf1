"""Supervised warm start: next-token cross-entropy on reference solutions.

It reuses the RL train step (packing, micro-batching, sharding, non-finite skip) with
`sft_loss` in place of the PPO objective, so there is one update path to trust.
"""

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from async_rl import batching, sharding, train_step
from async_rl.config import ExperimentConfig, OptimizerConfig
from async_rl.models import flops
from async_rl.tasks import TrainStream

# The warm start draws from its own stream, so RL does not begin on memorised prompts.
_SFT_STREAM_SEED_OFFSET = 7919


def sft_loss(logp, prox_logp, behav_logp, advantages, mask, *, num_tokens=None,
             entropy=None):
  """Mean negative log-likelihood of the masked tokens (the PPO-loss signature)."""
  del prox_logp, behav_logp, advantages, entropy
  count = mask.sum()
  denom = jnp.maximum(count if num_tokens is None else num_tokens, 1)
  nll = -jnp.sum(jnp.where(mask > 0, logp, 0.0)) / denom
  return nll, {"nll": nll, "num_tokens": count}


def sft_sequences(prompts) -> list[batching.Sequence]:
  """Prompt then reference solution; only the solution tokens are trained on."""
  out = []
  for p in prompts:
    n = len(p.target)
    out.append(batching.Sequence(tokens=np.array(p.tokens + p.target), prompt_len=len(p.tokens),
                                 behav_logp=np.zeros(n, np.float32),
                                 versions=np.zeros(n, np.int32), advantage=0.0))
  return out


def warm_start(cfg: ExperimentConfig, mesh, *, echo: Callable[[str], None] = print):
  """Trains a fresh model for `cfg.sft.steps` steps; returns host params."""
  s = cfg.sft
  tx = train_step.make_optimizer(OptimizerConfig(learning_rate=s.learning_rate,
                                                 warmup_steps=min(10, s.steps)))
  state = train_step.create_train_state(cfg.model, tx, mesh, jax.random.key(cfg.seed))
  shardings = train_step.train_state_shardings(jax.eval_shape(lambda: state), mesh)
  step = train_step.jit_train_step(mesh, shardings, model_cfg=cfg.model, loss_fn=sft_loss)
  stream = TrainStream(dataclasses.replace(
      cfg.task, seed=cfg.task.seed + _SFT_STREAM_SEED_OFFSET))
  budget = cfg.batching.max_tokens_per_mb
  buckets = cfg.batching.row_buckets or batching.default_row_buckets(budget)
  shards = sharding.num_batch_shards(mesh)
  attention_len = flops.attention_break_even_len(cfg.model)
  t0 = time.perf_counter()
  for i in range(1, s.steps + 1):
    seqs = sft_sequences(next(stream) for _ in range(s.batch_size))
    batch = batching.pack_dynamic(seqs, max_tokens_per_mb=budget, num_shards=shards,
                                  row_buckets=buckets, attention_len=attention_len)
    state, metrics = step(state, batch)
    if i % s.log_every == 0 or i == s.steps:  # the only host reads: one every log_every
      echo(f"sft step {i}/{s.steps} nll={float(metrics['nll']):.4f} "
           f"({time.perf_counter() - t0:.0f}s)")
  return jax.device_get(state.params)
