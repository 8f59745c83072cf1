"""How a run's parts are built: the one place that builds them, in the order a run
needs them (`rl.entry` starts the run, or a replay, and places the parts).

`resolve` reads what the config names on disk, `check` and `preflight` check every
part's settings before anything is compiled, and the functions below build each part
from the config sections it owns, taking what else it needs ready-made: reading
checkpoints and data, writing the workdir and starting the pools and services is done
here.

Choices that exist only for XLA:CPU speed (`async_rl.cpu`) are made here, and nowhere
else: on the CPU backend a generator's slots split into groups decoded from threads of
their own, and a one-device trainer shares each update's micro-batches among threads.
"""

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from async_rl import advantages, cli, config, cpu, loss, models, sharding, train_step
from async_rl.config import ExperimentConfig, ModelConfig
from async_rl.generation import Engine, GeneratorPool, SamplingParams
from async_rl.generation.adapted import AdaptedEngine
from async_rl.generation.replicas import ReplicatedPool
from async_rl.models import hf, hf_config, pretrained
from async_rl.rewards import Reward, RewardService
from async_rl.rl import multihost, schedule
from async_rl.rl import workdir as workdir_lib
from async_rl.rl.checkpoint import Checkpointer, Restored
from async_rl.rl.deadlines import Deadlines
from async_rl.rl.errors import ConfigError
from async_rl.rl.evaluate import Evaluator
from async_rl.rl.lora_base import LoraBase
from async_rl.progress import Progress
from async_rl.rl.metrics_log import MetricsLog, check_wandb
from async_rl.rl.replay import (LOGP_ATOL, RecordedRun, Replay, read_log,
                                recompute_behaviour_logp)
from async_rl.rl.rollout import PromptSource, RolloutController, RolloutWorker
from async_rl.rl.trainer import Trainer
from async_rl.rl.trainer_loop import Outputs, Publishing, Settings, TrainLoop
from async_rl.sft import warm_start
from async_rl.tasks.registry import check_task, make_task
from async_rl.tasks.workflow import Workflow
from async_rl.timeline import Timeline


def resolve(cfg: ExperimentConfig) -> ExperimentConfig:
  """`cfg` with what it names read from disk: `hf_model_dir` as a Hugging Face
  directory (a GGUF file or a shipped model's name fetched and converted once,
  `models.pretrained.model_dir`) and the architecture in its config.json (only
  `config.HF_RUN_MODEL_FIELDS` of `model` stay as configured), absolute paths (Ray
  actors may run elsewhere), and the task's defaults filled in."""
  model, hf_dir = cfg.model, cfg.hf_model_dir
  if hf_dir is not None:
    try:
      hf_dir = pretrained.model_dir(hf_dir)
    except (OSError, ValueError) as e:
      raise ConfigError(f"hf_model_dir {hf_dir!r}: {e}") from None
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
      raise ConfigError(f"hf_model_dir must be a directory holding config.json, got {hf_dir!r}")
    try:
      fields = hf_config.read_config(hf_dir)
    except (KeyError, ValueError) as e:
      raise ConfigError(f"hf_model_dir {hf_dir!r} holds a model that cannot be read: "
                        f"{e!r}") from None
    model = ModelConfig(**{**fields, **{f: getattr(model, f)
                                        for f in config.HF_RUN_MODEL_FIELDS}})
  t = cfg.task
  absolute = lambda path: None if path is None else os.path.abspath(path)
  files = {}
  for section in ("math", "data"):
    for name in ("train_path", "heldout_path"):
      path = getattr(getattr(t, section), name)
      if path is not None and not os.path.isfile(path):
        raise ConfigError(f"task.{section}.{name} is not a file, got {path!r}")
      files.setdefault(section, {})[name] = absolute(path)
  task = dataclasses.replace(
      t, math=dataclasses.replace(t.math, **files["math"]),
      data=dataclasses.replace(t.data, **files["data"]),
      tokenizer_dir=absolute(t.tokenizer_dir or hf_dir),
      max_prompt_len=t.max_prompt_len or cfg.generation.max_prompt_len)
  try:
    return dataclasses.replace(cfg, hf_model_dir=hf_dir, model=model, task=task)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def check(cfg: ExperimentConfig) -> ExperimentConfig:
  """Runs the checks each part owns on its settings (the loss's, the advantage
  estimator's, the task's: a built-in task's own checks, or that a "module:attr"
  factory loads), which need nothing built; returns `cfg`.

  Raises:
    ConfigError: naming the field whose value a part rejects.
  """
  with _config_errors():
    _check_objective(cfg)
    check_task(cfg)
  return cfg


