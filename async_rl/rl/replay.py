"""The replay that re-executes a run from its recorded schedule (`rl.schedule`).

What an asynchronous run trains is decided by timing, but given what it is fed the
trainer is deterministic (on one machine and software: the same initial params, a
random init, the warm start and an HF checkpoint being functions of the config and its
seed; the same programs; gradients summed in a fixed order, threads included), and the
run records what it was fed (`rl.schedule`).

`Replay` re-executes the trainer: from the run's initial params (or, when its record
was pruned, the recorded run's oldest checkpoint that the record goes on from:
`schedule.replay_start`) it trains the recorded batches in order in a workdir of its
own (checkpoints, metrics). After each step it
checks the step against the recorded run's log line (prompts, trained tokens, loss,
gradient norm), and at each step where the recorded run kept a checkpoint, that the
train state equals it bit for bit; it stops at the first difference, naming it.

It does not regenerate the tokens. A sample's random stream is its own (seed, sample,
position), but its decode numerics are not: on XLA:CPU a sample's behaviour log-probs
change in their last bits with the samples decoded beside it (`benchmarks/replay.py`
counts them), and a draw whose Gumbel-perturbed logits nearly tie could then change.
Instead, before step s it recomputes the behaviour log-prob of every generated token of
the batch under the params of the version that produced it (`recomputable_T`), and
checks it against the record within `LOGP_ATOL` when the generator's numerics are
float32 (else it reports the largest difference without a bound). Those versions are
the last η + 1 the replay itself produced, in order (it keeps their params), or, for
the first steps of a replay that starts from a checkpoint, the recorded run's
checkpoints of them. The tokens it cannot check are counted (`logp_unchecked`): with
update mode "keep", those produced from a cache another version computed, and those of
a version neither kept nor checkpointed.
"""

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import numpy as np

from async_rl import batching as batching_lib, sharding, train_step
from async_rl.config import BatchingConfig
from async_rl.progress import Progress, stamped
from async_rl.rl import schedule
from async_rl.rl.checkpoint import Checkpointer, Meta, Restored
from async_rl.rl.errors import ReplayError
from async_rl.rl.metrics_log import MetricsLog
from async_rl.rl.trainer import Trainer
from async_rl.trajectory import Group, Trajectory

# Decode and full-forward log-probs of one float32 model agree to about 1e-5 (the
# generator's parity tests); a changed token or version moves them by far more.
LOGP_ATOL = 1e-4
# The per-step figures of the recorded run's log a replayed step must equal.
LOGGED = ("prompts", "trained_tokens", "skipped", "loss", "grad_norm")
# Context facts whose difference makes a replay differ, and the setting that fixes each.
_CONTEXT_SETTINGS = {"grad_threads": "cpu.grad_threads",
                     "trainer_devices": "placement.trainer_devices", "platform": None}


def recomputable_T(traj: Trajectory, version: int, update_mode: str) -> np.ndarray:
  """The policy tokens whose behaviour log-prob the params of `version` determine: those
  it produced from a context (KV cache) it also computed. A weight update re-prefills
  the samples in flight in "retract" (and a sample resumed after preemption in any
  mode), and "drain" never mixes versions in a cache, so there every token of
  `version` is one; "keep" keeps the cache computed so far, so only the tokens before
  any token of another version are."""
  policy_T = traj.versions_T >= 0
  mine_T = traj.versions_T == version
  if update_mode == "keep":
    mine_T &= np.logical_and.accumulate(mine_T | ~policy_T)
  return policy_T & mine_T


