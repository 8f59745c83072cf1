"""The trainer side of a run: take B admitted groups, update, publish v + 1, repeat.

It owns the `Trainer`, checkpoints, metrics and held-out evaluation, and reaches the
parameter server and the rollout workers only through their methods, so they may be
local objects (in process) or proxies to Ray actors. With η = 0 the gate lets one
batch of groups start per version, so the same loop is the synchronous baseline.

Faults: a damaged latest checkpoint falls back to the previous one
(`Checkpointer.restore_latest`); a non-finite step is skipped and counted; every
wait runs under the run's deadlines (`deadlines.Deadlines`), and a stall or a
failed rollout worker checkpoints the current version and stops the run with an
error that names it.
"""

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from tqdm import tqdm

from async_rl import config_dict, sharding
from async_rl.config import ExperimentConfig
from async_rl.generation import GeneratorPool
from async_rl.models import hf
from async_rl.param_server.buffer import length_summary
from async_rl.rewards import RewardService, RewardTask
from async_rl.rl.checkpoint import Checkpointer
from async_rl.rl.components import make_engine, reward_fn
from async_rl.rl.deadlines import Deadlines
from async_rl.rl.errors import NonFiniteError, RolloutWorkerError, StallError
from async_rl.rl.evaluate import evaluate
from async_rl.rl.metrics_log import MetricsLog
from async_rl.rl.trainer import Trainer
from async_rl.sft import warm_start
from async_rl.tasks.registry import make_task
from async_rl.timeline import Timeline

_BATCH_POLL_S = 0.5


