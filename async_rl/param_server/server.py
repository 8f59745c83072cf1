"""The parameter server: versioned weights, the staleness gate and the training buffer."""

import threading
from typing import Any, Optional

import jax
import numpy as np

from async_rl.config import StalenessConfig
from async_rl.param_server.buffer import AdmissionBuffer
from async_rl.param_server.gate import StalenessGate
from async_rl.trajectory import Group


class ParameterServer:
  """Holds the latest published `(version, params)` and decides what runs and trains.

  The trainer publishes params and takes batches; the rollout side fetches params,
  acquires capacity for a prompt group, then offers the scored group (or rejects
  it). Every method takes and returns plain picklable values, so the same class
  serves in-process (threads) and as a Ray actor; as an actor its blocking methods
  (`acquire` with a timeout, `wait_for_version`, `get_batch`) need a threaded actor
  (`max_concurrency` > 1).

  Version protocol: the trainer publishes `(v, params)` after its v-th training step and
  then takes the next batch of B groups at version v; that batch is trained into
  the params it publishes next. A publish must increase the version, except the
  first one after construction or `load_state_dict`, which may repeat the current
  (restored) version: it supplies the params the checkpoint holds. The server keeps
  a reference to the published params, not a copy: publish arrays that nothing
  will donate or modify (`Trainer.device_params` copies the donated train state's).

  All state sits behind one lock; three conditions on it wake the waiters for a new
  version, for freed capacity and for a full batch.
  """

  def __init__(self, staleness: StalenessConfig, batch_groups: int):
    self._gate = StalenessGate(max_staleness=staleness.max_staleness,
                               batch_groups=batch_groups,
                               max_concurrent=staleness.max_concurrent)
    self._buffer = AdmissionBuffer(staleness.max_staleness, staleness.admit_stale)
    self._lock = threading.Lock()
    self._new_version = threading.Condition(self._lock)
    self._capacity_freed = threading.Condition(self._lock)
    self._batch_ready = threading.Condition(self._lock)
    self._params = None
    self._spec = None
    self._pending = 0
    self._consumed = 0
    self._closed = False

  # Trainer side.

  def publish(self, version: int, params: Any) -> None:
    """Makes `params` the latest weights, at `version`.

    Groups that the new version makes stale are dropped from the buffer (unless
    `admit_stale`), and the batches taken since the last publish count as trained.

    Raises:
      ValueError: if `version` does not increase, or the tree structure, a shape or
        a dtype differs from the first publish; nothing changes then.
    """
    version = _as_version(version, "publish: version")
    if params is None:
      raise ValueError("publish: params must be a pytree of arrays, got None")
    spec = _tree_spec(params)
    with self._lock:
      current = self._gate.version
      if self._params is not None and version <= current:
        raise ValueError(f"publish(version={version}) rejected: versions must increase, and "
                         f"version {current} is already published")
      if version < current:
        raise ValueError(f"publish(version={version}) rejected: older than the restored "
                         f"version {current}")
      if self._spec is not None:
        _check_same_spec(self._spec, spec, version)
      self._spec = spec if self._spec is None else self._spec
      self._params = params
      self._gate.set_version(version)
      self._gate.drop_accepted(self._buffer.purge(version))
      self._consumed += self._pending
      self._pending = 0
      self._new_version.notify_all()
      self._capacity_freed.notify_all()

  def get_batch(self, timeout: Optional[float] = None) -> Optional[list[Group]]:
    """The B oldest admitted groups, once B are buffered; None on timeout or close.

    None of them is stale at the current version unless `admit_stale`; they are
    counted as trained, and their tokens enter the staleness histogram, now.
    """
    with self._lock:
      b = self._gate.batch_groups
      self._batch_ready.wait_for(lambda: self._closed or len(self._buffer) >= b, timeout)
      if self._closed or len(self._buffer) < b:
        return None
      self._pending += b
      return self._buffer.take(b, self._gate.version)

  # Rollout side.

  def fetch(self, have_version: int) -> Optional[tuple[int, Any]]:
    """`(version, params)` if newer than `have_version` (-1: none held), else None."""
    with self._lock:
      if not self._has_newer(have_version):
        return None
      return self._gate.version, self._params

  def wait_for_version(self, have_version: int,
                       timeout: Optional[float] = None) -> Optional[int]:
    """Blocks until a version newer than `have_version` is published and returns it.

    Returns None on timeout or close. Fetch the params with `fetch`.
    """
    with self._lock:
      self._new_version.wait_for(lambda: self._closed or self._has_newer(have_version),
                                 timeout)
      return self._gate.version if self._has_newer(have_version) else None

  def acquire(self, timeout: Optional[float] = 0.0,
              generator_version: Optional[int] = None) -> bool:
    """Starts one prompt group if the gate has capacity, waiting up to `timeout` s.

    `generator_version` is the version of the weights the group will be sampled with
    (see `StalenessGate.capacity`). Returns whether a group was started (never after
    `close`). Every started group must end in exactly one `offer` or `reject`.
    """
    with self._lock:
      self._capacity_freed.wait_for(
          lambda: self._closed or self._gate.capacity(generator_version) > 0, timeout)
      return not self._closed and self._gate.acquire(generator_version)

  def offer(self, group: Group) -> bool:
    """Finishes a started group by offering it for training; returns whether admitted.

    A group with a token older than `version - max_staleness` is dropped (which
    frees its capacity), or with `admit_stale` admitted and counted.

    Raises:
      ValueError: if no group is running, `group` is not a Group, or it holds
        a token newer than the published version; nothing changes then.
    """
    if not isinstance(group, Group):
      raise ValueError(f"offer expects a Group, got {type(group).__name__}")
    with self._lock:
      if self._gate.running == 0:
        raise ValueError("offer: no group is running (acquire before generating a group)")
      if self._buffer.offer(group, self._gate.version):
        self._gate.finish_accepted()
        self._batch_ready.notify_all()
        return True
      self._gate.finish_rejected()
      self._capacity_freed.notify_all()
      return False

  def reject(self) -> None:
    """Finishes a started group without training it (filtered or failed); frees capacity."""
    with self._lock:
      self._gate.finish_rejected()
      self._capacity_freed.notify_all()

  # Both.

  def version(self) -> int:
    """The latest published (or restored) version; 0 before any."""
    with self._lock:
      return self._gate.version

  def close(self) -> None:
    """Wakes every waiter; afterwards `acquire` fails and `get_batch` returns None."""
    with self._lock:
      self._closed = True
      for cond in (self._new_version, self._capacity_freed, self._batch_ready):
        cond.notify_all()

  def metrics(self) -> dict[str, Any]:
    """The counters, in prompt groups, and the staleness histogram of trained tokens.

    See `StalenessGate` and `AdmissionBuffer` for what each counter means;
    `staleness_hist[k]` counts the trained generated tokens of staleness k.
    """
    with self._lock:
      return {"version": self._gate.version, "running": self._gate.running,
              "accepted": self._gate.accepted, "rejected": self._gate.rejected,
              "lost": self._gate.lost, "capacity": self._gate.capacity(),
              "buffer_size": len(self._buffer), "admitted": self._buffer.admitted,
              "dropped": self._buffer.dropped,
              "admitted_stale": self._buffer.admitted_stale,
              "trained": self._buffer.trained, "trained_stale": self._buffer.trained_stale,
              "staleness_hist": list(self._buffer.staleness_hist)}

  def state_dict(self) -> dict[str, Any]:
    """Counters and version for a checkpoint, as nested dicts of ints and a list.

    `consumed` counts the groups trained into the latest published params: a batch
    taken but not yet followed by a publish is not among them. So the state is
    consistent with a checkpoint of the published params whenever it is taken.
    """
    with self._lock:
      return {"gate": self._gate.state_dict(), "buffer": self._buffer.state_dict(),
              "consumed": self._consumed}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores a `state_dict` on a server that has published nothing yet, for resume.

    The groups in flight, buffered or taken but unpublished when the state was saved
    are gone; the gate is re-based (`StalenessGate.rebase`) so they count as `lost`
    and their capacity is free. The next publish supplies the restored version's
    params (or a newer version).
    """
    with self._lock:
      if self._params is not None:
        raise ValueError("load_state_dict must come before the first publish")
      missing = sorted({"gate", "buffer", "consumed"} - set(state))
      if missing:
        raise ValueError(f"parameter server state is missing {missing}")
      gate = StalenessGate.from_state_dict(
          state["gate"], max_staleness=self._gate.max_staleness,
          batch_groups=self._gate.batch_groups, max_concurrent=self._gate.max_concurrent)
      consumed = int(state["consumed"])
      gate.rebase(consumed)
      buffer = AdmissionBuffer(self._buffer.max_staleness, self._buffer.admit_stale)
      buffer.load_state_dict(state["buffer"])
      self._gate, self._buffer = gate, buffer
      self._consumed, self._pending = consumed, 0
      self._new_version.notify_all()
      self._capacity_freed.notify_all()

  def _has_newer(self, have_version):
    return self._params is not None and self._gate.version > have_version


def _as_version(version, what):
  if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
    raise ValueError(f"{what} must be an int, got {version!r}")
  if version < 0:
    raise ValueError(f"{what} must be >= 0, got {version}")
  return int(version)


def _leaf_spec(x):
  dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
  return tuple(np.shape(x)), np.dtype(dtype)


def _tree_spec(params):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  return treedef, {jax.tree_util.keystr(path): _leaf_spec(x) for path, x in leaves}


def _check_same_spec(expected, got, version):
  (want_def, want), (got_def, have) = expected, got
  prefix = f"publish(version={version}) rejected: params differ from the first publish"
  if want_def != got_def:
    missing = sorted(set(want) - set(have))[:5]
    extra = sorted(set(have) - set(want))[:5]
    detail = (f"missing leaves {missing}, unexpected leaves {extra}" if missing or extra
              else f"tree {got_def} instead of {want_def}")
    raise ValueError(f"{prefix} in tree structure: {detail}")
  for path, (shape, dtype) in want.items():
    if have[path] != (shape, dtype):
      raise ValueError(f"{prefix} at leaf {path}: shape {have[path][0]} dtype "
                       f"{have[path][1]}, expected shape {shape} dtype {dtype}")
