"""How a run is put together, top to bottom: the one place that builds its parts.

`run` resolves the config (what it names on disk), checks every part's settings before
anything is compiled, and places the parts: in this process (`in_process`: the
trainer loop on the calling thread, the rollout controller, the generator pool's
decode loop and the reward service's dispatch on threads of their own, the reward
functions in worker processes) or as Ray actors (`rl.ray_placement`), which build their
parts with the functions below. Each part gets the config sections it owns and takes
what else it needs ready-made; reading checkpoints and data, writing the workdir and
starting the pools and services is done here, in the order below.

Choices that exist only for XLA:CPU speed (`async_rl.cpu`) are made here, and nowhere
else: on the CPU backend a generator's slots split into groups decoded from threads of
their own, and a one-device trainer shares each update's micro-batches among threads.
"""

import contextlib
import dataclasses
import functools
import json
import os
import threading
from typing import Any, Callable, Optional

import jax

from async_rl import advantages, config, cpu, loss, models, sharding, train_step
from async_rl.config import ExperimentConfig, ModelConfig
from async_rl.generation import Engine, GeneratorPool, SamplingParams
from async_rl.models import hf, hf_config
from async_rl.param_server import ParameterServer
from async_rl.rewards import RewardService
from async_rl.rl.checkpoint import Checkpointer
from async_rl.rl.deadlines import Deadlines
from async_rl.rl.errors import ConfigError
from async_rl.rl.evaluate import Evaluator
from async_rl.rl.metrics_log import MetricsLog
from async_rl.rl.rollout import PromptSource, RolloutController, RolloutWorker
from async_rl.rl.trainer import Trainer
from async_rl.rl.trainer_loop import TrainLoop
from async_rl.sft import warm_start
from async_rl.tasks.registry import TASKS, check_task, make_task


def run(cfg: ExperimentConfig, workdir: str, *, placement: str = "in_process", task=None,
        init_params=None, stop: Optional[threading.Event] = None,
        echo: Callable[[str], None] = print, progress: bool = True,
        **ray_options) -> dict[str, Any]:
  """Runs (or resumes from `workdir`) the experiment; returns the loop's summary.

  Args:
    cfg: the experiment.
    workdir: checkpoints, `metrics.jsonl`, TensorBoard files and `config.json`.
    placement: one of `config.PLACEMENTS`.
    task: a task built in this process (say, in a notebook) in place of `cfg.task`'s
      (in process only).
    init_params: params to start from when not resuming; by default those of
      `cfg.hf_model_dir`, else a warm start of `cfg.sft.steps`, else a random init.
    stop: set it (e.g. from a SIGTERM handler) to checkpoint and return early.
    echo: receives the one-line summary of every step, and warnings.
    progress: show a progress bar.
    **ray_options: for placement "ray", `rl.ray_placement.run_on_ray`'s options.

  Raises:
    ConfigError: a setting that cannot work, found before anything is compiled.
  """
  cfg = resolve(cfg)
  if placement not in config.PLACEMENTS:
    raise ConfigError(f"placement must be one of {config.PLACEMENTS}, got {placement!r}")
  if placement == "ray":
    if task is not None:
      raise ConfigError("a task object runs in process only; on Ray name it in task.name")
    preflight(cfg, _make_task(cfg))
    from async_rl.rl.ray_placement import run_on_ray  # noqa: PLC0415 (ray is an extra)
    return run_on_ray(cfg, workdir, stop=stop, init_params=init_params, echo=echo,
                      progress=progress, **ray_options)
  task = preflight(cfg, _make_task(cfg) if task is None else task)
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  # One engine for the rollout and held-out pools: its programs compile once.
  engine = make_engine(cfg)
  loop = worker = None
  try:
    loop = train_loop(cfg, workdir, server, task=task, engine=engine, init_params=init_params,
                      stop=stop, echo=echo, progress=progress)
    worker = rollout_worker(cfg, server, task=task, engine=engine)
    summary = loop.run([worker])
    summary["history"] = loop.history
    return summary
  finally:
    server.close()
    for part in (worker, loop):
      if part is not None:
        part.close()


def _make_task(cfg):
  with _config_errors():
    return make_task(cfg.task)


