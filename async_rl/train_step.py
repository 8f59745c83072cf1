"""The train step: micro-batched decoupled-PPO update over a device mesh.

`train_step` and `recompute_logp` are pure functions of (state or params, batch);
`jit_train_step` / `jit_recompute_logp` compile them with explicit shardings, and the
attention kernels of the mesh's devices (`models.attention.kernels_for`).
A batch is a `PackedBatch` of M micro-batches of R rows: gradients are accumulated
over M with `lax.scan`, each micro-batch's loss divided by the valid-token count of
the whole batch, so the update equals the full-batch one. Micro-batches with no valid
token (bucket padding) are skipped with `lax.cond`.

Version protocol (docs/architecture.md, "Versions"): `TrainState.step` counts
training steps, one per batch, whatever happens inside. A step whose loss or gradient
is not finite changes neither params nor optimizer moments (`optax.apply_if_finite`)
but still counts; its metrics say `skipped = 1`.
"""

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from async_rl import off_policy, policy, sharding
from async_rl.batching import PackedBatch
from async_rl.config import LoraConfig, ModelConfig, OptimizerConfig
from async_rl.models import init_params, lora
from async_rl.models.attention import kernels_for


# apply_if_finite gives up and applies a non-finite update after this many in a row;
# the trainer loop stops the run long before (`train.max_consecutive_skips`).
_NEVER_GIVE_UP = np.iinfo(np.int32).max


@flax.struct.dataclass
class TrainState:
  """Params and optimizer state; `step` counts training steps (skipped ones too).

  `ref_params`, when the objective has a KL penalty, are the reference policy: the
  params the run started from, frozen (no step changes them), sharded as `params` and
  checkpointed with them; None otherwise.

  With LoRA (`models.lora`), `params` are the adapters, the only params trained, and
  `base` the frozen model they adapt (held once: it is also the reference policy,
  with the adapters zeroed, so `ref_params` is None); `lora_scale` is their alpha / r.
  """
  step: jax.Array
  params: Any
  opt_state: Any
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  ref_params: Any = None
  base: Any = None
  lora_scale: float = flax.struct.field(pytree_node=False, default=1.0)

  def model_params(self, params=None):
    """What the model functions take for `params` (default: the trained ones): with
    LoRA, the base with those adapters attached."""
    params = self.params if params is None else params
    return params if self.base is None else lora.attach(self.base, params, self.lora_scale)

  def reference_params(self):
    """The reference policy's model params: `ref_params`, or with LoRA the base with
    its adapters zeroed (no second copy of the base)."""
    if self.base is None:
      return self.ref_params
    return self.model_params(lora.zeros_like(self.params))


def learning_rate(cfg: OptimizerConfig) -> optax.Schedule:
  """The learning rate by applied update: linear warmup, then constant or cosine."""
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                              cfg.warmup_steps + cfg.decay_steps)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1)),
       optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, at the `learning_rate` schedule."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay))


def create_train_state(model_cfg: ModelConfig, tx, mesh: Mesh, key: jax.Array,
                       params=None, *, reference: bool = False,
                       lora_cfg: LoraConfig = LoraConfig()
                       ) -> tuple[TrainState, TrainState]:
  """A sharded TrainState built in place, and its shardings: shapes first, then jit with
  out_shardings.

  `tx` is wrapped in `optax.apply_if_finite`, so a non-finite gradient leaves the
  params and the optimizer's moments as they were (its schedule counts only applied
  updates). With `params` given (e.g. a warm start), they are resharded and used
  instead of a random init. With `reference`, the state also keeps a copy of these
  initial params as `ref_params`, the frozen reference policy. With `lora_cfg` enabled
  those params are the frozen `base` instead, the trained `params` are new LoRA
  adapters on it (`models.lora.init_adapters`, from `key` folded with 1) and the
  optimizer state is theirs alone; the reference policy is then the base itself.
  """
  tx = optax.apply_if_finite(tx, max_consecutive_errors=_NEVER_GIVE_UP)

  def init(key, params):
    params = init_params(model_cfg, key) if params is None else params
    if lora_cfg.enabled:
      trained = lora.init_adapters(model_cfg, lora_cfg, jax.random.fold_in(key, 1))
      return TrainState(step=jnp.zeros((), jnp.int32), params=trained,
                        opt_state=tx.init(trained), tx=tx, base=params,
                        lora_scale=lora_cfg.scale)
    # A copy, not the same arrays: the step donates `params` and keeps `ref_params`.
    ref_params = jax.tree.map(jnp.copy, params) if reference else None
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(params), tx=tx, ref_params=ref_params)

  abstract = jax.eval_shape(init, key, params)
  shardings = train_state_shardings(abstract, mesh)
  return jax.jit(init, out_shardings=shardings)(key, params), shardings


