"""Run metrics: one JSON line per step in `metrics.jsonl`, TensorBoard event files,
sample completions in `samples.jsonl`, and Weights & Biases when asked for.

The log holds each step once. A run resumed from the checkpoint of step s trains the
steps after s again, so the lines above s (written by the process that stopped) are
superseded: they are removed before the run appends, by rewriting the file whole
(a temporary file renamed over it, so a crash leaves the old file or the new one),
and TensorBoard is told to hide its events past s (`purge_step`). Every line carries
the id of the run (process) that wrote it and the wall-clock time (`time`, seconds
since the epoch); each run's TensorBoard file ends with its id.

`metrics.jsonl` keeps the names the trainer loop gives; TensorBoard and W&B group them
by what they measure (`tag`): `train/` (the objective, rewards, learning rate),
`perf/` (timings and throughputs), `staleness/`, `rollout/`, and a section of their
own for the nested ones (`server/`, `rewards/`, `lengths/`, `workers/`, `eval/`). Process
ids are not metrics and are not plotted.

The warm start's lines sit before RL (`step` 0, their own step under `sft`), so no
resume supersedes them; TensorBoard plots them as a run of their own
(`tensorboard/sft`), whose steps a resumed run's purge cannot reach.

TensorBoard's event files are written by `rl.tensorboard`, which imports neither
TensorFlow nor PyTorch. Every number is plotted, inf and nan included. Logging never
ends a run: a metric TensorBoard or W&B cannot take (a tag that is not UTF-8, say) is
left out of them with a warning, once per name, and `metrics.jsonl` still holds it.
"""

import importlib
import json
import logging
import os
import time
from typing import Any, Iterator, Optional

from async_rl.rl.tensorboard import EventWriter


FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
# Not metrics, though numbers: never plotted.
_NOT_METRICS = ("pid",)
# Top-level names whose group their name does not say.
_GROUP_OF = {"worker_restarts": "rollout"}


def check_wandb(project: Optional[str]) -> None:
  """Raises ValueError when `project` asks for W&B logging and `wandb` does not import."""
  if project is None:
    return
  try:
    importlib.import_module("wandb")
  except ImportError as e:
    raise ValueError(f"log.wandb_project needs the wandb package (pip install "
                     f"'async_rl[wandb]'), which does not import ({e}); set "
                     f"log.wandb_project=None to log without it, got {project!r}") from None


