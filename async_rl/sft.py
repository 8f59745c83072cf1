"""Supervised warm start: next-token cross-entropy on a task's reference solutions.

It reuses the RL train step (packing, micro-batching, sharding, non-finite skip) with
`sft_loss` in place of the PPO objective, so there is one update path to trust. The
examples are the task's `sft_examples()` (`tasks.protocol.supervised` trajectories:
the loss is on the tokens their mask marks, e.g. not a tool's output).
"""

import functools
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from async_rl import batching, sharding, train_step
from async_rl.config import BatchingConfig, ModelConfig, OptimizerConfig, SFTConfig
from async_rl.models import flops
from async_rl.progress import stamped


def sft_loss(logp, prox_logp, behav_logp, advantages, mask, segment_ids=None, *,
             num_tokens=None, entropy=None):
  """Mean negative log-likelihood of the masked tokens (the PPO-loss signature)."""
  del prox_logp, behav_logp, advantages, segment_ids, entropy
  count = mask.sum()
  denom = jnp.maximum(count if num_tokens is None else num_tokens, 1)
  nll = -jnp.sum(jnp.where(mask > 0, logp, 0.0)) / denom
  return nll, {"nll": nll, "num_tokens": count}


def warm_start(task, model: ModelConfig, sft: SFTConfig, batching_cfg: BatchingConfig, mesh, *,
               seed: int = 0, echo: Callable[[str], None] = print,
               record: Callable[[int, dict], None] = lambda step, metrics: None):
  """Trains a fresh model for `sft.steps` steps on `task`'s reference solutions
  (`sft_examples`); returns host params.

  Every `sft.log_every` steps (and at the last) it echoes a line and passes `record`
  the step and its metrics: `loss`, the mean NLL over the steps since the last
  record, and `lr`, the learning rate of the step.

  Raises:
    ValueError: the task has no `sft_examples`.
  """
  s = sft
  if not hasattr(task, "sft_examples"):
    raise ValueError(f"sft.steps={s.steps} needs a task with reference solutions "
                     f"(sft_examples); {type(task).__name__} has none")
  examples = task.sft_examples()
  optimizer = OptimizerConfig(learning_rate=s.learning_rate, warmup_steps=min(10, s.steps))
  tx, learning_rate = train_step.make_optimizer(optimizer), train_step.learning_rate(optimizer)
  state, shardings = train_step.create_train_state(model, tx, mesh, jax.random.key(seed))
  step = train_step.jit_train_step(mesh, shardings, model_cfg=model, loss_fn=sft_loss)
  pack = functools.partial(batching.pack_dynamic,
                           max_tokens_per_mb=batching_cfg.max_tokens_per_mb,
                           num_shards=sharding.num_batch_shards(mesh))
  batches = [[next(examples) for _ in range(s.batch_size)] for _ in range(s.steps)]
  zeros = np.zeros(s.batch_size)
  buckets = batching_cfg.row_buckets or batching.default_row_buckets(
      batching_cfg.max_tokens_per_mb)
  shape = (_one_shape(pack, batches, buckets, flops.attention_break_even_len(model))
           if batches else None)  # no steps: nothing to compile
  t0 = time.perf_counter()
  nll_sum, since = 0.0, 0
  for i, seqs in enumerate(batches, start=1):
    batch = pack(seqs, zeros, row_buckets=shape[2:], compiled=(shape,), reuse_slack=math.inf)
    state, metrics = step(state, batch, batch.behav_logp)
    nll_sum = nll_sum + metrics["nll"]  # added on the device: no host read per step
    if i % s.log_every == 0 or i == s.steps:  # the only host reads: one every log_every
      logged = {"loss": float(nll_sum) / (i - since),
                "lr": float(learning_rate(i - 1))}
      nll_sum, since = 0.0, i
      record(i, logged)
      echo(stamped(f"sft step {i}/{s.steps} nll={logged['loss']:.4f} "
                   f"lr={logged['lr']:.3g} ({time.perf_counter() - t0:.0f}s)"))
  return jax.device_get(state.params)


def _one_shape(pack, batches, row_buckets, attention_len) -> tuple[int, int, int]:
  """The one [M, R, T] shape every batch of the warm start packs into.

  The warm start knows its batches in advance, so it compiles its train step once:
  for each row length T that holds the longest sequence, the most micro-batches and
  rows any batch needs at T; of those shapes, the one of least estimated cost
  (slots times `1 + T / attention_len`, as `batching.pack_dynamic` weighs them). A
  compile costs tens of steps' time on a CPU; the rows it adds to the smaller batches
  cost less (BENCHMARKS.md, "The quick start").
  """
  longest = max(len(seq) for seqs in batches for seq in seqs)
  best = None
  for T in sorted(b for b in row_buckets if b >= longest):
    shapes = [pack(seqs, np.zeros(len(seqs)), row_buckets=(T,)).tokens.shape
              for seqs in batches]
    M, R = max(s[0] for s in shapes), max(s[1] for s in shapes)
    cost = M * R * T * (1 + T / attention_len)
    if best is None or cost < best[0]:
      best = cost, (M, R, T)
  if best is None:
    raise ValueError(f"no row bucket in {tuple(sorted(row_buckets))} holds a sequence of "
                     f"{longest} tokens")
  return best[1]
