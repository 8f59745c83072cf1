"""Orbax checkpoints of a run: the train state plus the host-side bookkeeping.

A checkpoint at step v holds the params, optimizer state, version and, with a KL
penalty, the reference policy's params (`state`), and a JSON item (`meta`) with the
parameter server's counters, the prompt streams' positions and anything else the loop
needs to resume exactly. With LoRA the params are the adapters, and the frozen base is
not saved: the meta holds its pointer (`lora_base`), and a resumed trainer is built on
the base that pointer names. A base that only the run itself made (a warm start) is
written once beside the checkpoints (`save_base`), and the pointer names that file and
its digest (`load_base` checks the file against its own digest, `check_base` against
the checkpoint's).

Writes are atomic: Orbax writes a step into a temporary directory and renames it
when every item is complete, so a process killed mid-save leaves the previous
checkpoints as they were and no half-written step among them. Damage after the
fact (a truncated or deleted file, a missing item) shows up when the step is read:
`restore_latest` then falls back to the newest step that restores whole.

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
import hashlib
import json
import logging
import os
import shutil
import time
import zipfile
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from async_rl import models
from async_rl.config import ModelConfig
from async_rl.rl.errors import CheckpointError, NoUsableCheckpointError


@dataclasses.dataclass(frozen=True)
class Restored:
  """What `Checkpointer.restore_latest` found.

  Attributes:
    step: the step restored.
    state: the train state, with the shardings asked for.
    meta: the JSON item saved with it.
    damaged: `(step, error, moved_to)` of each newer step that failed to restore,
      newest first; each was moved aside to `moved_to` (no longer a step).
  """
  step: int
  state: Any
  meta: dict[str, Any]
  damaged: tuple[tuple[int, str, str], ...] = ()


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

  def save(self, step: int, state, meta: dict[str, Any], *, wait: bool = False) -> None:
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
          state=ocp.args.StandardSave(_arrays(state)), meta=ocp.args.JsonSave(meta)))
      if wait:
        self._manager.wait_until_finished()
    except Exception as e:
      raise CheckpointError(self._describe(f"writing checkpoint {step} failed", e)) from e

  def check(self) -> None:
    """Raises `CheckpointError` if a background write has failed; returns at once while
    one is still under way."""
    if self._held is None:
      return
    self._check_directory()
    if self._manager.is_saving_in_progress():
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

  def restore(self, step: int, abstract_state) -> tuple[Any, dict[str, Any]]:
    """The state (with the shardings of `abstract_state`) and meta saved at `step`."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        _arrays(abstract_state))
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    restored = abstract_state.replace(**out["state"])
    return restored, dict(out["meta"])

  def restore_latest(self, abstract_state,
                     accept: Optional[Callable[[Any, dict], None]] = None) -> Optional[Restored]:
    """The newest step that restores whole; None when there is no checkpoint at all.

    A step is damaged when Orbax cannot read it, when its train state's step or its
    meta's "version" is not the step's number, or when `accept(state, meta)` raises
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
      return Restored(step, state, meta, damaged)
    if failures:
      listing = "; ".join(f"step {s}: {why[:300]}" for s, why in failures)
      raise NoUsableCheckpointError(
          f"no checkpoint under {self.directory} can be restored ({listing}). They are "
          f"left in place; move the directory away to start the run afresh.")
    return None

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
  manager = ocp.CheckpointManager(os.path.abspath(directory),
                                  options=ocp.CheckpointManagerOptions(create=False))
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {directory}")
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


# A run's own frozen base, beside its `checkpoints/`: a numpy archive of the leaves' bytes
# and a manifest (the format, each leaf's dtype and shape, the digest of them all).
BASE_FILE = "lora_base.npz"
BASE_FORMAT = "async_rl.lora_base.v1"
_MANIFEST = "__manifest__"


def base_digest(params) -> str:
  """The sha256 of `params`' leaves (their paths, dtypes, shapes and bytes)."""
  return _digest(_named_leaves(params))


def save_base(path: str, params) -> str:
  """Writes `params` (host or device arrays) to the file `path` atomically (a temporary
  file, synced, renamed over `path`); returns their digest (`base_digest`)."""
  leaves = _named_leaves(params)
  digest = _digest(leaves)
  manifest = {"format": BASE_FORMAT, "sha256": digest,
              "leaves": {name: [str(x.dtype), list(x.shape)] for name, x in leaves.items()}}
  # bfloat16 has no numpy name: every leaf is stored as its bytes.
  arrays = {name: np.ascontiguousarray(x).reshape(-1).view(np.uint8)
            for name, x in leaves.items()}
  arrays[_MANIFEST] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      np.savez(f, **arrays)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
      os.fsync(directory)
    finally:
      os.close(directory)
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise CheckpointError(f"writing the run's frozen base to {path} failed "
                          f"({type(e).__name__}: {e})") from e
  return digest


