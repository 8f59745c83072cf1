"""Ray placement: the parameter server, each rollout worker and the trainer as actors.

The component classes are the in-process ones; each runs in its own Ray actor
process and reaches the others through `_Proxy`, which turns method calls into
actor calls that fail with `StallError` past `run.stall_timeout_s`. The driver only
starts the actors, prints the trainer's step lines, forwards a stop request and
shuts everything down.

A rollout worker whose process dies (SIGKILL, the OOM killer, a lost node) does not
end the run: the trainer reaches each worker through a `_RolloutHandle`, which
starts a new actor in its place (from the latest weights; registering with the
server writes off the dead one's running groups and hands over its prompts to issue
again), up to `run.max_worker_restarts` times per worker.

`config.PlacementConfig` places the actors. By default they ask for no CPUs or GPUs,
so any number of them fits on a laptop. On a cluster, e.g.

  --config.placement.kind=ray --config.placement.ray_address=auto
  --config.placement.rollout_workers=4 --config.placement.trainer_gpus=4
  --config.placement.rollout_gpus=1 --config.placement.working_dir=.

Ray then sets each actor's CUDA_VISIBLE_DEVICES, so the trainer and every rollout
worker own their GPUs (a rollout worker's generator replicas split them:
`build.split_devices`). An actor given no GPUs sees all of them; actors that share a
GPU (fractional GPUs) must cap JAX's preallocation (`placement.gpu_memory_fraction`).
The user's task and reward modules reach the actors through the `runtime_env`
(`placement.working_dir`, `placement.py_modules`; `runtime_env`).
"""

import logging
import os
import queue
import signal
import sys
import threading
from typing import Any, Callable, Optional

import jax
import ray

from async_rl.config import ExperimentConfig
from async_rl.param_server import ParameterServer
from async_rl.progress import Progress
from async_rl.rl import build
from async_rl.rl.errors import ConfigError, RolloutWorkerError, StallError
from async_rl.rl.lora_base import LoraBase
from async_rl.rl.rollout import RolloutWorker
from async_rl.tasks.registry import make_task

_POLL_S = 0.5
_CLOSE_TIMEOUT_S = 60.0


class _Proxy:
  """`proxy.f(*args)` is `ray.get(handle.f.remote(*args))`: an actor as a local object.

  A call without an answer in `timeout_s` raises `StallError` naming it.
  """

  def __init__(self, handle, name: str, timeout_s: float):
    self._handle, self._name, self._timeout_s = handle, name, timeout_s

  def __getattr__(self, name):
    if name.startswith("_"):  # pickle probes dunders on a bare instance
      raise AttributeError(name)
    method = getattr(self._handle, name)

    def call(*args, **kwargs):
      try:
        return ray.get(method.remote(*args, **kwargs), timeout=self._timeout_s)
      except ray.exceptions.GetTimeoutError:
        raise StallError(f"stalled: the Ray call {self._name}.{name} got no answer in "
                         f"{self._timeout_s:g} s (run.stall_timeout_s)") from None

    return call


class _RolloutHandle:
  """Rollout worker `index` as an actor, replaced by a new one when its process dies.

  The trainer calls it like a `RolloutWorker`. It is built by the driver around the
  first actor and travels to the trainer's process, which restarts the worker.
  """

  def __init__(self, cfg, workdir, server, index, actor, options, cpus):
    self._cfg, self._workdir, self._server, self._index = cfg, workdir, server, index
    self._options, self._cpus = options, cpus
    self._use(actor)
    self.restarts = 0

  def start(self):
    self._call("start")

  def error(self):
    """The controller's failure (None if none); a dead process is replaced first.

    Raises:
      RolloutWorkerError: the worker died more than `run.max_worker_restarts` times.
    """
    return self._call("error")

  def waits(self):
    return self._call("waits", restart=False) or {}

  def metrics(self):
    return {**self._call("metrics"), "restarts": self.restarts}

  def timeline(self):
    return self._call("timeline", restart=False) or []

  def close(self):
    try:
      ray.get(self._actor.close.remote(), timeout=_CLOSE_TIMEOUT_S)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
      pass
    ray.kill(self._actor)

  def _use(self, actor):
    self._actor = actor
    self._proxy = _Proxy(actor, f"rollout worker {self._index}", self._cfg.run.stall_timeout_s)

  def _call(self, method, restart=True):
    """`method` on the actor; if it died, None, or with `restart` a new actor's answer."""
    try:
      return getattr(self._proxy, method)()
    except ray.exceptions.RayActorError as e:
      if not restart:
        return None
      self._restart(e)
    try:
      return getattr(self._proxy, method)()
    except ray.exceptions.RayActorError as e:
      raise RolloutWorkerError(f"rollout worker {self._index} died again right after a "
                               f"restart: {e}") from e

  def _restart(self, error):
    limit = self._cfg.run.max_worker_restarts
    if self.restarts >= limit:
      raise RolloutWorkerError(f"rollout worker {self._index} died, and has been restarted "
                               f"run.max_worker_restarts={limit} times already: {error}")
    logging.warning("rollout worker %d died (%s); starting a new one", self._index, error)
    ray.kill(self._actor)
    self._use(_rollout_actor(self._cfg, self._workdir, self._server, self._index,
                             self._options))
    if self._cpus is not None:
      ray.get(self._actor.__ray_call__.remote(_pin, self._cpus))
    self.restarts += 1
    self._proxy.start()


