"""Orbax checkpoints of a run: the train state plus the host-side bookkeeping.

A checkpoint at step v holds the params, optimizer state, version and, with a KL
penalty, the reference policy's params (`state`), and a JSON item (`meta`): the loop's
`Meta`, the one type every checkpoint's bookkeeping is written and read as. With LoRA
the params are the adapters, and the frozen base is not saved: the meta holds its
pointer (`Meta.lora_base`, `rl.lora_base`).

Writes are atomic: Orbax writes a step into a temporary directory and renames it
when every item is complete, so a process killed mid-save leaves the previous
checkpoints as they were and no half-written step among them (`steps` lists the
complete ones). Damage after the fact (a truncated or deleted file, a missing item)
shows up when the step is read: `restore_latest` then falls back to the newest step
that restores whole.

A write that fails (no space left, a workdir made unwritable or removed) fails in
Orbax's background thread; `check` raises it without waiting for a write still
under way, so the loop learns of it after the step it happened in, not at the next
save. Every write failure is a `CheckpointError` naming the directory, the cause,
the space free there against a checkpoint's size, and the last good checkpoint,
which the failed write leaves whole. The first save also checks the free space.

A directory removed or moved away while the run writes to it (the workdir deleted, a
volume unmounted) would go unnoticed: Orbax recreates a missing directory on the next
write. So the first save opens the directory and keeps it open, and `save` and `check`
raise a `CheckpointError` once the path no longer names the directory held.
"""

import dataclasses
import logging
import os
import shutil
import time
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp

from async_rl import models
from async_rl.config import ModelConfig
from async_rl.rl.errors import CheckpointError, NoUsableCheckpointError


@dataclasses.dataclass(frozen=True)
class Meta:
  """What a checkpoint keeps beside the train state: what the loop needs to resume
  exactly, written as its JSON item.

  Attributes:
    version: the trainer's version, the checkpoint's step.
    skipped_steps: the steps skipped as non-finite so far.
    applied_updates: the optimizer updates applied so far.
    packed_shapes: the [M, R, T] shapes the train step has run, which packing depends
      on (`Trainer.packed_shapes`).
    server: the parameter server's state (`ParameterServer.state_dict`); None in a
      replay's checkpoints.
    lora_base: with LoRA, the pointer to the frozen base (`rl.lora_base`); else None.
    replay_of: in a replay's checkpoints, the workdir of the run it replays.
  """
  version: int
  skipped_steps: int = 0
  applied_updates: int = 0
  packed_shapes: tuple[tuple[int, ...], ...] = ()
  server: Optional[dict[str, Any]] = None
  lora_base: Optional[dict[str, Any]] = None
  replay_of: Optional[str] = None

  def __post_init__(self):
    object.__setattr__(self, "packed_shapes", tuple(tuple(s) for s in self.packed_shapes))

  def to_json(self) -> dict[str, Any]:
    """The JSON item: every field, but those that are None."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

  @classmethod
  def from_json(cls, item: dict[str, Any]) -> "Meta":
    """The `Meta` a JSON item holds.

    Raises:
      ValueError: the item lacks `version` or holds a field `Meta` does not have.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    if "version" not in item or set(item) - names:
      raise ValueError(f"a checkpoint's meta must hold version and only the fields of "
                       f"Meta ({sorted(names)}), got {sorted(item)}")
    return cls(**item)


@dataclasses.dataclass(frozen=True)
class Restored:
  """The checkpoint a run resumes from.

  Attributes:
    step: its step; None: there was none, the run starts afresh.
    meta: its meta (a fresh run's: version 0, nothing counted yet).
    damaged: `(step, error, moved_to)` of each newer step that failed to restore,
      newest first; each was moved aside to `moved_to` (no longer a step).
  """
  step: Optional[int] = None
  meta: Meta = Meta(version=0)
  damaged: tuple[tuple[int, str, str], ...] = ()


def steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints under `directory`, oldest first (none when it
  does not exist)."""
  if not os.path.isdir(directory):
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))


def read_meta(directory: str, step: int) -> Meta:
  """The meta of `directory`'s checkpoint `step`, without reading its train state.

  Raises:
    FileNotFoundError: no such checkpoint.
  """
  if step not in steps(directory):
    raise FileNotFoundError(f"no checkpoint {step} under {directory} (its checkpoints: "
                            f"{steps(directory)})")
  item = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
      os.path.join(os.path.abspath(directory), str(step), "meta"))
  return Meta.from_json(item)


class Checkpointer:
  """Saves and restores (train_state, meta) under `directory`, keeping the last `keep`."""

  def __init__(self, directory: str, *, keep: int):
    self.directory = os.path.abspath(directory)
    self._bytes = None  # a checkpoint's size, known at the first save
    self._held = None  # the directory's descriptor, from the first save on
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first: those retention has kept."""
    return steps(self.directory)

  def save(self, step: int, state, meta: Meta, *, wait: bool = False) -> None:
    """Saves asynchronously (the arrays are copied first, so `state` may be donated).

    Raises:
      CheckpointError: this write failed, or an earlier one did in the background; or,
        on the first save, the directory has less free space than a checkpoint needs.
    """
    if self._held is None:
      self._bytes = _nbytes(state)
      try:
        os.makedirs(self.directory, exist_ok=True)
        self._held = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
      except OSError as e:
        raise CheckpointError(self._describe("creating the checkpoint directory failed",
                                             e)) from e
      if self._free_bytes() < self._bytes:
        raise CheckpointError(self._describe("no room for a checkpoint"))
    self._check_directory()
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_arrays(state)), meta=ocp.args.JsonSave(meta.to_json())))
      if wait:
        self._manager.wait_until_finished()
    except Exception as e:
      raise CheckpointError(self._describe(f"writing checkpoint {step} failed", e)) from e

  def check(self, *, wait: bool = False) -> None:
    """Raises `CheckpointError` if a background write has failed; returns at once while
    one is still under way, or with `wait` once it is done (and retention has deleted
    the checkpoints it drops)."""
    if self._held is None:
      return
    self._check_directory()
    if self._manager.is_saving_in_progress() and not wait:
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      raise CheckpointError(self._describe("writing a checkpoint failed", e)) from e

  def _check_directory(self) -> None:
    """Raises `CheckpointError` when the path no longer names the directory held: removed
    (perhaps recreated since by a write) or moved away."""
    held = os.fstat(self._held)
    try:
      now = os.stat(self.directory)
      same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino) and held.st_nlink > 0
    except OSError:
      same = False
    if not same:
      raise CheckpointError(
          f"the checkpoint directory {self.directory} was removed or moved away while the run "
          f"wrote to it (was the workdir deleted, or its volume unmounted?); the checkpoints "
          f"written there went with it. Rerun the same command to start again there, or "
          f"restore the directory first to resume from its last checkpoint")

  def _free_bytes(self) -> int:
    try:
      return shutil.disk_usage(self.directory).free
    except OSError:  # the directory vanished: the write says why
      return 0

  def _describe(self, what: str, error: Optional[BaseException] = None) -> str:
    cause = "" if error is None else f" ({type(error).__name__}: {' '.join(str(error).split())})"
    return (f"{what} in {self.directory}{cause}: {self._free_bytes() / 2**20:,.0f} MiB free "
            f"there, a checkpoint needs ~{self._bytes / 2**20:,.0f} MiB; the last good "
            f"checkpoint is {self.latest_step()}. Fix the cause and rerun the same command "
            f"to resume from it")

  def restore(self, step: int, abstract_state) -> tuple[Any, Meta]:
    """The state (with the shardings of `abstract_state`) and meta saved at `step`."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        _arrays(abstract_state))
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    restored = abstract_state.replace(**out["state"])
    return restored, Meta.from_json(dict(out["meta"]))

  def restore_latest(self, abstract_state, accept: Optional[Callable[[Any, Meta], None]] = None
                     ) -> tuple[Any, Restored]:
    """The train state of the newest step that restores whole, and which step that is;
    (None, `Restored()`) when there is no checkpoint at all.

    A step is damaged when Orbax cannot read it, when its train state's step or its
    meta's version is not the step's number, or when `accept(state, meta)` raises
    (the caller's own check of the meta; it must change nothing when it raises).
    Damaged steps newer than the one restored are logged and moved aside (renamed
    `<step>.damaged-<unix time>`, kept for inspection), so that the run can write
    those step numbers again.

    Raises:
      NoUsableCheckpointError: every step is damaged; they are all left in place
        and the error lists why each failed.
      CheckpointError: a damaged step cannot be moved aside (a read-only workdir).
    """
    failures = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        state, meta = self.restore(step, abstract_state)
        _check_step(step, state, meta)
        if accept is not None:
          accept(state, meta)
      except Exception as e:  # Any failure to read a step whole marks it damaged.
        why = " ".join(f"{type(e).__name__}: {e}".split())
        failures.append((step, why))
        logging.error("checkpoint %d in %s cannot be restored: %s", step, self.directory,
                      why[:500])
        continue
      damaged = tuple((s, why, self._set_aside(s, why)) for s, why in failures)
      return state, Restored(step, meta, damaged)
    if failures:
      listing = "; ".join(f"step {s}: {why[:300]}" for s, why in failures)
      raise NoUsableCheckpointError(
          f"no checkpoint under {self.directory} can be restored ({listing}). They are "
          f"left in place; move the directory away to start the run afresh.")
    return None, Restored()

  def _set_aside(self, step: int, why: str) -> str:
    path = os.path.join(self.directory, str(step))
    moved = f"{path}.damaged-{int(time.time())}"
    try:
      os.rename(path, moved)
    except OSError as e:
      raise CheckpointError(
          f"checkpoint {step} in {self.directory} cannot be restored ({why[:300]}), nor moved "
          f"aside to {moved} ({type(e).__name__}: {e}), so the run cannot write step {step} "
          f"again. Fix the cause (or move {path} away yourself) and rerun the same "
          f"command") from e
    self._manager.reload()
    return moved

  def close(self) -> None:
    """Waits for the last write and closes; raises what that write raised."""
    try:
      self._manager.wait_until_finished()
    finally:
      self._manager.close()
      if self._held is not None:
        os.close(self._held)
        self._held = None


def restore_params(directory: str, cfg: ModelConfig, *, step: int | None = None,
                   sharding: jax.sharding.Sharding | None = None, abstract=None):
  """The params of a `Checkpointer` checkpoint under `directory`, without its optimizer state.

  Reads only the params of the checkpoint at `step` (default: the latest), onto
  `sharding` (default: the first device): enough to serve or sample a trained policy.
  `abstract`: the params' shapes (default: `cfg`'s model's; a LoRA run's are its
  adapters', `models.lora.abstract_adapters`).
  """
  if step is None:
    if not steps(directory):
      raise FileNotFoundError(f"no checkpoint under {directory}")
    step = steps(directory)[-1]
  manager = ocp.CheckpointManager(os.path.abspath(directory),
                                  options=ocp.CheckpointManagerOptions(create=False))
  try:
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"params": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        models.abstract_params(cfg) if abstract is None else abstract)}
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
    return out["state"]["params"]
  finally:
    manager.close()


def _check_step(step, state, meta: Meta):
  if int(state.step) != step:
    raise ValueError(f"its train state is at step {int(state.step)}")
  if meta.version != step:
    raise ValueError(f"its meta says version {meta.version!r}")


def _nbytes(state) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(_arrays(state)))


def _arrays(state) -> dict[str, Any]:
  """The state's pytree fields that hold something (`ref_params` only with a KL penalty),
  but a LoRA run's frozen `base`: its pointer is saved instead (`Meta.lora_base`)."""
  fields = (f.name for f in dataclasses.fields(state)
            if f.metadata.get("pytree_node", True) and f.name != "base")
  return {name: getattr(state, name) for name in fields if getattr(state, name) is not None}
