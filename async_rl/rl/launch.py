"""Placement: the one call a binary makes to run an experiment."""

import threading
from typing import Any, Optional

from async_rl.config import ExperimentConfig

PLACEMENTS = ("in_process", "ray")


def run(cfg: ExperimentConfig, workdir: str, *, placement: str = "in_process",
        stop: Optional[threading.Event] = None, ray_address: Optional[str] = None,
        init_params=None) -> dict[str, Any]:
  """Runs (or resumes) the experiment with its components placed as asked."""
  if placement == "in_process":
    from async_rl.rl.run import run_in_process  # noqa: PLC0415
    return run_in_process(cfg, workdir, init_params=init_params, stop=stop)
  if placement == "ray":
    from async_rl.rl.ray_placement import run_on_ray  # noqa: PLC0415 (ray is an extra)
    return run_on_ray(cfg, workdir, address=ray_address, stop=stop, init_params=init_params)
  raise ValueError(f"unknown placement {placement!r}; known: {PLACEMENTS}")