def task_of(cfg: ExperimentConfig):
  """The task `cfg.task` names, built (`tasks.registry.make_task`).

  Raises:
    ConfigError: a setting the task rejects.
  """
  with _config_errors():
    return make_task(cfg.task)


def preflight(cfg: ExperimentConfig, task=None):
  """The checks of a run on `task`, before anything is compiled; returns the task.

  None: `check`, then the task `cfg.task` names, built (`task_of`). A task given
  instead is not `cfg.task`'s, so of `check` only the objective's checks concern it.
  Then, on either: that the task fits the model, that its workflow has the methods a
  run calls (`tasks.workflow.Workflow`), that its reward functions load, and that what
  the log needs imports.

  Raises:
    ConfigError: naming the field whose value a part rejects.
  """
  if task is None:
    task = task_of(check(cfg))
  else:
    with _config_errors():
      _check_objective(cfg)
  with _config_errors():
    reward_fn(cfg, task)
    correct_fn(cfg, task)
    also_correct_fns(cfg)
    check_wandb(cfg.log.wandb_project)
  if task.workflow is not None and not isinstance(task.workflow, Workflow):
    missing = [m for m in ("run", "metrics", "close") if not hasattr(task.workflow, m)]
    raise ConfigError(f"the task's workflow must have run, metrics and close (subclass "
                      f"async_rl.tasks.Workflow for the defaults of the last two); "
                      f"{type(task.workflow).__name__} has no {', '.join(missing)}")
  if task.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size must hold the task's tokenizer "
                      f"({task.tokenizer.vocab_size} ids), got {cfg.model.vocab_size}")
  _check_prompts(cfg, task)
  if cfg.sft.steps and cfg.hf_model_dir is None:
    _check_warm_start(task)
  return task


def _check_warm_start(task) -> None:
  """A warm start needs reference completions to imitate; found before any compile."""
  if not hasattr(task, "sft_examples"):
    raise ConfigError(f"sft.steps > 0 needs a task with reference completions "
                      f"(sft_examples); {type(task).__name__} has none: set sft.steps=0")
  try:
    next(iter(task.sft_examples()))
  except (ValueError, StopIteration) as e:
    raise ConfigError(f"sft.steps > 0 needs reference completions: {e or 'none found'}") from e


def _check_objective(cfg):
  """The objective's own checks, and settings that would train on no signal."""
  loss.from_config(cfg.ppo)
  advantages.from_config(cfg.advantage, cfg.generation.max_new_tokens)
  a, g = cfg.advantage, cfg.generation
  if g.group_size == 1 and "group" in (a.mean_level, a.std_level):
    raise ValueError(f"generation.group_size must be >= 2 when advantage.mean_level or "
                     f"advantage.std_level is 'group' (a group of one is its own baseline: "
                     f"every advantage would be 0), got {g.group_size}")
  if g.temperature == 0:
    raise ValueError("generation.temperature must be > 0 for training: greedy samples of a "
                     "group are all alike, so they carry no learning signal (held-out "
                     "evaluation is greedy whatever it is), got 0")


