"""The train step: micro-batched decoupled-PPO update over a device mesh.

`train_step` and `recompute_logp` are pure functions of (state or params, batch);
`jit_train_step` / `jit_recompute_logp` compile them with explicit shardings.
A batch is a `PackedBatch` of M micro-batches of R rows: gradients are accumulated
over M with `lax.scan`, each micro-batch's loss divided by the valid-token count of
the whole batch, so the update equals the full-batch one. Micro-batches with no valid
token (bucket padding) are skipped with `lax.cond`.

Version protocol (DESIGN.md, "Versions"): `TrainState.step` counts training steps,
one per batch, whatever happens inside. A step whose loss or gradient is not finite
changes neither params nor optimizer moments (`optax.apply_if_finite`) but still
counts; its metrics say `skipped = 1`.
"""

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from async_rl import cpu_threads, off_policy, policy, sharding
from async_rl.batching import PackedBatch
from async_rl.config import OptimizerConfig
from async_rl.models import ModelConfig, init_params


# apply_if_finite gives up and applies a non-finite update after this many in a row;
# the trainer loop stops the run long before (`train.max_consecutive_skips`).
_NEVER_GIVE_UP = np.iinfo(np.int32).max


@flax.struct.dataclass
class TrainState:
  """Params and optimizer state; `step` counts training steps (skipped ones too)."""
  step: jax.Array
  params: Any
  opt_state: Any
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, with linear warmup then constant or cosine."""
  if cfg.schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                            cfg.warmup_steps + cfg.decay_steps)
  else:
    lr = optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1)),
         optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps])
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))


def create_train_state(model_cfg: ModelConfig, tx, mesh: Mesh, key: jax.Array,
                       params=None) -> TrainState:
  """A sharded TrainState built in place: shapes first, then jit with out_shardings.

  `tx` is wrapped in `optax.apply_if_finite`, so a non-finite gradient leaves the
  params and the optimizer's moments as they were (its schedule counts only applied
  updates). With `params` given (e.g. a warm start), they are resharded and used
  instead of a random init.
  """
  tx = optax.apply_if_finite(tx, max_consecutive_errors=_NEVER_GIVE_UP)

  def init(key, params):
    params = init_params(model_cfg, key) if params is None else params
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(params), tx=tx)

  abstract = jax.eval_shape(init, key, params)
  shardings = train_state_shardings(abstract, mesh)
  return jax.jit(init, out_shardings=shardings)(key, params)


def train_state_shardings(abstract_state: TrainState, mesh: Mesh):
  params_sh = sharding.param_shardings(abstract_state.params, mesh)
  return abstract_state.replace(
      step=NamedSharding(mesh, P()), params=params_sh,
      opt_state=sharding.state_shardings(abstract_state.opt_state, abstract_state.params,
                                         mesh))


def _mb_loss(params, mb: PackedBatch, prox_logp, num_tokens, prox_version, theta_version, *,
             model_cfg, loss_fn, temperature):
  logp, ent = policy.logp_and_entropy(params, model_cfg, mb.tokens, mb.positions,
                                      mb.segment_ids, temperature=temperature)
  if prox_logp is None:
    prox_logp = off_policy.loglinear_prox_logp(logp, mb.behav_logp, mb.versions,
                                               prox_version=prox_version,
                                               theta_version=theta_version)
  return loss_fn(logp, prox_logp, mb.behav_logp, mb.advantages, mb.loss_mask,
                 mb.segment_ids, num_tokens=num_tokens, entropy=ent)


def _combine(acc, new):
  """Mean-type metrics are pre-divided by the global token count, so they add up."""
  return {k: jnp.maximum(acc[k], new[k]) if k.endswith("_max") else acc[k] + new[k]
          for k in acc}


def _minibatches(x, n):
  """[M, ...] -> [n, M / n, ...]; minibatch k takes micro-batches k, k + n, k + 2n, ...

  Striding spreads the real micro-batches (which `pack_dynamic` puts first, balanced)
  over the minibatches, and the empty padding ones with them.
  """
  return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


def _grad_fn(model_cfg, loss_fn, temperature):
  return jax.value_and_grad(functools.partial(_mb_loss, model_cfg=model_cfg, loss_fn=loss_fn,
                                              temperature=temperature), has_aux=True)


def accumulate_grads(params, micro_batches: PackedBatch, prox_logp, num_tokens, version,
                     theta_version, *, model_cfg: ModelConfig, loss_fn: Callable,
                     temperature: float = 1.0):
  """Loss, metrics and float32 gradients summed over [m, R, T] micro-batches, each loss
  divided by `num_tokens` (its update's valid tokens); empty micro-batches add zeros."""
  grad_fn = _grad_fn(model_cfg, loss_fn, temperature)
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  first = jax.tree.map(lambda x: x[0], (micro_batches, prox_logp))
  _, metrics_shape = jax.eval_shape(grad_fn, params, *first, 1.0, version, version)[0]
  zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape)

  def one(mb, prox):
    (loss, metrics), grads = grad_fn(params, mb, prox, num_tokens, version, theta_version)
    return loss, metrics, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

  def skip(mb, prox):
    return jnp.zeros((), jnp.float32), zero_metrics, zeros

  def body(carry, xs):
    loss_acc, metrics_acc, grads_acc = carry
    loss, metrics, grads = jax.lax.cond(xs[0].loss_mask.sum() > 0, one, skip, *xs)
    return (loss_acc + loss, _combine(metrics_acc, metrics),
            jax.tree.map(jnp.add, grads_acc, grads)), None

  return jax.lax.scan(body, (jnp.zeros(()), zero_metrics, zeros), (micro_batches, prox_logp))[0]


