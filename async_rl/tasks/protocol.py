"""What a run needs from a task, as structural types: any object with these members is a task.

A task provides a resumable prompt stream per rollout worker, a held-out set, the
reward function and the reference each prompt is checked against (a `rewards.Row` for
one read from a data set), a tokenizer (`Tokenizer`; `TextTokenizer` for prompts
written as text), and optionally a workflow (`tasks.workflow`; None is single-turn) and
supervised examples for the warm start. Built-in tasks are named in
`tasks.registry.TASKS`; a user's own is named "module:attr" (a factory called with the
`config.TaskConfig`), so it needs no edit of the library. `ListTask` builds one from
lists of examples, and the data task (`tasks.data_task`) from JSONL or Parquet files."""

import hashlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Optional, Protocol, Union

import numpy as np

from async_rl.trajectory import Trajectory

# A reward function or the name of one (`rewards.registry`: a registered name or
# "module:function"), or a list of them whose rewards are summed; how each is called
# (`fn(completion, reference) -> float`, TRL's or verl's) is `rewards.adapters`'.
RewardFnLike = Union[str, Callable[..., Any], Sequence[Union[str, Callable[..., Any]]]]


class Tokenizer(Protocol):
  """Text to token ids and back: what every task's tokenizer has.

  Attributes:
    vocab_size: ids lie in [0, vocab_size); `model.vocab_size` must be at least this
      (checked before a run starts).
    stop_ids: generation ends at the first of these it samples.

  `encode(text)` gives the ids of `text` with no special tokens added. `decode(ids)`
  gives the text up to (not including) the first stop id, without special tokens; it
  must accept any id a model may sample, including ids of a larger model vocabulary
  (rendered as U+FFFD, so that a verifier scores them as wrong instead of crashing).
  """
  vocab_size: int
  stop_ids: tuple[int, ...]

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class TextTokenizer(Tokenizer, Protocol):
  """A tokenizer for prompts written as text or conversations (the data task's).

  Attributes:
    pad_id: the padding id.
    bos_id: the beginning-of-sequence id, or None for a model that uses none (Qwen).
      Prompts get no BOS added: a chat template writes its own special tokens.
    eos_id: the end of a reply: a warm-start target ends with it, and it is one of
      `stop_ids`.

  `render_chat(messages, add_generation_prompt=True, **kwargs)` gives the text of a
  conversation (a list of {"role", "content"} messages) up to where the assistant's
  reply begins; `kwargs` are extra variables of the chat template.
  """
  pad_id: int
  bos_id: Optional[int]
  eos_id: int

  def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                  add_generation_prompt: bool = True, **kwargs) -> str: ...


class Prompt(Protocol):
  """A prompt as the generator sees it: `id` unique within a run, `tokens` its ids."""
  id: Hashable
  tokens: Sequence[int]


class PromptStream(Protocol):
  """An endless iterator of training prompts whose position checkpoints as a small dict."""

  def __iter__(self) -> Iterator[Prompt]: ...

  def __next__(self) -> Prompt: ...

  def state(self) -> dict: ...


class Task(Protocol):
  """A run's task.

  Attributes:
    tokenizer: encodes prompts, decodes completions for the reward, gives the stop ids.
    reward_fn: the reward function or its name, or a list of them (summed); None for a
      task that has none of its own, so `rollout.reward_fn` must name one.
      `rollout.reward_fn`, when set, replaces it.
    workflow: turns one prompt group into trajectories (`tasks.workflow`); None is
      single-turn generation.

  A task with reference solutions may also have `sft_examples() -> Iterator[Trajectory]`,
  an endless stream of `supervised` examples, which `sft.steps > 0` trains on.
  """
  tokenizer: Tokenizer
  reward_fn: Optional[RewardFnLike]
  workflow: Optional[Any]

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0) -> PromptStream:
    """The training prompts of rollout worker `worker_index`, resumed from `state`."""

  def heldout(self, n: int) -> Sequence[Prompt]:
    """The first `n` held-out prompts (fewer if the task has fewer); never trained on."""

  def reference(self, prompt: Prompt) -> Any:
    """What the reward function checks a completion of `prompt` against (picklable)."""


def supervised(prompt_P: Sequence[int], target_C: Sequence[int],
               train_C: Optional[Sequence[bool]] = None) -> Trajectory:
  """A warm-start example: `prompt_P`, then the reference `target_C`, trained where
  `train_C` (default: every target token). No policy wrote it: its versions are -1."""
  P, C = len(prompt_P), len(target_C)
  train_C = np.ones(C, bool) if train_C is None else np.asarray(train_C, bool)
  if train_C.shape != (C,):
    raise ValueError(f"train_C must have shape ({C},) like target_C, got {train_C.shape}")
  return Trajectory(tokens_T=np.asarray([*prompt_P, *target_C], np.int32),
                    loss_mask_T=np.concatenate([np.zeros(P, bool), train_C]),
                    logp_T=np.zeros(P + C, np.float32), versions_T=np.full(P + C, -1, np.int32),
                    prompt_len=P, finish_reason="stop")


def is_heldout(prompt: str, fraction: float) -> bool:
  """Whether `prompt` belongs to the held-out split of the given size: a hash of the
  prompt alone decides, so a prompt keeps its side whatever else changes."""
  digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") < fraction * 2 ** 64


# Draws a split gets before it is called too small for its fraction.
MAX_SPLIT_DRAWS = 10_000


def draw_in_split(key: list[int], draw, text, heldout: bool, fraction: float, field: str):
  """The first `draw(rng)` on the given side of the split (`is_heldout(text(item),
  fraction)`), from the generator seeded by `key`, so that item i of a stream is a
  function of its key alone. `field` names the fraction in the error raised when
  `MAX_SPLIT_DRAWS` draws find none."""
  rng = np.random.default_rng(key)
  for _ in range(MAX_SPLIT_DRAWS):
    item = draw(rng)
    if is_heldout(text(item), fraction) == heldout:
      return item
  raise RuntimeError(f"no {'held-out' if heldout else 'train'} problem in {MAX_SPLIT_DRAWS} "
                     f"draws; {field}={fraction} is too extreme")