def _check_prompts(cfg: ExperimentConfig, task, sample: int = 64) -> None:
  """The task's held-out prompts and the first of its training stream must fit the
  generator (`task.max_prompt_len`, leaving room for an answer); when some do not,
  says how many (the rollouts skip them, `rollout.PromptSource`)."""
  limit = cfg.task.max_prompt_len
  stream = task.stream(worker_index=0)
  prompts = {"held-out": list(task.heldout(sample)),
             "training": [next(stream) for _ in range(sample)]}
  for split, drawn in prompts.items():
    longer = sum(len(p.tokens) > limit for p in drawn)
    if drawn and longer == len(drawn):
      raise ConfigError(f"task.max_prompt_len (generation.max_prompt_len) must hold the "
                        f"task's prompts: all {len(drawn)} {split} prompts drawn are longer "
                        f"than {limit} tokens (the longest has "
                        f"{max(len(p.tokens) for p in drawn)})")
    if longer:
      logging.warning("%d of the first %d %s prompts are longer than task.max_prompt_len=%d "
                      "tokens; the rollouts skip such prompts", longer, len(drawn), split,
                      limit)


@contextlib.contextmanager
def _config_errors():
  try:
    yield
  except ValueError as e:
    raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Devices:
  """Where the devices go: the trainer's mesh, and each generator replica's."""
  trainer: tuple
  replicas: tuple[tuple, ...]


