r"""Exports a run's trained policy as a Hugging Face directory that `transformers` loads.

  async-rl-export --workdir=/tmp/q15 --out=/tmp/q15_hf [--step=200]
  async-rl-export --workdir=/tmp/lora --out=/tmp/lora_adapter --adapter
  async-rl-export --workdir=/tmp/lora --out=/tmp/lora_base --base

(in a clone of the repository, also `python -m launch.export_hf ...`).

Restores the params of the latest checkpoint in WORKDIR/checkpoints (or --step) with
the run's model config (WORKDIR/config.json) and writes config.json,
model.safetensors and, if the run started from `--config.hf_model_dir`, its
tokenizer and generation files. A LoRA run's adapters are merged into its base; with
--adapter they are written alone in PEFT's layout (adapter_config.json,
adapter_model.safetensors), and with --base their base is written as a model: what
`peft.PeftModel.from_pretrained(base, adapters)` loads them onto when no
`hf_model_dir` holds it (a warm-started base, or a random init). Needs the `hf` extra.
"""

from absl import flags, logging

from async_rl import launch
from async_rl.rl.export import export_hf

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (config.json, checkpoints/).")
_OUT = flags.DEFINE_string("out", None, "The directory to write.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")
_ADAPTER = flags.DEFINE_bool(
    "adapter", False, "For a LoRA run: write the adapters alone, as PEFT saves them, instead "
    "of the base with them merged in.")
_BASE = flags.DEFINE_bool(
    "base", False, "For a LoRA run: write the frozen base its adapters were trained on, the "
    "model PEFT loads them onto, instead of the base with them merged in.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO; -v 0 shows it
  export_hf(_WORKDIR.value, _OUT.value, step=_STEP.value, adapter=_ADAPTER.value,
            base=_BASE.value)
  print(f"exported {_WORKDIR.value} to {_OUT.value}")


def run():
  """The console script `async-rl-export`."""
  launch.run(main, __name__, has_config=False)


if __name__ == "__main__":
  run()
