"""The parameter server: versioned weights, the staleness gate and the training buffer."""

import threading
from typing import Any, Optional

import jax
import numpy as np

from async_rl.config import StalenessConfig
from async_rl.param_server.buffer import AdmissionBuffer
from async_rl.param_server.gate import StalenessGate
from async_rl.param_server.ledger import PromptLedger
from async_rl.rl.errors import VersionError
from async_rl.trajectory import Group


class ParameterServer:
  """Holds the latest published `(version, params)` and decides what runs and trains.

  The trainer publishes params and takes batches; a rollout worker registers, then
  fetches params, acquires a ticket for each prompt group it starts, and finishes
  the ticket by offering the scored group (or rejecting it). Every method takes and
  returns plain picklable values, so the same class serves in-process (threads) and
  as a Ray actor; as an actor its blocking methods (`acquire` with a timeout,
  `wait_for_version`, `get_batch`) need a threaded actor (`max_concurrency` > 1).

  Version protocol: the trainer publishes `(v, params)` after its v-th training
  step and then takes the next batch of B groups at version v; that batch is
  trained into the params it publishes next. A publish must increase the version,
  except the first one after construction or `load_state_dict`, which may repeat
  the current (restored) version: it supplies the params the checkpoint holds. The
  server keeps a reference to the published params, not a copy: publish arrays that
  nothing will donate or modify (`Trainer.device_params` copies the donated train
  state's).

  Every ticket is recorded in a `PromptLedger` with its worker and prompt position,
  so the groups of a worker that died, and those open when a checkpoint was taken,
  are written off (`lost_groups`) and their prompts issued again.

  All state sits behind one lock; three conditions on it wake the waiters for a new
  version, for freed capacity and for a full batch.
  """

  def __init__(self, staleness: StalenessConfig, batch_groups: int):
    self._gate = StalenessGate(max_staleness=staleness.max_staleness,
                               batch_groups=batch_groups,
                               max_concurrent=staleness.max_concurrent)
    self._buffer = AdmissionBuffer(staleness.max_staleness, staleness.on_stale)
    self._ledger = PromptLedger()
    self._lock = threading.Lock()
    self._new_version = threading.Condition(self._lock)
    self._capacity_freed = threading.Condition(self._lock)
    self._batch_ready = threading.Condition(self._lock)
    self._params = None
    self._spec = None
    self._pending: list[int] = []
    self._consumed = 0
    self._closed = False

  # Trainer side.

  def publish(self, version: int, params: Any) -> None:
    """Makes `params` the latest weights, at `version`.

    Buffered groups are re-checked against the new version (`on_stale`), and the
    batches taken since the last publish count as trained.

    Raises:
      VersionError: if `version` does not increase (a `ValueError` too).
      ValueError: if the tree structure, a shape or a dtype differs from the first
        publish; nothing changes then.
    """
    version = _as_version(version, "publish: version")
    if params is None:
      raise ValueError("publish: params must be a pytree of arrays, got None")
    spec = _tree_spec(params)
    with self._lock:
      current = self._gate.version
      if self._params is not None and version <= current:
        raise VersionError(f"publish(version={version}) rejected: versions must increase, "
                           f"and version {current} is already published")
      if version < current:
        raise VersionError(f"publish(version={version}) rejected: older than the restored "
                           f"version {current}")
      if self._spec is not None:
        _check_same_spec(self._spec, spec, version)
      self._spec = spec if self._spec is None else self._spec
      self._params = params
      self._gate.set_version(version)
      dropped = self._buffer.purge(version)
      self._gate.drop_accepted(len(dropped))
      for ticket in dropped + self._pending:
        self._ledger.close(ticket)
      self._consumed += len(self._pending)
      self._pending = []
      self._new_version.notify_all()
      self._capacity_freed.notify_all()

  def get_batch(self, timeout: Optional[float] = None) -> Optional[list[Group]]:
    """The B oldest admitted groups, once B are buffered; None on timeout or close.

    With `on_stale` "drop" or "mask_tokens" no token they train is staler than η at
    the current version; they are counted as trained, and their tokens enter the
    staleness histogram, now. They come in a fixed order (oldest tokens first, then
    the order in which they were started), not in the order they finished.
    """
    with self._lock:
      b = self._gate.batch_groups
      self._batch_ready.wait_for(lambda: self._closed or len(self._buffer) >= b, timeout)
      if self._closed or len(self._buffer) < b:
        return None
      taken = self._buffer.take(b, self._gate.version)
      self._pending += [ticket for ticket, _ in taken]
      return [group for _, group in taken]

  # Rollout side.

  def register_worker(self, worker: int) -> dict:
    """Starts (or restarts) rollout worker `worker`; returns where its prompts resume.

    Groups still running for an earlier worker of the same index are written off
    (counted in `lost_groups`, their capacity freed) and queued to be issued again.
    Returns `{"cursor": stream state or None, "replay": [positions]}`: the worker
    issues the prompts at `replay` first, in order, then continues its stream from
    `cursor` (None: from its start).
    """
    with self._lock:
      start, lost = self._ledger.register(worker)
      self._gate.write_off(lost)
      self._capacity_freed.notify_all()
      return start

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

  def acquire(self, timeout: Optional[float] = 0.0, generator_version: Optional[int] = None,
              *, worker: int = 0, position: Optional[dict] = None,
              next_position: Optional[dict] = None) -> Optional[int]:
    """Starts one prompt group if the gate has capacity, waiting up to `timeout` s.

    `generator_version` is the version of the weights the group will be sampled with
    (see `StalenessGate.capacity`). `position` is the group's prompt's place in
    `worker`'s stream and `next_position` the stream's state after it (see
    `PromptLedger.start`). Returns the group's ticket (an int >= 1), or None if no
    group was started (never after `close`). It also returns None as soon as a version
    newer than the one published at the call is published, so that a generator whose
    own version holds the gate shut applies the new weights now, not at `timeout`.
    Every ticket must end in exactly one `offer` or `reject`.
    """
    with self._lock:
      published = self._gate.version
      self._capacity_freed.wait_for(
          lambda: (self._closed or self._gate.capacity(generator_version) > 0
                   or self._gate.version > published), timeout)
      if self._closed or not self._gate.acquire(generator_version):
        return None
      return self._ledger.start(worker, position, next_position)

  def offer(self, ticket: int, group: Group) -> bool:
    """Finishes a started group by offering it for training; returns whether admitted.

    A group with a token older than `version - max_staleness` is dropped (which
    frees its capacity), masked or admitted as `on_stale` says. A group whose
    ticket was written off (its worker was replaced meanwhile) is not admitted.

    Raises:
      VersionError: `group` holds a token newer than the published version, or one in
        its loss without a version (`buffer.check_versions`).
      ValueError: if `ticket` is not running or `group` is not a Group; nothing
        changes then.
    """
    if not isinstance(group, Group):
      raise ValueError(f"offer expects a Group, got {type(group).__name__}")
    with self._lock:
      if self._ledger.was_written_off(ticket):
        return False
      self._check_running(ticket, "offer")
      if self._buffer.offer(group, self._gate.version, ticket):
        self._ledger.admit(ticket)
        self._gate.finish_accepted()
        self._batch_ready.notify_all()
        return True
      self._ledger.close(ticket)
      self._gate.finish_rejected()
      self._capacity_freed.notify_all()
      return False

  def reject(self, ticket: int) -> None:
    """Finishes a started group without training it (filtered or failed); frees capacity."""
    with self._lock:
      if self._ledger.was_written_off(ticket):
        return
      self._check_running(ticket, "reject")
      self._ledger.close(ticket)
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
    """The counters, in prompt groups, and the staleness histogram.

    See `StalenessGate` and `AdmissionBuffer` for what each counter means
    (`lost_groups` is the gate's `lost`); `staleness_hist[k]` counts the trained
    tokens of staleness k.
    """
    with self._lock:
      g, b = self._gate, self._buffer
      return {"version": g.version, "running": g.running, "accepted": g.accepted,
              "rejected": g.rejected, "lost_groups": g.lost, "capacity": g.capacity(),
              "buffer_size": len(b), "admitted": b.admitted, "dropped": b.dropped,
              "admitted_stale": b.admitted_stale, "trained": b.trained,
              "trained_stale": b.trained_stale, "masked_tokens": b.masked_tokens,
              "staleness_hist": list(b.staleness_hist)}

  def length_histograms(self) -> dict[str, list[int]]:
    """`hist[kind][n]`: the samples of n policy tokens "generated" (offered),
    "admitted", "dropped" and "trained", and the tokens trained samples of that
    length kept in the loss ("trained_tokens")."""
    with self._lock:
      return {k: list(v) for k, v in self._buffer.length_hist.items()}

  def state_dict(self) -> dict[str, Any]:
    """Counters, version and prompt ledger for a checkpoint, as JSON-able dicts.

    `consumed` counts the groups trained into the latest published params: a batch
    taken but not yet followed by a publish is not among them (its prompts are in
    the ledger's replay). So the state is consistent with a checkpoint of the
    published params whenever it is taken.
    """
    with self._lock:
      return {"gate": self._gate.state_dict(), "buffer": self._buffer.state_dict(),
              "consumed": self._consumed, "ledger": self._ledger.state_dict()}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores a `state_dict` on a server that has published nothing yet, for resume.

    The groups in flight, buffered or taken but unpublished when the state was saved
    are gone; the gate is re-based (`StalenessGate.rebase`) so they count as
    `lost_groups` and their capacity is free, and their prompts are queued to be
    issued again. The next publish supplies the restored version's params (or a
    newer version). Nothing changes if it raises.
    """
    with self._lock:
      if self._params is not None:
        raise ValueError("load_state_dict must come before the first publish")
      missing = sorted({"gate", "buffer", "consumed", "ledger"} - set(state))
      if missing:
        raise ValueError(f"parameter server state is missing {missing}")
      gate = StalenessGate.from_state_dict(
          state["gate"], max_staleness=self._gate.max_staleness,
          batch_groups=self._gate.batch_groups, max_concurrent=self._gate.max_concurrent)
      consumed = int(state["consumed"])
      gate.rebase(consumed)
      buffer = AdmissionBuffer(self._buffer.max_staleness, self._buffer.on_stale)
      buffer.load_state_dict(state["buffer"])
      ledger = PromptLedger()
      ledger.load_state_dict(state["ledger"])
      self._gate, self._buffer, self._ledger = gate, buffer, ledger
      self._consumed, self._pending = consumed, []
      self._new_version.notify_all()
      self._capacity_freed.notify_all()

  def _has_newer(self, have_version):
    return self._params is not None and self._gate.version > have_version

  def _check_running(self, ticket, what):
    if not self._ledger.is_running(ticket):
      raise ValueError(f"{what}: ticket {ticket!r} is not running (acquire a ticket before "
                       f"generating a group, and finish it once)")


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
