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

Stopping: once `stop` is set (a signal), the loop ends at the step it is in (a
training step, once started, runs to its end; waits for a batch or for a held-out
evaluation end at once), checkpoints the current version and returns, its summary
saying `stopped` and which checkpoint holds the params.
"""

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from async_rl.config import LogConfig
from async_rl.param_server.buffer import length_summary
from async_rl.progress import Progress, stamped
from async_rl.rl import multihost
from async_rl.rl.checkpoint import Checkpointer
from async_rl.rl.deadlines import Deadlines
from async_rl.rl.errors import (NonFiniteError, NoTrainableGroupError, RolloutWorkerError,
                                StallError, StopRequested)
from async_rl.rl.evaluate import Evaluator
from async_rl.rl.metrics_log import MetricsLog
from async_rl.rl.trainer import Trainer
from async_rl.timeline import Timeline
from async_rl.trajectory import Group

_BATCH_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a run resumes with: the checkpoint's step (None: it starts afresh), the step
  counts kept beside the train state, and how many newer checkpoints were damaged (and
  moved aside)."""
  step: Optional[int] = None
  skipped_steps: int = 0
  applied_updates: int = 0
  damaged_checkpoints: int = 0


class TrainLoop:
  """Takes B admitted groups, trains, publishes v + 1, logs, evaluates, checkpoints.

  Built by `rl.build.train_loop` with the trainer (restored), the server (which holds
  the published version), the held-out evaluator, the checkpointer, the metrics log and
  the run's deadlines.

  Args:
    num_steps: train until the version reaches it.
    eval_every: evaluate every this many steps (0: only before and after).
    checkpoint_every: checkpoint every this many steps.
    max_consecutive_skips: non-finite steps in a row that stop the run.
    max_untrainable_groups: groups finished in a row with none admitted that stop the
      run (`NoTrainableGroupError`); 0: never.
    restored: the counts the run resumes with.
    publish_on_host: publish host (numpy) copies of the params, for a server in
      another process; by default they stay device arrays (`Trainer.device_params`).
    publish_dtype: the host copies' dtype (None: the params' own).
    leader: with a trainer over several `jax.distributed` processes (this one
      process 0), announces each collective step to the others (`multihost`); the
      params it publishes and evaluates are then host copies gathered from all.
    stop: set it (e.g. from a SIGTERM handler) to checkpoint and return early; the
      evaluator's waits must end when it is set (`Deadlines.result`'s `stop`).
    echo: receives the one-line summary of every step, and warnings; give it
      `progress.echo`, so that no line glues onto the bar.
    progress: the bar of training steps (drawn on a terminal only); None: none.
    learning_rate: the optimizer's learning rate by applied update, for the log.
    decode: token ids to text, for the sample completions the log shows.
    correct_threshold: a trained sample whose reward is at least this counts as correct
      (`accuracy`), as in the held-out evaluation.
    log_cfg: what the log shows besides metrics (sample completions).
    record: receives each step and its batch before the step trains (`rl.replay`).
  """

  def __init__(self, trainer: Trainer, server, evaluator: Evaluator, checkpointer: Checkpointer,
               log: MetricsLog, deadlines: Deadlines, *, num_steps: int, eval_every: int,
               checkpoint_every: int, max_consecutive_skips: int,
               max_untrainable_groups: int = 0, restored: Restored = Restored(), publish_on_host: bool = False,
               publish_dtype: Optional[str] = None,
               leader: Optional[multihost.Leader] = None,
               stop: Optional[threading.Event] = None, echo: Callable[[str], None] = print,
               progress: Optional[Progress] = None,
               learning_rate: Callable[[int], float], decode: Callable[[Sequence[int]], str],
               correct_threshold: float = 1.0, log_cfg: LogConfig = LogConfig(),
               record: Callable[[int, Sequence[Group]], None] = lambda step, groups: None):
    self.trainer, self.server, self.evaluator = trainer, server, evaluator
    self.checkpointer, self.log, self.deadlines = checkpointer, log, deadlines
    self.num_steps = num_steps
    self.eval_every, self.checkpoint_every = eval_every, checkpoint_every
    self.max_consecutive_skips = max_consecutive_skips
    self.max_untrainable_groups = max_untrainable_groups
    self.skipped_steps, self.applied_updates = restored.skipped_steps, restored.applied_updates
    self.damaged_checkpoints = restored.damaged_checkpoints
    self.publish_on_host = publish_on_host or leader is not None
    self.publish_dtype = publish_dtype
    self.leader = leader
    self.stop = stop or threading.Event()
    self.echo, self.progress = echo, progress or Progress(echo, enabled=False)
    self.learning_rate, self.correct_threshold = learning_rate, correct_threshold
    self.decode, self.log_cfg, self.record = decode, log_cfg, record
    self._checkpoint_stalled = False
    self.consecutive_skips = 0
    self.history: list[dict[str, Any]] = []
    self.timeline = Timeline()
    # An evaluation the log already holds (of the version resumed from) is not redone.
    self._last_eval: tuple[Optional[int], Optional[dict]] = max(log.evals.items(),
                                                                default=(None, None))

  @staticmethod
  def restore(checkpointer: Checkpointer, trainer: Trainer, server,
              echo: Callable[[str], None] = print) -> Restored:
    """Restores the newest checkpoint that reads whole into `trainer` and `server` (None:
    a process without one, a `jax.distributed` follower)."""
    restored = checkpointer.restore_latest(trainer.abstract_state(), accept=None if server is None else (
        lambda state, meta: server.load_state_dict(meta["server"])))
    if restored is None:
      return Restored()
    for step, why, moved in restored.damaged:
      echo(f"WARNING: checkpoint {step} is damaged ({why[:200]}); moved to {moved}")
    trainer.restore(restored.state, restored.meta.get("packed_shapes", ()))
    echo(f"resumed from checkpoint {restored.step} in {checkpointer.directory}")
    return Restored(restored.step, int(restored.meta["skipped_steps"]),
                    int(restored.meta["applied_updates"]), len(restored.damaged))

  def _announce(self, step: str, payload=None) -> None:
    if self.leader is not None:
      self.leader.announce(step, payload)

  def _published_params(self):
    if self.publish_on_host:
      self._announce("params", self.publish_dtype)
      return self.trainer.host_params(self.publish_dtype)
    return self.trainer.device_params()

  def evaluate(self) -> dict[str, float]:
    """Held-out metrics of the trainer's current params (greedy, pass@k)."""
    if self.trainer.version > self.evaluator.pool.version:
      params = (self._published_params() if self.leader is not None
                else self.trainer.device_params())
      self.evaluator.load(params, self.trainer.version)
    return self.evaluator.evaluate()

  def run(self, rollouts: Sequence) -> dict[str, Any]:
    """Starts `rollouts` and trains to `num_steps` (or until `stop`).

    Returns the run's summary: versions, evaluations (None when stopped first),
    `stopped`, the newest `checkpoint` and its `checkpoint_dir`, the server's counters
    and the timeline.

    Raises:
      StallError: a wait passed `run.stall_timeout_s`.
      RolloutWorkerError: a rollout worker's controller failed.
      NoTrainableGroupError: `max_untrainable_groups` groups in a row could not be
        trained.
      NonFiniteError: too many non-finite steps in a row.
      In the first three cases the current version is checkpointed first.
    """
    start_version = self.trainer.version
    summary: dict[str, Any] = {"start_version": start_version,
                               "damaged_checkpoints": self.damaged_checkpoints}
    # The rollouts start first, so the first batch is generated while the held-out
    # evaluation of the starting params runs; a run stopped already starts nothing
    # that it would have to wait for (a generator's first compile).
    if not self.stop.is_set():
      for r in rollouts:
        r.start()
    if start_version == 0:
      summary["eval_before"] = self._eval_and_log()
    self.progress.start(self.num_steps, start_version)
    last = {"t": time.perf_counter(), "gen_tokens": 0, "restarts": 0, "reward_calls": 0,
            "reward_failures": 0,
            "staleness_hist": np.asarray(self.server.metrics()["staleness_hist"], np.int64)}

    def waits():
      return {what: s for r in rollouts for what, s in r.waits().items()}

    try:
      with self.deadlines.watching(waits):
        self._steps(rollouts, last)
    except (StallError, RolloutWorkerError, NoTrainableGroupError) as e:
      raise type(e)(f"{e}\n{self._checkpoint_before_stopping()}") from e
    finally:
      self.progress.close()
    self._checkpoint(wait=True)
    version = self.trainer.version
    summary.update(end_version=version, stopped=self.stop.is_set(),
                   checkpoint=self.checkpointer.latest_step(),
                   checkpoint_dir=self.checkpointer.directory)
    if self.stop.is_set():
      self.echo(f"stopped at version {version}: checkpoint {summary['checkpoint']} in "
                f"{self.checkpointer.directory} holds it; rerun the same command to resume")
    summary["timeline"] = self.timeline.spans() + [s for r in rollouts for s in r.timeline()]
    if version >= self.num_steps and not self.stop.is_set():
      summary["eval_after"] = self._eval_and_log()
    summary["server"] = {**self.server.metrics(),
                         "length_hist": self.server.length_histograms()}
    summary["longest_unreported_wait_s"] = self.deadlines.longest_unreported_s
    return summary

  def _steps(self, rollouts, last):
    while self.trainer.version < self.num_steps and not self.stop.is_set():
      groups, waited = self._next_batch(rollouts)
      if groups is None:
        break
      metrics = self._train(groups, waited, rollouts, last)
      version = self.trainer.version
      self.echo(stamped(_line(version, metrics)))
      self._count_skip(version, metrics, groups)
      self.progress.update_to(version)
      every = self.log_cfg.samples_every
      if every and version % every == 0:
        self.log.write_samples(version, _samples(groups, self.decode, self.log_cfg,
                                                 self.correct_threshold))
      if self.eval_every and version % self.eval_every == 0:
        self._eval_and_log()
      if version % self.checkpoint_every == 0:
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
    is past the soft deadline. Groups that finish but cannot be trained are progress
    of another kind: `max_untrainable_groups` of them in a row stop the run.
    """
    t0 = time.perf_counter()
    finished, since = None, time.monotonic()
    admitted = untrainable_before = None
    what = "a training batch (no group finished)"
    with self.deadlines.waiting(what, may_stall=False) as progress:
      while not self.stop.is_set():
        self.deadlines.check()
        waited = time.monotonic() - since
        d = self.deadlines
        if (waited >= d.stall_timeout_s + d.warn_after_s
            and d.longest(besides=what) < d.warn_after_s):
          raise self.deadlines.stall(what, waited)
        for r in rollouts:
          if (error := r.error()) is not None:
            raise RolloutWorkerError(f"rollout worker failed: {error}")
        groups = self.server.get_batch(timeout=_BATCH_POLL_S)
        if groups is not None:
          return groups, time.perf_counter() - t0
        m = self.server.metrics()
        if m["admitted"] + m["rejected"] != finished:
          finished, since = m["admitted"] + m["rejected"], time.monotonic()
          progress()
        untrainable = m["rejected"] + m["dropped"]
        if m["admitted"] != admitted:
          admitted, untrainable_before = m["admitted"], untrainable
        elif 0 < self.max_untrainable_groups <= untrainable - untrainable_before:
          raise NoTrainableGroupError(_untrainable_cause(
              untrainable - untrainable_before, self.max_untrainable_groups, m,
              [r.metrics() for r in rollouts]))
    return None, time.perf_counter() - t0

  def _train(self, groups, waited, rollouts, last):
    version = self.trainer.version
    with self.timeline.span("trainer", "train"), self.deadlines.waiting(
        f"training step {version + 1}", may_stall=False):
      self._announce("train", groups)
      t0 = time.perf_counter()
      self.record(version + 1, groups)
      record_s = time.perf_counter() - t0
      metrics = self.trainer.train(groups)
    t0 = time.perf_counter()
    with self.timeline.span("trainer", "publish"), self.deadlines.waiting(
        f"publishing version {version + 1}", may_stall=False):
      self.server.publish(self.trainer.version, self._published_params())
    now, logging_since = time.perf_counter(), time.time()
    server = self.server.metrics()
    # The server counted the batch's tokens by staleness when it handed the batch out.
    hist = np.asarray(server["staleness_hist"], np.int64)
    counts = hist - np.pad(last["staleness_hist"], (0, hist.size - last["staleness_hist"].size))
    last["staleness_hist"] = hist
    metrics.update(_staleness(counts))
    self.skipped_steps += metrics["skipped"]
    self.applied_updates += metrics["applied_updates"]
    rewards = np.array([t.reward for g in groups for t in g.trajectories])
    workers = [r.metrics() for r in rollouts]
    gen_tokens = sum(w["rollout"]["generated_tokens"] for w in workers)
    reward_calls = sum(w["rewards"]["calls"] for w in workers)
    reward_failures = sum(w["rewards"]["errors"] + w["rewards"]["timeouts"] for w in workers)
    metrics.update(
        lr=float(self.learning_rate(max(self.applied_updates - 1, 0))),
        reward_mean=float(rewards.mean()),
        accuracy=float((rewards >= self.correct_threshold).mean()),
        time_wait_s=waited, time_publish_s=now - t0, time_record_s=record_s,
        skipped_steps=self.skipped_steps, updates=self.applied_updates,
        train_tokens_per_s=metrics["trained_tokens"] / max(metrics["time_train_s"], 1e-9),
        gen_tokens_per_s=(gen_tokens - last["gen_tokens"]) / (now - last["t"]),
        reward_error_rate=((reward_failures - last["reward_failures"])
                           / max(reward_calls - last["reward_calls"], 1)),
        prompts=[str(g.prompt_id) for g in groups],
        longest_unreported_wait_s=self.deadlines.longest_unreported_s,
        worker_restarts=sum(w.get("restarts", 0) for w in workers),
        lengths={k: length_summary(hist) for k, hist in self.server.length_histograms().items()},
        server={k: v for k, v in server.items() if k != "staleness_hist"},
        **(workers[0] if len(workers) == 1 else {"workers": workers}))
    if metrics["worker_restarts"] > last["restarts"]:
      self.echo(f"WARNING: a rollout worker died and was restarted (worker_restarts="
                f"{metrics['worker_restarts']}, lost_groups={server['lost_groups']})")
    last.update(t=now, gen_tokens=gen_tokens, restarts=metrics["worker_restarts"],
                reward_calls=reward_calls, reward_failures=reward_failures)
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
    limit = self.max_consecutive_skips
    if self.consecutive_skips >= limit:
      raise NonFiniteError(
          f"{limit} consecutive training steps were skipped as non-finite, the last at "
          f"step {version} ({cause}); the run stops and keeps its last checkpoint "
          f"(step {self.checkpointer.latest_step()})")

  def _eval_and_log(self) -> Optional[dict]:
    """Evaluates and logs the current version, once: the final evaluation reuses the
    periodic one when `num_steps` is a multiple of `eval.every_steps`, and a resumed
    run the one logged of the version it resumes from. None if stopped meanwhile."""
    version = self.trainer.version
    if self._last_eval[0] == version:
      return self._last_eval[1]
    try:
      with self.timeline.span("trainer", "eval"):
        metrics = self.evaluate()
    except StopRequested:
      return None
    self._last_eval = version, metrics
    self.log.write(version, {"eval": metrics})
    self.echo(stamped(_eval_line(version, metrics)))
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
          lambda: self._save(version, meta, wait),
          f"the checkpoint of version {version}")
    except StallError:
      self._checkpoint_stalled = True
      raise

  def _save(self, version, meta, wait):
    self._announce("checkpoint", (version, meta, wait))
    self.checkpointer.save(version, self.trainer.state, meta, wait=wait)

  def close(self):
    closers = (("followers", lambda: self._announce("stop")),
               ("held-out evaluator", self.evaluator.close),
               ("checkpointer", self.checkpointer.close), ("metrics log", self.log.close))
    for name, closer in closers:
      try:
        self.deadlines.call(closer, f"closing the {name}")
      except Exception:  # keep closing the rest; an earlier error is already raised
        logging.exception("error while closing the %s", name)


def _staleness(counts) -> dict:
  """A batch's staleness metrics from `counts[k]`, its trained tokens of staleness k."""
  tokens = int(counts.sum())
  return {"staleness_mean": float(np.arange(counts.size) @ counts) / max(tokens, 1),
          "staleness_max": int(np.flatnonzero(counts)[-1]) if tokens else 0,
          "staleness_hist": {k: int(c) for k, c in enumerate(counts) if c}}


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


