r"""Scores a policy on its task's held-out set: a run's checkpoint, or a Hugging Face model.

  async-rl-eval --workdir=/tmp/run [--step=200] [--out=report.json]
  async-rl-eval --config=qwen2_5 \
      --config.hf_model_dir=/models/Qwen2.5-1.5B-Instruct --config.task.name=math ...

(in a clone of the repository, also `python -m launch.eval ...`).

With --workdir, the run's own config (WORKDIR/config.json) and the params of its latest
checkpoint (or --step; a LoRA run's adapters on their base); with --config, the params
of `hf_model_dir` (or of a random init, a baseline). Prints, as its last line, and writes to --out, one JSON object:
greedy accuracy, pass@k (k samples at temperature 1), the mean completion length, the
number of prompts and of reward calls that failed. --num_prompts and --pass_k override
the config's `eval` section.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from async_rl import cli, launch
from async_rl.rl.errors import ConfigError, NoUsableCheckpointError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, launch.CONFIG_HELP + " With --config.hf_model_dir, a Hugging Face model.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A run's workdir (config.json, checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step (default: the latest).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", None, "Held-out prompts (default: eval's).")
_PASS_K = flags.DEFINE_integer("pass_k", None, "Samples per prompt for pass@k.")
_OUT = flags.DEFINE_string("out", None, "Also write the report to this JSON file.")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO; -v 0 shows it
  if (_WORKDIR.value is None) == (_CONFIG.value is None):
    raise app.UsageError("give --workdir (a run's checkpoint) or --config (a model)")
  # After flag parsing, so that a usage error costs no JAX start.
  from async_rl.rl import export  # noqa: PLC0415
  try:
    if _WORKDIR.value is not None:
      policy = export.load_policy(workdir=_WORKDIR.value, step=_STEP.value)
    else:
      policy = export.load_policy(cli.from_dict(_CONFIG.value))
    report = {**policy.source, "task": policy.cfg.task.name,
              **export.score(policy, num_prompts=_NUM_PROMPTS.value, pass_k=_PASS_K.value)}
  except (ConfigError, ValueError, FileNotFoundError, NoUsableCheckpointError) as e:
    sys.exit(f"eval: {e}")
  if _OUT.value is not None:
    with open(_OUT.value, "w") as f:
      json.dump(report, f, indent=2)
  print(json.dumps(report))


def run():
  """The console script `async-rl-eval`."""
  launch.run(main, __name__)


if __name__ == "__main__":
  run()
