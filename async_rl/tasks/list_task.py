"""A task over fixed lists of examples: what a user's own data set needs.

`ListTask(train, heldout, tokenizer, reward_fn)` serves the training examples in a
fresh seeded order every epoch, each rollout worker its own order, and resumes each
stream exactly from `{"seed", "epoch", "index"}`. Examples with a target (the
reference completion) are what the warm start trains on. The README's user task
builds one from a JSONL file; the data task (`tasks.data_task`) builds one from JSONL
or Parquet files named in the config.
"""

import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Optional

import numpy as np

from async_rl.tasks.protocol import RewardFnLike, Tokenizer, supervised
from async_rl.tasks.workflow import Workflow
from async_rl.trajectory import Trajectory

_WORKER_SEED_STRIDE = 1000


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with what its completions are checked against.

  Attributes:
    id: unique within its list.
    tokens: the prompt's token ids (with BOS if the model expects one).
    reference: what the reward function receives as its second argument.
    target: the ids of a reference completion (ending with the tokenizer's EOS), for
      the warm start; None: the example is not trained on there.
  """
  id: Hashable
  tokens: tuple[int, ...]
  reference: Any
  target: Optional[tuple[int, ...]] = None


class ListStream:
  """Epoch e visits every example once, in an order seeded by (seed, e). Not thread-safe."""

  def __init__(self, examples: Sequence[Example], seed: int, epoch: int = 0, index: int = 0):
    if not 0 <= index <= len(examples) or epoch < 0:
      raise ValueError(f"stream position (epoch {epoch}, index {index}) is outside the "
                       f"{len(examples)} examples")
    self._examples, self.seed, self.epoch, self.index = examples, seed, epoch, index
    self._order = self._permutation()

  def _permutation(self) -> np.ndarray:
    return np.random.default_rng([self.seed, self.epoch]).permutation(len(self._examples))

  def __iter__(self):
    return self

  def __next__(self) -> Example:
    if self.index == len(self._examples):
      self.epoch, self.index = self.epoch + 1, 0
      self._order = self._permutation()
    example = self._examples[self._order[self.index]]
    self.index += 1
    return dataclasses.replace(example, id=f"train/{self.seed}/{example.id}@{self.epoch}")

  def state(self) -> dict[str, int]:
    return {"seed": self.seed, "epoch": self.epoch, "index": self.index}


@dataclasses.dataclass
class ListTask:
  """Training and held-out examples, a tokenizer and a reward function.

  Attributes:
    train: the training examples (at least one).
    heldout_examples: the held-out examples, never trained on.
    tokenizer: decodes completions for the reward; its `stop_ids` end generation.
    reward_fn: `fn(completion_text, example.reference) -> float`, or its name (or
      another style of `rewards.adapters`); None: `rollout.reward_fn` must name one.
    seed: seeds the training order (rollout worker i uses seed + 1000 i).
    workflow: None is single-turn.
  """
  train: Sequence[Example]
  heldout_examples: Sequence[Example]
  tokenizer: Tokenizer
  reward_fn: Optional[RewardFnLike]
  seed: int = 0
  workflow: Optional[Workflow] = None

  def __post_init__(self):
    if not self.train:
      raise ValueError("ListTask needs at least one training example")
    held = {tuple(e.tokens) for e in self.heldout_examples}
    overlap = sum(tuple(e.tokens) in held for e in self.train)
    if overlap:
      raise ValueError(f"{overlap} training examples have the prompt of a held-out one")

  @staticmethod
  def reference(prompt: Example) -> Any:
    return prompt.reference

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0) -> ListStream:
    seed = self.seed + _WORKER_SEED_STRIDE * worker_index
    if not state:
      return ListStream(self.train, seed)
    if set(state) != {"seed", "epoch", "index"} or state["seed"] != seed:
      raise ValueError(f"stream state must have keys seed={seed}, epoch and index for "
                       f"worker {worker_index}, got {state!r}")
    return ListStream(self.train, seed, state["epoch"], state["index"])

  def heldout(self, n: int) -> list[Example]:
    return [dataclasses.replace(e, id=f"heldout/{e.id}") for e in self.heldout_examples[:n]]

  def sft_examples(self) -> Iterator[Trajectory]:
    """The training examples that have a target, as `supervised` prompt + target
    sequences, endlessly, in a fresh seeded order every epoch.

    Raises:
      ValueError: no training example has a target.
    """
    examples = [e for e in self.train if e.target is not None]
    if not examples:
      raise ValueError("the warm start (sft.steps > 0) needs training examples with a "
                       "target (the reference completion's ids); none of the "
                       f"{len(self.train)} has one")
    return (supervised(e.tokens, e.target) for e in ListStream(examples, self.seed))
