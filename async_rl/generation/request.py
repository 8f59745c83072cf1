"""What goes into the generator pool (`Request`); what comes out is a `Trajectory`."""

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Optional

import numpy as np

from async_rl.generation.sampling import SamplingParams
from async_rl.trajectory import Trajectory

FINISH_REASONS = ("stop", "length", "aborted")


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt to complete `n` times.

  Attributes:
    request_id: unique among the pool's unfinished requests; `abort` uses it.
    prompt: prompt token ids.
    n: number of independent samples.
    sampling: how to sample them.
    hold_slot: a sample that ends on a stop id keeps its slot and KV cache, and its
      trajectory's metadata carries the `SlotHandle` that `GeneratorPool.extend`
      continues it with (or `release` frees it with).
    on_tokens: called as `on_tokens(index, token_ids)` with each sample's new tokens
      as the pool reads them (a decode chunk's worth at a time), before its future
      resolves: a server streams with it. It runs on the decode thread, so it must be
      quick and must not call the pool.
  """
  request_id: Hashable
  prompt: Sequence[int]
  n: int = 1
  sampling: SamplingParams = SamplingParams()
  hold_slot: bool = False
  on_tokens: Optional[Callable[[int, list[int]], None]] = dataclasses.field(
      default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class SlotHandle:
  """A finished sample whose slot (and KV cache) the pool holds.

  Attributes:
    slot: the slot.
    key: tells this holding of the slot from earlier and later ones.
    length: the sample's length, prompt included; the cache holds all but its last
      token.
  """
  slot: int
  key: int
  length: int


def validate(request: Request, *, vocab_size: int, max_prefill_length: int) -> np.ndarray:
  """Raises ValueError naming the first bad field; returns the prompt as int32."""
  if not isinstance(request, Request):
    raise ValueError(f"expected a Request, got {type(request).__name__}")
  if not isinstance(request.sampling, SamplingParams):
    raise ValueError(f"request.sampling must be SamplingParams, got "
                     f"{type(request.sampling).__name__}")
  prompt_P = np.asarray(request.prompt)
  if prompt_P.ndim != 1 or prompt_P.size == 0:
    raise ValueError(f"request {request.request_id!r}: prompt must be a non-empty 1-D "
                     f"sequence of token ids, got shape {prompt_P.shape}")
  if not np.issubdtype(prompt_P.dtype, np.integer):
    raise ValueError(f"request {request.request_id!r}: prompt token ids must be integers, "
                     f"got dtype {prompt_P.dtype}")
  if prompt_P.size > max_prefill_length:
    raise ValueError(f"request {request.request_id!r}: prompt has {prompt_P.size} tokens, "
                     f"more than max_prefill_length={max_prefill_length}")
  if prompt_P.min() < 0 or prompt_P.max() >= vocab_size:
    raise ValueError(f"request {request.request_id!r}: prompt token ids must be in "
                     f"[0, {vocab_size})")
  if not isinstance(request.n, int) or request.n < 1:
    raise ValueError(f"request {request.request_id!r}: n must be an int >= 1, got {request.n!r}")
  bad_stops = [t for t in request.sampling.stop_token_ids if not 0 <= t < vocab_size]
  if bad_stops:
    raise ValueError(f"request {request.request_id!r}: stop_token_ids {bad_stops} are not in "
                     f"the vocabulary [0, {vocab_size})")
  return prompt_P.astype(np.int32)


def empty_sample(request_id: Hashable, index: int, prompt_P: np.ndarray,
                 reason: str) -> Trajectory:
  """A sample that never produced a token (aborted before it started)."""
  return Trajectory.from_completion(prompt_P, np.zeros(0, np.int32), np.zeros(0, np.float32),
                                    np.zeros(0, np.int32), reason,
                                    metadata={"request_id": request_id, "index": index})
