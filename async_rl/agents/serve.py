"""Serving a policy through the OpenAI-compatible endpoint without training: a run's
checkpoint or a Hugging Face model on one generator pool, so that an agent is evaluated
with the code it trains with (`async-rl-serve --openai`)."""

import contextlib
import os
from collections.abc import Iterator
from typing import Optional

from async_rl.agents.server import Endpoint
from async_rl.config import LOOPBACK_HOSTS, ExperimentConfig


@contextlib.contextmanager
def serve(cfg: ExperimentConfig, *, workdir: Optional[str] = None, step: Optional[int] = None,
          host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = None,
          max_tokens: Optional[int] = None) -> Iterator[Endpoint]:
  """The started endpoint over a pool of `cfg`'s generator (`generation` sizes), serving
  the policy of a run's checkpoint (`workdir`, its latest or `step`; a LoRA run's
  adapters on their base) through its task's tokenizer or, without `workdir`, the model
  in `cfg.hf_model_dir` through its own (`rl.export.load_policy`, which the other
  binaries load with). Plain `/v1/...` requests sample as they ask, up to `max_tokens`
  (default `generation.max_new_tokens`) each; everything stops on exit.

  Raises:
    ValueError: neither a workdir nor `cfg.hf_model_dir`; a host other than loopback
      without an `api_key`.
  """
  if workdir is None and cfg.hf_model_dir is None:
    raise ValueError("nothing to serve: give a run's workdir or set hf_model_dir")
  if host not in LOOPBACK_HOSTS and not api_key:
    raise ValueError(f"serving on {host!r}, not a loopback address, needs an api_key")
  from async_rl.rl import build, export  # noqa: PLC0415 - the serving path only
  policy = export.load_policy(cfg, workdir=workdir, step=step)
  with build.make_pool([policy.engine()], policy.params) as pool:
    endpoint = Endpoint(policy.tokenizer(), host=host, port=port, api_key=api_key, pool=pool,
                        model=os.path.basename(os.path.normpath(workdir or cfg.hf_model_dir)),
                        max_tokens=max_tokens or policy.cfg.generation.max_new_tokens,
                        add_bos=policy.cfg.task.agent.add_bos)
    try:
      yield endpoint.start()
    finally:
      endpoint.close()