def train_state_shardings(abstract_state: TrainState, mesh: Mesh):
  params_sh = sharding.param_shardings(abstract_state.params, mesh)
  return abstract_state.replace(
      step=NamedSharding(mesh, P()), params=params_sh,
      opt_state=sharding.state_shardings(abstract_state.opt_state, abstract_state.params,
                                         mesh),
      ref_params=None if abstract_state.ref_params is None else params_sh,
      base=None if abstract_state.base is None else sharding.param_shardings(
          abstract_state.base, mesh))


def _logp_and_entropy(params, mb: PackedBatch, *, model_cfg, temperature, rows, kernels):
  """`policy.logp_and_entropy` of a micro-batch's loss-mask tokens (0 elsewhere), on the
  truncated support its tokens were sampled from where the batch carries one."""
  return policy.logp_and_entropy(params, model_cfg, mb.tokens, mb.positions, mb.segment_ids,
                                 temperature=temperature, top_k_BT=mb.top_k,
                                 top_p_BT=mb.top_p, scored_BT=mb.loss_mask != 0, rows=rows,
                                 kernels=kernels)


def mismatch(logp, behav_logp, on, num_tokens):
  """The behaviour-vs-recomputed log-ratio d = log π_θ - log π_behav over the tokens
  `on`, as metrics that add up over micro-batches and updates (`finish_step` turns
  them into the step's): `mismatch_mean` (of d), `mismatch_k3` (the k3 estimate of
  KL(π_behav || π_θ), exp(d) - 1 - d, for tokens drawn from π_behav),
  `mismatch_abs_max` (max |d|) and `mismatch_tokens` (how many)."""
  d = jnp.where(on, jax.lax.stop_gradient(logp) - behav_logp, 0.0)
  return {"mismatch_mean": d.sum() / num_tokens,
          "mismatch_k3": off_policy.divergence(-d, "kl_k3").sum() / num_tokens,
          "mismatch_abs_max": jnp.abs(d).max(),
          "mismatch_tokens": on.sum() / num_tokens}


def _mb_loss(params, mb: PackedBatch, prox_logp, num_tokens, prox_version, theta_version,
             base, *, model_cfg, loss_fn, temperature, rows, kernels, lora_scale):
  if base is not None:  # LoRA: `params` are the adapters on the frozen base
    params = lora.attach(base, params, lora_scale)
  logp, ent = _logp_and_entropy(params, mb, model_cfg=model_cfg, temperature=temperature,
                                rows=rows, kernels=kernels)
  if prox_logp is None:
    prox_logp = off_policy.loglinear_prox_logp(logp, mb.behav_logp, mb.versions,
                                               prox_version=prox_version,
                                               theta_version=theta_version)
  # Only a batch with reference log-probs passes them, so losses without a KL term
  # (the SFT loss) keep their signature.
  ref = {} if mb.ref_logp is None else {"ref_logp": mb.ref_logp}
  loss, metrics = loss_fn(logp, prox_logp, mb.behav_logp, mb.advantages, mb.loss_mask,
                          mb.segment_ids, num_tokens=num_tokens, entropy=ent, **ref)
  if mb.versions is not None:
    # Tokens the params being trained produced, before the first update moves them:
    # their recorded and recomputed log-probs differ only by rounding.
    on = (mb.versions == prox_version) & (mb.loss_mask != 0) & (theta_version == prox_version)
    metrics = {**metrics, **mismatch(logp, mb.behav_logp, on, num_tokens)}
  return loss, metrics


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


def _grad_fn(model_cfg, loss_fn, temperature, rows, kernels, lora_scale):
  return jax.value_and_grad(functools.partial(_mb_loss, model_cfg=model_cfg, loss_fn=loss_fn,
                                              temperature=temperature, rows=rows,
                                              kernels=kernels, lora_scale=lora_scale),
                            has_aux=True)