def split_devices(placement: config.PlacementConfig, local_devices, global_devices=None, *,
                  with_trainer: bool = True) -> Devices:
  """The trainer's and the generator replicas' devices (`config.PlacementConfig`).

  The trainer takes the first `trainer_devices` of this host's `local_devices` (all of
  them with -1, or every one of `global_devices` across `jax.distributed` processes);
  generator replicas of `devices_per_replica` take the devices it leaves, or share its
  first ones when it leaves none. A process without a trainer (a Ray rollout worker)
  gives every device to generators.

  Raises:
    ConfigError: the placement does not fit the devices; the message names the field.
  """
  p, local = placement, list(local_devices)
  everywhere = list(global_devices or local)
  if len(everywhere) > len(local) and p.trainer_devices != -1:
    raise ConfigError(f"placement.trainer_devices must be -1 across jax.distributed "
                      f"processes (the trainer takes all {len(everywhere)} devices), got "
                      f"{p.trainer_devices}")
  if p.trainer_devices > len(local):
    raise ConfigError(f"placement.trainer_devices must be at most the {len(local)} local "
                      f"devices, got {p.trainer_devices}")
  if not with_trainer:
    trainer, free = (), local
  elif len(everywhere) > len(local) or p.trainer_devices == -1:
    trainer, free = tuple(everywhere), []
  else:
    trainer, free = tuple(local[:p.trainer_devices]), local[p.trainer_devices:]
  k = p.devices_per_replica
  pool = free or local  # Generators share the trainer's devices when it leaves none.
  n = (len(free) // k or 1) if p.generator_replicas == -1 else p.generator_replicas
  if n * k > len(pool):
    where = (f"the {len(free)} devices placement.trainer_devices={p.trainer_devices} leaves"
             if free else f"the {len(local)} local devices")
    raise ConfigError(f"placement.generator_replicas ({n}) x placement.devices_per_replica "
                      f"({k}) must fit {where}")
  return Devices(trainer, tuple(tuple(pool[i * k:(i + 1) * k]) for i in range(n)))


def make_engine(cfg: ExperimentConfig, devices=None, base=None):
  """A generator engine on `devices` (default: the first local device); with several,
  its params split over heads and MLP width (the `tensor` axis of its own mesh). Its
  prefill takes whole episodes so far, not only prompts: a multi-turn workflow's next
  turn holds everything before it. On one CPU device its slots split into groups
  decoded at once (`cpu.SlotGroupEngine`), each with its share of the KV cache's
  `generation.kv_blocks`, so no more groups than shares that hold a sequence of
  `generation.max_length`; on CPU devices its decode steps read the cache as the CPU's
  `cpu.PagedDecoding`. With `cfg.lora` it serves adapters on the frozen base `base`
  (`generation.adapted.AdaptedEngine`; None: given later, `set_base`, before the first
  adapters)."""
  g = cfg.generation
  devices = list(devices or jax.local_devices()[:1])
  mesh = Mesh(np.array(devices).reshape(1, 1, len(devices)), sharding.AXES)
  param_sharding = None
  if len(devices) > 1:
    param_sharding = sharding.param_shardings(models.abstract_params(cfg.model), mesh)
  groups = decode_groups(cfg, devices[0].platform) if len(devices) == 1 else 1
  if g.kv_blocks:
    groups = cpu.engine.num_groups(g.num_slots, min(groups, g.kv_blocks // g.sequence_blocks))
  engine = Engine(cfg.model, max_concurrent_decodes=g.num_slots // groups,
                  max_prefill_length=g.max_length - 1, max_target_length=g.max_length,
                  steps_per_call=g.steps_per_call, kv_blocks=g.kv_blocks // groups,
                  kv_block_size=g.kv_block_size, mesh=mesh, param_sharding=param_sharding,
                  decoding=cpu.PagedDecoding() if devices[0].platform == "cpu" else None)
  engine = engine if groups == 1 else cpu.SlotGroupEngine(engine, groups)
  if cfg.lora.enabled:
    engine = AdaptedEngine(engine, cfg.lora.scale, base)
  return engine


def make_pool(engines, params, *, version: int = 0, seed: int = 0):
  """A `GeneratorPool` on the one engine, or a `ReplicatedPool` over several."""
  if len(engines) == 1:
    return GeneratorPool(engines[0], params, version=version, seed=seed)
  timeline = Timeline()
  return ReplicatedPool([GeneratorPool(e, params, version=version, seed=seed + i,
                                       timeline=timeline) for i, e in enumerate(engines)])


def decode_groups(cfg: ExperimentConfig, platform: str) -> int:
  """The generator's slot groups: on the CPU as many as `cpu.decode_threads` (0: half
  the cores) allow (`cpu.engine.num_groups`); elsewhere 1, one program keeps a device
  busy."""
  if platform != "cpu":
    return 1
  return cpu.engine.num_groups(cfg.generation.num_slots,
                               cfg.cpu.decode_threads or cpu.default_threads())


def grad_threads(cfg: ExperimentConfig, mesh) -> int:
  """Threads that share each update's micro-batches: `cpu.grad_threads` (0: half the
  cores) for a trainer on one CPU device; else 1, a program over several devices (or on
  an accelerator) already keeps them busy."""
  if mesh.devices.size > 1 or mesh.devices.flat[0].platform != "cpu":
    return 1
  return cfg.cpu.grad_threads or cpu.default_threads()


def make_trainer(cfg: ExperimentConfig, mesh, params=None) -> Trainer:
  """The trainer, its state built on `mesh` (from `params`, or a random init; with a KL
  penalty, these initial params are also its frozen reference policy; with `cfg.lora`,
  they are the frozen base of the adapters it trains). A trainer on one
  CPU device shares each update's micro-batches among threads (`cpu.threaded_steps`)."""
  tx = train_step.make_optimizer(cfg.optimizer)
  state, shardings = train_step.create_train_state(cfg.model, tx, mesh,
                                                   jax.random.key(cfg.seed), params=params,
                                                   reference=cfg.ppo.kl_beta > 0,
                                                   lora_cfg=cfg.lora)
  step_kw = dict(model_cfg=cfg.model, loss_fn=loss.from_config(cfg.ppo),
                 temperature=cfg.generation.logp_temperature,
                 num_minibatches=cfg.ppo.num_minibatches)
  threads = grad_threads(cfg, mesh)
  if threads > 1:
    steps = cpu.threaded_steps(mesh, shardings, threads=threads, **step_kw)
  else:
    steps = train_step.jit_steps(mesh, shardings, **step_kw)
  return Trainer(state, shardings, mesh, steps, model=cfg.model, ppo=cfg.ppo,
                 batching=cfg.batching,
                 advantage_fn=advantages.from_config(cfg.advantage, cfg.generation.max_new_tokens),
                 group_size=cfg.generation.group_size, max_length=cfg.generation.max_length,
                 sample_per_turn=cfg.task.sample_per_turn,
                 base_pointer=LoraBase(cfg).pointer if cfg.lora.enabled else None)


def initial_params(cfg: ExperimentConfig, mesh, task, echo: Callable[[str], None] = print,
                   record: Callable[[int, dict], None] = lambda step, metrics: None):
  """A fresh run's params: `hf_model_dir`'s, loaded straight onto the trainer's
  shardings; else the warm start on `task` (its metrics passed to `record`); else None
  (a random init)."""
  if cfg.hf_model_dir is not None:
    return hf.load_hf(cfg.hf_model_dir, cfg.model, shardings=sharding.param_shardings(
        models.abstract_params(cfg.model), mesh))
  if cfg.sft.steps:
    return warm_start(task, cfg.model, cfg.sft, cfg.batching, mesh, seed=cfg.seed, echo=echo,
                      record=record)
  return None


def reward_fn(cfg: ExperimentConfig, task) -> Reward:
  """The reward: `rollout.reward_fn` when set, else the task's own reward function,
  each function called in its style (`rollout.reward_style`) with its weight
  (`rollout.reward_weights`).

  Raises:
    ValueError: neither names a reward function, or one does not load.
  """
  r = cfg.rollout
  if r.reward_fn is None and task.reward_fn is None:
    raise ValueError(f"rollout.reward_fn must name a reward function: the task "
                     f"{cfg.task.name!r} has none of its own, got None")
  return Reward(r.reward_fn or task.reward_fn, style=r.reward_style, weights=r.reward_weights,
                field="rollout.reward_fn")


def correct_fn(cfg: ExperimentConfig, task) -> Reward:
  """What the evaluation scores correctness with: `eval.correct_fn` when set (its
  style decided by its signature), else the training reward (`reward_fn`)."""
  if cfg.eval.correct_fn is None:
    return reward_fn(cfg, task)
  return Reward(cfg.eval.correct_fn, field="eval.correct_fn")


def also_correct_fns(cfg: ExperimentConfig) -> dict[str, Reward]:
  """The evaluation's other criteria of correctness (`eval.also_correct_fns`), by name."""
  return {name: Reward(fn, field=f"eval.also_correct_fns[{name!r}]")
          for name, fn in cfg.eval.also_correct_fns.items()}


def reward_service(cfg: ExperimentConfig, num_workers: int) -> RewardService:
  """A reward service of `num_workers` worker processes, as `rollout` configures them."""
  r = cfg.rollout
  return RewardService(num_workers=num_workers, timeout_s=r.reward_timeout_s,
                       memory_mb=r.reward_memory_mb, allow_weak_sandbox=r.allow_weak_sandbox,
                       error_window=r.reward_error_window)


def make_evaluator(cfg: ExperimentConfig, task, params, *, engines=None, version: int = 0,
                   reward_workers: int = 1,
                   wait: Optional[Callable[[Future, str], Any]] = None) -> Evaluator:
  """The held-out evaluator of `params` (at `version`) on `task`, as `cfg.eval` says: a
  generator pool over `engines` (None: one new engine), a reward service of
  `reward_workers` processes as `rollout` configures them (`reward_service`), and
  `correct_fn` (and `also_correct_fns`) to score with. Its waits end as `wait(future, what)` says (None: never
  time out)."""
  rewards = reward_service(cfg, num_workers=reward_workers)
  try:
    pool = make_pool(engines or [make_engine(cfg)], params, version=version)
  except BaseException:
    rewards.close()
    raise
  return Evaluator(pool, rewards, task, cfg.eval, reward_fn=correct_fn(cfg, task),
                   also_correct=also_correct_fns(cfg),
                   max_new_tokens=cfg.generation.max_new_tokens, seed=cfg.seed,
                   vocab_size=cfg.model.vocab_size, max_prompt_len=cfg.task.max_prompt_len,
                   wait=wait)


def random_params(cfg: ExperimentConfig, mesh):
  """A random init of `cfg.model` (the trainer's, with `cfg.seed`), built straight onto
  its shardings on `mesh`: no optimizer state."""
  shardings = sharding.param_shardings(models.abstract_params(cfg.model), mesh)
  return jax.jit(functools.partial(models.init_params, cfg.model),
                 out_shardings=shardings)(jax.random.key(cfg.seed))


def sampling_params(cfg: ExperimentConfig, task) -> SamplingParams:
  """How the rollouts sample: the generation section, and the task's stop ids."""
  g = cfg.generation
  return SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                        max_new_tokens=g.max_new_tokens, stop_token_ids=task.tokenizer.stop_ids,
                        truncated_logp=g.truncated_logp)


def restored_trainer(cfg: ExperimentConfig, workdir: str, mesh, task, *, server=None,
                     init_params=None, echo: Callable[[str], None] = print,
                     record: Callable[[int, dict], None] = lambda step, metrics: None
                     ) -> tuple[Trainer, Checkpointer, Restored]:
  """The trainer on `mesh`, restored from `workdir`'s newest checkpoint that reads whole
  (`server` with it; None: a process without one), else starting from `init_params`
  (None: `initial_params`, which passes the warm start's metrics to `record`); with its
  checkpointer and what it resumed. Process 0 then writes the run's `config.json`:
  after the restore, so that a resume that fails leaves the run's own.

  A LoRA checkpoint holds no base: the trainer is built on the one its `LoraBase`
  makes or reads (`LoraBase.for_trainer`). A warm start is the base: a fresh run writes
  it to `workdir` before its first step, and a resumed one reads it from there rather
  than warm-starting again, and checks it against the restored checkpoint's pointer.

  Raises:
    NoUsableCheckpointError: the checkpoints cannot be restored, or a resumed LoRA run's
      warm-started base is missing, damaged or not the one its checkpoints record."""
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.checkpoint.keep)
  try:
    resumed = checkpointer.latest_step() is not None
    make = lambda: initial_params(cfg, mesh, task, echo, record=record)
    base = LoraBase(cfg, workdir, given=init_params) if cfg.lora.enabled else None
    if base is not None:
      init_params = base.for_trainer(make, resumed=resumed, write=multihost.is_leader())
    elif init_params is None and not resumed:
      init_params = make()
    trainer = make_trainer(cfg, mesh, init_params)
    if base is not None:
      trainer.base_pointer = base.pointer
    restored = TrainLoop.restore(checkpointer, trainer, server, echo)
    if base is not None and restored.step is not None:
      base.check(restored.meta.lora_base)
  except BaseException:
    checkpointer.close()
    raise
  if multihost.is_leader():
    workdir_lib.write_config(workdir, cfg)
  return trainer, checkpointer, restored


def train_loop(cfg: ExperimentConfig, workdir: str, server, *, task, engines=None,
               trainer_devices=None, init_params=None,
               stop: Optional[threading.Event] = None, echo: Callable[[str], None] = print,
               progress: bool = True, publish_on_host: bool = False,
               run_id: Optional[str] = None) -> TrainLoop:
  """The trainer side of a run, resumed from `workdir`'s newest checkpoint that reads
  whole, its version published to `server` (host copies with `publish_on_host`, for a
  server in another process).

  `engines` serve the held-out evaluation (None: one new engine); in one process they
  are the rollout worker's, so their programs compile once. With LoRA they get the
  frozen base here, once the trainer has made it (a warm start's: written to
  `workdir`). `trainer_devices` carry the trainer's mesh (None: every device). `run_id`
  marks the run's metrics lines (None: a new id); the log drops the lines the restored
  checkpoint supersedes. The loop's lines, the deadlines' and the warm start's go to
  `echo` clear of the progress bar (`progress.Progress`).
  """
  os.makedirs(workdir, exist_ok=True)
  bar = Progress(echo, enabled=progress)
  mesh = sharding.make_mesh(cfg.mesh, trainer_devices)
  warm_start_log = []  # written once the log exists, after the restore
  trainer, checkpointer, restored = restored_trainer(
      cfg, workdir, mesh, task, server=server, init_params=init_params, echo=bar.echo,
      record=lambda *line: warm_start_log.append((*line, time.time())))
  recorder = schedule.recorder(
      os.path.join(workdir, schedule.SCHEDULE_DIR), restored.step, record_context(cfg, mesh),
      enabled=cfg.run.record_schedule, echo=bar.echo,
      checkpoints=checkpointer.steps if cfg.run.prune_schedule else None)
  leader = multihost.Leader() if jax.process_count() > 1 else None
  publishing = Publishing(on_host=publish_on_host or leader is not None,
                          dtype=cfg.placement.publish_dtype, leader=leader)
  # Unannounced: every follower makes this first host copy of its own (`entry.follow`).
  params = (trainer.host_params(publishing.dtype) if publishing.on_host
            else trainer.device_params())
  server.publish(trainer.version, params)
  deadlines = Deadlines(cfg.run.warn_after_s, cfg.run.stall_timeout_s, bar.echo)
  stop = stop or threading.Event()
  engines = engines or [make_engine(cfg)]
  if cfg.lora.enabled:  # the base the trainer made (a warm start: wrote) is theirs too
    base = LoraBase(cfg, workdir, given=init_params).load(against=trainer.base_pointer)
    for engine in engines:
      engine.set_base(base)
  evaluator = make_evaluator(cfg, task, params, engines=engines, version=trainer.version,
                             wait=functools.partial(deadlines.result, stop=stop))
  log = MetricsLog(workdir, run_id or workdir_lib.new_run_id(), resume_step=restored.step,
                   wandb_project=cfg.log.wandb_project, hparams=cli.to_dict(cfg))
  for step, metrics, at in warm_start_log:
    log.write_warm_start(step, metrics, at)
  settings = Settings(
      num_steps=cfg.num_steps, eval_every=cfg.eval.every_steps,
      checkpoint_every=cfg.checkpoint.every_steps,
      max_consecutive_skips=cfg.train.max_consecutive_skips,
      learning_rate=train_step.learning_rate(cfg.optimizer), decode=task.tokenizer.decode,
      max_untrainable_groups=cfg.run.max_untrainable_groups,
      correct_threshold=cfg.eval.correct_threshold, log=cfg.log,
      max_staleness=None if cfg.staleness.on_stale == "admit" else cfg.staleness.max_staleness)
  return TrainLoop(trainer, server, evaluator, deadlines, settings,
                   Outputs(checkpointer, log, echo=bar.echo, progress=bar, schedule=recorder),
                   publishing, restored=restored, stop=stop)


def replay(cfg: ExperimentConfig, workdir: str, recorded: str, task, *, run_id: str,
           stop: Optional[threading.Event] = None, echo: Callable[[str], None] = print,
           progress: bool = True) -> Replay:
  """The replay in `workdir` of the run recorded in the workdir `recorded` (`rl.replay`),
  ready to run: the trainer, restored from the replay's own newest checkpoint, else at
  the recorded run's initial params or restored from its checkpoint that its record
  goes on from (`schedule.replay_start`); its checkpointer and log; and the recorded
  run's record, log and checkpoints, to check every step against.

  Raises:
    ConfigError: `recorded` holds no record, or a record with a step missing, or none
      of its checkpoints is one its record goes on from; or the replay's own checkpoint
      is older than where the record lets it start.
  """
  record = os.path.join(recorded, schedule.SCHEDULE_DIR)
  steps = schedule.recorded_steps(record)
  if not steps:
    raise ConfigError(f"{recorded} holds no recorded schedule ({record} has no batch): "
                      f"its run had run.record_schedule=False, or trained no step, or its "
                      f"record was pruned up to its newest checkpoint (run.prune_schedule)")
  if steps != list(range(steps[0], steps[-1] + 1)):
    raise ConfigError(f"--replay needs the batches of consecutive steps in {record}, found "
                      f"those of steps {steps[:10]}")
  reference = Checkpointer(os.path.join(recorded, "checkpoints"), keep=cfg.checkpoint.keep)
  checkpoints = reference.steps()
  start = schedule.replay_start(steps, checkpoints)
  if start is None:
    reference.close()
    raise ConfigError(f"the record in {record} holds the batches of steps {steps[0]} to "
                      f"{steps[-1]}; a replay starts from a checkpoint of {recorded} that "
                      f"they go on from, and none is (its checkpoints: {checkpoints})")
  bar = Progress(echo, enabled=progress)
  mesh = sharding.make_mesh(cfg.mesh, split_devices(cfg.placement, jax.local_devices(),
                                                    jax.devices()).trainer)
  closing = [reference]
  try:
    trainer, checkpointer, restored = restored_trainer(cfg, workdir, mesh, task, echo=bar.echo)
    closing.append(checkpointer)
    abstract, initial = trainer.abstract_state(), None
    if restored.step is None and start > 0:
      initial = trainer.device_params()  # version 0's, which the run kept no checkpoint of
      state, meta = reference.restore(start, abstract)
      trainer.restore(state, meta.packed_shapes)
      restored = Restored(start, meta)
      where = ("where its record starts" if start == steps[0] - 1 else
               f"the oldest its record (from step {steps[0]}) goes on from")
      bar.echo(f"the replay starts from {recorded}'s checkpoint {start}, {where}")
    elif (restored.step or 0) < start:
      raise ConfigError(f"a replay of the record in {record} starts from checkpoint {start}, "
                        f"after this replay's checkpoint {restored.step}: replay into a new "
                        f"workdir")
    log = MetricsLog(workdir, run_id, resume_step=restored.step, hparams=cli.to_dict(cfg))
  except BaseException:
    for part in closing:
      part.close()
    raise
  recorded_run = RecordedRun(recorded, reference, abstract, checkpoints=checkpoints,
                             logged=read_log(recorded), initial=initial)
  float32 = cfg.model.dtype == "float32" and cfg.placement.publish_dtype is None
  return Replay(
      trainer, checkpointer, log, recorded_run, steps=min(cfg.num_steps, steps[-1]),
      context=record_context(cfg, mesh),
      recompute=functools.partial(recompute_behaviour_logp, trainer, batching=cfg.batching,
                                  max_length=cfg.generation.max_length, compiled=set()),
      update_mode=cfg.generation.update_mode, max_staleness=cfg.staleness.max_staleness,
      logp_atol=LOGP_ATOL if float32 else None, checkpoint_every=cfg.checkpoint.every_steps,
      restored=restored, stop=stop, echo=bar.echo, progress=bar)


def record_context(cfg: ExperimentConfig, mesh) -> dict[str, Any]:
  """What fixes the trainer's numerics beside the config: the gradient threads (the
  order of its sums), its devices and the software (`rl.replay`)."""
  return {"grad_threads": grad_threads(cfg, mesh), "trainer_devices": int(mesh.devices.size),
          "platform": mesh.devices.flat[0].platform, "jax": jax.__version__}


def rollout_worker(cfg: ExperimentConfig, server, *, index: int = 0, task=None,
                   engines=None) -> RolloutWorker:
  """Rollout worker `index`: its prompt stream, generator pool (over `engines`, one per
  generator replica, a LoRA run's holding its base; None: one new engine), reward
  service and controller, starting at the server's weights.

  Registering with the server writes off anything an earlier worker of that index
  left running and says where its prompt stream resumes (the prompts to issue again,
  then the stream's cursor).
  """
  task = make_task(cfg.task) if task is None else task
  start = server.register_worker(index)
  version, params = server.fetch(-1)
  prompts = PromptSource(lambda state: task.stream(state, worker_index=index),
                         cursor=start["cursor"], replay=start["replay"])
  if engines is None:  # a LoRA run's base named by its config: not a warm start's
    engines = [make_engine(cfg, base=LoraBase(cfg).load() if cfg.lora.enabled else None)]
  pool = make_pool(engines, params, version=version, seed=cfg.seed + index)
  rewards = reward_service(cfg, num_workers=cfg.rollout.reward_workers)
  controller = RolloutController(
      server=server, pool=pool, rewards=rewards, prompts=prompts, reference=task.reference,
      decode=task.tokenizer.decode, reward_fn=reward_fn(cfg, task),
      sampling=sampling_params(cfg, task), group_size=cfg.generation.group_size,
      update_mode=cfg.generation.update_mode,
      dynamic_filter=cfg.rollout.dynamic_filter, worker=index, seed=cfg.seed,
      workflow=task.workflow, vocab_size=cfg.model.vocab_size,
      max_prompt_len=cfg.task.max_prompt_len,
      max_reward_error_rate=cfg.rollout.max_reward_error_rate)
  return RolloutWorker(index, controller, pool, rewards)
