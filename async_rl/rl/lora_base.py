"""A LoRA run's frozen base: where it comes from, its params, and the file a warm-started
one is kept in.

With LoRA the trained state is the adapters; the base is frozen, held once, and not
saved in checkpoints. Each checkpoint's meta holds its pointer instead
(`checkpoint.Meta.lora_base`), which names it:

  {"hf_model_dir": DIR}                      the weights of a Hugging Face directory;
  {"warm_start": BASE_FILE, "sha256": SHA}   the run's own warm start, written once
                                             into its workdir before its first step;
  {"seed": SEED, "model": {...}}             the random init of the model with that seed;
  GIVEN                                      params given to the run (`init_params`),
                                             which no config names.

`LoraBase` owns all of it: the pointer, the trainer's base (made and written, or read
back when a run resumes), the base a generator, an export or a server loads (only
adapters are published, so every process that generates loads it itself), and the
check against the pointer a checkpoint recorded: a warm start's file, sound in itself
but another run's, is refused.

The file: a numpy archive of the leaves' bytes (bfloat16 has no numpy name) and a
manifest (the format, each leaf's dtype and shape, the sha256 of them all), written
atomically (a temporary file, synced, renamed); reading it checks its bytes against
its digest and its leaves against the model's.
"""

import dataclasses
import functools
import hashlib
import json
import os
import zipfile
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from async_rl import models
from async_rl.config import ExperimentConfig
from async_rl.models import hf
from async_rl.rl.errors import CheckpointError, NoUsableCheckpointError

BASE_FILE = "lora_base.npz"
FORMAT = "async_rl.lora_base.v1"
GIVEN = {"init_params": "given to the run, not named by its config"}
_MANIFEST = "__manifest__"


class LoraBase:
  """The frozen base of the adapters of run `cfg` (with `cfg.lora`).

  Args:
    cfg: the run's config (resolved: `rl.build.resolve`).
    workdir: the run's workdir, where a warm start's file is (None: none; such a base
      then cannot be read).
    given: params given to the run (`init_params`): they are the base.
  """

  def __init__(self, cfg: ExperimentConfig, workdir: Optional[str] = None, given=None):
    self._cfg, self._workdir, self._given = cfg, workdir, given
    self._sha256: Optional[str] = None  # a warm start's, once made or read

  @property
  def warm_started(self) -> bool:
    """Whether the base is the run's own warm start (`sft.steps`, no `hf_model_dir`)."""
    c = self._cfg
    return self._given is None and c.hf_model_dir is None and c.sft.steps > 0

  @property
  def path(self) -> str:
    """The warm start's file.

    Raises:
      ValueError: no workdir was given.
    """
    if self._workdir is None:
      raise ValueError("a warm-started LoRA base is read from its run's workdir; none given")
    return os.path.join(self._workdir, BASE_FILE)

  @property
  def pointer(self) -> dict[str, Any]:
    """What a checkpoint records of the base (the module docstring). A warm start's
    digest is known once the base was made or read (`for_trainer`, `load`)."""
    if self._given is not None:
      return GIVEN
    if self._cfg.hf_model_dir is not None:
      return {"hf_model_dir": self._cfg.hf_model_dir}
    if self.warm_started:
      return {"warm_start": BASE_FILE, "sha256": self._sha256}
    return {"seed": self._cfg.seed, "model": dataclasses.asdict(self._cfg.model)}

  def for_trainer(self, make: Callable[[], Any], *, resumed: bool, write: bool):
    """The trainer's initial params, which are the base.

    The given params; or a warm start's, which `make()` makes in a run that starts
    afresh and this process writes to the workdir if it may (`write`: one process of
    several writes it), and which a `resumed` run reads back from there (then `check` it
    against the checkpoint restored); else `make()`'s (the Hugging Face weights, or
    None: the seed's init, which the trainer builds).

    Raises:
      NoUsableCheckpointError: a resumed run's warm start is missing or damaged.
    """
    if self._given is not None:
      return self._given
    if not self.warm_started:
      return make()
    if resumed:
      return self.load()
    params = make()
    self._sha256 = save_file(self.path, params) if write else digest(params)
    return params

  def load(self, against: Optional[dict] = None):
    """The base's params, for a generator, an export or a server: the given ones, the
    Hugging Face directory's, the warm start's file (checked against its own digest),
    or the seed's init, built on the first device. `against`: the pointer a checkpoint
    recorded, which the base must be.

    Raises:
      NoUsableCheckpointError: a warm start's file is missing, damaged or not the one
        `against` names.
      ValueError: `against` names params given to the run, which this base cannot know.
    """
    if against == GIVEN and self._given is None:
      raise ValueError("the run trained its adapters on a base given to it (init_params), "
                       "which its config does not name: export the adapters alone "
                       "(--adapter) and merge them into that base")
    if self._given is not None:
      params = self._given
    elif self._cfg.hf_model_dir is not None:
      params = hf.load_hf(self._cfg.hf_model_dir, self._cfg.model)
    elif self.warm_started:
      params, self._sha256 = load_file(self.path, models.abstract_params(self._cfg.model))
    else:
      params = jax.jit(functools.partial(models.init_params, self._cfg.model))(
          jax.random.key(self._cfg.seed))
    if against is not None:
      self.check(against)
    return params

  def check(self, recorded: dict) -> None:
    """Checks that a checkpoint whose pointer is `recorded` was trained on this base: a
    warm start's digest must be the one it records (read or made first).

    Raises:
      NoUsableCheckpointError: naming both digests.
    """
    want = recorded.get("sha256") if isinstance(recorded, dict) else None
    if self.warm_started and want is not None and want != self._sha256:
      raise NoUsableCheckpointError(
          f"the run's frozen base {self.path} has sha256 {self._sha256}, but its checkpoints' "
          f"adapters were trained on a base of sha256 {want}: restore the run's own file, or "
          f"start the run afresh in a new workdir")


def digest(params) -> str:
  """The sha256 of `params`' leaves (their paths, dtypes, shapes and bytes)."""
  return _digest(_named_leaves(params))


def save_file(path: str, params) -> str:
  """Writes `params` (host or device arrays) to the file `path` atomically (a temporary
  file, synced, renamed over `path`); returns their digest (`digest`)."""
  leaves = _named_leaves(params)
  sha256 = _digest(leaves)
  manifest = {"format": FORMAT, "sha256": sha256,
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
  return sha256


def load_file(path: str, abstract):
  """The params `save_file` wrote to `path`, as host arrays in the tree of `abstract`
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
      if manifest.get("format") != FORMAT:
        fail(f"has format {manifest.get('format')!r}, not {FORMAT!r}")
      leaves = {name: archive[name].view(jnp.dtype(dtype)).reshape(shape)
                for name, (dtype, shape) in manifest["leaves"].items()}
  except FileNotFoundError:
    fail("is missing")
  except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
    fail(f"cannot be read ({type(e).__name__}: {e})")
  sha256 = _digest(leaves)
  if sha256 != manifest["sha256"]:
    fail(f"is damaged: its leaves' sha256 is {sha256}, its manifest says {manifest['sha256']}")
  want = {name: f"{x.dtype}{list(x.shape)}" for name, x in _named_leaves(abstract).items()}
  got = {name: f"{x.dtype}{list(x.shape)}" for name, x in leaves.items()}
  if got != want:
    differ = sorted(set(got.items()) ^ set(want.items()))[:4]
    fail(f"holds other params than the run's model (leaves that differ: {differ})")
  paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  return jax.tree.unflatten(treedef, [leaves[_name(p)] for p, _ in paths]), sha256


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


