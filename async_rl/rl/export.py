"""A run's trained policy as a Hugging Face directory, the way back from `hf_model_dir`."""

import json
import os
from typing import Optional

from async_rl.models import ModelConfig, hf
from async_rl.rl.checkpoint import restore_params


def export_hf(workdir: str, out_dir: str, *, step: Optional[int] = None) -> None:
  """Writes the params of the run's checkpoint at `step` (default: the latest) to
  `out_dir` as `config.json` and `model.safetensors`, with the tokenizer files of
  the run's `hf_model_dir` when it has one.

  The model config is the run's own, from `workdir/config.json` (written by the
  trainer loop), so no config file or override is needed.
  """
  with open(os.path.join(workdir, "config.json")) as f:
    run = json.load(f)
  model_cfg = ModelConfig(**run["model"])
  tokenizer_dir = run.get("hf_model_dir")  # Absent from runs older than the field.
  if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
    raise FileNotFoundError(f"the run's hf_model_dir {tokenizer_dir} (its tokenizer files) "
                            "is not a directory")
  params = restore_params(os.path.join(workdir, "checkpoints"), model_cfg, step=step)
  hf.save_hf(model_cfg, params, out_dir, tokenizer_dir=tokenizer_dir)