def accumulate_grads(params, micro_batches: PackedBatch, prox_logp, num_tokens, version,
                     theta_version, *, model_cfg: ModelConfig, loss_fn: Callable,
                     temperature: float = 1.0, rows=None, kernels: str = "xla", base=None,
                     lora_scale: float = 1.0):
  """Loss, metrics and float32 gradients summed over [m, R, T] micro-batches, each loss
  divided by `num_tokens` (its update's valid tokens); empty micro-batches add zeros.
  `rows`: the sharding of a micro-batch's rows, as `models.hidden` takes it; `kernels`:
  the attention's, as `models.hidden` takes them. With a `base`, `params` are LoRA
  adapters on it at `lora_scale` (`TrainState`), and the gradients theirs alone."""
  grad_fn = _grad_fn(model_cfg, loss_fn, temperature, rows, kernels, lora_scale)
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  first = jax.tree.map(lambda x: x[0], (micro_batches, prox_logp))
  _, metrics_shape = jax.eval_shape(grad_fn, params, *first, 1.0, version, version, base)[0]
  zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape)

  def one(mb, prox):
    (loss, metrics), grads = grad_fn(params, mb, prox, num_tokens, version, theta_version,
                                     base)
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
  if "mismatch_tokens" in metrics:  # token means over the mismatch's own tokens
    share = metrics["mismatch_tokens"]
    for k in ("mismatch_mean", "mismatch_k3"):
      metrics[k] = jnp.where(share > 0, metrics[k] / jnp.where(share > 0, share, 1.0), 0.0)
    metrics["mismatch_tokens"] = jnp.round(share * total)
  return state.replace(step=state.step + 1), metrics


def _check_splits(batch, n):
  if batch.tokens.shape[0] % n:
    raise ValueError(f"the batch's {batch.tokens.shape[0]} micro-batches do not split into "
                     f"{n} minibatches (pad with batching.pad_micro_batches)")


def train_step(state: TrainState, batch: PackedBatch, prox_logp, *, model_cfg: ModelConfig,
               loss_fn: Callable, temperature: float = 1.0, num_minibatches: int = 1,
               rows=None, kernels: str = "xla"):
  """One training step on a [M, R, T] batch: `num_minibatches` updates; (state, metrics).

  Args:
    state: the train state; `state.step` (the version v) advances by one.
    batch: M micro-batches, M a multiple of `num_minibatches` (see
      `batching.pad_micro_batches`); with `ref_logp` (`recompute_logp` under
      `state.ref_params`) when the loss has a KL term.
    prox_logp: the proximal log-probs [M, R, T] (`recompute_logp` under the params
      at the start of the step, or `batch.behav_logp` for naive PPO), or None for
      the log-linear estimate from `batch.versions` (`off_policy.loglinear_prox_logp`,
      with v_prox = v and v_θ = v + k / n before update k of n).
    model_cfg, loss_fn, temperature: the policy and its loss.
    num_minibatches: n, PPO updates in the step (AReaL's `ppo_n_minibatches`). Each
      is the mean over its own valid tokens; an empty one is no update.
    rows: the sharding of a micro-batch's rows' activations (`rows_sharding`), or
      None on one device.
    kernels: the attention kernels (`models.attention.KERNELS`), static.

  A non-finite loss or gradient leaves params and optimizer moments as they were
  (that update is skipped). Metrics are the whole batch's: token means weighted by
  each minibatch's tokens, `skipped` 1 if any update was skipped, `applied_updates`;
  with `batch.versions`, the `mismatch` of the tokens of version v, measured in the
  first update's forward pass (before it moves the params).
  """
  n = num_minibatches
  version = state.step

  def update(state, xs):
    k, minibatch, prox = xs
    num_tokens = minibatch.loss_mask.sum()
    sums = accumulate_grads(state.params, minibatch, prox, num_tokens, version,
                            version + k / n, model_cfg=model_cfg, loss_fn=loss_fn,
                            temperature=temperature, rows=rows, kernels=kernels,
                            base=state.base, lora_scale=state.lora_scale)
    return apply_grads(state, *sums, num_tokens)

  _check_splits(batch, n)
  split = functools.partial(_minibatches, n=n)
  state, per_update = jax.lax.scan(
      update, state, (jnp.arange(n), jax.tree.map(split, batch), jax.tree.map(split, prox_logp)))
  return finish_step(state, per_update)


