"""A run's schedule, recorded in its workdir: what the trainer was fed, step by step.

What an asynchronous run trains is decided by timing: which groups finish first and
form each batch, and where each weight update hits each sample. Given what it is fed,
the trainer is deterministic (`rl.replay` re-executes it). So the record is what it was
fed: for every training step, the batch's groups in order and each trajectory as
trained: tokens, loss mask, behaviour log-probs, per-token versions (which say where
each weight update hit the sample), prompt length, finish reason and reward. Step 7's
batch is `schedule/00000007.npz` in the workdir (deflated), written before the step
trains (so a step that crashes is in the record) with a digest of its contents and the
facts that fix the trainer's numerics (`context`). A resumed run first removes the
batches its restored checkpoint supersedes, as the metrics log removes their lines.

A replay starts from the run's initial params when the record starts at step 1, else
from the oldest checkpoint the record goes on from (`replay_start`). So the record is
bounded as the checkpoints are: by default each write, and the trainer once its last
checkpoint is written, delete the batches up to the oldest checkpoint retention has
kept (`Recorder.prune`), which no replay needs.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from async_rl.rl.errors import ReplayError, WorkdirError
from async_rl.trajectory import Group, Trajectory

SCHEDULE_DIR = "schedule"
_BATCH_FILE = re.compile(r"^(\d+)\.npz$")
_PER_TOKEN = {"tokens": ("tokens_T", np.int32), "loss_mask": ("loss_mask_T", np.bool_),
              "logp": ("logp_T", np.float32), "versions": ("versions_T", np.int32)}


def _path(directory: str, step: int) -> str:
  return os.path.join(directory, f"{step:08d}.npz")


def recorded_steps(directory: str) -> list[int]:
  """The steps whose batches `directory` holds, in order."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(m.group(1)) for name in os.listdir(directory)
                if (m := _BATCH_FILE.match(name)))


def replay_start(recorded: Sequence[int], checkpoints: Sequence[int]) -> Optional[int]:
  """The step a replay of the batches of the consecutive steps `recorded` starts from: 0
  (the run's initial params) when they start at step 1, else the oldest of the run's
  `checkpoints` that they go on from, with a batch after it; None: none."""
  if not recorded:
    return None
  first, last = recorded[0], recorded[-1]
  if first == 1:
    return 0
  return min((c for c in checkpoints if first - 1 <= c < last), default=None)


@dataclasses.dataclass(frozen=True)
class Recorder:
  """Records each training batch of a run (`record`) and prunes the record as the
  run's checkpoints go (`prune`). `recorder` makes it.

  Attributes:
    directory: the record; None: nothing is recorded.
    context: the facts that fix the trainer's numerics, written with every batch.
    checkpoints: the steps of the run's checkpoints now (`Checkpointer.steps`); None:
      the record keeps every batch.
  """
  directory: Optional[str] = None
  context: dict[str, Any] = dataclasses.field(default_factory=dict)
  checkpoints: Optional[Callable[[], Sequence[int]]] = None

  def record(self, step: int, groups: Sequence[Group]) -> None:
    """Writes the batch of `step` (`write_batch`), then prunes."""
    if self.directory is None:
      return
    write_batch(self.directory, step, groups, context=self.context)
    self.prune()

  def prune(self) -> None:
    """Deletes the batches up to the oldest checkpoint the record goes on from: a replay
    starts from it or later (`replay_start`)."""
    if self.directory is None or self.checkpoints is None:
      return
    steps = recorded_steps(self.directory)
    oldest = min((c for c in self.checkpoints() if steps and c >= steps[0] - 1), default=None)
    for step in steps:
      if oldest is not None and step <= oldest:
        os.remove(_path(self.directory, step))


def recorder(directory: str, resume_step: Optional[int], context: dict[str, Any], *,
             enabled: bool = True, echo: Callable[[str], None] = print,
             checkpoints: Optional[Callable[[], Sequence[int]]] = None) -> Recorder:
  """The recorder of a run's batches in `directory`.

  First removes the batches above `resume_step` (the step of the checkpoint the run
  resumes from; None: a run that starts afresh, which keeps none): the run trains
  those steps again. `checkpoints` lists the run's checkpoints, up to the oldest of
  which the record is pruned (None: never). The recorder records nothing when not
  `enabled`, or when the record lacks a batch between its start and `resume_step`
  (recording was off for it): a replay needs every batch after the checkpoint it
  starts from.
  """
  through = resume_step or 0
  for step in recorded_steps(directory):
    if step > through:
      os.remove(_path(directory, step))
  if not enabled:
    return Recorder()
  steps = recorded_steps(directory)
  first = steps[0] if steps else through + 1
  if steps != list(range(first, through + 1)):
    echo(f"WARNING: {directory} holds the batches of {len(steps)} of the {through} steps "
         f"before this one, not every one after a checkpoint; the run does not record its "
         f"schedule (a replay needs every batch after the checkpoint it starts from)")
    return Recorder()
  os.makedirs(directory, exist_ok=True)
  return Recorder(directory, context, checkpoints)