def apply_grads(state: TrainState, loss, metrics, grads, num_tokens):
  """One update from summed gradients; (state, the update's metrics). A non-finite loss
  or gradient leaves the state as it was; an empty update (no token) is none."""
  grad_norm = optax.tree.norm(grads)
  # A non-finite loss poisons the gradient, so that apply_if_finite skips the update.
  grads = jax.tree.map(
      lambda g, p: jnp.where(jnp.isfinite(loss), g, jnp.nan).astype(p.dtype),
      grads, state.params)

  def apply(state):
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    return (state.replace(params=optax.apply_updates(state.params, updates),
                          opt_state=opt_state), opt_state.last_finite)

  nonempty = num_tokens > 0
  state, finite = jax.lax.cond(nonempty, apply, lambda s: (s, jnp.array(True)), state)
  weight = num_tokens.astype(jnp.float32)
  metrics = {k: v if k.endswith("_max") or k == "num_tokens" else v * weight
             for k, v in metrics.items()}
  metrics.update(loss=loss * weight, grad_norm=grad_norm, skipped=~finite,
                 applied_updates=nonempty & finite)
  return state, metrics


def finish_step(state: TrainState, per_update):
  """The step's end: `state.step` advances; metrics over its updates (`per_update`, each
  metric stacked over them): token means weighted by each update's tokens."""
  total = jnp.maximum(per_update["num_tokens"].sum(), 1.0)
  metrics = {k: v.max() if k.endswith("_max") else v.sum() if k == "num_tokens"
             else v.sum() / total for k, v in per_update.items()}
  metrics.update(grad_norm=per_update["grad_norm"].mean(),
                 skipped=per_update["skipped"].any().astype(jnp.int32),
                 applied_updates=per_update["applied_updates"].sum(dtype=jnp.int32))
  return state.replace(step=state.step + 1), metrics


def _check_splits(batch, n):
  if batch.tokens.shape[0] % n:
    raise ValueError(f"the batch's {batch.tokens.shape[0]} micro-batches do not split into "
                     f"{n} minibatches (pad with batching.pad_micro_batches)")


