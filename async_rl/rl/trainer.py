"""The trainer: scored groups in, one decoupled-PPO update out.

Owns the sharded `TrainState` and the jitted functions; the math lives in
`advantages`, `batching`, `loss` and `train_step`. One `train` call is one training
step: advantages per trajectory, packing into bucketed micro-batches, recomputation
of the proximal log-probs under the current params, then the update. The caller
publishes the new params at the new version.
"""

import functools
import time
from typing import Sequence as SequenceOf

import jax
import numpy as np
from jax.experimental import multihost_utils

from async_rl import batching as batching_lib, sharding, train_step
from async_rl.config import BatchingConfig, ModelConfig, PPOConfig
from async_rl.models import flops
from async_rl.trajectory import split_turns


def group_advantages(groups, advantage_fn, group_size: int):
  """The groups' trajectories, flat, and their advantages [N] from the group rewards."""
  trajs = [t for g in groups for t in g.trajectories]
  if any(len(g.trajectories) != group_size for g in groups):
    raise ValueError(f"every group must hold generation.group_size={group_size} "
                     f"trajectories, got {[len(g.trajectories) for g in groups]}")
  rewards_N = np.array([t.reward for t in trajs], np.float32)
  lengths_N = np.array([t.num_policy_tokens for t in trajs], np.int32)
  truncated_N = np.array([t.finish_reason == "length" for t in trajs])
  return trajs, np.asarray(advantage_fn(rewards_N, lengths_N, truncated_N, group_size))


class Trainer:
  """Holds the policy being trained; `train(groups)` runs one training step.

  Args:
    state: the sharded train state to start from (`train_step.create_train_state`).
    state_shardings: its shardings.
    mesh: the trainer's devices.
    steps: the compiled update and proximal recompute (`train_step.jit_steps`).
    model: the model's config (for the packing's cost estimate).
    ppo: the objective; `prox_logp` says where π_prox comes from.
    batching: how batches pack into micro-batches.
    advantage_fn: the advantage estimator (`advantages.from_config`).
    group_size: samples per group, which every group must hold.
    max_length: the longest sequence (prompt plus completion).
    sample_per_turn: train each policy turn of an episode as a sample of its own
      (`trajectory.split_turns`).

  `version` is the number of training steps done (a host int, read from the device
  only when a checkpoint is restored).
  """

  def __init__(self, state, state_shardings, mesh, steps: train_step.StepFns, *,
               model: ModelConfig, ppo: PPOConfig, batching: BatchingConfig,
               advantage_fn, group_size: int, max_length: int, sample_per_turn: bool = False):
    self.state, self.state_shardings, self.mesh = state, state_shardings, mesh
    self.version = 0
    self.steps, self._ppo, self._batching = steps, ppo, batching
    self._advantage_fn, self._group_size = advantage_fn, group_size
    self._sample_per_turn = sample_per_turn
    self._batch_sharding = train_step.batch_shardings(mesh)
    self._row_buckets = batching.row_buckets or batching_lib.default_row_buckets(
        batching.max_tokens_per_mb, longest=max_length)
    self._num_shards = sharding.num_batch_shards(mesh)
    self._attention_len = flops.attention_break_even_len(model)
    self._compiled = set()  # the [M, R, T] shapes the step has run

  def restore(self, state, packed_shapes=()) -> None:
    """Takes a restored train state (and its version, the one device read) and the
    `packed_shapes` saved with it, so that batches pack as they would have."""
    self.state = state
    self.version = int(state.step)
    self._compiled = {tuple(shape) for shape in packed_shapes}

  @property
  def packed_shapes(self) -> list[list[int]]:
    """The [M, R, T] shapes the step has run (`batching.pack_dynamic`'s `compiled`):
    packing depends on them, so a checkpoint keeps them."""
    return sorted(map(list, self._compiled))

  def pack(self, groups) -> batching_lib.PackedBatch:
    trajs, adv_N = group_advantages(groups, self._advantage_fn, self._group_size)
    if self._sample_per_turn:
      turns = [split_turns(t) for t in trajs]
      trajs, adv_N = [s for ts in turns for s in ts], np.repeat(adv_N, [len(ts) for ts in turns])
    parts = self.steps.micro_batch_multiple  # equal shares of the batch
    batch = batching_lib.pack_dynamic(trajs, adv_N,
                                      max_tokens_per_mb=self._batching.max_tokens_per_mb,
                                      num_shards=self._num_shards, row_buckets=self._row_buckets,
                                      attention_len=self._attention_len,
                                      with_versions=self._ppo.prox_logp == "loglinear",
                                      num_parts=parts, compiled=self._compiled,
                                      reuse_slack=self._batching.reuse_slack)
    batch = batching_lib.pad_micro_batches(batch, parts)
    self._compiled.add(batch.tokens.shape)
    return batch

  def train(self, groups: SequenceOf) -> dict:
    """One training step on `groups`; returns host metrics, with timings.

    The version advances even when the step is skipped (metric `skipped` = 1).
    """
    t0 = time.perf_counter()
    batch = jax.device_put(self.pack(groups), self._batch_sharding)
    t_pack = time.perf_counter()
    mode = self._ppo.prox_logp
    if mode == "recompute":
      prox_logp = self.steps.recompute(self.state.params, batch)
    elif mode == "behav":  # naive PPO
      prox_logp = batch.behav_logp
    else:  # "loglinear": estimated inside the step from batch.versions
      prox_logp = None
    self.state, metrics = self.steps.step(self.state, batch, prox_logp)
    metrics = jax.device_get(metrics)
    t_done = time.perf_counter()
    self.version += 1
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics.update(
        skipped=int(metrics["skipped"]), applied_updates=int(metrics["applied_updates"]),
        trained_tokens=int(metrics["num_tokens"]),
        packed_tokens=int(np.prod(batch.tokens.shape)),
        time_pack_s=t_pack - t0, time_train_s=t_done - t_pack)
    return metrics

  def device_params(self):
    """A copy of the params on the trainer's devices, safe to publish in process.

    The next step donates the train state, so the published params must not alias
    it; this copy stays on the devices (no host round trip), and a generator
    reshards it onto its own with `jax.device_put`.
    """
    return jax.device_put(self.state.params, self.state_shardings.params, may_alias=False)

  def host_params(self, dtype=None):
    """A host (numpy) copy of the params, in `dtype` if given (cast on the devices, so
    fewer bytes leave them): safe to publish, since the state is donated.

    With a trainer over several `jax.distributed` processes, every process gets the
    whole params (an all-gather), since no process holds all their shards.
    """
    params = self.state.params
    if dtype is not None:
      params = _cast(params, jax.numpy.dtype(dtype))
    if jax.process_count() > 1:
      return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


@functools.partial(jax.jit, static_argnums=1)
def _cast(params, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), params)
