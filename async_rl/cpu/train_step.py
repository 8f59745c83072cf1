"""`train_step` and `recompute_logp` with each update's micro-batches shared among W
threads, for a trainer on one CPU device (`cpu.threads`): each thread dispatches the
gradient sum over its share, then one program adds them up and applies the update.
Micro-batch k + n (j + W i) of a batch of n updates goes to thread j in update k, so
the batch's M must be a multiple of n W. The result equals `train_step`'s but for the
order in which gradients are summed.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from async_rl.batching import PackedBatch
from async_rl.config import ModelConfig
from async_rl.cpu.threads import Dispatchers
from async_rl.train_step import (StepFns, TrainState, _check_splits, _combine, accumulate_grads,
                                 apply_grads, finish_step, recompute_logp)


def _update_part(x, n, threads, k, j):
  """The micro-batches of update k that thread j takes: k + n (j + W i), i = 0, 1, ..."""
  return x.reshape(x.shape[0] // (n * threads), threads, n, *x.shape[1:])[:, j, k]


def _accumulate_part(params, batch, prox_logp, k, j, version, base, *, n, threads,
                     **policy_kw):
  """`accumulate_grads` over thread j's share of update k's micro-batches, and the
  update's valid-token count."""
  loss_mask = batch.loss_mask
  num_tokens = loss_mask.reshape(loss_mask.shape[0] // n, n, *loss_mask.shape[1:])[:, k].sum()
  part = jax.tree.map(lambda x: _update_part(x, n, threads, k, j), (batch, prox_logp))
  sums = accumulate_grads(params, *part, num_tokens, version, version + k / n, base=base,
                          **policy_kw)
  return sums, num_tokens


def _apply_parts(state, parts):
  """`apply_grads` with the threads' sums added up."""
  (loss, metrics, grads), num_tokens = parts[0]
  for (more_loss, more_metrics, more_grads), _ in parts[1:]:
    loss, metrics = loss + more_loss, _combine(metrics, more_metrics)
    grads = jax.tree.map(jnp.add, grads, more_grads)
  return apply_grads(state, loss, metrics, grads, num_tokens)


def _finish_stacked(state, per_update):
  return finish_step(state, jax.tree.map(lambda *x: jnp.stack(x), *per_update))


class ThreadedTrainStep:
  """`train_step` with each update's micro-batches shared among W threads (module
  docstring). Called as `jit_train_step`'s function: (state, batch, prox_logp) -> (state,
  metrics); the state is donated.
  """

  def __init__(self, mesh: Mesh, state_shardings: TrainState, *, threads: int,
               model_cfg: ModelConfig, loss_fn: Callable, temperature: float = 1.0,
               num_minibatches: int = 1):
    self._n, self._dispatchers = num_minibatches, Dispatchers(threads, "grads")
    out_shardings = (state_shardings, NamedSharding(mesh, P()))
    self._accumulate = jax.jit(functools.partial(
        _accumulate_part, n=num_minibatches, threads=threads, model_cfg=model_cfg,
        loss_fn=loss_fn, temperature=temperature, lora_scale=state_shardings.lora_scale))
    self._apply = jax.jit(_apply_parts, donate_argnums=0, out_shardings=out_shardings)
    self._finish = jax.jit(_finish_stacked, donate_argnums=0, out_shardings=out_shardings)

  def __call__(self, state: TrainState, batch: PackedBatch, prox_logp):
    n, threads = self._n, len(self._dispatchers)
    _check_splits(batch, n * threads)
    per_update = []
    for k in range(n):
      # The step count (the version) stays until `finish_step`; each update donates it.
      parts = self._dispatchers.map(self._accumulate, [
          (state.params, batch, prox_logp, np.int32(k), np.int32(j), state.step, state.base)
          for j in range(threads)])
      state, metrics = self._apply(state, parts)
      per_update.append(metrics)
    return self._finish(state, per_update)


def _recompute_part(params, batch, j, *, threads, **policy_kw):
  """`recompute_logp` of thread j's micro-batches: j, j + W, j + 2W, ..."""
  part = jax.tree.map(lambda x: x.reshape(x.shape[0] // threads, threads, *x.shape[1:])[:, j],
                      batch)
  return recompute_logp(params, part, **policy_kw)


def _interleave(parts):
  """Thread j's [M / W, R, T] log-probs back at micro-batches j, j + W, ... of [M, R, T]."""
  stacked = jnp.stack(parts, axis=1)
  return stacked.reshape(-1, *stacked.shape[2:])


class ThreadedRecompute:
  """`recompute_logp` with the micro-batches shared among W threads (one CPU device, as
  `ThreadedTrainStep`); M must be a multiple of W. Called as `jit_recompute_logp`'s
  function: (params, batch) -> [M, R, T]."""

  def __init__(self, *, threads: int, model_cfg: ModelConfig, temperature: float = 1.0):
    self._threads = Dispatchers(threads, "recompute")
    self._part = jax.jit(functools.partial(_recompute_part, threads=threads,
                                           model_cfg=model_cfg, temperature=temperature))
    self._interleave = jax.jit(_interleave)

  def __call__(self, params, batch: PackedBatch):
    W = len(self._threads)
    if batch.tokens.shape[0] % W:
      raise ValueError(f"the batch's {batch.tokens.shape[0]} micro-batches do not split "
                       f"among {W} threads (pad with batching.pad_micro_batches)")
    return self._interleave(self._threads.map(
        self._part, [(params, batch, np.int32(j)) for j in range(W)]))


def threaded_steps(mesh: Mesh, state_shardings: TrainState, *, threads: int,
                   model_cfg: ModelConfig, loss_fn: Callable, temperature: float = 1.0,
                   num_minibatches: int = 1) -> StepFns:
  """`train_step.jit_steps` with the micro-batches shared among `threads` threads."""
  policy_kw = dict(model_cfg=model_cfg, temperature=temperature)
  return StepFns(
      ThreadedTrainStep(mesh, state_shardings, threads=threads, loss_fn=loss_fn,
                        num_minibatches=num_minibatches, **policy_kw),
      ThreadedRecompute(threads=threads, **policy_kw),
      num_minibatches * threads)
