r"""Serves a policy with JetStream's own orchestrator (extra `jetstream`): a run's
checkpoint, or a Hugging Face model.

  async-rl-serve --workdir=/tmp/async_rl_tiny --prompt="12+34=" --prompt="7*8="
  async-rl-serve --config=qwen2_5 --config.hf_model_dir=/models/Qwen2.5-1.5B-Instruct \
      --config.generation.num_slots=8 --max_tokens=256 --prompt="The capital of France is"

(in a clone of the repository, also `python -m launch.serve_jetstream ...`).

With --workdir, the params of the run's latest checkpoint (or --step) under the run's
own config (WORKDIR/config.json, or --config), the prompts through its task's
tokenizer; without, the params and the tokenizer of --config's `hf_model_dir`.
Runs JetStream's Driver in this process with our engine behind the adapter, sends the
prompts through `LLMOrchestrator.Decode` and prints, as its last line, a JSON list of
{"prompt", "text", "token_ids"}. Greedy unless --temperature is given.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from async_rl import cli, launch
from async_rl.rl.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, launch.CONFIG_HELP + " Default with --workdir: the run's own.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A run's workdir (checkpoints/ inside).")
_PROMPTS = flags.DEFINE_multi_string("prompt", None, "A prompt to complete (repeatable).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None,
                                   "Tokens per completion (default: generation.max_new_tokens).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to serve (default: the latest).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["prompt"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO; -v 0 shows it
  if _WORKDIR.value is None and _CONFIG.value is None:
    raise app.UsageError("give --workdir (a run's checkpoint) or --config with "
                         "--config.hf_model_dir (a Hugging Face model)")
  from async_rl.generation import SamplingParams  # noqa: PLC0415 - after flag parsing
  from async_rl.rl import export  # noqa: PLC0415
  try:
    cfg = (cli.from_dict(_CONFIG.value) if _CONFIG.value is not None
           else export.run_config(_WORKDIR.value))
    completions = export.serve(
        cfg, _PROMPTS.value, workdir=_WORKDIR.value, step=_STEP.value,
        max_tokens=_MAX_TOKENS.value,
        sampling=SamplingParams(temperature=_TEMPERATURE.value, seed=_SEED.value))
  except (ConfigError, ValueError, FileNotFoundError) as e:
    sys.exit(f"serve: {e}")
  print(json.dumps([{"prompt": p, "text": c.text, "token_ids": c.token_ids}
                    for p, c in zip(_PROMPTS.value, completions)]))


def run():
  """The console script `async-rl-serve`."""
  launch.run(main, __name__)


if __name__ == "__main__":
  run()