def recompute_behaviour_logp(trainer: Trainer, params, trajs: Sequence[Trajectory], *,
                             batching: BatchingConfig, max_length: int,
                             compiled: set) -> tuple[np.ndarray, np.ndarray]:
  """(recomputed, recorded) log-probs of `trajs`' loss-mask tokens, flat: the proximal
  recompute under `params` (the trainer's, or another version's of the same shapes) on
  a batch packed as the trainer packs (reusing the `compiled` shapes it has run, and
  adding its own)."""
  buckets = batching.row_buckets or batching_lib.default_row_buckets(
      batching.max_tokens_per_mb, longest=max_length)
  parts = trainer.steps.micro_batch_multiple
  batch = batching_lib.pack_dynamic(
      trajs, np.zeros(len(trajs), np.float32), max_tokens_per_mb=batching.max_tokens_per_mb,
      num_shards=sharding.num_batch_shards(trainer.mesh), row_buckets=buckets,
      num_parts=parts, compiled=compiled, reuse_slack=batching.reuse_slack)
  batch = batching_lib.pad_micro_batches(batch, parts)
  compiled.add(batch.tokens.shape)
  logp = trainer.steps.recompute(
      trainer.state.model_params(params),
      jax.device_put(batch, train_step.batch_shardings(trainer.mesh)))
  mask = batch.loss_mask > 0
  return np.asarray(jax.device_get(logp))[mask], batch.behav_logp[mask]


def first_difference(state, reference) -> Optional[str]:
  """Where two train states differ bit for bit: the first differing leaf, how many of
  its elements differ and by how much at most; None when they are equal."""
  for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                               jax.tree_util.tree_flatten_with_path(reference)[0], strict=True):
    a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
    name = jax.tree_util.keystr(path)
    if a.shape != b.shape or a.dtype != b.dtype:
      return f"{name}: {a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}"
    bits = lambda x: x.reshape(-1).view(np.dtype(f"u{x.dtype.itemsize}"))
    differ = bits(a) != bits(b)
    if differ.any():
      largest = np.max(np.abs(a.reshape(-1)[differ].astype(np.float64)
                              - b.reshape(-1)[differ].astype(np.float64)))
      return (f"{name}: {np.count_nonzero(differ)} of {a.size} elements differ (by up "
              f"to {largest:.3g})")
  return None


class RecordedRun:
  """The recorded run a replay checks against: its record, its log and its checkpoints.

  Built by `rl.build.replay`.

  Args:
    workdir: its workdir.
    checkpointer: its checkpoints, read only (closed by `close`).
    abstract_state: what they restore into (the replay's `Trainer.abstract_state`).
    checkpoints: their steps.
    logged: {step: line} of its metrics log (`read_log`).
    initial: its params of version 0, which it kept no checkpoint of: for the tokens
      they produced when the replay starts from a later checkpoint (None: not needed).
  """

  def __init__(self, workdir: str, checkpointer: Checkpointer, abstract_state, *,
               checkpoints: Sequence[int], logged: dict[int, dict], initial=None):
    self.workdir, self._checkpointer, self._abstract = workdir, checkpointer, abstract_state
    self.checkpoints, self.logged, self._initial = frozenset(checkpoints), logged, initial

  def batch(self, step: int) -> tuple[list[Group], dict[str, Any]]:
    """The batch of `step` and the context it was trained in (`schedule.read_batch`)."""
    return schedule.read_batch(os.path.join(self.workdir, schedule.SCHEDULE_DIR), step)

  def state(self, step: int):
    """Its train state at `step`, one of its `checkpoints`."""
    return self._checkpointer.restore(step, self._abstract)[0]

  def params(self, version: int):
    """Its params of `version`, or None when it kept no checkpoint of them."""
    if version == 0 and self._initial is not None:
      return self._initial
    if version in self.checkpoints:
      return self.state(version).params
    return None

  def close(self) -> None:
    self._checkpointer.close()


