"""Run metrics: one JSON line per step in `metrics.jsonl`, TensorBoard event files.

The log holds each step once. A run resumed from the checkpoint of step s trains the
steps after s again, so the lines above s (written by the process that stopped) are
superseded: they are removed before the run appends, by rewriting the file whole
(a temporary file renamed over it, so a crash leaves the old file or the new one),
and TensorBoard is told to hide its events past s (`purge_step`). Every line carries
the id of the run (process) that wrote it and the wall-clock time (`time`, seconds
since the epoch); each run's TensorBoard file ends with its id.

TensorBoard files are written with tensorboardX, which needs no TensorFlow.
"""

import json
import math
import os
import time
from typing import Any, Optional

from tensorboardX import SummaryWriter

FILE = "metrics.jsonl"


class MetricsLog:
  """Appends scalars per step; nested dicts become `a/b` names, lists are skipped.

  Args:
    workdir: where `metrics.jsonl` and `tensorboard/` are.
    run_id: written on every line.
    resume_step: the step of the checkpoint the run resumes from; lines above it are
      removed. None for a run that starts afresh: every line is removed.

  Attributes:
    evals: {step: metrics} of the evaluation lines kept.
  """

  def __init__(self, workdir: str, run_id: str, resume_step: Optional[int] = None):
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, FILE)
    kept = _keep_through(path, -1 if resume_step is None else resume_step)
    self.evals = {line["step"]: line["eval"] for line in kept if "eval" in line}
    self.run_id = run_id
    self._jsonl = open(path, "a", buffering=1)
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                             purge_step=0 if resume_step is None else resume_step + 1,
                             filename_suffix=f".{run_id}")

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    line = {"step": step, "run_id": self.run_id, "time": time.time(), **metrics}
    self._jsonl.write(json.dumps(line, default=_jsonable) + "\n")
    for name, value in _scalars(metrics):
      self._tb.add_scalar(name, value, step)

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


def _keep_through(path: str, step: int) -> list[dict]:
  """Rewrites `path` (atomically) without its lines above `step`, and without a line
  cut short by a crash; returns the lines kept."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    text = f.read()
  kept, raw = [], []
  for row in text.splitlines():
    try:
      line = json.loads(row)
    except ValueError:  # the last line of a process killed mid-write
      continue
    if line["step"] <= step:
      kept.append(line)
      raw.append(row + "\n")
  if "".join(raw) != text:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
      f.writelines(raw)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  return kept


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
