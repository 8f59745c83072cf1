"""A run's trained policy out of its workdir, or a Hugging Face model, loaded once
(`load_policy`: its params, tokenizer and engine) and scored on the task's held-out
set, exported as a Hugging Face directory (the way back from `hf_model_dir`), or served
by JetStream's orchestrator (`serve`) or the OpenAI-compatible endpoint
(`agents.serve`)."""

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any, Optional

import jax

from async_rl import cli, sharding
from async_rl.config import ExperimentConfig, LoraConfig, MeshConfig
from async_rl.generation import Engine, SamplingParams
from async_rl.models import hf, lora
from async_rl.models.hf_tokenizer import HFTokenizer
from async_rl.rl import build, checkpoint
from async_rl.rl.lora_base import LoraBase
from async_rl.tasks.registry import make_task


def run_config(workdir: str) -> ExperimentConfig:
  """The run's resolved config, as it wrote it to `workdir/config.json`."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: {workdir} holds no run (a run writes "
                            "it once it has started or resumed)")
  with open(path) as f:
    return cli.from_dict(json.load(f))


@dataclasses.dataclass(frozen=True)
class Policy:
  """A policy to score, export or serve, as `load_policy` loads it.

  Attributes:
    cfg: the config it runs under, resolved (a run's own).
    params: the model's params (a LoRA run's adapters merged into their base).
    source: where it comes from: {"workdir", "step"} of a run's checkpoint, or
      {"hf_model_dir"} of a model (None: the random init of `cfg.model`).
    adapters: a LoRA run's adapters as trained; None without LoRA.
  """
  cfg: ExperimentConfig
  params: Any
  source: dict[str, Any]
  adapters: Any = None

  def tokenizer(self):
    """A Hugging Face model's own (`task.tokenizer_dir`), else the task's."""
    if self.source.get("hf_model_dir") is not None:
      return HFTokenizer(self.cfg.task.tokenizer_dir)
    return make_task(self.cfg.task).tokenizer

  def engine(self, devices=None):
    """A generator engine of the config's `generation` sizes that serves `params`
    (`build.make_engine`), on `devices` (default: the first local device)."""
    return build.make_engine(dataclasses.replace(self.cfg, lora=LoraConfig()), devices)


def load_policy(cfg: Optional[ExperimentConfig] = None, *, workdir: Optional[str] = None,
                step: Optional[int] = None) -> Policy:
  """The one loader of a policy to score, export or serve.

  With `workdir`, a run's checkpoint at `step` (default: the latest) under `cfg`
  (default: the run's own config, `run_config`); a LoRA run's adapters merged into the
  base its checkpoint names (`rl.lora_base`: a warm start's is read from the workdir).
  Without, `cfg.hf_model_dir`'s weights, or else the random init of `cfg.model` with
  `cfg.seed` (a baseline).

  Raises:
    FileNotFoundError: the workdir holds no run, or no checkpoint (at `step`).
    NoUsableCheckpointError: a LoRA run's warm-started base is missing, damaged or not
      the one its checkpoint records.
    ValueError: a LoRA run's base was given to it (`init_params`): nothing names it.
  """
  if workdir is None:
    cfg = build.resolve(cfg)
    if cfg.hf_model_dir is None:
      mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
      return Policy(cfg, build.random_params(cfg, mesh), {"hf_model_dir": None})
    return Policy(cfg, hf.load_hf(cfg.hf_model_dir, cfg.model),
                  {"hf_model_dir": cfg.hf_model_dir})
  cfg = build.resolve(cfg or run_config(workdir))
  directory, step, meta = _checkpoint(workdir, step)
  source = {"workdir": workdir, "step": step}
  if not cfg.lora.enabled:
    return Policy(cfg, checkpoint.restore_params(directory, cfg.model, step=step), source)
  adapters = _adapters(cfg, directory, step)
  base = LoraBase(cfg, workdir).load(against=meta.lora_base)
  return Policy(cfg, lora.merge(base, adapters, cfg.lora.scale), source, adapters=adapters)


def _checkpoint(workdir: str, step: Optional[int]) -> tuple[str, int, checkpoint.Meta]:
  """The run's checkpoint directory, the step (default: the latest) and its meta."""
  directory = os.path.join(workdir, "checkpoints")
  steps = checkpoint.steps(directory)
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {directory}")
  step = steps[-1] if step is None else step
  return directory, step, checkpoint.read_meta(directory, step)


def _adapters(cfg: ExperimentConfig, directory: str, step: int):
  return checkpoint.restore_params(directory, cfg.model, step=step,
                                   abstract=lora.abstract_adapters(cfg.model, cfg.lora))


def score(policy: Policy, *, num_prompts: Optional[int] = None,
          pass_k: Optional[int] = None) -> dict:
  """Held-out metrics of `policy` on its config's task (`build.make_evaluator`, its
  reward service of `rollout.reward_workers` processes): greedy accuracy, pass@k, mean
  completion length, and the reward calls that failed."""
  cfg = policy.cfg
  task = build.preflight(cfg)
  cfg = dataclasses.replace(cfg, eval=dataclasses.replace(
      cfg.eval, num_prompts=num_prompts or cfg.eval.num_prompts,
      pass_k=cfg.eval.pass_k if pass_k is None else pass_k))
  evaluator = build.make_evaluator(cfg, task, policy.params, engines=[policy.engine()],
                                   reward_workers=cfg.rollout.reward_workers)
  try:
    metrics = evaluator.evaluate()
    rewards = evaluator.rewards.metrics()
  finally:
    evaluator.close()
  return {**metrics, "num_prompts": len(task.heldout(cfg.eval.num_prompts)),
          "reward_calls": rewards["calls"],
          "reward_failures": rewards["errors"] + rewards["timeouts"]}


def export_hf(workdir: str, out_dir: str, *, step: Optional[int] = None,
              adapter: bool = False, base: bool = False) -> None:
  """Writes the policy of the run's checkpoint at `step` (default: the latest) to
  `out_dir` as a Hugging Face directory: `config.json` and `model.safetensors`, with
  the tokenizer files of the run's `hf_model_dir` when it has one.

  The model config is the run's own, from `workdir/config.json`, so no config file or
  override is needed. A LoRA run's adapters are merged into the base its checkpoint
  names (`load_policy`); with `adapter` they are written alone as PEFT saves them
  (`export_peft`), and with `base` their base is, the model PEFT loads them onto when
  no `hf_model_dir` names it (a warm start, a random init).

  Raises:
    ValueError: `adapter` or `base` for a run without LoRA, or both at once; a merge or
      a base for a LoRA run whose base was given to it (`init_params`) rather than
      named by its config.
  """
  if adapter and base:
    raise ValueError("export the adapters (--adapter) or their base (--base), not both at "
                     "once")
  cfg = build.resolve(run_config(workdir))
  if (adapter or base) and not cfg.lora.enabled:
    raise ValueError(f"the run in {workdir} trained no adapters (lora.rank = 0): export the "
                     f"whole model, without --adapter or --base")
  if adapter:
    directory, step, _ = _checkpoint(workdir, step)
    export_peft(cfg, _adapters(cfg, directory, step), out_dir)
    return
  if base:
    _, _, meta = _checkpoint(workdir, step)
    params = LoraBase(cfg, workdir).load(against=meta.lora_base)
  else:
    params = load_policy(cfg, workdir=workdir, step=step).params
  hf.save_hf(cfg.model, params, out_dir, tokenizer_dir=cfg.hf_model_dir)


def export_peft(cfg: ExperimentConfig, adapters, out_dir: str) -> None:
  """Writes LoRA `adapters` of the run `cfg` to `out_dir` as PEFT saves them
  (`adapter_config.json`, `adapter_model.safetensors`): `peft.PeftModel.from_pretrained`
  loads them onto the base, the run's `hf_model_dir` (or that base exported with
  `hf.save_hf`)."""
  from safetensors.numpy import save_file  # noqa: PLC0415 (the hf extra)
  os.makedirs(out_dir, exist_ok=True)
  save_file(lora.peft_tensors(jax.device_get(adapters)),
            os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(lora.peft_config(cfg.lora, cfg.hf_model_dir), f, indent=2)


def serve(cfg: ExperimentConfig, prompts: Sequence, *, workdir: Optional[str] = None,
          step: Optional[int] = None, max_tokens: Optional[int] = None,
          sampling: Optional[SamplingParams] = None) -> list:
  """Completes `prompts` with JetStream's orchestrator (extra `jetstream`) serving a
  run's checkpoint through its task's tokenizer or, without `workdir`, the model in
  `cfg.hf_model_dir` through its own tokenizer (`load_policy`).

  Args:
    cfg: the config of the run or model (its model and task, and generation sizes for
      the engine).
    prompts: text or token ids, as for `jetstream_adapter.JetStreamServer.complete`.
    workdir: the run whose checkpoint (`<workdir>/checkpoints`) to serve.
    step: the checkpoint to serve; default the latest.
    max_tokens: tokens per completion; default `cfg.generation.max_new_tokens`.
    sampling: as for `JetStreamEngine`; greedy by default.

  Returns:
    A `jetstream_adapter.Completion` per prompt.

  Raises:
    ValueError: neither a workdir nor `cfg.hf_model_dir`, or a prompt length JetStream
      cannot prefill.
  """
  if workdir is None and cfg.hf_model_dir is None:
    raise ValueError("nothing to serve: give a run's workdir or set hf_model_dir")
  from async_rl.generation import jetstream_adapter as js  # noqa: PLC0415 (an extra)
  g = cfg.generation
  # JetStream pads prompts to its prefill lengths; the engine's must be one of them.
  prefill_length = next((n for n in js.PREFILL_LENGTHS if n >= g.max_prompt_len), None)
  if prefill_length is None:
    raise ValueError(f"generation.max_prompt_len {g.max_prompt_len} exceeds JetStream's "
                     f"longest prefill length {js.PREFILL_LENGTHS[-1]}")
  policy = load_policy(cfg, workdir=workdir, step=step)
  engine = Engine(policy.cfg.model, max_concurrent_decodes=g.num_slots,
                  max_prefill_length=prefill_length,
                  max_target_length=prefill_length + g.max_new_tokens)
  served = js.JetStreamEngine(engine, policy.params, tokenizer=policy.tokenizer(),
                              sampling=sampling or js.GREEDY)
  with js.JetStreamServer(served) as server:
    return server.complete(prompts, max_tokens=max_tokens or g.max_new_tokens)
