"""The trainer side of a run: take B admitted groups, update, publish v + 1, repeat.

It owns the `Trainer`, checkpoints, metrics and held-out evaluation, and reaches the
parameter server and the rollout workers only through their methods, so they may be
local objects (in process) or proxies to Ray actors. With η = 0 the gate lets one
batch of groups start per version, so the same loop is the synchronous baseline.

Faults: a damaged latest checkpoint falls back to the previous one
(`Checkpointer.restore_latest`); a non-finite step is skipped and counted; a batch
with a token outside the staleness bound or newer than the params stops the run
before it trains (`VersionError`, naming the sample); every wait runs under the run's
deadlines (`deadlines.Deadlines`), and a stall or a failed rollout worker checkpoints
the current version and stops the run with an error that names it.

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
from async_rl.param_server.buffer import check_versions
from async_rl.progress import Progress, stamped
from async_rl.rl import multihost
from async_rl.rl.checkpoint import Checkpointer, Meta, Restored
from async_rl.rl.deadlines import Deadlines
from async_rl.rl.errors import (NonFiniteError, NoTrainableGroupError, RolloutWorkerError,
                                StallError, StopRequested, VersionError)
from async_rl.rl.evaluate import Evaluator
from async_rl.rl.metrics_log import MetricsLog
from async_rl.rl.schedule import Recorder
from async_rl.rl.step_metrics import (Since, eval_line, samples, skip_cause, step_line,
                                      step_metrics, untrainable_cause)
from async_rl.rl.trainer import Trainer
from async_rl.timeline import Timeline

_BATCH_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the loop does, and when.

  Args:
    num_steps: train until the version reaches it.
    eval_every: evaluate every this many steps (0: only before and after).
    checkpoint_every: checkpoint every this many steps.
    max_consecutive_skips: non-finite steps in a row that stop the run.
    learning_rate: the optimizer's learning rate by applied update, for the log.
    decode: token ids to text, for the sample completions the log shows.
    max_untrainable_groups: groups finished in a row with none admitted that stop the
      run (`NoTrainableGroupError`); 0: never.
    correct_threshold: a trained sample whose reward is at least this counts as correct
      (`accuracy`), as in the held-out evaluation.
    log: what the log shows besides metrics (sample completions).
    max_staleness: every token a batch trains must be at most this many versions older
      than the params it trains (None: no bound, as with `staleness.on_stale="admit"`);
      a batch that breaks it, or holds a token newer than them, stops the run.
  """
  num_steps: int
  eval_every: int
  checkpoint_every: int
  max_consecutive_skips: int
  learning_rate: Callable[[int], float]
  decode: Callable[[Sequence[int]], str]
  max_untrainable_groups: int = 0
  correct_threshold: float = 1.0
  log: LogConfig = LogConfig()
  max_staleness: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Outputs:
  """Where the run's results go.

  Args:
    checkpointer: the train state and the loop's counts, every `checkpoint_every`.
    log: the metrics of every step and evaluation, and sample completions.
    echo: receives the one-line summary of every step, and warnings; give it
      `progress.echo`, so that no line glues onto the bar.
    progress: the bar of training steps (drawn on a terminal only); None: none.
    schedule: records each step's batch before the step trains, pruned as the
      checkpoints go (`rl.schedule`); by default nothing is recorded.
  """
  checkpointer: Checkpointer
  log: MetricsLog
  echo: Callable[[str], None] = print
  progress: Optional[Progress] = None
  schedule: Recorder = Recorder()


@dataclasses.dataclass(frozen=True)
class Publishing:
  """How the trainer's params (with LoRA, its adapters) reach the server and the
  evaluator.

  Args:
    on_host: publish host (numpy) copies of the params: for a server in another
      process, or gathered from every process under a `leader`; else they stay device
      arrays (`Trainer.device_params`).
    dtype: the host copies' dtype (None: the params' own).
    leader: with a trainer over several `jax.distributed` processes (this one process
      0), announces each collective step to the others (`multihost`), and the params
      it evaluates are host copies too.
  """
  on_host: bool = False
  dtype: Optional[str] = None
  leader: Optional[multihost.Leader] = None

  def announce(self, step: str, payload=None) -> None:
    if self.leader is not None:
      self.leader.announce(step, payload)

  def params(self, trainer: Trainer):
    """The trainer's params to publish: the model's, or a LoRA run's adapters alone,
    which every generator merges into the base it holds."""
    if self.on_host:
      self.announce("params", self.dtype)
      return trainer.host_params(self.dtype)
    return trainer.device_params()