class RolloutWorkerActor(RolloutWorker):
  """A rollout worker built in its actor's process (whose name, `ray::RolloutWorker...`,
  says what it is)."""

  def __init__(self, cfg, workdir, server, index):
    # Every device of this actor (Ray's GPUs for it) serves its generator replicas, on
    # the LoRA base read once (a warm-started one from `workdir`, where the trainer
    # wrote it before this actor started), each engine with a copy on its devices.
    devices = build.split_devices(cfg.placement, jax.local_devices(), with_trainer=False)
    base = LoraBase(cfg, workdir).load() if cfg.lora.enabled else None
    worker = build.rollout_worker(cfg, server, index=index, engines=[
        build.make_engine(cfg, replica, base=base) for replica in devices.replicas])
    super().__init__(worker.index, worker.controller, worker.pool, worker.rewards)


def _rollout_actor(cfg, workdir, server, index, options):
  return ray.remote(RolloutWorkerActor).options(**options).remote(
      cfg, workdir, _Proxy(server, "server", cfg.run.stall_timeout_s), index)


class _Trainer:
  """The trainer actor: a `TrainLoop` whose step lines the driver collects."""

  def __init__(self, cfg, workdir, server, init_params, run_id):
    self._lines = queue.SimpleQueue()
    self._rollouts = []
    # The server is another process: publish host copies (one device_get per step).
    self.loop = build.train_loop(cfg, workdir, server, task=make_task(cfg.task),
                                 init_params=init_params, echo=self._lines.put, progress=False,
                                 publish_on_host=True, run_id=run_id)

  def run(self, rollouts):
    self._rollouts = rollouts
    summary = self.loop.run(rollouts)
    summary["history"] = self.loop.history
    return summary

  def close_rollouts(self):
    """Closes the rollout workers as they are now (restarted ones included)."""
    for r in self._rollouts:
      r.close()

  def request_stop(self):
    self.loop.stop.set()

  def lines(self) -> list[str]:
    out = []
    while not self._lines.empty():
      out.append(self._lines.get())
    return out

  def close(self):
    self.loop.close()


def run_on_ray(cfg: ExperimentConfig, workdir: str, *, stop: Optional[threading.Event] = None,
               init_params=None, echo: Callable[[str], None] = print,
               progress: bool = True, run_id: Optional[str] = None) -> dict[str, Any]:
  """Runs (or resumes from `workdir`) the experiment with its components as Ray actors,
  placed as `cfg.placement` says (cluster address, rollout workers, actor resources,
  runtime_env, core pinning). `rl.entry.run` calls it, with `cfg` resolved and checked
  and `workdir` held.

  Args:
    cfg: the experiment, resolved (`build.resolve`).
    workdir: as for `rl.entry.run`, an absolute path; every actor must see it (a shared
      file system on a cluster).
    stop: set it (e.g. from a SIGTERM handler) to checkpoint and return early.
    init_params: params to start from when not resuming.
    echo: receives the one-line summary of every step.
    progress: show a progress bar (on a terminal only).
    run_id: marks the metrics lines (None: a new id): the id of the run that holds the
      workdir (`rl.workdir.hold`) in this process.

  Returns:
    The trainer loop's summary, its `history` of step metrics and `pids`: the process
    id of the driver, the server, the trainer and each rollout worker.
  """
  if cfg.lora.enabled and init_params is not None:
    raise ConfigError("init_params with lora.rank > 0 on Ray: every rollout actor loads the "
                      "base from its pointer (hf_model_dir, the run's warm start or the "
                      "seed's init), so the base must be one: write it as a Hugging Face "
                      "directory (models.hf.save_hf) and set hf_model_dir")
  p = cfg.placement
  trainer_options = _actor_options(p, p.trainer_cpus, p.trainer_gpus)
  rollout_options = _actor_options(p, p.rollout_cpus, p.rollout_gpus)
  trainer_cores, rollout_cores = p.pin_trainer_cores or None, p.pin_rollout_cores or None
  started = not ray.is_initialized()
  if started:
    _init_ray(p)
  server = trainer = None
  rollouts = []
  try:
    server = ray.remote(ParameterServer).options(
        num_cpus=0, max_concurrency=_server_concurrency(cfg, p.rollout_workers)
    ).remote(cfg.staleness, cfg.batch_groups)
    # request_stop and lines must run while run() does.
    trainer = ray.remote(_Trainer).options(**trainer_options, max_concurrency=4).remote(
        cfg, workdir, _Proxy(server, "server", cfg.run.stall_timeout_s), init_params,
        run_id)
    # The trainer publishes the (restored) params before the workers fetch them.
    ray.get(trainer.__ray_ready__.remote())
    rollouts = [_rollout_actor(cfg, workdir, server, i, rollout_options)
                for i in range(p.rollout_workers)]
    pids = ray.get([a.__ray_call__.remote(_pid) for a in (server, trainer, *rollouts)])
    ray.get([a.__ray_call__.remote(_pin, cores)
             for actors, cores in (([trainer], trainer_cores), (rollouts, rollout_cores))
             if cores is not None for a in actors])
    handles = [_RolloutHandle(cfg, workdir, server, i, a, rollout_options, rollout_cores)
               for i, a in enumerate(rollouts)]
    summary = _drive(cfg, server, trainer, handles, stop, echo, progress)
    summary["pids"] = {"driver": os.getpid(), "server": pids[0], "trainer": pids[1],
                       "rollout": pids[2:]}
    return summary
  finally:
    _shutdown(server, trainer, rollouts)
    if started:
      ray.shutdown()


