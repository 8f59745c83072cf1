"""Orbax checkpoints of a run: the train state plus the host-side bookkeeping.

A checkpoint at step v holds the params, optimizer state and version (`state`), and
a JSON item (`meta`) with the parameter server's counters, the prompt stream's
position and anything else the loop needs to resume exactly.
"""

import functools
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from async_rl import models


class Checkpointer:
  """Saves and restores (train_state, meta) under `directory`, keeping the last `keep`."""

  def __init__(self, directory: str, *, keep: int):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def save(self, step: int, state, meta: dict[str, Any], *, wait: bool = False) -> None:
    """Saves asynchronously (the arrays are copied first, so `state` may be donated)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_arrays(state)), meta=ocp.args.JsonSave(meta)))
    if wait:
      self._manager.wait_until_finished()

  def restore(self, step: int, abstract_state) -> tuple[Any, dict[str, Any]]:
    """The state (with the shardings of `abstract_state`) and meta saved at `step`."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        _arrays(abstract_state))
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    restored = abstract_state.replace(**out["state"])
    return restored, dict(out["meta"])

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def restore_params(directory: str, cfg: models.ModelConfig, *, step: int | None = None,
                   sharding: jax.sharding.Sharding | None = None):
  """The params of a `Checkpointer` checkpoint under `directory`, without its optimizer state.

  Reads only the params of the checkpoint at `step` (default: the latest), onto
  `sharding` (default: the first device): enough to serve or sample a trained policy.
  """
  manager = ocp.CheckpointManager(os.path.abspath(directory),
                                  options=ocp.CheckpointManagerOptions(create=False))
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {directory}")
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(functools.partial(models.init_params, cfg), jax.random.key(0))
    target = {"params": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)}
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
    return out["state"]["params"]
  finally:
    manager.close()


def _arrays(state) -> dict[str, Any]:
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state}