def resolve(cfg: ExperimentConfig) -> ExperimentConfig:
  """`cfg` with what it names read from disk: the architecture in `hf_model_dir`'s
  config.json (only `config.HF_RUN_MODEL_FIELDS` of `model` stay as configured),
  absolute paths (Ray actors may run elsewhere), and the task's defaults filled in."""
  model, hf_dir = cfg.model, cfg.hf_model_dir
  if hf_dir is not None:
    hf_dir = os.path.abspath(hf_dir)
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
  for name in ("train_path", "heldout_path"):
    path = getattr(t.math, name)
    if path is not None and not os.path.isfile(path):
      raise ConfigError(f"task.math.{name} is not a file, got {path!r}")
  absolute = lambda path: None if path is None else os.path.abspath(path)
  task = dataclasses.replace(
      t, math=dataclasses.replace(t.math, train_path=absolute(t.math.train_path),
                                  heldout_path=absolute(t.math.heldout_path)),
      tokenizer_dir=absolute(t.tokenizer_dir or hf_dir),
      max_prompt_len=t.max_prompt_len or cfg.generation.max_prompt_len)
  try:
    return dataclasses.replace(cfg, hf_model_dir=hf_dir, model=model, task=task)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def check(cfg: ExperimentConfig) -> ExperimentConfig:
  """Runs the checks each part owns on its settings (the loss's, the advantage
  estimator's, the task's: a built-in task's own checks, or that a "module:attr"
  factory loads); returns `cfg`.

  Raises:
    ConfigError: naming the field whose value a part rejects.
  """
  with _config_errors():
    _check_objective(cfg)
    check_task(cfg)
  return cfg


def preflight(cfg: ExperimentConfig, task):
  """`check` for a run on `task` (built from `cfg.task`, or given), and that the task
  fits the model; returns `task`.

  Raises:
    ConfigError: naming the field whose value a part rejects.
  """
  with _config_errors():
    _check_objective(cfg)
    if cfg.task.name in TASKS:
      TASKS[cfg.task.name].check(cfg)
  if task.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size must hold the task's tokenizer "
                      f"({task.tokenizer.vocab_size} ids), got {cfg.model.vocab_size}")
  return task


def _check_objective(cfg):
  loss.from_config(cfg.ppo)
  advantages.from_config(cfg.advantage, cfg.generation.max_new_tokens)


@contextlib.contextmanager
def _config_errors():
  try:
    yield
  except ValueError as e:
    raise ConfigError(str(e)) from None


def make_engine(cfg: ExperimentConfig):
  """The generator engine, its KV cache `generation.kv_blocks` blocks. Its prefill takes
  whole episodes so far, not only prompts: a multi-turn workflow's next turn holds
  everything before it. On the CPU backend its slots split into groups decoded at once
  (`cpu.SlotGroupEngine`), each with its share of the KV blocks, so no more groups than
  shares that hold a sequence of `generation.max_length`."""
  g = cfg.generation
  groups = decode_groups(cfg, jax.default_backend())
  if g.kv_blocks:
    groups = cpu.engine.num_groups(g.num_slots, min(groups, g.kv_blocks // g.sequence_blocks))
  engine = Engine(cfg.model, max_concurrent_decodes=g.num_slots // groups,
                  max_prefill_length=g.max_length - 1, max_target_length=g.max_length,
                  steps_per_call=g.steps_per_call, kv_blocks=g.kv_blocks // groups,
                  kv_block_size=g.kv_block_size)
  return engine if groups == 1 else cpu.SlotGroupEngine(engine, groups)


def decode_groups(cfg: ExperimentConfig, backend: str) -> int:
  """The generator's slot groups: on the CPU as many as `cpu.decode_threads` (0: half
  the cores) allow (`cpu.engine.num_groups`); elsewhere 1, one program keeps a device
  busy."""
  if backend != "cpu":
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
  """The trainer, its state built on `mesh` (from `params`, or a random init). A trainer
  on one CPU device shares each update's micro-batches among threads
  (`cpu.threaded_steps`)."""
  tx = train_step.make_optimizer(cfg.optimizer)
  state, shardings = train_step.create_train_state(cfg.model, tx, mesh,
                                                   jax.random.key(cfg.seed), params=params)
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
                 sample_per_turn=cfg.task.sample_per_turn)


def initial_params(cfg: ExperimentConfig, mesh, task, echo: Callable[[str], None] = print):
  """A fresh run's params: `hf_model_dir`'s, loaded straight onto the trainer's
  shardings; else the warm start on `task`; else None (a random init)."""
  if cfg.hf_model_dir is not None:
    abstract = jax.eval_shape(functools.partial(models.init_params, cfg.model),
                              jax.random.key(0))
    return hf.load_hf(cfg.hf_model_dir, cfg.model,
                      shardings=sharding.param_shardings(abstract, mesh))
  if cfg.sft.steps:
    return warm_start(task, cfg.model, cfg.sft, cfg.batching, mesh, seed=cfg.seed, echo=echo)
  return None


def reward_fn(cfg: ExperimentConfig, task):
  """`rollout.reward_fn` when set, else the task's own reward function."""
  return cfg.rollout.reward_fn or task.reward_fn


def sampling_params(cfg: ExperimentConfig, task) -> SamplingParams:
  """How the rollouts sample: the generation section, and the task's stop ids."""
  g = cfg.generation
  return SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                        max_new_tokens=g.max_new_tokens, stop_token_ids=task.tokenizer.stop_ids)