class Replay:
  """Trains a recorded run's batches again and checks each step against the record.

  Built by `rl.build.replay` with the trainer (at the recorded run's initial params,
  restored from the recorded run's checkpoint the replay starts from, or from the
  replay's own checkpoint), its checkpointer and log.

  Args:
    recorded: the recorded run.
    steps: the last step to replay.
    context: this replay's numerics (as `recorder`'s), which each batch's must equal.
    recompute: (params, trajectories) -> (recomputed, recorded) behaviour log-probs
      (`recompute_behaviour_logp` of the trainer).
    update_mode: the recorded run's weight update mode.
    max_staleness: the recorded run's η: the replay keeps the params of the last η + 1
      versions (None: of the last one) to recompute the tokens each produced; those of
      the versions before the one it starts from are the recorded run's checkpoints'.
    logp_atol: the bound on their difference; None: reported, not checked.
    checkpoint_every: checkpoint every this many steps (and at the end).
    restored: the checkpoint the replay resumes from.
    stop: set it (a signal) to checkpoint and return early.
    echo: receives a line per step and per comparison.
    progress: the bar of steps; None: none.
  """

  def __init__(self, trainer: Trainer, checkpointer: Checkpointer, log: MetricsLog,
               recorded: RecordedRun, *, steps: int, context: dict[str, Any],
               recompute: Callable[[Any, Sequence[Trajectory]], tuple[np.ndarray, np.ndarray]],
               update_mode: str, logp_atol: Optional[float], checkpoint_every: int,
               max_staleness: Optional[int] = 0, restored: Restored = Restored(),
               stop: Optional[threading.Event] = None, echo: Callable[[str], None] = print,
               progress: Optional[Progress] = None):
    self.trainer, self.checkpointer, self.log = trainer, checkpointer, log
    self.recorded, self.steps, self.context = recorded, steps, context
    self.recompute, self.update_mode, self.logp_atol = recompute, update_mode, logp_atol
    self.checkpoint_every = checkpoint_every
    self.skipped_steps = restored.meta.skipped_steps
    self.applied_updates = restored.meta.applied_updates
    self.stop = stop or threading.Event()
    self.echo, self.progress = echo, progress or Progress(echo, enabled=False)
    self._warned_software = False
    self._keep = 1 if max_staleness is None else max_staleness + 1
    # {version: params} of the last `_keep` versions this replay produced.
    self._params = {trainer.version: trainer.device_params()}

  def run(self) -> dict[str, Any]:
    """Replays to `steps` (or until `stop`); returns a summary: versions, the steps
    whose train state was compared (all equal, or it raised), the behaviour log-probs
    checked, `stopped` and the newest checkpoint.

    Raises:
      ReplayError: a batch cannot be read, was trained in another context, or a step
        differs from the record; the message names the step and the first difference.
    """
    summary = {"start_version": self.trainer.version, "compared": [], "logp_tokens": 0,
               "logp_unchecked": 0, "logp_max_abs_diff": 0.0}
    if self.trainer.version in self.recorded.checkpoints:  # the initial params, or a resume's
      self._compare(self.trainer.version)
      summary["compared"].append(self.trainer.version)
    self.progress.start(self.steps, self.trainer.version)
    try:
      while self.trainer.version < self.steps and not self.stop.is_set():
        self._step(summary)
        self.progress.update_to(self.trainer.version)
    finally:
      self.progress.close()
    self._checkpoint(wait=True)
    summary.update(end_version=self.trainer.version, stopped=self.stop.is_set(),
                   checkpoint=self.checkpointer.latest_step(),
                   checkpoint_dir=self.checkpointer.directory)
    if self.stop.is_set():
      self.echo(f"replay stopped at version {self.trainer.version}: checkpoint "
                f"{summary['checkpoint']} in {self.checkpointer.directory} holds it; rerun "
                f"the same command to go on")
    return summary

  def _step(self, summary):
    step = self.trainer.version + 1
    groups, context = self.recorded.batch(step)
    self._check_context(step, context)
    checked, unchecked, diff = self._check_behaviour(step, groups)
    metrics = self.trainer.train(groups)
    self._params[self.trainer.version] = self.trainer.device_params()
    for version in [v for v in self._params if v <= self.trainer.version - self._keep]:
      del self._params[version]
    self.skipped_steps += metrics["skipped"]
    self.applied_updates += metrics["applied_updates"]
    metrics["prompts"] = [str(g.prompt_id) for g in groups]
    self._check_logged(step, metrics)
    summary["logp_tokens"] += checked
    summary["logp_unchecked"] += unchecked
    summary["logp_max_abs_diff"] = max(summary["logp_max_abs_diff"], diff)
    metrics["replay"] = {"logp_tokens": checked, "logp_unchecked": unchecked,
                         "logp_max_abs_diff": diff}
    self.log.write(step, metrics)
    self.echo(stamped(f"replay v={step} loss={metrics['loss']:.4f} behaviour log-probs "
                      f"checked={checked} unchecked={unchecked} max|diff|={diff:.2g}"))
    if step in self.recorded.checkpoints:
      self._compare(step)
      summary["compared"].append(step)
    if step % self.checkpoint_every == 0:
      self._checkpoint()

  def _check_behaviour(self, step, groups) -> tuple[int, int, float]:
    """Recomputes the behaviour log-prob of each generated token of step `step`'s batch
    under the params of the version that produced it; returns how many were checked and
    not, and the largest difference.

    Raises:
      ReplayError: a difference past `logp_atol`, naming the version.
    """
    trajs = [t for g in groups for t in g.trajectories]
    generated = sum(int(np.count_nonzero(t.versions_T >= 0)) for t in trajs)
    versions = np.unique(np.concatenate([t.versions_T[t.versions_T >= 0] for t in trajs]))
    checked, diff = 0, 0.0
    for version in map(int, versions):
      if version not in self._params and (params := self.recorded.params(version)) is not None:
        self._params[version] = params  # read once; dropped with the versions it precedes
      params = self._params.get(version)
      if params is None:
        continue
      made = [dataclasses.replace(t, loss_mask_T=mask_T) for t in trajs
              if (mask_T := recomputable_T(t, version, self.update_mode)).any()]
      if not made:
        continue
      got, want = self.recompute(params, made)
      version_diff = float(np.max(np.abs(got - want), initial=0.0))
      if self.logp_atol is not None and version_diff > self.logp_atol:
        raise ReplayError(
            f"step {step} of {self.recorded.workdir}: a recorded behaviour log-prob differs by "
            f"{version_diff:.3g} (more than {self.logp_atol:g}) from the one version "
            f"{version}'s params give: the record's tokens or versions are not what that "
            f"version generated")
      checked, diff = checked + got.size, max(diff, version_diff)
    return checked, generated - checked, diff

  def _check_context(self, step, context):
    for key, setting in _CONTEXT_SETTINGS.items():
      if context.get(key) != self.context[key]:
        fix = f"; set {setting}={context.get(key)}" if setting else ""
        raise ReplayError(f"step {step} of {self.recorded.workdir} was trained with {key}="
                          f"{context.get(key)!r}, this replay has {self.context[key]!r}: "
                          f"its sums would differ in their last bits{fix}")
    if context.get("jax") != self.context["jax"] and not self._warned_software:
      self._warned_software = True
      self.echo(f"WARNING: {self.recorded.workdir} was recorded with jax {context.get('jax')}, "
                f"this replay runs jax {self.context['jax']}: its programs may round "
                f"differently")

  def _check_logged(self, step, metrics):
    line = self.recorded.logged.get(step)
    if line is None:  # the recorded run stopped before it logged the step
      return
    for key in LOGGED:
      if line.get(key) != metrics[key]:
        raise ReplayError(
            f"step {step} differs from {self.recorded.workdir}'s log: {key} is {metrics[key]!r} in "
            f"the replay, {line.get(key)!r} in the record (so the params after step "
            f"{step - 1} or the batch of step {step} differ)")

  def _compare(self, step):
    # A LoRA run's frozen base is not in its checkpoints.
    difference = first_difference(self.trainer.state.replace(base=None),
                                  self.recorded.state(step).replace(base=None))
    if difference is not None:
      raise ReplayError(f"the train state after step {step} differs from "
                        f"{self.recorded.workdir}'s checkpoint {step}: {difference}")
    self.echo(f"replay v={step}: the train state equals {self.recorded.workdir}'s checkpoint "
              f"{step} bit for bit")

  def _checkpoint(self, wait=False):
    version = self.trainer.version
    if self.checkpointer.latest_step() == version:
      return
    meta = Meta(version, self.skipped_steps, self.applied_updates, self.trainer.packed_shapes,
                replay_of=self.recorded.workdir)
    self.checkpointer.save(version, self.trainer.state, meta, wait=wait)

  def close(self):
    for part in (self.checkpointer, self.log, self.recorded):
      part.close()


def read_log(workdir: str) -> dict[int, dict]:
  """{step: line} of the training steps in `workdir`'s metrics log."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  lines = {}
  with open(path) as f:
    for row in f:
      try:
        line = json.loads(row)
      except ValueError:  # the last line of a process killed mid-write
        continue
      if "loss" in line:
        lines[line["step"]] = line
  return lines
