r"""Serves a training checkpoint with JetStream's own orchestrator (extra `jetstream`).

  python -m launch.serve_jetstream --config=configs/tiny.py --workdir=/tmp/async_rl_tiny \
      --prompt="12+34=" --prompt="7*8="

Restores the params of the latest checkpoint in <workdir>/checkpoints (or --step),
runs JetStream's Driver in this process with our engine behind the adapter, sends
the prompts through `LLMOrchestrator.Decode` and prints, as its last line, a JSON
list of {"prompt", "text", "token_ids"}. Greedy unless --temperature is given.
"""

import json
import os

from absl import app, flags, logging
from ml_collections import config_flags

from async_rl import config
from async_rl.generation import SamplingParams
from async_rl.rl import build, export

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (checkpoints/ inside).")
_PROMPTS = flags.DEFINE_multi_string("prompt", None, "A prompt to complete (repeatable).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None,
                                   "Tokens per completion (default: generation.max_new_tokens).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to serve (default: the latest).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["config", "workdir", "prompt"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO; -v 0 shows it
  cfg = build.resolve(config.from_dict(_CONFIG.value))
  completions = export.serve_checkpoint(
      cfg, os.path.join(_WORKDIR.value, "checkpoints"), _PROMPTS.value,
      max_tokens=_MAX_TOKENS.value, step=_STEP.value,
      sampling=SamplingParams(temperature=_TEMPERATURE.value, seed=_SEED.value))
  print(json.dumps([{"prompt": p, "text": c.text, "token_ids": c.token_ids}
                    for p, c in zip(_PROMPTS.value, completions)]))


if __name__ == "__main__":
  app.run(main, flags_parser=config.parse_flags)