def train_step(state: TrainState, batch: PackedBatch, prox_logp, *, model_cfg: ModelConfig,
               loss_fn: Callable, temperature: float = 1.0, num_minibatches: int = 1):
  """One training step on a [M, R, T] batch: `num_minibatches` updates; (state, metrics).

  Args:
    state: the train state; `state.step` (the version v) advances by one.
    batch: M micro-batches, M a multiple of `num_minibatches` (see
      `batching.pad_micro_batches`).
    prox_logp: the proximal log-probs [M, R, T] (`recompute_logp` under the params
      at the start of the step, or `batch.behav_logp` for naive PPO), or None for
      the log-linear estimate from `batch.versions` (`off_policy.loglinear_prox_logp`,
      with v_prox = v and v_θ = v + k / n before update k of n).
    model_cfg, loss_fn, temperature: the policy and its loss.
    num_minibatches: n, PPO updates in the step (AReaL's `ppo_n_minibatches`). Each
      is the mean over its own valid tokens; an empty one is no update.

  A non-finite loss or gradient leaves params and optimizer moments as they were
  (that update is skipped). Metrics are the whole batch's: token means weighted by
  each minibatch's tokens, `skipped` 1 if any update was skipped, `applied_updates`.
  """
  n = num_minibatches
  version = state.step

  def update(state, xs):
    k, minibatch, prox = xs
    num_tokens = minibatch.loss_mask.sum()
    sums = accumulate_grads(state.params, minibatch, prox, num_tokens, version,
                            version + k / n, model_cfg=model_cfg, loss_fn=loss_fn,
                            temperature=temperature)
    return apply_grads(state, *sums, num_tokens)

  _check_splits(batch, n)
  split = functools.partial(_minibatches, n=n)
  state, per_update = jax.lax.scan(
      update, state, (jnp.arange(n), jax.tree.map(split, batch), jax.tree.map(split, prox_logp)))
  return finish_step(state, per_update)