class TrainLoop:
  """Takes B admitted groups, trains, publishes v + 1, logs, evaluates, checkpoints.

  Built by `rl.build.train_loop` with the trainer (restored), the server (which holds
  the published version), the held-out evaluator and the run's deadlines, from parts.

  Args:
    settings: what the loop does, and when.
    outputs: where its checkpoints, metrics and lines go.
    publishing: how it publishes params.
    restored: the counts the run resumes with.
    stop: set it (e.g. from a SIGTERM handler) to checkpoint and return early; the
      evaluator's waits must end when it is set (`Deadlines.result`'s `stop`).
  """

  def __init__(self, trainer: Trainer, server, evaluator: Evaluator, deadlines: Deadlines,
               settings: Settings, outputs: Outputs, publishing: Publishing = Publishing(), *,
               restored: Restored = Restored(), stop: Optional[threading.Event] = None):
    self.trainer, self.server, self.evaluator = trainer, server, evaluator
    self.deadlines, self.settings, self.publishing = deadlines, settings, publishing
    self.checkpointer, self.log = outputs.checkpointer, outputs.log
    self.echo, self.schedule = outputs.echo, outputs.schedule
    self.progress = outputs.progress or Progress(outputs.echo, enabled=False)
    self.skipped_steps = restored.meta.skipped_steps
    self.applied_updates = restored.meta.applied_updates
    self.damaged_checkpoints = len(restored.damaged)
    self.stop = stop or threading.Event()
    self._checkpoint_stalled = False
    self.consecutive_skips = 0
    self.history: list[dict[str, Any]] = []
    self.timeline = Timeline()
    # An evaluation the log already holds (of the version resumed from) is not redone.
    self._last_eval: tuple[Optional[int], Optional[dict]] = max(self.log.evals.items(),
                                                                default=(None, None))

  @staticmethod
  def restore(checkpointer: Checkpointer, trainer: Trainer, server,
              echo: Callable[[str], None] = print) -> Restored:
    """Restores the newest checkpoint that reads whole into `trainer` and `server` (None:
    a process without one, a `jax.distributed` follower)."""
    accept = None if server is None else (
        lambda state, meta: server.load_state_dict(meta.server))
    state, restored = checkpointer.restore_latest(trainer.abstract_state(), accept=accept)
    if restored.step is None:
      return restored
    for step, why, moved in restored.damaged:
      echo(f"WARNING: checkpoint {step} is damaged ({why[:200]}); moved to {moved}")
    trainer.restore(state, restored.meta.packed_shapes)
    echo(f"resumed from checkpoint {restored.step} in {checkpointer.directory}")
    return restored

  def evaluate(self) -> dict[str, float]:
    """Held-out metrics of the trainer's current params (greedy, pass@k)."""
    if self.trainer.version > self.evaluator.pool.version:
      params = (self.publishing.params(self.trainer) if self.publishing.leader is not None
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
    self.progress.start(self.settings.num_steps, start_version)
    since = Since(time.perf_counter(),
                  np.asarray(self.server.metrics()["staleness_hist"], np.int64))

    def waits():
      return {what: s for r in rollouts for what, s in r.waits().items()}

    try:
      with self.deadlines.watching(waits):
        self._steps(rollouts, since)
    except (StallError, RolloutWorkerError, NoTrainableGroupError) as e:
      raise type(e)(f"{e}\n{self._checkpoint_before_stopping()}") from e
    finally:
      self.progress.close()
    self._checkpoint(wait=True)
    self.checkpointer.check(wait=True)
    self.schedule.prune()  # as the checkpoints retention kept
    version = self.trainer.version
    summary.update(end_version=version, stopped=self.stop.is_set(),
                   checkpoint=self.checkpointer.latest_step(),
                   checkpoint_dir=self.checkpointer.directory)
    if self.stop.is_set():
      self.echo(f"stopped at version {version}: checkpoint {summary['checkpoint']} in "
                f"{self.checkpointer.directory} holds it; rerun the same command to resume")
    summary["timeline"] = self.timeline.spans() + [s for r in rollouts for s in r.timeline()]
    if version >= self.settings.num_steps and not self.stop.is_set():
      summary["eval_after"] = self._eval_and_log()
    summary["server"] = {**self.server.metrics(),
                         "length_hist": self.server.length_histograms()}
    summary["longest_unreported_wait_s"] = self.deadlines.longest_unreported_s
    return summary

  def _steps(self, rollouts, since: Since):
    settings = self.settings
    while self.trainer.version < settings.num_steps and not self.stop.is_set():
      groups, waited = self._next_batch(rollouts)
      if groups is None:
        break
      metrics, record_s = self._train(groups)
      publish_s = self._publish()
      metrics, since = self._write_metrics(metrics, groups, rollouts, since,
                                           time_wait_s=waited, time_publish_s=publish_s,
                                           time_record_s=record_s)
      version = self.trainer.version
      self.echo(stamped(step_line(version, metrics)))
      self._count_skip(version, metrics, groups)
      self.progress.update_to(version)
      every = settings.log.samples_every
      if every and version % every == 0:
        self.log.write_samples(version, samples(groups, settings.decode, settings.log,
                                                settings.correct_threshold))
      if settings.eval_every and version % settings.eval_every == 0:
        self._eval_and_log()
      if version % settings.checkpoint_every == 0:
        self._checkpoint()
      self.checkpointer.check()  # a failed background write stops the run now

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
        elif 0 < self.settings.max_untrainable_groups <= untrainable - untrainable_before:
          raise NoTrainableGroupError(untrainable_cause(
              untrainable - untrainable_before, self.settings.max_untrainable_groups, m,
              [r.metrics() for r in rollouts]))
    return None, time.perf_counter() - t0

  def _train(self, groups) -> tuple[dict, float]:
    """One training step on `groups` (recorded first); its metrics and the seconds the
    record took."""
    version, eta = self.trainer.version, self.settings.max_staleness
    check_versions(groups, newest=version, oldest=None if eta is None else version - eta,
                   where=f"the batch of training step {version + 1} (params of version "
                         f"{version}, max_staleness {eta})")
    with self.timeline.span("trainer", "train"), self.deadlines.waiting(
        f"training step {version + 1}", may_stall=False):
      self.publishing.announce("train", groups)
      t0 = time.perf_counter()
      self.schedule.record(version + 1, groups)
      record_s = time.perf_counter() - t0
      metrics = self.trainer.train(groups)
    if self.trainer.version != version + 1:
      raise VersionError(f"training step {version + 1} left the trainer at version "
                         f"{self.trainer.version}, not {version + 1}")
    return metrics, record_s

  def _publish(self) -> float:
    """Publishes the trainer's version to the server; returns the seconds it took."""
    t0 = time.perf_counter()
    with self.timeline.span("trainer", "publish"), self.deadlines.waiting(
        f"publishing version {self.trainer.version}", may_stall=False):
      self.server.publish(self.trainer.version, self.publishing.params(self.trainer))
    return time.perf_counter() - t0

  def _write_metrics(self, train, groups, rollouts, since: Since, **times
                     ) -> tuple[dict, Since]:
    """The step's metrics (`step_metrics`) from what the parts count now, logged."""
    now, logging_since = time.perf_counter(), time.time()
    self.skipped_steps += train["skipped"]
    self.applied_updates += train["applied_updates"]
    server = self.server.metrics()
    metrics, counted = step_metrics(
        train, groups, server=server, lengths=self.server.length_histograms(),
        workers=[r.metrics() for r in rollouts], since=since, now=now,
        skipped_steps=self.skipped_steps, applied_updates=self.applied_updates,
        learning_rate=self.settings.learning_rate,
        correct_threshold=self.settings.correct_threshold,
        longest_unreported_wait_s=self.deadlines.longest_unreported_s, **times)
    if counted.restarts > since.restarts:
      self.echo(f"WARNING: a rollout worker died and was restarted (worker_restarts="
                f"{counted.restarts}, lost_groups={server['lost_groups']})")
    self.log.write(self.trainer.version, metrics)
    self.history.append(metrics)
    self.timeline.record("trainer", "log", logging_since, time.time())
    return metrics, counted

  def _count_skip(self, version, metrics, groups):
    """Warns about a skipped step; stops the run after too many in a row."""
    if not metrics["skipped"]:
      self.consecutive_skips = 0
      return
    self.consecutive_skips += 1
    cause = skip_cause(metrics, groups)
    self.echo(f"WARNING: step {version} skipped ({cause}); params unchanged, "
              f"{self.consecutive_skips} in a row")
    logging.warning("step %d skipped: %s", version, cause)
    limit = self.settings.max_consecutive_skips
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
    self.echo(stamped(eval_line(version, metrics)))
    return metrics

  def _checkpoint(self, wait=False):
    """Saves the current version (Orbax's save also waits for the previous one)."""
    version = self.trainer.version
    if self.checkpointer.latest_step() == version:
      return
    meta = Meta(version, self.skipped_steps, self.applied_updates, self.trainer.packed_shapes,
                server=self.server.state_dict(), lora_base=self.trainer.base_pointer)
    try:
      self.deadlines.call(
          lambda: self._save(version, meta, wait),
          f"the checkpoint of version {version}")
    except StallError:
      self._checkpoint_stalled = True
      raise

  def _save(self, version, meta, wait):
    self.publishing.announce("checkpoint", (version, meta, wait))
    self.checkpointer.save(version, self.trainer.state, meta, wait=wait)

  def close(self):
    closers = (("followers", lambda: self.publishing.announce("stop")),
               ("held-out evaluator", self.evaluator.close),
               ("checkpointer", self.checkpointer.close), ("metrics log", self.log.close))
    for name, closer in closers:
      try:
        self.deadlines.call(closer, f"closing the {name}")
      except Exception:  # keep closing the rest; an earlier error is already raised
        logging.exception("error while closing the %s", name)
