"""Run metrics: one JSON line per step in `metrics.jsonl`, TensorBoard event files.

TensorBoard files are written with tensorboardX, which needs no TensorFlow.
"""

import json
import math
import os
from typing import Any

from tensorboardX import SummaryWriter


class MetricsLog:
  """Appends scalars per step; nested dicts become `a/b` names, lists are skipped."""

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    self._jsonl.write(json.dumps({"step": step, **metrics}, default=_jsonable) + "\n")
    for name, value in _scalars(metrics):
      self._tb.add_scalar(name, value, step)

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


def _scalars(metrics, prefix=""):
  for k, v in metrics.items():
    if isinstance(v, dict):
      yield from _scalars(v, f"{prefix}{k}/")
    elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
      yield f"{prefix}{k}", v


def _jsonable(x):
  if hasattr(x, "tolist"):
    return x.tolist()
  return str(x)
