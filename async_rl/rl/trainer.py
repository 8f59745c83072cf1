"""The trainer: scored groups in, one decoupled-PPO update out.

Owns the sharded `TrainState` and the jitted functions; the math lives in
`advantages`, `batching`, `loss` and `train_step`. One `train` call: advantages per
sample, packing into bucketed micro-batches, recomputation of the proximal
log-probs under the current params, then the update. The caller publishes the new
params.
"""

import collections
import time
from typing import Sequence as SequenceOf

import jax
import numpy as np

from async_rl import advantages, batching, loss, sharding, train_step
from async_rl.config import ExperimentConfig
from async_rl.models import flops


def make_advantage_fn(cfg: ExperimentConfig):
  a, g = cfg.advantage, cfg.generation
  overlong = a.overlong_cache_len is not None
  return advantages.make_advantage_fn(
      bias=a.reward_bias, scale=a.reward_scale, clip=a.reward_clip,
      overlong_max_len=g.max_new_tokens if overlong else None,
      overlong_cache_len=a.overlong_cache_len, overlong_factor=a.overlong_factor,
      zero_truncated=a.zero_truncated, mean_level=a.mean_level, std_level=a.std_level,
      leave_one_out=a.leave_one_out)


def group_sequences(groups, advantage_fn, group_size: int) -> list[batching.Sequence]:
  """Flattens groups into packed-ready sequences, each carrying its advantage."""
  samples = [s for g in groups for s in g.samples]
  if any(len(g.samples) != group_size for g in groups):
    raise ValueError(f"every group must hold generation.group_size={group_size} samples, "
                     f"got {[len(g.samples) for g in groups]}")
  rewards_N = np.array([s.reward for s in samples], np.float32)
  lengths_N = np.array([len(s.completion_T) for s in samples], np.int32)
  truncated_N = np.array([s.finish_reason == "length" for s in samples])
  adv_N = np.asarray(advantage_fn(rewards_N, lengths_N, truncated_N, group_size))
  return [batching.Sequence(
      tokens=np.concatenate([s.prompt_P, s.completion_T]),
      prompt_len=len(s.prompt_P), behav_logp=s.behav_logp_T, versions=s.versions_T,
      advantage=float(a)) for s, a in zip(samples, adv_N)]


class Trainer:
  """Holds the policy being trained; `train(groups)` applies one update."""

  def __init__(self, cfg: ExperimentConfig, mesh, *, params=None, key=None):
    self.cfg = cfg
    self.mesh = mesh
    key = jax.random.key(cfg.seed) if key is None else key
    tx = train_step.make_optimizer(cfg.optimizer)
    self.state = train_step.create_train_state(cfg.model, tx, mesh, key, params=params)
    self.state_shardings = train_step.train_state_shardings(
        jax.eval_shape(lambda: self.state), mesh)
    ppo = cfg.ppo
    self.loss_fn = loss.make_loss(ppo.loss, eps_clip=ppo.eps_clip,
                                  eps_clip_higher=ppo.eps_clip_higher, c_clip=ppo.c_clip,
                                  behav_imp_weight_cap=ppo.behav_imp_weight_cap)
    self._step = train_step.jit_train_step(mesh, self.state_shardings, model_cfg=cfg.model,
                                           loss_fn=self.loss_fn,
                                           temperature=cfg.generation.logp_temperature)
    self._prox = train_step.jit_recompute_logp(mesh, self.state_shardings.params,
                                               model_cfg=cfg.model,
                                               temperature=cfg.generation.logp_temperature)
    self._batch_sharding = train_step.batch_shardings(mesh)
    self._advantage_fn = make_advantage_fn(cfg)
    b = cfg.batching
    self._row_buckets = b.row_buckets or batching.default_row_buckets(b.max_tokens_per_mb)
    self._num_shards = sharding.num_batch_shards(mesh)
    self._attention_len = flops.attention_break_even_len(cfg.model)

  @property
  def version(self) -> int:
    return int(self.state.step)

  def pack(self, groups) -> batching.PackedBatch:
    seqs = group_sequences(groups, self._advantage_fn, self.cfg.generation.group_size)
    return batching.pack_dynamic(seqs, max_tokens_per_mb=self.cfg.batching.max_tokens_per_mb,
                                 num_shards=self._num_shards, row_buckets=self._row_buckets,
                                 attention_len=self._attention_len)

  def train(self, groups: SequenceOf) -> dict:
    """One update from `groups`; returns host metrics, including staleness and timings."""
    t0 = time.perf_counter()
    version = self.version
    batch = jax.device_put(self.pack(groups), self._batch_sharding)
    t_pack = time.perf_counter()
    if self.cfg.ppo.loss == "decoupled_ppo":
      batch = batch.replace(prox_logp=self._prox(self.state.params, batch))
    self.state, metrics = self._step(self.state, batch)
    metrics = jax.device_get(metrics)
    t_done = time.perf_counter()
    versions = np.concatenate([s.versions_T for g in groups for s in g.samples])
    staleness = version - versions
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics.update(
        staleness_mean=float(staleness.mean()) if staleness.size else 0.0,
        staleness_max=int(staleness.max()) if staleness.size else 0,
        staleness_hist=dict(collections.Counter(staleness.tolist())),
        trained_tokens=int(metrics["num_tokens"]),
        packed_tokens=int(np.prod(batch.tokens.shape)),
        time_pack_s=t_pack - t0, time_train_s=t_done - t_pack)
    return metrics

  def host_params(self):
    """A host (numpy) copy of the params: safe to publish, since the state is donated."""
    return jax.device_get(self.state.params)