def recompute_logp(params, batch: PackedBatch, *, model_cfg: ModelConfig,
                   temperature: float = 1.0, rows=None, kernels: str = "xla"):
  """Log-probs [M, R, T] of the batch's tokens under `params` (the proximal policy);
  `rows` and `kernels` as `train_step`'s."""
  def one(mb):
    logp, _ = _logp_and_entropy(params, mb, model_cfg=model_cfg, temperature=temperature,
                                rows=rows, kernels=kernels)
    return logp * mb.loss_mask

  def body(_, mb):
    return None, jax.lax.cond(mb.loss_mask.sum() > 0, one, lambda mb: jnp.zeros_like(
        mb.loss_mask), mb)

  return jax.lax.scan(body, None, batch)[1]


def batch_shardings(mesh: Mesh) -> NamedSharding:
  """The sharding of every [M, R, T] field of a batch: R over data x fsdp."""
  return sharding.batch_sharding(mesh, leading_axes=1)


def rows_sharding(mesh: Mesh) -> NamedSharding:
  """A micro-batch's activations [R, T, ...]: R over data x fsdp, as its batch."""
  return sharding.batch_sharding(mesh, leading_axes=0)


def jit_train_step(mesh: Mesh, state_shardings: TrainState, *, model_cfg: ModelConfig,
                   loss_fn: Callable, temperature: float = 1.0, num_minibatches: int = 1,
                   kernels: str | None = None):
  """`train_step` compiled over `mesh`; the input state is donated. `kernels`: the
  attention's, by default those of the mesh's devices (`models.attention.kernels_for`)."""
  fn = functools.partial(train_step, model_cfg=model_cfg, loss_fn=loss_fn,
                         temperature=temperature, num_minibatches=num_minibatches,
                         rows=rows_sharding(mesh),
                         kernels=kernels or kernels_for(mesh.devices.flat))
  return jax.jit(fn, in_shardings=(state_shardings, batch_shardings(mesh),
                                   sharding.batch_sharding(mesh, leading_axes=1)),
                 out_shardings=(state_shardings, NamedSharding(mesh, P())),
                 donate_argnums=0)


def jit_recompute_logp(mesh: Mesh, params_shardings, *, model_cfg: ModelConfig,
                       temperature: float = 1.0, kernels: str | None = None):
  """`recompute_logp` compiled over `mesh`, for params on `params_shardings`; `kernels`
  as `jit_train_step`'s."""
  fn = functools.partial(recompute_logp, model_cfg=model_cfg, temperature=temperature,
                         rows=rows_sharding(mesh),
                         kernels=kernels or kernels_for(mesh.devices.flat))
  return jax.jit(fn, in_shardings=(params_shardings, batch_shardings(mesh)),
                 out_shardings=sharding.batch_sharding(mesh, leading_axes=1))


def model_shardings(state_shardings: TrainState):
  """The shardings of `TrainState.model_params` (with LoRA: base and adapters joined)."""
  if state_shardings.base is None:
    return state_shardings.params
  return lora.join(state_shardings.base, state_shardings.params)


@dataclasses.dataclass(frozen=True)
class StepFns:
  """A run's compiled update and proximal recompute.

  Attributes:
    step: (state, batch, prox_logp) -> (state, metrics), `train_step`; the state is
      donated.
    recompute: (model params, batch) -> their log-probs [M, R, T], `recompute_logp`:
      the proximal ones under `TrainState.model_params`, the reference policy's under
      `TrainState.reference_params`.
    micro_batch_multiple: a batch's M must be a multiple of it
      (`batching.pad_micro_batches`).
  """
  step: Callable
  recompute: Callable
  micro_batch_multiple: int


def jit_steps(mesh: Mesh, state_shardings: TrainState, *, model_cfg: ModelConfig,
              loss_fn: Callable, temperature: float = 1.0, num_minibatches: int = 1,
              kernels: str | None = None) -> StepFns:
  """`train_step` and `recompute_logp` compiled over `mesh`; `kernels` as
  `jit_train_step`'s."""
  return StepFns(
      jit_train_step(mesh, state_shardings, model_cfg=model_cfg, loss_fn=loss_fn,
                     temperature=temperature, num_minibatches=num_minibatches,
                     kernels=kernels),
      jit_recompute_logp(mesh, model_shardings(state_shardings), model_cfg=model_cfg,
                         temperature=temperature, kernels=kernels),
      num_minibatches)
