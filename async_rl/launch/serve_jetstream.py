r"""Serves a policy, a run's checkpoint or a Hugging Face model: with JetStream's own
orchestrator (extra `jetstream`), or with --openai as an OpenAI-compatible endpoint
(extra `agents`).

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

  async-rl-serve --openai --workdir=/tmp/async_rl_tiny --port=8000
  async-rl-serve --openai --config=qwen2_5 \
      --config.hf_model_dir=/models/Qwen2.5-1.5B-Instruct --port=8000

With --openai, serves `/v1/chat/completions` and `/v1/completions` (`agents.server`)
on --host:--port until interrupted, each request sampled as it asks, and prints
{"base_url": ...} once it listens: an agent's `openai` client pointed there runs as it
does in training. A --host other than loopback needs --api_key.
"""

import json
import signal
import sys
import threading

from absl import app, flags, logging
from ml_collections import config_flags

from async_rl import cli, launch
from async_rl.rl.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, launch.CONFIG_HELP + " Default with --workdir: the run's own.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A run's workdir (checkpoints/ inside).")
_PROMPTS = flags.DEFINE_multi_string("prompt", None, "A prompt to complete (repeatable).")
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens", None, "Tokens per completion; with --openai, also the most a request may "
    "ask for (default: generation.max_new_tokens).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to serve (default: the latest).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_OPENAI = flags.DEFINE_boolean(
    "openai", False, "Serve an OpenAI-compatible endpoint until interrupted instead of "
    "completing --prompt.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "With --openai: the address to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "With --openai: the port (0: a free one).")
_API_KEY = flags.DEFINE_string(
    "api_key", None, "With --openai: the bearer token requests must carry (needed for a "
    "--host other than loopback).")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO; -v 0 shows it
  if _WORKDIR.value is None and _CONFIG.value is None:
    raise app.UsageError("give --workdir (a run's checkpoint) or --config with "
                         "--config.hf_model_dir (a Hugging Face model)")
  if not _OPENAI.value and not _PROMPTS.value:
    raise app.UsageError("give --prompt (repeatable), or --openai to serve an endpoint")
  from async_rl.generation import SamplingParams  # noqa: PLC0415 - after flag parsing
  from async_rl.rl import export  # noqa: PLC0415
  try:
    cfg = (cli.from_dict(_CONFIG.value) if _CONFIG.value is not None
           else export.run_config(_WORKDIR.value))
    if _OPENAI.value:
      _serve_openai(cfg)
      return
    completions = export.serve(
        cfg, _PROMPTS.value, workdir=_WORKDIR.value, step=_STEP.value,
        max_tokens=_MAX_TOKENS.value,
        sampling=SamplingParams(temperature=_TEMPERATURE.value, seed=_SEED.value))
  except (ConfigError, ValueError, FileNotFoundError) as e:
    sys.exit(f"serve: {e}")
  print(json.dumps([{"prompt": p, "text": c.text, "token_ids": c.token_ids}
                    for p, c in zip(_PROMPTS.value, completions)]))


def _serve_openai(cfg):
  from async_rl.agents import serve  # noqa: PLC0415 - the `agents` extra
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  with serve.serve(cfg, workdir=_WORKDIR.value, step=_STEP.value, host=_HOST.value,
                   port=_PORT.value, api_key=_API_KEY.value,
                   max_tokens=_MAX_TOKENS.value) as endpoint:
    print(json.dumps({"base_url": f"{endpoint.url}/v1"}), flush=True)
    while not stop.wait(1.0):
      pass


def run():
  """The console script `async-rl-serve`."""
  launch.run(main, __name__)


if __name__ == "__main__":
  run()