def _actor_options(placement, cpus, gpus) -> dict[str, Any]:
  options = {"num_cpus": cpus, "num_gpus": gpus}
  if placement.gpu_memory_fraction:
    options["runtime_env"] = {"env_vars": {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": str(placement.gpu_memory_fraction)}}
  return options


def runtime_env(placement) -> dict[str, Any]:
  """The Ray `runtime_env` of a run: `working_dir` and `py_modules` shipped to every
  node when set; else, for a local instance, this process's sys.path (so that local
  actors import what it imports, e.g. reward functions named "module:function")."""
  if placement.working_dir is not None or placement.py_modules:
    env = {}
    if placement.working_dir is not None:
      env["working_dir"] = placement.working_dir
    if placement.py_modules:
      env["py_modules"] = list(placement.py_modules)
    return env
  if placement.ray_address is not None:
    return {}
  path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
  return {"env_vars": {"PYTHONPATH": path}}


def _init_ray(placement):
  # ray.init replaces the SIGTERM handler with sys.exit; keep the caller's (which
  # sets `stop`, so that the trainer checkpoints).
  sigterm = signal.getsignal(signal.SIGTERM)
  env = runtime_env(placement)
  if placement.ray_address is not None:
    ray.init(address=placement.ray_address, runtime_env=env or None)
  else:
    ray.init(include_dashboard=False, runtime_env=env)
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, sigterm)


def _server_concurrency(cfg, num_rollout_workers):
  # Every blocking call holds an actor thread: per rollout worker, its controller's
  # acquire and the offers from its reward threads and decode thread; the trainer's
  # get_batch; a few short calls around them.
  return 4 + num_rollout_workers * (2 + cfg.rollout.reward_workers)


def _pid(_actor):
  return os.getpid()


def _pin(_actor, cpus):
  # sched_setaffinity(0, ...) moves only the calling thread; XLA's and Ray's threads
  # already exist, so move each of them (threads started later inherit it).
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), cpus)
    except ProcessLookupError:  # the thread ended since the listing
      pass


def _drive(cfg, server, trainer, rollouts, stop, echo, progress):
  """Runs the trainer, printing its lines and forwarding `stop`, until it returns."""
  server_proxy = _Proxy(server, "server", cfg.run.stall_timeout_s)
  start = server_proxy.version()
  bar = Progress(echo, enabled=progress)
  bar.start(cfg.num_steps, start)
  run = trainer.run.remote(rollouts)
  stop_sent = finished = False
  try:
    while True:
      finished = bool(ray.wait([run], timeout=_POLL_S)[0])
      for line in ray.get(trainer.lines.remote()):
        bar.echo(line)
      if finished:
        summary = ray.get(run)  # raises the trainer's error, with its remote traceback
        bar.update_to(summary["end_version"])
        return summary
      bar.update_to(server_proxy.version())
      if stop is not None and stop.is_set() and not stop_sent:
        trainer.request_stop.remote()
        stop_sent = True
  finally:
    bar.close()
    if not finished:  # the driver failed: let the trainer return before closing it
      trainer.request_stop.remote()
      ray.wait([run], timeout=_CLOSE_TIMEOUT_S)


def _shutdown(server, trainer, rollouts):
  """Closes the server (waking its waiters), the rollout workers (those the trainer
  restarted too), the trainer; kills them."""
  calls = ([server], "close"), ([trainer], "close_rollouts"), (rollouts, "close"), (
      [trainer], "close")
  for actors, method in calls:
    refs = [getattr(a, method).remote() for a in actors if a is not None]
    for ref in refs:
      try:
        ray.get(ref, timeout=_CLOSE_TIMEOUT_S)
      except ray.exceptions.RayActorError:  # a rollout worker that died and was replaced
        pass
      except Exception:  # keep closing the rest; an earlier error is already raised
        logging.exception("error while closing a Ray actor")
  for a in (server, trainer, *rollouts):
    if a is not None:
      ray.kill(a)
