"""The trainer: scored groups in, one decoupled-PPO update out.

Owns the sharded `TrainState` and the jitted functions; the math lives in
`advantages`, `batching`, `loss` and `train_step`. One `train` call is one training
step: advantages per trajectory, packing into bucketed micro-batches, with a KL
penalty the reference policy's log-probs (a forward pass under the frozen
`ref_params`, or with LoRA the base alone), recomputation of the proximal log-probs
under the current params, then the update. The caller publishes the new params at the
new version: with LoRA, the adapters alone.
"""

import functools
import time
from typing import Optional, Sequence as SequenceOf

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from async_rl import batching as batching_lib, loss, sharding, train_step
from async_rl.config import BatchingConfig, ModelConfig, PPOConfig
from async_rl.models import flops
from async_rl.trajectory import split_turns


def trajectories(groups, group_size: int):
  """The groups' trajectories, flat; every group must hold `group_size`."""
  if any(len(g.trajectories) != group_size for g in groups):
    raise ValueError(f"every group must hold generation.group_size={group_size} "
                     f"trajectories, got {[len(g.trajectories) for g in groups]}")
  return [t for g in groups for t in g.trajectories]


def group_advantages(groups, advantage_fn, group_size: int, penalty_N=None):
  """The groups' trajectories, flat, and their advantages [N] from the group rewards,
  less `penalty_N` (one per trajectory) when given."""
  trajs = trajectories(groups, group_size)
  rewards_N = np.array([t.reward for t in trajs], np.float32)
  if penalty_N is not None:
    rewards_N = rewards_N - np.asarray(penalty_N, np.float32)
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
    ppo: the objective; `prox_logp` says where π_prox comes from, `kl_beta` and
      `kl_in` whether and where the KL penalty to `state.ref_params` goes.
    batching: how batches pack into micro-batches.
    advantage_fn: the advantage estimator (`advantages.from_config`).
    group_size: samples per group, which every group must hold.
    max_length: the longest sequence (prompt plus completion).
    sample_per_turn: train each policy turn of an episode as a sample of its own
      (`trajectory.split_turns`).
    base_pointer: with LoRA, where the frozen base comes from (`rl.lora_base`),
      which checkpoints record in place of the base.

  `version` is the number of training steps done (a host int, read from the device
  only when a checkpoint is restored).
  """

  def __init__(self, state, state_shardings, mesh, steps: train_step.StepFns, *,
               model: ModelConfig, ppo: PPOConfig, batching: BatchingConfig,
               advantage_fn, group_size: int, max_length: int, sample_per_turn: bool = False,
               base_pointer: Optional[dict] = None):
    self.state, self.state_shardings, self.mesh = state, state_shardings, mesh
    self.version = 0
    self.steps, self._ppo, self._batching = steps, ppo, batching
    self._advantage_fn, self._group_size = advantage_fn, group_size
    self._sample_per_turn = sample_per_turn
    self.base_pointer = base_pointer
    self._batch_sharding = train_step.batch_shardings(mesh)
    self._row_buckets = batching.row_buckets or batching_lib.default_row_buckets(
        batching.max_tokens_per_mb, longest=max_length)
    self._num_shards = sharding.num_batch_shards(mesh)
    self._attention_len = flops.attention_break_even_len(model)
    self._compiled = set()  # the [M, R, T] shapes the step has run
    if ppo.kl_beta > 0 and state.ref_params is None and state.base is None:
      raise ValueError("ppo.kl_beta > 0 needs the reference policy in the train state "
                       "(train_step.create_train_state(..., reference=True))")
    # The estimate per token, whole on every process: the host sums it per episode.
    self._token_kl = jax.jit(functools.partial(loss.token_kl, estimator=ppo.kl_estimator),
                             out_shardings=NamedSharding(mesh, P()))

  def restore(self, state, packed_shapes=()) -> None:
    """Takes a restored train state (and its version, the one device read) and the
    `packed_shapes` saved with it, so that batches pack as they would have. A LoRA
    state's frozen base is not in checkpoints: the trainer keeps the one it holds."""
    if self.state.base is not None:
      state = state.replace(base=self.state.base)
    self.state = state
    self.version = int(state.step)
    self._compiled = {tuple(shape) for shape in packed_shapes}

  def abstract_state(self):
    """The train state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s): what a
    checkpoint of it restores into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self.state, self.state_shardings)

  @property
  def packed_shapes(self) -> list[list[int]]:
    """The [M, R, T] shapes the step has run (`batching.pack_dynamic`'s `compiled`):
    packing depends on them, so a checkpoint keeps them."""
    return sorted(map(list, self._compiled))

  def pack(self, groups) -> batching_lib.PackedBatch:
    """The groups' samples packed, each with its episode's advantage."""
    trajs, adv_N = group_advantages(groups, self._advantage_fn, self._group_size)
    return self._pack(trajs, adv_N)

  def _pack(self, trajs, value_N) -> batching_lib.PackedBatch:
    """The episodes' samples (their turns, with `sample_per_turn`) packed, the loss
    tokens of each carrying its episode's `value_N` as their advantage."""
    if self._sample_per_turn:
      turns = [split_turns(t) for t in trajs]
      trajs = [s for ts in turns for s in ts]
      value_N = np.repeat(value_N, [len(ts) for ts in turns])
    parts = self.steps.micro_batch_multiple  # equal shares of the batch
    # Versions serve the log-linear estimate and the step's mismatch metrics.
    batch = batching_lib.pack_dynamic(trajs, value_N,
                                      max_tokens_per_mb=self._batching.max_tokens_per_mb,
                                      num_shards=self._num_shards, row_buckets=self._row_buckets,
                                      attention_len=self._attention_len,
                                      with_versions=True,
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
    ppo, extra = self._ppo, {}
    kl_in_reward = ppo.kl_beta > 0 and ppo.kl_in == "reward"
    if kl_in_reward:  # Loss tokens carry their episode's index until the penalty is known.
      trajs = trajectories(groups, self._group_size)
      host_batch = self._pack(trajs, np.arange(len(trajs), dtype=np.float32))
    else:
      host_batch = self.pack(groups)
    batch = jax.device_put(host_batch, self._batch_sharding)
    t_pack = time.perf_counter()
    if ppo.kl_beta > 0:
      ref_logp = self.steps.recompute(self.state.reference_params(), batch)
      if kl_in_reward:
        batch, extra["kl"] = self._penalise_rewards(groups, host_batch, batch, ref_logp)
      else:
        batch = batch.replace(ref_logp=ref_logp)
    mode = ppo.prox_logp
    if mode == "recompute":
      prox_logp = self.steps.recompute(self.state.model_params(), batch)
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
        **extra,
        skipped=int(metrics["skipped"]), applied_updates=int(metrics["applied_updates"]),
        trained_tokens=int(metrics["num_tokens"]),
        packed_tokens=int(np.prod(batch.tokens.shape)),
        time_pack_s=t_pack - t0, time_train_s=t_done - t_pack)
    return metrics

  def _penalise_rewards(self, groups, host_batch, batch, ref_logp):
    """`batch` with the KL penalty in its advantages, and the token mean of the estimate.

    Each episode's reward loses kl_beta times the sum, over its loss tokens, of
    `loss.token_kl` of π_behav (the policy that sampled them, so the estimate is of
    KL(π_behav || π_ref)) against π_ref, before the advantages are normalised (as
    verl's KL in the reward, for outcome rewards). `host_batch` holds each loss
    token's episode index in place of its advantage.
    """
    kl_MRT = np.asarray(jax.device_get(self._token_kl(batch.behav_logp, ref_logp,
                                                      batch.loss_mask)))
    mask_MRT = host_batch.loss_mask != 0
    episode = host_batch.advantages[mask_MRT].astype(np.int64)
    kl_tokens = kl_MRT[mask_MRT]
    kl_N = np.bincount(episode, weights=kl_tokens,
                       minlength=sum(len(g.trajectories) for g in groups))
    _, adv_N = group_advantages(groups, self._advantage_fn, self._group_size,
                                penalty_N=self._ppo.kl_beta * kl_N)
    adv_MRT = np.zeros_like(host_batch.advantages)
    adv_MRT[mask_MRT] = adv_N[episode]
    advantages = jax.device_put(adv_MRT, self._batch_sharding)
    return batch.replace(advantages=advantages), float(kl_tokens.mean()) if kl_tokens.size else 0.0

  def device_params(self):
    """A copy of the trained params on the trainer's devices, safe to publish in
    process: the model's, or with LoRA the adapters alone (`TrainState.params`; every
    generator holds the frozen base itself, `rl.lora_base`).

    The next step donates the train state, so the published params must not alias
    it; this copy stays on the devices (no host round trip), and a generator
    reshards it onto its own with `jax.device_put`.
    """
    return jax.device_put(self.state.params, self.state_shardings.params, may_alias=False)

  def host_params(self, dtype=None):
    """A host (numpy) copy of the trained params (as `device_params`: with LoRA, the
    adapters alone), in `dtype` if given (cast on the devices, so fewer bytes leave
    them): safe to publish, since the state is donated.

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