def train_loop(cfg: ExperimentConfig, workdir: str, server, *, task, engine=None,
               init_params=None, stop: Optional[threading.Event] = None,
               echo: Callable[[str], None] = print, progress: bool = True,
               publish_on_host: bool = False) -> TrainLoop:
  """The trainer side of a run, resumed from `workdir`'s newest checkpoint that reads
  whole, its version published to `server` (host copies with `publish_on_host`, for a
  server in another process).

  `engine` serves the held-out evaluation (None: a new one); in one process it is the
  rollout worker's, so its programs compile once.
  """
  os.makedirs(workdir, exist_ok=True)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.checkpoint.keep)
  mesh = sharding.make_mesh(cfg.mesh)
  if checkpointer.latest_step() is None and init_params is None:
    init_params = initial_params(cfg, mesh, task, echo)
  trainer = make_trainer(cfg, mesh, init_params)
  restored = TrainLoop.restore(checkpointer, trainer, server, echo)
  # Written once the restore succeeded, so a resume that fails leaves the run's own.
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config.to_dict(cfg), f, indent=2)
  params = trainer.host_params() if publish_on_host else trainer.device_params()
  server.publish(trainer.version, params)
  deadlines = Deadlines(cfg.run.warn_after_s, cfg.run.stall_timeout_s, echo)
  evaluator = Evaluator(
      GeneratorPool(engine or make_engine(cfg), params, version=trainer.version),
      RewardService(num_workers=1, timeout_s=cfg.rollout.reward_timeout_s,
                    allow_weak_sandbox=cfg.rollout.allow_weak_sandbox),
      task, cfg.eval, reward_fn=reward_fn(cfg, task),
      max_new_tokens=cfg.generation.max_new_tokens, seed=cfg.seed,
      vocab_size=cfg.model.vocab_size, wait=deadlines.result)
  return TrainLoop(trainer, server, evaluator, checkpointer, MetricsLog(workdir), deadlines,
                   num_steps=cfg.num_steps, eval_every=cfg.eval.every_steps,
                   checkpoint_every=cfg.checkpoint.every_steps,
                   max_consecutive_skips=cfg.train.max_consecutive_skips, restored=restored,
                   publish_on_host=publish_on_host, stop=stop, echo=echo, progress=progress)


def rollout_worker(cfg: ExperimentConfig, server, *, index: int = 0, task=None,
                   engine=None) -> RolloutWorker:
  """Rollout worker `index`: its prompt stream, generator pool, reward service and
  controller, starting at the server's weights.

  Registering with the server writes off anything an earlier worker of that index
  left running and says where its prompt stream resumes (the prompts to issue again,
  then the stream's cursor).
  """
  task = make_task(cfg.task) if task is None else task
  start = server.register_worker(index)
  version, params = server.fetch(-1)
  prompts = PromptSource(lambda state: task.stream(state, worker_index=index),
                         cursor=start["cursor"], replay=start["replay"])
  pool = GeneratorPool(engine or make_engine(cfg), params, version=version, seed=cfg.seed + index)
  rewards = RewardService(num_workers=cfg.rollout.reward_workers,
                          timeout_s=cfg.rollout.reward_timeout_s,
                          allow_weak_sandbox=cfg.rollout.allow_weak_sandbox)
  controller = RolloutController(
      server=server, pool=pool, rewards=rewards, prompts=prompts, reference=task.reference,
      decode=task.tokenizer.decode, reward_fn=reward_fn(cfg, task),
      sampling=sampling_params(cfg, task), group_size=cfg.generation.group_size,
      update_mode=cfg.generation.update_mode,
      dynamic_filter=cfg.rollout.dynamic_filter, worker=index, seed=cfg.seed,
      workflow=task.workflow, vocab_size=cfg.model.vocab_size)
  return RolloutWorker(index, controller, pool, rewards)