class MetricsLog:
  """Appends scalars per step; nested dicts become `a/b` names, lists are skipped.

  Args:
    workdir: where `metrics.jsonl`, `samples.jsonl` and `tensorboard/` are.
    run_id: written on every line.
    resume_step: the step of the checkpoint the run resumes from; lines above it are
      removed. None for a run that starts afresh: every line is removed.
    wandb_project: also log to this Weights & Biases project, as a W&B run named
      `run_id` (each process its own) in a group named after the workdir.
    hparams: the run's config, for W&B.

  Attributes:
    evals: {step: metrics} of the evaluation lines kept.
  """

  def __init__(self, workdir: str, run_id: str, resume_step: Optional[int] = None, *,
               wandb_project: Optional[str] = None, hparams: Optional[dict] = None):
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, FILE)
    through = -1 if resume_step is None else resume_step
    kept = _keep_through(path, through)
    self._samples_path = os.path.join(workdir, SAMPLES_FILE)
    _keep_through(self._samples_path, through)
    self.evals = {line["step"]: line["eval"] for line in kept if "eval" in line}
    self.run_id = run_id
    self._workdir = workdir
    self._jsonl = open(path, "a", buffering=1)
    self._samples = None
    self._tb = EventWriter(os.path.join(workdir, "tensorboard"), purge_step=through + 1,
                           suffix=f".{run_id}")
    self._tb_sft = None
    self._unwritable = set()  # names already warned of
    self._wandb = None
    if wandb_project is not None:
      import wandb  # noqa: PLC0415 - an optional extra, checked by `check_wandb`
      self._wandb = wandb.init(project=wandb_project, name=run_id, config=hparams,
                               group=os.path.basename(os.path.abspath(workdir)), dir=workdir)
      self._wandb.define_metric("version")
      self._wandb.define_metric("sft/step")
      self._wandb_groups = set()

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Logs the metrics of version `step` (a training step's, or `{"eval": ...}`)."""
    self._line(self._jsonl, {"step": step, **metrics})
    scalars = dict(tags(metrics))
    for name, value in scalars.items():
      self._unless_unwritable(f"{name!a} to TensorBoard", self._tb.add_scalar, name, value,
                              step)
    self._to_wandb(scalars, "version", step)

  def write_warm_start(self, sft_step: int, metrics: dict[str, float],
                       at: Optional[float] = None) -> None:
    """Logs the warm start's metrics at its step `sft_step` (before RL: version 0),
    taken at time `at` (default: now; the warm start runs before the log exists)."""
    self._line(self._jsonl, {"step": 0, "sft": {"step": sft_step, **metrics}}, at)
    if self._tb_sft is None:  # a warm start runs only in a run that starts afresh
      self._tb_sft = EventWriter(os.path.join(self._workdir, "tensorboard", "sft"),
                                 purge_step=0, suffix=f".{self.run_id}")
    scalars = dict(tags({"sft": metrics}))
    for name, value in scalars.items():
      self._unless_unwritable(f"{name!a} to TensorBoard", self._tb_sft.add_scalar, name,
                              value, sft_step)
    self._to_wandb(scalars, "sft/step", sft_step)

  def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
    """Logs completions trained at version `step`: one `samples.jsonl` line each
    (`prompt`, `completion`, `reward`, ...), and a text entry in TensorBoard."""
    if self._samples is None:
      self._samples = open(self._samples_path, "a", buffering=1)
    for sample in samples:
      self._line(self._samples, {"step": step, **sample})
    self._unless_unwritable("the samples to TensorBoard", self._tb.add_text,
                            "samples/completions", _markdown(samples), step)
    if self._wandb is not None:
      import wandb  # noqa: PLC0415
      columns = sorted({k for sample in samples for k in sample})
      table = wandb.Table(columns=["step", *columns],
                          data=[[step, *(s.get(k) for k in columns)] for s in samples])
      self._to_wandb({"samples/completions": table}, "version", step)

  def close(self) -> None:
    for f in (self._jsonl, self._samples, self._tb, self._tb_sft):
      if f is not None:
        f.close()
    if self._wandb is not None:
      self._wandb.finish()

  def _line(self, f, line, at=None):
    line = {"step": line["step"], "run_id": self.run_id,
            "time": time.time() if at is None else at, **line}
    f.write(json.dumps(line, default=_jsonable) + "\n")

  def _to_wandb(self, values, axis, x):
    """Logs `values` against their own axis (`axis` = x): W&B's own step counts calls,
    and the warm start's steps and RL's versions both start from 0."""
    if self._wandb is None:
      return
    for group in {name.split("/")[0] for name in values} - self._wandb_groups:
      self._wandb.define_metric(f"{group}/*", step_metric=axis)
      self._wandb_groups.add(group)
    self._unless_unwritable("the metrics to W&B", self._wandb.log, {**values, axis: x})

  def _unless_unwritable(self, what: str, write, *args) -> None:
    """`write(*args)`; if it cannot encode what it is given, a warning (once for each
    `what`) instead of an error: logging never ends a run."""
    try:
      write(*args)
    except (ValueError, TypeError) as e:
      if what not in self._unwritable:
        self._unwritable.add(what)
        logging.warning("the metrics log cannot write %s (%s: %a); %s holds it", what,
                        type(e).__name__, str(e), FILE)


def tags(metrics: dict[str, Any]) -> Iterator[tuple[str, float]]:
  """The numbers of a log line, inf and nan included (lists, strings, and `pid`s left
  out), under the tags TensorBoard groups them by (the module docstring)."""
  for path, value in _scalars(metrics, ()):
    if path[-1] in _NOT_METRICS:
      continue
    head = path[0]
    if head.startswith("staleness_"):
      path = ("staleness", head[len("staleness_"):], *path[1:])
    elif len(path) == 1:
      if head.startswith("time_") or head.endswith(("_per_s", "_wait_s")):
        group = "perf"
      else:
        group = _GROUP_OF.get(head, "train")
      path = (group, head)
    yield "/".join(path), value


def _scalars(metrics, prefix):
  for k, v in metrics.items():
    if isinstance(v, dict):
      yield from _scalars(v, (*prefix, str(k)))
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
      yield (*prefix, str(k)), v


def _markdown(samples) -> str:
  """Samples as TensorBoard's text tab shows them: a heading each, texts as code."""
  blocks = []
  for s in samples:
    facts = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in s.items() if k not in ("prompt", "completion"))
    blocks.append(f"**{facts}**\n\n{_code(s['prompt'])}\n\n{_code(s['completion'])}")
  return "\n\n---\n\n".join(blocks)


def _code(text) -> str:
  return "\n".join("    " + line for line in (text.splitlines() or [""]))


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


def _jsonable(x):
  if hasattr(x, "tolist"):
    return x.tolist()
  return str(x)