def _eval_line(version, m) -> str:
  scores = " ".join(f"{k}={v:.3f}" for k, v in m.items() if not isinstance(v, dict))
  failed = {k: int(m["rewards"][k]) for k in ("errors", "timeouts") if m["rewards"][k]}
  return f"eval v={version}: {scores}" + "".join(f" reward_{k}={n}" for k, n in failed.items())


def _line(version, m) -> str:
  return (f"v={version} reward={m['reward_mean']:.3f} acc={m['accuracy']:.3f} "
          f"stale={m['staleness_mean']:.2f}/{m['staleness_max']} "
          f"gen={m['gen_tokens_per_s']:.0f}tok/s train={m['train_tokens_per_s']:.0f}tok/s "
          f"wait={m['time_wait_s']:.2f}s update={m['time_train_s']:.2f}s "
          f"publish={m['time_publish_s']:.2f}s loss={m['loss']:.4f} lr={m['lr']:.3g} "
          f"reward_err={m['reward_error_rate']:.2f}")


def _untrainable_cause(n, limit, server, workers) -> str:
  """Why `n` groups in a row could not be trained, from the counts so far."""
  counts = {k: sum(w["rollout"][k] for w in workers) for k in ("too_long", "failed", "filtered")}
  reasons = [f"{counts['too_long']} had prompts longer than task.max_prompt_len",
             f"{counts['failed']} failed to generate or score",
             f"{counts['filtered']} were filtered as all rewards equal "
             f"(rollout.dynamic_filter)",
             f"{server['dropped']} were dropped as staler than staleness.max_staleness"]
  return (f"{n} groups in a row finished and none could be trained (run."
          f"max_untrainable_groups={limit}); of all groups so far, {'; '.join(reasons)}")


def _samples(groups: Sequence[Group], decode, log_cfg: LogConfig,
             correct_threshold: float) -> list[dict]:
  """The first `log_cfg.num_samples` completions of a batch, with their prompts and
  rewards, as text cut to `log_cfg.sample_chars`."""
  trajs = [(g.prompt_id, t) for g in groups for t in g.trajectories][:log_cfg.num_samples]
  clip = lambda ids: _clip(decode([int(i) for i in ids]), log_cfg.sample_chars)
  return [{"prompt_id": str(prompt_id), "reward": float(t.reward),
           "correct": bool(t.reward >= correct_threshold), "finish_reason": t.finish_reason,
           "prompt": clip(t.prompt_P), "completion": clip(t.completion_C)}
          for prompt_id, t in trajs]


def _clip(text: str, limit: int) -> str:
  """`text`, or when longer than `limit` its beginning and end around a count of the
  characters cut: a prompt's question is at its end, a completion's answer too."""
  if len(text) <= limit:
    return text
  keep = limit - len(_cut(len(text)))  # the count of those cut has no more digits
  return text[:keep // 2] + _cut(len(text) - keep) + text[len(text) - (keep - keep // 2):]


def _cut(n: int) -> str:
  return f" [...{n} characters...] "
