"""A rollout worker's prompts: the ones to issue again first, then its task stream.

The parameter server's ledger tells a starting worker where to resume
(`ParameterServer.register_worker`): positions of prompts whose groups were lost,
to be issued again in order, and the cursor its stream continues from. A position
is the stream's state just before the prompt was drawn, so reopening the stream
there and drawing once gives the same prompt back.

A sample's random seed is a function of the run's seed, the worker and the prompt's
position (`sample_seed`), not of how many requests came before it: a prompt issued
again after a crash or a resume is sampled exactly as it would have been.
"""

import hashlib
import json
from typing import Any, Callable, Iterator, NamedTuple, Optional


class Drawn(NamedTuple):
  """A prompt, its position in the stream and the stream's state after it."""
  prompt: Any
  position: dict
  next_position: dict


class PromptSource:
  """Draws a worker's prompts: the replays first, then the stream from `cursor`.

  Args:
    open_stream: a stream state (or None for the start) -> an iterator of prompts
      with a `state()` method, the task's resumable stream.
    cursor: the stream state to continue from; None: the stream's start.
    replay: positions of prompts to issue again first, in order.
  """

  def __init__(self, open_stream: Callable[[Optional[dict]], Iterator], *,
               cursor: Optional[dict] = None, replay=()):
    self._open = open_stream
    self._stream = open_stream(cursor)
    self._replay = list(replay)

  def draw(self) -> Drawn:
    if self._replay:
      position = self._replay.pop(0)
      return Drawn(next(self._open(position)), position, self._stream.state())
    position = self._stream.state()
    prompt = next(self._stream)
    return Drawn(prompt, position, self._stream.state())

  def state(self) -> dict:
    """The stream's cursor (the replays are the server's to keep)."""
    return self._stream.state()


def sample_seed(seed: int, worker: int, position: dict) -> int:
  """The sampling seed, in [0, 2**32), of the group drawn at `position` by `worker`."""
  key = json.dumps([seed, worker, position], sort_keys=True).encode()
  return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
