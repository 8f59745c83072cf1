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
from async_rl.tasks import TrainStream
from async_rl.trajectory import Trajectory

# The warm start draws from its own stream, so RL does not begin on memorised prompts.
_SFT_STREAM_SEED_OFFSET = 7919


def sft_loss(logp, prox_logp, behav_logp, advantages, mask, segment_ids=None, *,
             num_tokens=None, entropy=None):
  """Mean negative log-likelihood of the masked tokens (the PPO-loss signature)."""
  del prox_logp, behav_logp, advantages, segment_ids, entropy
  count = mask.sum()
  denom = jnp.maximum(count if num_tokens is None else num_tokens, 1)
  nll = -jnp.sum(jnp.where(mask > 0, logp, 0.0)) / denom
  return nll, {"nll": nll, "num_tokens": count}


def sft_sequences(prompts) -> list[Trajectory]:
  """Prompt then reference solution; only the solution tokens are trained on.

  The solution is not a policy's output, so its tokens carry version -1.
  """
  out = []
  for p in prompts:
    tokens = np.array(p.tokens + p.target, np.int32)
    P = len(p.tokens)
    out.append(Trajectory(tokens_T=tokens, loss_mask_T=np.arange(tokens.size) >= P,
                          logp_T=np.zeros(tokens.size, np.float32),
                          versions_T=np.full(tokens.size, -1, np.int32), prompt_len=P,
                          finish_reason="stop"))
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
  rows = sharding.num_batch_shards(mesh)
  t0 = time.perf_counter()
  for i in range(1, s.steps + 1):
    seqs = sft_sequences(next(stream) for _ in range(s.batch_size))
    batch = batching.pack_dynamic(seqs, np.zeros(len(seqs)), max_tokens_per_mb=budget,
                                  rows_per_mb=rows, row_buckets=buckets)
    state, metrics = step(state, batch, batch.behav_logp)
    if i % s.log_every == 0 or i == s.steps:  # the only host reads: one every log_every
      echo(f"sft step {i}/{s.steps} nll={float(metrics['nll']):.4f} "
           f"({time.perf_counter() - t0:.0f}s)")
  return jax.device_get(state.params)