def write_batch(directory: str, step: int, groups: Sequence[Group], *,
                context: dict[str, Any]) -> None:
  """Writes the batch of `step` (atomically: a temporary file renamed).

  Raises:
    WorkdirError: the write failed (a full disk, an unwritable or vanished workdir).
  """
  path = _path(directory, step)
  arrays = encode(groups, context)
  try:
    # Deflate at level 1: as small as the default level on these arrays (token ids and
    # log-probs compress little past it; versions and masks are long runs) at a
    # fraction of the time, which the trainer waits for.
    with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
      for name, array in arrays.items():
        with z.open(f"{name}.npy", "w", force_zip64=True) as f:
          np.lib.format.write_array(f, array, allow_pickle=False)
    os.replace(path + ".tmp", path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.remove(path + ".tmp")
    raise WorkdirError(f"writing the record of step {step} to {path} failed ({type(e).__name__}: "
                       f"{e}); {_free_space(directory)}. Fix the cause and rerun the same "
                       f"command to resume from the last checkpoint") from e


def _free_space(directory: str) -> str:
  try:
    return f"{shutil.disk_usage(directory).free / 2**20:,.0f} MiB free there"
  except OSError:
    return "the directory is gone"


def read_batch(directory: str, step: int) -> tuple[list[Group], dict[str, Any]]:
  """The batch of `step` and the context it was trained in.

  Raises:
    ReplayError: the file cannot be read, or its contents do not match its digest.
  """
  path = _path(directory, step)
  try:
    with np.load(path, allow_pickle=False) as f:
      arrays = {name: f[name] for name in f.files}
    groups, context = decode(arrays)
  except Exception as e:  # any damage: a truncated file, a missing field, a bad CRC
    raise ReplayError(f"the record of step {step} ({path}) cannot be read: "
                      f"{type(e).__name__}: {e}") from e
  if str(arrays["digest"]) != _digest(arrays):
    raise ReplayError(f"the record of step {step} ({path}) does not match its digest: it "
                      f"was changed after the run wrote it")
  return groups, context


def encode(groups: Sequence[Group], context: dict[str, Any]) -> dict[str, np.ndarray]:
  """A batch as flat arrays: per-token arrays laid end to end, per-trajectory and
  per-group fields, the context as JSON, and a digest of them all."""
  trajs = [t for g in groups for t in g.trajectories]
  arrays = {name: np.concatenate([np.asarray(getattr(t, field), dtype) for t in trajs])
            for name, (field, dtype) in _PER_TOKEN.items()}
  arrays.update(
      lengths=np.array([len(t) for t in trajs], np.int64),
      prompt_lens=np.array([t.prompt_len for t in trajs], np.int64),
      top_ks=np.array([t.top_k for t in trajs], np.int64),
      top_ps=np.array([t.top_p for t in trajs], np.float64),
      rewards=np.array([t.reward for t in trajs], np.float64),
      finish_reasons=np.array([t.finish_reason for t in trajs], np.str_),
      group_sizes=np.array([len(g.trajectories) for g in groups], np.int64),
      prompt_ids=np.array([str(g.prompt_id) for g in groups], np.str_),
      context=np.array(json.dumps(context, sort_keys=True)))
  arrays["digest"] = np.array(_digest(arrays))
  return arrays


def decode(arrays: dict[str, np.ndarray]) -> tuple[list[Group], dict[str, Any]]:
  """The groups and context `encode` wrote (the digest is not checked here)."""
  ends = np.cumsum(arrays["lengths"])
  per_token = {name: np.split(arrays[name], ends[:-1]) for name in _PER_TOKEN}
  trajs = [Trajectory(**{field: per_token[name][i] for name, (field, _) in _PER_TOKEN.items()},
                      prompt_len=int(arrays["prompt_lens"][i]),
                      top_k=int(arrays["top_ks"][i]), top_p=float(arrays["top_ps"][i]),
                      finish_reason=str(arrays["finish_reasons"][i]),
                      reward=float(arrays["rewards"][i]))
           for i in range(ends.size)]
  bounds = np.concatenate([[0], np.cumsum(arrays["group_sizes"])])
  groups = [Group(str(prompt_id), tuple(trajs[a:b]))
            for prompt_id, a, b in zip(arrays["prompt_ids"], bounds[:-1], bounds[1:])]
  return groups, json.loads(str(arrays["context"]))


def _digest(arrays: dict[str, np.ndarray]) -> str:
  h = hashlib.sha256()
  for name in sorted(arrays):
    if name != "digest":
      a = np.ascontiguousarray(arrays[name])
      h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
      h.update(a.tobytes())
  return h.hexdigest()
