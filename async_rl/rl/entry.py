"""Where a run starts: `run` (or resume), `replay` of a recorded run, and `follow` on a
`jax.distributed` process other than 0.

Each resolves the config once (`build.resolve`), checks it before anything is compiled
(`build.preflight`), takes the workdir (`rl.workdir.hold`) and checks what it holds
(`rl.workdir.check_resume`), then has `rl.build` build the parts and places them: in
this process (the trainer loop on the calling thread, the rollout controller, the
generator pool's decode loop and the reward service's dispatch on threads of their own,
the reward functions in worker processes) or, this module alone deciding, as Ray actors
(`rl.ray_placement`), which build their parts with the same `rl.build` functions.
"""

import os
import threading
from typing import Any, Callable, Optional

import jax

from async_rl import sharding
from async_rl.config import ExperimentConfig
from async_rl.param_server import ParameterServer
from async_rl.rl import build, multihost
from async_rl.rl import workdir as workdir_lib
from async_rl.rl.errors import ConfigError


def run(cfg: ExperimentConfig, workdir: str, *, task=None, init_params=None,
        stop: Optional[threading.Event] = None, echo: Callable[[str], None] = print,
        progress: bool = True) -> dict[str, Any]:
  """Runs (or resumes from `workdir`) the experiment, placed as `cfg.placement` says;
  returns the loop's summary.

  Args:
    cfg: the experiment.
    workdir: checkpoints, `metrics.jsonl`, TensorBoard files and `config.json`.
    task: a task built in this process (say, in a notebook) in place of `cfg.task`'s
      (in process only).
    init_params: params to start from when not resuming; by default those of
      `cfg.hf_model_dir`, else a warm start of `cfg.sft.steps`, else a random init.
    stop: set it (e.g. from a SIGTERM handler) to checkpoint and return early (at
      once, saving nothing, if it is set before the run is built).
    echo: receives the run's id, the one-line summary of every step, and warnings.
    progress: show a progress bar (on a terminal only).

  Raises:
    ConfigError: a setting that cannot work, found before anything is compiled.
    WorkdirInUseError: another run holds `workdir` (`rl.workdir`).
  """
  cfg = build.resolve(cfg)
  if cfg.placement.kind == "ray" and task is not None:
    raise ConfigError("a task object runs in process only; on Ray name it in task.name")
  task = build.preflight(cfg, task)
  if not multihost.is_leader():  # the leader holds the workdir
    follow(cfg, workdir, task=task, init_params=init_params)
    return {}
  if stop is not None and stop.is_set():  # before anything is built or written
    echo(f"stopped before the run started; {workdir} is as it was")
    return {"stopped": True}
  # The workdir is this run's (on Ray, the driver holds it) before anything is written.
  with workdir_lib.hold(workdir, echo) as me:
    echo(f"{me}: workdir {os.path.abspath(workdir)}")
    workdir_lib.check_resume(cfg, workdir)
    if cfg.placement.kind == "ray":
      from async_rl.rl import ray_placement  # noqa: PLC0415 (ray is an extra)
      return ray_placement.run_on_ray(cfg, os.path.abspath(workdir), stop=stop,
                                      init_params=init_params, echo=echo, progress=progress,
                                      run_id=me.run_id)
    return _in_process(cfg, workdir, task, init_params=init_params, stop=stop, echo=echo,
                       progress=progress, run_id=me.run_id)


def _in_process(cfg, workdir, task, *, init_params, stop, echo, progress, run_id):
  """The run's parts in this process: the trainer loop on this thread."""
  devices = build.split_devices(cfg.placement, jax.local_devices(), jax.devices())
  try:
    cfg.mesh.axis_sizes(len(devices.trainer))  # the mesh must fill the trainer's devices
  except ValueError as e:
    raise ConfigError(str(e)) from None
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  # One engine per generator replica, for the rollout and held-out pools alike: their
  # programs compile once. With LoRA the trainer loop gives them the base it made.
  engines = [build.make_engine(cfg, replica) for replica in devices.replicas]
  loop = worker = None
  try:
    loop = build.train_loop(cfg, workdir, server, task=task, engines=engines,
                            trainer_devices=devices.trainer, init_params=init_params, stop=stop,
                            echo=echo, progress=progress, run_id=run_id)
    worker = build.rollout_worker(cfg, server, task=task, engines=engines)
    summary = loop.run([worker])
    summary["history"] = loop.history
    return summary
  finally:
    server.close()
    for part in (worker, loop):
      if part is not None:
        part.close()
    # A workflow that serves (an agent's endpoint) frees its port for the next run.
    if task.workflow is not None:
      task.workflow.close()


def replay(cfg: ExperimentConfig, workdir: str, recorded: str, *,
           stop: Optional[threading.Event] = None, echo: Callable[[str], None] = print,
           progress: bool = True) -> dict[str, Any]:
  """Re-executes the run recorded in the workdir `recorded` (its `schedule/`) in
  `workdir`, or goes on with the replay `workdir` holds: from the run's initial params
  (or, when the record was pruned, the oldest of its checkpoints the record goes on
  from: `schedule.replay_start`), the recorded batches in order, each step checked against the record and the
  train state against every checkpoint the recorded run kept, bit for bit (`rl.replay`).
  Nothing is generated or evaluated. Returns the replay's summary.

  `cfg` must be the recorded run's config but for `config.RESUMABLE_FIELDS`, and the
  trainer must get as many devices and gradient threads as the run's did.

  Raises:
    ConfigError: `cfg` differs from the recorded run's, `recorded` holds no record it
      can start from (`build.replay`), or `workdir` is `recorded`.
    WorkdirInUseError: another run holds `workdir` or `recorded`.
    ReplayError: the record is unusable, or a step differs from it.
  """
  cfg = build.resolve(cfg)
  if jax.process_count() > 1:
    raise ConfigError("a replay runs in one process; start it without jax.distributed")
  if os.path.realpath(workdir) == os.path.realpath(recorded):
    raise ConfigError(f"a replay needs a workdir of its own; {workdir} is the recorded run's")
  workdir_lib.check_replay(cfg, recorded)
  task = build.task_of(cfg)
  if stop is not None and stop.is_set():
    echo(f"stopped before the replay started; {workdir} is as it was")
    return {"stopped": True}
  # The recorded run's workdir is held too: a resume of it would rewrite its record.
  with workdir_lib.hold(workdir, echo) as me, workdir_lib.hold(recorded, echo):
    echo(f"{me}: replaying {os.path.abspath(recorded)} in workdir {os.path.abspath(workdir)}")
    workdir_lib.check_resume(cfg, workdir)
    replayer = build.replay(cfg, workdir, recorded, task, run_id=me.run_id, stop=stop,
                            echo=echo, progress=progress)
    try:
      return replayer.run()
    finally:
      replayer.close()


def follow(cfg: ExperimentConfig, workdir: str, *, task, init_params=None) -> None:
  """A `jax.distributed` process other than 0 (`cfg` resolved and checked, as `run`
  does): its shard of the trainer, restored as process 0 restores, stepping as process
  0 announces (`multihost.follow`) until the run ends there."""
  trainer, checkpointer, _ = build.restored_trainer(
      cfg, workdir, sharding.make_mesh(cfg.mesh), task, init_params=init_params,
      echo=lambda _: None)
  try:
    trainer.host_params(cfg.placement.publish_dtype)  # process 0's first publish
    multihost.follow(trainer, checkpointer)
  finally:
    checkpointer.close()