def check_base(path: str, digest: str, pointer) -> None:
  """Checks that a checkpoint whose meta's `lora_base` is `pointer` was trained on the
  warm-started base in `path`, whose digest is `digest`: a self-consistent base file of
  another run is not the run's.

  Raises:
    NoUsableCheckpointError: naming both digests.
  """
  recorded = pointer.get("sha256") if isinstance(pointer, dict) else None
  if recorded is not None and recorded != digest:
    raise NoUsableCheckpointError(
        f"the run's frozen base {path} has sha256 {digest}, but its checkpoints' adapters "
        f"were trained on a base of sha256 {recorded}: restore the run's own file, or start "
        f"the run afresh in a new workdir")


def saved_pointer(directory: str, step: int):
  """The `lora_base` pointer in the meta of `directory`'s checkpoint `step`; None if the
  meta has none or cannot be read (restoring the step reports why)."""
  try:
    with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
      return json.load(f).get("lora_base")
  except (OSError, ValueError, AttributeError):
    return None


def load_base(path: str, abstract):
  """The params `save_base` wrote to `path`, as host arrays in the tree of `abstract`
  (shapes and dtypes as its leaves'); with their digest.

  Raises:
    NoUsableCheckpointError: naming `path` (no checkpoint of the run can be restored
      without it): the file is missing or unreadable, of another format, its bytes do
      not match its digest, or its leaves are not `abstract`'s.
  """
  def fail(why):
    raise NoUsableCheckpointError(
        f"the run's frozen base {path} {why}. It was written by the run's warm start before "
        f"its first step, and its checkpoints hold only the adapters trained on it; restore "
        f"the file, or start the run afresh in a new workdir")

  try:
    with np.load(path) as archive:
      manifest = json.loads(bytes(archive[_MANIFEST]))
      if manifest.get("format") != BASE_FORMAT:
        fail(f"has format {manifest.get('format')!r}, not {BASE_FORMAT!r}")
      leaves = {name: archive[name].view(jnp.dtype(dtype)).reshape(shape)
                for name, (dtype, shape) in manifest["leaves"].items()}
  except FileNotFoundError:
    fail("is missing")
  except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
    fail(f"cannot be read ({type(e).__name__}: {e})")
  digest = _digest(leaves)
  if digest != manifest["sha256"]:
    fail(f"is damaged: its leaves' sha256 is {digest}, its manifest says {manifest['sha256']}")
  want = {name: f"{x.dtype}{list(x.shape)}" for name, x in _named_leaves(abstract).items()}
  got = {name: f"{x.dtype}{list(x.shape)}" for name, x in leaves.items()}
  if got != want:
    differ = sorted(set(got.items()) ^ set(want.items()))[:4]
    fail(f"holds other params than the run's model (leaves that differ: {differ})")
  paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  return jax.tree.unflatten(treedef, [leaves[_name(p)] for p, _ in paths]), digest


def _name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _named_leaves(params) -> dict[str, Any]:
  """`params`' leaves by path; host arrays, but for abstract ones."""
  return {_name(p): x if isinstance(x, jax.ShapeDtypeStruct) else np.asarray(jax.device_get(x))
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _digest(leaves: dict[str, np.ndarray]) -> str:
  h = hashlib.sha256()
  for name in sorted(leaves):
    x = leaves[name]
    h.update(f"{name}:{x.dtype}:{x.shape};".encode())
    h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)
  return h.hexdigest()


def _check_step(step, state, meta):
  if int(state.step) != step:
    raise ValueError(f"its train state is at step {int(state.step)}")
  if meta.get("version") != step:
    raise ValueError(f"its meta says version {meta.get('version')!r}")


def _nbytes(state) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(_arrays(state)))


def _arrays(state) -> dict[str, Any]:
  """The state's pytree fields that hold something (`ref_params` only with a KL penalty),
  but a LoRA run's frozen `base`: its pointer is saved instead."""
  fields = (f.name for f in dataclasses.fields(state)
            if f.metadata.get("pytree_node", True) and f.name != "base")
  return {name: getattr(state, name) for name in fields if getattr(state, name) is not None}
