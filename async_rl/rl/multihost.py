"""A trainer over several `jax.distributed` processes: process 0 leads, the others follow.

Process 0 runs the whole run: the parameter server, the rollouts, the evaluation, the
log. Every process holds a shard of the trainer's state, so every process takes part
in each collective step: a training step (on the same batch everywhere), the
all-gather that gives process 0 the params to publish and evaluate, and a checkpoint
save. Before each, the leader announces it (`Leader.announce`: a broadcast of the
pickled step from process 0), and a follower loops on those announcements doing the
same (`follow`) until the leader says stop.
"""

import pickle
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

_MIN_MESSAGE = 1 << 12  # Messages pad to a power of two bytes: the broadcast compiles
# once per size, so a run compiles it a few times, not once per batch.


def is_leader() -> bool:
  return jax.process_index() == 0


def _broadcast(message: Optional[bytes]) -> bytes:
  """Process 0's `message`, on every process (a collective: all must call it)."""
  size = np.int64(len(message) if is_leader() else 0)
  size = int(multihost_utils.broadcast_one_to_all(size))
  padded = max(_MIN_MESSAGE, 1 << (size - 1).bit_length())
  buffer = np.zeros(padded, np.uint8)
  if is_leader():
    buffer[:size] = np.frombuffer(message, np.uint8)
  return multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes()


class Leader:
  """Process 0's side: `announce(step, payload)` before each collective step."""

  def announce(self, step: str, payload: Any = None) -> None:
    _broadcast(pickle.dumps((step, payload)))


def follow(trainer, checkpointer) -> None:
  """A follower's loop: does each collective step the leader announces, until "stop".

  "train" takes the batch's groups (`Trainer.train`), "params" the all-gather in a
  dtype (`Trainer.host_params`), "checkpoint" a (version, meta, wait) to save.
  """
  while True:
    step, payload = pickle.loads(_broadcast(None))
    if step == "train":
      trainer.train(payload)
    elif step == "params":
      trainer.host_params(payload)
    elif step == "checkpoint":
      version, meta, wait = payload
      checkpointer.save(version, trainer.state, meta, wait=wait)
    elif step == "stop":
      return
    else:
      raise ValueError(f"unknown step {step!r} announced by process 0")
