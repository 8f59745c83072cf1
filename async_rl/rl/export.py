"""A run's trained policy out of its workdir: scored on the task's held-out set, as a
Hugging Face directory (the way back from `hf_model_dir`), or served, like a Hugging
Face model, by JetStream's orchestrator."""

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import Optional

import jax

from async_rl import cli
from async_rl.config import ExperimentConfig, ModelConfig
from async_rl.generation import Engine, SamplingParams
from async_rl.models import hf, lora
from async_rl.models.hf_tokenizer import HFTokenizer
from async_rl.rl import build, checkpoint
from async_rl.rl.checkpoint import restore_params
from async_rl.tasks.registry import make_task


def run_config(workdir: str) -> ExperimentConfig:
  """The run's resolved config, as it wrote it to `workdir/config.json`."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: {workdir} holds no run (a run writes "
                            "it once it has started or resumed)")
  with open(path) as f:
    return cli.from_dict(json.load(f))


def latest_step(workdir: str) -> int:
  """The newest checkpoint step under `workdir/checkpoints`."""
  directory = os.path.join(workdir, "checkpoints")
  steps = [int(p) for p in os.listdir(directory) if p.isdigit()] if os.path.isdir(
      directory) else []
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {directory}")
  return max(steps)


def checkpoint_params(cfg: ExperimentConfig, workdir: str, step: Optional[int] = None):
  """The params a generator of run `cfg` (`build.make_engine`) takes, from `workdir`'s
  checkpoint at `step` (default: the latest): the model's, or a LoRA run's adapters."""
  abstract = lora.abstract_adapters(cfg.model, cfg.lora) if cfg.lora.enabled else None
  return restore_params(os.path.join(workdir, "checkpoints"), cfg.model, step=step,
                        abstract=abstract)


def score(cfg: ExperimentConfig, params, *, workdir: Optional[str] = None,
          num_prompts: Optional[int] = None, pass_k: Optional[int] = None) -> dict:
  """Held-out metrics of `params` (`checkpoint_params`'s) on `cfg`'s task
  (`build.make_evaluator`, its reward service of `rollout.reward_workers` processes):
  greedy accuracy, pass@k, mean completion length, and the reward calls that failed.
  A LoRA run's adapters are served on the base its pointer names (`build.lora_base`):
  a warm-started one is read from the run's `workdir`."""
  cfg = build.resolve(cfg)
  task = build.preflight(cfg)
  cfg = dataclasses.replace(cfg, eval=dataclasses.replace(
      cfg.eval, num_prompts=num_prompts or cfg.eval.num_prompts,
      pass_k=pass_k or cfg.eval.pass_k))
  engines = None
  if cfg.lora.enabled:
    engines = [build.make_engine(cfg, base=functools.partial(build.lora_base, cfg, workdir))]
  evaluator = build.make_evaluator(cfg, task, params, engines=engines,
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
              adapter: bool = False) -> None:
  """Writes the params of the run's checkpoint at `step` (default: the latest) to
  `out_dir` as `config.json` and `model.safetensors`, with the tokenizer files of
  the run's `hf_model_dir` when it has one.

  The model config is the run's own, from `workdir/config.json` (written by the
  trainer loop), so no config file or override is needed. A LoRA run's checkpoint
  holds adapters: they are merged into the base its pointer names (`build.lora_base`),
  or with `adapter` written alone as PEFT saves them (`export_peft`).

  Raises:
    ValueError: `adapter` for a run without LoRA, or a merge for a LoRA run whose base
      was given to it (`init_params`) rather than named by its config.
  """
  with open(os.path.join(workdir, "config.json")) as f:
    run = json.load(f)
  model_cfg = ModelConfig(**run["model"])
  tokenizer_dir = run.get("hf_model_dir")  # Absent from runs older than the field.
  if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
    raise FileNotFoundError(f"the run's hf_model_dir {tokenizer_dir} (its tokenizer files) "
                            "is not a directory")
  checkpoints = os.path.join(workdir, "checkpoints")
  if run.get("lora", {}).get("rank", 0) > 0:
    cfg = cli.from_dict(run)
    adapters = restore_params(checkpoints, model_cfg, step=step,
                              abstract=lora.abstract_adapters(model_cfg, cfg.lora))
    if adapter:
      export_peft(cfg, adapters, out_dir)
      return
    step = latest_step(workdir) if step is None else step
    with open(os.path.join(checkpoints, str(step), "meta", "metadata")) as f:
      pointer = json.load(f).get("lora_base")
    if pointer == build.GIVEN_BASE:
      raise ValueError(f"the run in {workdir} trained adapters on a base given to it "
                       f"(init_params), which its config does not name: export the "
                       f"adapters alone (--adapter) and merge them into that base")
    base = build.lora_base(cfg, workdir)
    if build.warm_started(cfg):
      checkpoint.check_base(os.path.join(workdir, checkpoint.BASE_FILE),
                            checkpoint.base_digest(base), pointer)
    params = lora.merge(base, adapters, cfg.lora.scale)
  elif adapter:
    raise ValueError(f"the run in {workdir} trained no adapters (lora.rank = 0): export "
                     f"the whole model, without --adapter")
  else:
    params = restore_params(checkpoints, model_cfg, step=step)
  hf.save_hf(model_cfg, params, out_dir, tokenizer_dir=tokenizer_dir)


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
  `cfg.hf_model_dir` through its own tokenizer (`task.tokenizer_dir` if set).

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
  cfg = build.resolve(cfg)
  g = cfg.generation
  # JetStream pads prompts to its prefill lengths; the engine's must be one of them.
  prefill_length = next((n for n in js.PREFILL_LENGTHS if n >= g.max_prompt_len), None)
  if prefill_length is None:
    raise ValueError(f"generation.max_prompt_len {g.max_prompt_len} exceeds JetStream's "
                     f"longest prefill length {js.PREFILL_LENGTHS[-1]}")
  if workdir is not None:
    params = checkpoint_params(cfg, workdir, step)
    if cfg.lora.enabled:
      params = lora.merge(build.lora_base(cfg, workdir), params, cfg.lora.scale)
    tokenizer = make_task(cfg.task).tokenizer
  else:
    params = hf.load_hf(cfg.hf_model_dir, cfg.model)
    tokenizer = HFTokenizer(cfg.task.tokenizer_dir)
  engine = Engine(cfg.model, max_concurrent_decodes=g.num_slots,
                  max_prefill_length=prefill_length,
                  max_target_length=prefill_length + g.max_new_tokens)
  served = js.JetStreamEngine(engine, params, tokenizer=tokenizer,
                              sampling=sampling or js.GREEDY)
  with js.JetStreamServer(served) as server:
    return server.complete(prompts, max_tokens=max_tokens or g.max_new_tokens)
