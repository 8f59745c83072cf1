"""Seeded train / held-out splits of the arithmetic task, as tokenized prompts.

The split is a pure function of the prompt string: a prompt is held out iff a hash of
it falls below `heldout_fraction`. The train stream rejects held-out prompts and the
held-out set rejects the rest, so no prompt is ever in both, whatever the seeds,
lengths or number drawn; and a prompt keeps its side when other task fields change.

Problem i of a stream is drawn from its own generator seeded by (stream, seed, i), so
the training stream is resumed from `{"seed", "index"}` alone and continues exactly.
Within a split prompts repeat (there are only a few hundred two-term chains): each
split is a sample from the task distribution restricted to its prompts, so held-out
accuracy estimates accuracy on unseen prompts at the training mix of lengths.
"""

import dataclasses
import hashlib
import itertools

import numpy as np

from async_rl.tasks.arithmetic import Problem, TaskConfig, make_problem
from async_rl.tasks.tokenizer import CharTokenizer

_TRAIN_STREAM, _HELDOUT_STREAM = 0, 1
_MAX_ATTEMPTS = 10_000
_TOKENIZER = CharTokenizer()


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A problem ready for the generator and the reward.

  Attributes:
    id: unique within a run, for example `train/0/17` (split, seed, index).
    tokens: BOS and the prompt's token ids.
    target: the reference solution's token ids and EOS (the SFT target).
    problem: what the verifier checks completions against.
  """
  id: str
  tokens: tuple[int, ...]
  target: tuple[int, ...]
  problem: Problem


def is_heldout(prompt: str, fraction: float) -> bool:
  """Whether `prompt` belongs to the held-out split of the given size."""
  digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") < fraction * 2 ** 64


def _problem(cfg: TaskConfig, heldout: bool, index: int) -> Problem:
  key = [_HELDOUT_STREAM, index] if heldout else [_TRAIN_STREAM, cfg.seed, index]
  rng = np.random.default_rng(key)
  for _ in range(_MAX_ATTEMPTS):
    problem = make_problem(rng, cfg)
    if is_heldout(problem.prompt, cfg.heldout_fraction) == heldout:
      return problem
  raise RuntimeError(f"no {'held-out' if heldout else 'train'} problem in {_MAX_ATTEMPTS} "
                     f"draws; task.heldout_fraction={cfg.heldout_fraction} is too extreme")


def _prompt(id_: str, problem: Problem) -> Prompt:
  return Prompt(id=id_, tokens=(_TOKENIZER.bos_id, *_TOKENIZER.encode(problem.prompt)),
                target=(*_TOKENIZER.encode(problem.solution), _TOKENIZER.eos_id),
                problem=problem)


def heldout_set(cfg: TaskConfig, n: int) -> list[Prompt]:
  """The first `n` held-out prompts; the same for every `cfg.seed`."""
  return [_prompt(f"heldout/{i}", _problem(cfg, True, i)) for i in range(n)]


class TrainStream:
  """An endless, seeded iterator of training prompts that checkpoints as a small dict.

  `TrainStream.resume(cfg, stream.state())` yields exactly what `stream` would have
  yielded next. Not thread-safe: one consumer draws from it.
  """

  def __init__(self, cfg: TaskConfig, *, index: int = 0):
    if index < 0:
      raise ValueError(f"index must be >= 0, got {index}")
    self.cfg = cfg
    self.index = index

  def __iter__(self):
    return self

  def __next__(self) -> Prompt:
    prompt = _prompt(f"train/{self.cfg.seed}/{self.index}",
                     _problem(self.cfg, False, self.index))
    self.index += 1
    return prompt

  def state(self) -> dict[str, int]:
    return {"seed": self.cfg.seed, "index": self.index}

  @classmethod
  def resume(cls, cfg: TaskConfig, state: dict[str, int]) -> "TrainStream":
    """The stream continuing from `state`; its seed must be `cfg.seed`."""
    if set(state) != {"seed", "index"}:
      raise ValueError(f"stream state must have keys 'seed' and 'index', got {state!r}")
    if state["seed"] != cfg.seed:
      raise ValueError(f"stream state seed {state['seed']} does not match "
                       f"task.seed {cfg.seed}")
    return cls(cfg, index=state["index"])


def length_stats(cfg: TaskConfig, n: int = 10_000) -> dict[str, dict[str, float]]:
  """Quantiles (median, p90, p99, max) and mean of prompt and solution token counts
  over the first `n` training prompts; solutions include EOS, prompts BOS."""
  prompts = list(itertools.islice(TrainStream(cfg), n))
  stats = {}
  for name, lengths in (("prompt_tokens", [len(p.tokens) for p in prompts]),
                        ("solution_tokens", [len(p.target) for p in prompts])):
    lengths = np.asarray(lengths)
    stats[name] = {"median": float(np.median(lengths)),
                   "p90": float(np.percentile(lengths, 90)),
                   "p99": float(np.percentile(lengths, 99)),
                   "max": float(lengths.max()), "mean": float(lengths.mean())}
  return stats