class TrainerLoop:
  """Builds the trainer, resumes from `workdir` if it holds a checkpoint, publishes v.

  Args:
    cfg: the experiment.
    workdir: checkpoints, `metrics.jsonl`, TensorBoard files and `config.json`.
    server: the parameter server or a proxy with the same methods.
    init_params: params to start from when not resuming; by default those of
      `cfg.hf_model_dir`, else a warm start of `cfg.sft.steps`, else a random init.
    stop: set it (e.g. from a SIGTERM handler) to checkpoint and return early.
    echo: receives the one-line summary of every step, and warnings.
    publish_on_host: publish host (numpy) copies of the params, for a server in
      another process; by default they stay device arrays (`Trainer.device_params`).
    task: the task (`tasks.protocol.Task`) to warm-start on and evaluate; None builds
      `cfg.task_kind`'s.
    engine: the held-out evaluation's generator engine (None: `make_engine(cfg)`); in
      one process the rollout worker's, so its programs compile once.
  """

  def __init__(self, cfg: ExperimentConfig, workdir: str, server, *, init_params=None,
               stop: Optional[threading.Event] = None,
               echo: Callable[[str], None] = print, progress: bool = True, task=None,
               publish_on_host: bool = False, engine=None):
    self.cfg, self.workdir, self.server = cfg, workdir, server
    self.publish_on_host = publish_on_host
    self.stop = stop or threading.Event()
    self.echo, self.progress = echo, progress
    self.deadlines = Deadlines(cfg.run.warn_after_s, cfg.run.stall_timeout_s, echo)
    self._checkpoint_stalled = False
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_dict.to_dict(cfg), f, indent=2)
    self.task = make_task(cfg) if task is None else task
    self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                     keep=cfg.checkpoint.keep)
    mesh = sharding.make_mesh(cfg.mesh)
    if self.checkpointer.latest_step() is None and init_params is None:
      init_params = _initial_params(cfg, mesh, echo, self.task)
    self.trainer = Trainer(cfg, mesh, params=init_params)
    self.skipped_steps = self.applied_updates = 0
    self.damaged_checkpoints = self._maybe_restore()
    params = self._published_params()
    server.publish(self.trainer.version, params)
    self.eval_pool = GeneratorPool(engine or make_engine(cfg), params,
                                   version=self.trainer.version)
    self.eval_rewards = RewardService(num_workers=1, timeout_s=cfg.rollout.reward_timeout_s,
                                      allow_weak_sandbox=cfg.rollout.allow_weak_sandbox)
    self.log = MetricsLog(workdir)
    self.consecutive_skips = 0
    self.history: list[dict[str, Any]] = []
    self.timeline = Timeline()
    self._last_eval: tuple[Optional[int], dict[str, float]] = (None, {})

  def _published_params(self):
    if self.publish_on_host:
      return self.trainer.host_params()
    return self.trainer.device_params()

  def _maybe_restore(self) -> int:
    """Restores the newest checkpoint that reads whole; returns how many were damaged."""
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(lambda: self.trainer.state),
                            self.trainer.state_shardings)
    restored = self.checkpointer.restore_latest(
        abstract, accept=lambda state, meta: self.server.load_state_dict(meta["server"]))
    if restored is None:
      return 0
    for step, why, moved in restored.damaged:
      self.echo(f"WARNING: checkpoint {step} is damaged ({why[:200]}); moved to {moved}")
    self.trainer.restore(restored.state, restored.meta.get("packed_shapes", ()))
    self.skipped_steps = int(restored.meta["skipped_steps"])
    self.applied_updates = int(restored.meta["applied_updates"])
    self.echo(f"resumed from checkpoint {restored.step} in {self.workdir}")
    return len(restored.damaged)

  def evaluate(self) -> dict[str, float]:
    """Held-out metrics of the trainer's current params (greedy, pass@k)."""
    version = self.trainer.version
    if version > self.eval_pool.version:
      self.deadlines.result(
          self.eval_pool.update_weights(self.trainer.device_params(), version, "keep"),
          "the held-out generator's weight update")
    fn = reward_fn(self.cfg, self.task)

    def score(pairs):
      futures = [self.eval_rewards.submit(RewardTask(fn, text, self.task.reference(p)))
                 for p, text in pairs]
      return [self.deadlines.result(f, "held-out rewards") for f in futures]

    return evaluate(
        self.eval_pool, self.task.heldout(self.cfg.eval.num_prompts), score=score,
        decode=self.task.tokenizer.decode, max_new_tokens=self.cfg.generation.max_new_tokens,
        stop_token_ids=self.task.tokenizer.stop_ids, pass_k=self.cfg.eval.pass_k,
        seed=self.cfg.seed, workflow=self.task.workflow, vocab_size=self.cfg.model.vocab_size,
        wait=lambda f: self.deadlines.result(f, "held-out generation"))

  def run(self, rollouts: Sequence) -> dict[str, Any]:
    """Starts `rollouts` and trains to `cfg.num_steps` (or until `stop`).

    Raises:
      StallError: a wait passed `run.stall_timeout_s`.
      RolloutWorkerError: a rollout worker's controller failed.
      NonFiniteError: too many non-finite steps in a row.
      In the first two cases the current version is checkpointed first.
    """
    cfg = self.cfg
    start_version = self.trainer.version
    summary: dict[str, Any] = {"start_version": start_version,
                               "damaged_checkpoints": self.damaged_checkpoints}
    # The rollouts start first, so the first batch is generated while the held-out
    # evaluation of the starting params runs.
    for r in rollouts:
      r.start()
    if start_version == 0:
      summary["eval_before"] = self._eval_and_log()
    bar = tqdm(total=cfg.num_steps, initial=start_version, desc="train", unit="step",
               disable=not self.progress, dynamic_ncols=True)
    last = {"t": time.perf_counter(), "gen_tokens": 0, "restarts": 0}

    def waits():
      return {what: s for r in rollouts for what, s in r.waits().items()}

    try:
      with self.deadlines.watching(waits):
        self._steps(rollouts, bar, last)
    except (StallError, RolloutWorkerError) as e:
      raise type(e)(f"{e}\n{self._checkpoint_before_stopping()}") from e
    finally:
      bar.close()
    self._checkpoint(wait=True)
    summary["end_version"] = self.trainer.version
    summary["timeline"] = self.timeline.spans() + [s for r in rollouts for s in r.timeline()]
    if self.trainer.version >= cfg.num_steps:
      summary["eval_after"] = self._eval_and_log()
    summary["server"] = {**self.server.metrics(),
                         "length_hist": self.server.length_histograms()}
    summary["longest_unreported_wait_s"] = self.deadlines.longest_unreported_s
    return summary

  def _steps(self, rollouts, bar, last):
    cfg = self.cfg
    while self.trainer.version < cfg.num_steps and not self.stop.is_set():
      groups, waited = self._next_batch(rollouts)
      if groups is None:
        break
      metrics = self._train(groups, waited, rollouts, last)
      version = self.trainer.version
      self.echo(_line(version, metrics))
      self._count_skip(version, metrics, groups)
      bar.update(1)
      if cfg.eval.every_steps and version % cfg.eval.every_steps == 0:
        self._eval_and_log()
      if version % cfg.checkpoint.every_steps == 0:
        self._checkpoint()

  def _checkpoint_before_stopping(self) -> str:
    """Saves the current version on the way out; says what became of it."""
    if self._checkpoint_stalled:
      return "no checkpoint was written: the checkpoint itself stalled"
    try:
      self._checkpoint(wait=True)
    except Exception as e:  # noqa: BLE001 - the first error is the one to raise.
      logging.exception("could not checkpoint before stopping")
      return f"no checkpoint was written ({type(e).__name__}: {e})"
    return (f"checkpoint {self.trainer.version} holds the params; rerun the same command "
            f"to resume")

  def _next_batch(self, rollouts):
    """The next batch, within the deadlines.

    A slow batch is not a stall; no progress is. The wait counts from the last group
    that finished (admitted, dropped or rejected), and the rollout workers' own waits
    name the part that holds a group up: past the stall timeout (and `warn_after_s`
    more, for them to speak first) the batch wait is the stall only if no other wait
    is past the soft deadline.
    """
    t0 = time.perf_counter()
    finished, since = None, time.monotonic()
    what = "a training batch (no group finished)"
    with self.deadlines.waiting(what, may_stall=False) as progress:
      while not self.stop.is_set():
        self.deadlines.check()
        waited = time.monotonic() - since
        run = self.cfg.run
        if (waited >= run.stall_timeout_s + run.warn_after_s
            and self.deadlines.longest(besides=what) < run.warn_after_s):
          raise self.deadlines.stall(what, waited)
        for r in rollouts:
          if (error := r.error()) is not None:
            raise RolloutWorkerError(f"rollout worker failed:\n{error}")
        groups = self.server.get_batch(timeout=_BATCH_POLL_S)
        if groups is not None:
          return groups, time.perf_counter() - t0
        m = self.server.metrics()
        if m["admitted"] + m["rejected"] != finished:
          finished, since = m["admitted"] + m["rejected"], time.monotonic()
          progress()
    return None, time.perf_counter() - t0

  def _train(self, groups, waited, rollouts, last):
    version = self.trainer.version
    with self.timeline.span("trainer", "train"), self.deadlines.waiting(
        f"training step {version + 1}", may_stall=False):
      metrics = self.trainer.train(groups)
    t0 = time.perf_counter()
    with self.timeline.span("trainer", "publish"), self.deadlines.waiting(
        f"publishing version {version + 1}", may_stall=False):
      self.server.publish(self.trainer.version, self._published_params())
    now, logging_since = time.perf_counter(), time.time()
    self.skipped_steps += metrics["skipped"]
    self.applied_updates += metrics["applied_updates"]
    rewards = np.array([t.reward for g in groups for t in g.trajectories])
    workers = [r.metrics() for r in rollouts]
    gen_tokens = sum(w["rollout"]["generated_tokens"] for w in workers)
    server = self.server.metrics()
    metrics.update(
        reward_mean=float(rewards.mean()), accuracy=float((rewards >= 1.0).mean()),
        time_wait_s=waited, time_publish_s=now - t0,
        skipped_steps=self.skipped_steps, updates=self.applied_updates,
        train_tokens_per_s=metrics["trained_tokens"] / max(metrics["time_train_s"], 1e-9),
        gen_tokens_per_s=(gen_tokens - last["gen_tokens"]) / (now - last["t"]),
        prompts=[str(g.prompt_id) for g in groups],
        longest_unreported_wait_s=self.deadlines.longest_unreported_s,
        worker_restarts=sum(w.get("restarts", 0) for w in workers),
        lengths={k: length_summary(hist) for k, hist in self.server.length_histograms().items()},
        server={k: v for k, v in server.items() if k != "staleness_hist"},
        **(workers[0] if len(workers) == 1 else {"workers": workers}))
    if metrics["worker_restarts"] > last["restarts"]:
      self.echo(f"WARNING: a rollout worker died and was restarted (worker_restarts="
                f"{metrics['worker_restarts']}, lost_groups={server['lost_groups']})")
    last.update(t=now, gen_tokens=gen_tokens, restarts=metrics["worker_restarts"])
    self.log.write(self.trainer.version, metrics)
    self.history.append(metrics)
    self.timeline.record("trainer", "log", logging_since, time.time())
    return metrics

  def _count_skip(self, version, metrics, groups):
    """Warns about a skipped step; stops the run after too many in a row."""
    if not metrics["skipped"]:
      self.consecutive_skips = 0
      return
    self.consecutive_skips += 1
    cause = _skip_cause(metrics, groups)
    self.echo(f"WARNING: step {version} skipped ({cause}); params unchanged, "
              f"{self.consecutive_skips} in a row")
    logging.warning("step %d skipped: %s", version, cause)
    limit = self.cfg.train.max_consecutive_skips
    if self.consecutive_skips >= limit:
      raise NonFiniteError(
          f"{limit} consecutive training steps were skipped as non-finite, the last at "
          f"step {version} ({cause}); the run stops and keeps its last checkpoint "
          f"(step {self.checkpointer.latest_step()})")

  def _eval_and_log(self):
    """Evaluates and logs the current version, once: the final evaluation reuses the
    periodic one when `num_steps` is a multiple of `eval.every_steps`."""
    version = self.trainer.version
    if self._last_eval[0] == version:
      return self._last_eval[1]
    with self.timeline.span("trainer", "eval"):
      metrics = self.evaluate()
    self._last_eval = version, metrics
    self.log.write(version, {"eval": metrics})
    self.echo(f"eval v={version}: " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
    return metrics

  def _checkpoint(self, wait=False):
    """Saves the current version (Orbax's save also waits for the previous one)."""
    version = self.trainer.version
    if self.checkpointer.latest_step() == version:
      return
    meta = {"server": self.server.state_dict(), "version": version,
            "skipped_steps": self.skipped_steps, "applied_updates": self.applied_updates,
            "packed_shapes": self.trainer.packed_shapes}
    try:
      self.deadlines.call(
          lambda: self.checkpointer.save(version, self.trainer.state, meta, wait=wait),
          f"the checkpoint of version {version}")
    except StallError:
      self._checkpoint_stalled = True
      raise

  def close(self):
    closers = (("eval pool", self.eval_pool.shutdown),
               ("eval rewards", self.eval_rewards.close),
               ("checkpointer", self.checkpointer.close), ("metrics log", self.log.close))
    for name, closer in closers:
      try:
        self.deadlines.call(closer, f"closing the {name}")
      except Exception:  # keep closing the rest; an earlier error is already raised
        logging.exception("error while closing the %s", name)


def _initial_params(cfg: ExperimentConfig, mesh, echo, task):
  """A fresh run's params: the checkpoint, loaded straight onto the trainer's shardings;
  else the warm start on `task`; else None (a random init)."""
  if cfg.hf_model_dir is not None:
    return hf.load_hf(cfg.hf_model_dir, mesh=mesh, dtype=cfg.model.param_dtype)[1]
  if cfg.sft.steps:
    return warm_start(cfg, mesh, task=task, echo=echo)
  return None


def _skip_cause(metrics, groups) -> str:
  """What was not finite: the loss, the gradient norm, and any bad inputs."""
  parts = [f"loss={metrics['loss']:.4g} grad_norm={metrics['grad_norm']:.4g}"]
  trajs = [t for g in groups for t in g.trajectories]
  bad_logp = sum(int(np.count_nonzero(~np.isfinite(t.logp_T[t.loss_mask_T]))) for t in trajs)
  bad_reward = sum(not np.isfinite(t.reward) for t in trajs)
  if bad_logp:
    parts.append(f"{bad_logp} non-finite behaviour log-probs")
  if bad_reward:
    parts.append(f"{bad_reward} non-finite rewards")
  return ", ".join(parts)


def _line(version, m) -> str:
  return (f"v={version} reward={m['reward_mean']:.3f} acc={m['accuracy']:.3f} "
          f"stale={m['staleness_mean']:.2f}/{m['staleness_max']} "
          f"gen={m['gen_tokens_per_s']:.0f}tok/s train={m['train_tokens_per_s']:.0f}tok/s "
          f"wait={m['time_wait_s']:.2f}s train={m['time_train_s']:.2f}s "
          f"publish={m['time_publish_s']:.2f}s loss={m['loss']:.4f}")