def _update_part(x, n, threads, k, j):
  """The micro-batches of update k that thread j takes: k + n (j + G i), i = 0, 1, ..."""
  return x.reshape(x.shape[0] // (n * threads), threads, n, *x.shape[1:])[:, j, k]


def _accumulate_part(params, batch, prox_logp, k, j, version, *, n, threads, **policy_kw):
  """`accumulate_grads` over thread j's share of update k's micro-batches, and the
  update's valid-token count."""
  loss_mask = batch.loss_mask
  num_tokens = loss_mask.reshape(loss_mask.shape[0] // n, n, *loss_mask.shape[1:])[:, k].sum()
  part = jax.tree.map(lambda x: _update_part(x, n, threads, k, j), (batch, prox_logp))
  sums = accumulate_grads(params, *part, num_tokens, version, version + k / n, **policy_kw)
  return sums, num_tokens


def _apply_parts(state, parts):
  """`apply_grads` with the threads' sums added up."""
  (loss, metrics, grads), num_tokens = parts[0]
  for (more_loss, more_metrics, more_grads), _ in parts[1:]:
    loss, metrics = loss + more_loss, _combine(metrics, more_metrics)
    grads = jax.tree.map(jnp.add, grads, more_grads)
  return apply_grads(state, loss, metrics, grads, num_tokens)


def default_grad_threads(mesh: Mesh, cores: int | None = None) -> int:
  """`train.grad_threads` when automatic: one per core (`cores`; default all this
  process may use) for a trainer on one CPU device (`cpu_threads`), else 1: a program
  over several devices already runs on each."""
  if mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu":
    return cores or cpu_threads.cores()
  return 1


def _finish_stacked(state, per_update):
  return finish_step(state, jax.tree.map(lambda *x: jnp.stack(x), *per_update))


class ThreadedTrainStep:
  """`train_step` with each update's micro-batches shared among G threads, for one
  CPU device (`cpu_threads`): each thread dispatches the gradient sum over its share,
  then one program adds them up and applies the update. Micro-batch k + n (j + G i)
  of the batch (n updates) goes to thread j in update k, so the batch's M must be a
  multiple of n G (`batching.pad_micro_batches`). The result equals `train_step`'s
  but for the order in which gradients are summed.

  Called as `jit_train_step`'s function: (state, batch, prox_logp) -> (state,
  metrics); the state is donated.
  """

  def __init__(self, mesh: Mesh, state_shardings: TrainState, *, threads: int,
               model_cfg: ModelConfig, loss_fn: Callable, temperature: float = 1.0,
               num_minibatches: int = 1):
    self._n, self._dispatchers = num_minibatches, cpu_threads.Dispatchers(threads, "grads")
    out_shardings = (state_shardings, NamedSharding(mesh, P()))
    self._accumulate = jax.jit(functools.partial(
        _accumulate_part, n=num_minibatches, threads=threads, model_cfg=model_cfg,
        loss_fn=loss_fn, temperature=temperature))
    self._apply = jax.jit(_apply_parts, donate_argnums=0, out_shardings=out_shardings)
    self._finish = jax.jit(_finish_stacked, donate_argnums=0, out_shardings=out_shardings)

  def __call__(self, state: TrainState, batch: PackedBatch, prox_logp):
    n, threads = self._n, len(self._dispatchers)
    _check_splits(batch, n * threads)
    per_update = []
    for k in range(n):
      # The step count (the version) stays until `finish_step`; each update donates it.
      parts = self._dispatchers.map(self._accumulate, [
          (state.params, batch, prox_logp, np.int32(k), np.int32(j), state.step)
          for j in range(threads)])
      state, metrics = self._apply(state, parts)
      per_update.append(metrics)
    return self._finish(state, per_update)


def recompute_logp(params, batch: PackedBatch, *, model_cfg: ModelConfig,
                   temperature: float = 1.0):
  """Log-probs [M, R, T] of the batch's tokens under `params` (the proximal policy)."""
  def one(mb):
    logp, _ = policy.logp_and_entropy(params, model_cfg, mb.tokens, mb.positions,
                                      mb.segment_ids, temperature=temperature)
    return logp * mb.loss_mask

  def body(_, mb):
    return None, jax.lax.cond(mb.loss_mask.sum() > 0, one, lambda mb: jnp.zeros_like(
        mb.loss_mask), mb)

  return jax.lax.scan(body, None, batch)[1]


def batch_shardings(mesh: Mesh) -> NamedSharding:
  """The sharding of every [M, R, T] field of a batch: R over data x fsdp."""
  return sharding.batch_sharding(mesh, leading_axes=1)


def jit_train_step(mesh: Mesh, state_shardings: TrainState, *, model_cfg: ModelConfig,
                   loss_fn: Callable, temperature: float = 1.0, num_minibatches: int = 1):
  """`train_step` compiled over `mesh`; the input state is donated."""
  fn = functools.partial(train_step, model_cfg=model_cfg, loss_fn=loss_fn,
                         temperature=temperature, num_minibatches=num_minibatches)
  return jax.jit(fn, in_shardings=(state_shardings, batch_shardings(mesh),
                                   sharding.batch_sharding(mesh, leading_axes=1)),
                 out_shardings=(state_shardings, NamedSharding(mesh, P())),
                 donate_argnums=0)


def jit_recompute_logp(mesh: Mesh, params_shardings, *, model_cfg: ModelConfig,
                       temperature: float = 1.0):
  fn = functools.partial(recompute_logp, model_cfg=model_cfg, temperature=temperature)
  return jax.jit(fn, in_shardings=(params_shardings, batch_shardings(mesh)),
                 out_shardings=sharding.batch_sharding(mesh, leading_axes=1))


def _recompute_part(params, batch, j, *, threads, **policy_kw):
  """`recompute_logp` of thread j's micro-batches: j, j + G, j + 2G, ..."""
  part = jax.tree.map(lambda x: x.reshape(x.shape[0] // threads, threads, *x.shape[1:])[:, j],
                      batch)
  return recompute_logp(params, part, **policy_kw)


def _interleave(parts):
  """Thread j's [M / G, R, T] log-probs back at micro-batches j, j + G, ... of [M, R, T]."""
  stacked = jnp.stack(parts, axis=1)
  return stacked.reshape(-1, *stacked.shape[2:])


class ThreadedRecompute:
  """`recompute_logp` with the micro-batches shared among G threads (one CPU device, as
  `ThreadedTrainStep`); M must be a multiple of G. Called as `jit_recompute_logp`'s
  function: (params, batch) -> [M, R, T]."""

  def __init__(self, *, threads: int, model_cfg: ModelConfig, temperature: float = 1.0):
    self._threads = cpu_threads.Dispatchers(threads, "recompute")
    self._part = jax.jit(functools.partial(_recompute_part, threads=threads,
                                           model_cfg=model_cfg, temperature=temperature))
    self._interleave = jax.jit(_interleave)

  def __call__(self, params, batch: PackedBatch):
    G = len(self._threads)
    if batch.tokens.shape[0] % G:
      raise ValueError(f"the batch's {batch.tokens.shape[0]} micro-batches do not split "
                       f"among {G} threads (pad with batching.pad_micro_batches)")
    return self._interleave(self._threads.map(
        self._part, [(params, batch, np.int32(j)) for j in range(G)]))
