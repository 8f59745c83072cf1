"""Small synthetic programs with unit tests: the code task (`task.name="code"`).

A problem asks for a program that reads an integer n from stdin and prints an
expression of it; the prompt is a comment, the reference solution two lines:

    # print (n+3)*2
    n=int(input())
    print((n+3)*2)

The expression applies `code.min_ops` to `code.max_ops` operations (`+ - * // %` with a
constant in 1..9) to n in turn, parenthesised where Python's precedence needs it. The
reference is `code.num_tests` test cases `{"input": "5", "output": "16"}` for n drawn
in [0, 99]; the default reward, `code_tests`, scores the share of them the
completion's program passes, running each in the sandbox (`rewards.sandbox`). Text is
tokenized a character at a time over printable ASCII (`CODE_CHARS`, 99 ids).

The split and the streams work as the arithmetic task's (`tasks.arithmetic`): a prompt is
held out iff its hash falls below `code.heldout_fraction`, and problem i of a stream is
drawn from a generator seeded by (stream, seed, i), so a stream resumes from
`{"seed", "index"}`.
"""

import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

from async_rl.config import CodeConfig, ExperimentConfig, TaskConfig
from async_rl.tasks.arithmetic import SFT_SEED_OFFSET, WORKER_SEED_STRIDE, check_char_task
from async_rl.tasks.protocol import RewardFnLike, draw_in_split, supervised
from async_rl.tasks.tokenizer import CODE_CHARS, CharTokenizer
from async_rl.trajectory import Trajectory

_OPS = {"+": lambda a, k: a + k, "-": lambda a, k: a - k, "*": lambda a, k: a * k,
        "//": lambda a, k: a // k, "%": lambda a, k: a % k}
_MULTIPLICATIVE = ("*", "//", "%")
_HEADER = "n=int(input())\nprint("
_MAX_INPUT = 99
_TRAIN_STREAM, _HELDOUT_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class CodePrompt:
  """A code problem as the generator and the reward see it.

  Attributes:
    id: unique within a run (`train/{seed}/{index}`, `heldout/{index}`).
    tokens: BOS and the prompt's ids.
    target: the reference solution's ids and EOS (the warm-start target).
    tests: the test cases, the reward's reference.
  """
  id: str
  tokens: tuple[int, ...]
  target: tuple[int, ...]
  tests: tuple[dict, ...]


def make_program(rng: np.random.Generator, cfg: CodeConfig) -> tuple[str, str, tuple]:
  """(prompt text, reference solution, test cases) of one problem drawn with `rng`."""
  expr, prev, steps = "n", None, []
  for _ in range(int(rng.integers(cfg.min_ops, cfg.max_ops + 1))):
    op, k = list(_OPS)[int(rng.integers(len(_OPS)))], int(rng.integers(1, 10))
    if op in _MULTIPLICATIVE and prev is not None and prev not in _MULTIPLICATIVE:
      expr = f"({expr})"
    expr, prev = f"{expr}{op}{k}", op
    steps.append((op, k))
  tests = []
  for n in rng.integers(0, _MAX_INPUT + 1, size=cfg.num_tests):
    value = int(n)
    for op, k in steps:
      value = _OPS[op](value, k)
    tests.append({"input": str(int(n)), "output": str(value)})
  return f"# print {expr}\n", f"{_HEADER}{expr})", tuple(tests)


def max_expr_chars(cfg: CodeConfig) -> int:
  """An upper bound on an expression's length: each operation adds at most `()`, `//`
  and a digit."""
  return 1 + 5 * cfg.max_ops


class _Problems:
  """Problem i of the train (per seed) or held-out stream, tokenized."""

  def __init__(self, cfg: CodeConfig, tokenizer: CharTokenizer):
    self.cfg, self.tokenizer = cfg, tokenizer

  def prompt(self, heldout: bool, seed: int, index: int) -> CodePrompt:
    text, solution, tests = draw_in_split(
        [_HELDOUT_STREAM, index] if heldout else [_TRAIN_STREAM, seed, index],
        lambda rng: make_program(rng, self.cfg), lambda program: program[0], heldout,
        self.cfg.heldout_fraction, "code.heldout_fraction")
    tok = self.tokenizer
    return CodePrompt(f"heldout/{index}" if heldout else f"train/{seed}/{index}",
                      (tok.bos_id, *tok.encode(text)), (*tok.encode(solution), tok.eos_id),
                      tests)


class CodeStream:
  """An endless, seeded, resumable iterator of training problems (state `{"seed", "index"}`)."""

  def __init__(self, problems: _Problems, seed: int, index: int = 0):
    self._problems, self.seed, self.index = problems, seed, index

  def __iter__(self):
    return self

  def __next__(self) -> CodePrompt:
    prompt = self._problems.prompt(False, self.seed, self.index)
    self.index += 1
    return prompt

  def state(self) -> dict[str, int]:
    return {"seed": self.seed, "index": self.index}


@dataclasses.dataclass
class CodeTask:
  """Programs checked by their tests in the sandbox.

  Attributes:
    cfg: the problem distribution and split.
    reward_fn: "code_tests" (the share of tests passed), "code_tests_all", or any.
  """
  cfg: CodeConfig
  reward_fn: RewardFnLike = "code_tests"
  tokenizer: CharTokenizer = dataclasses.field(
      default_factory=lambda: CharTokenizer(CODE_CHARS))
  workflow = None

  def __post_init__(self):
    self._problems = _Problems(self.cfg, self.tokenizer)

  @staticmethod
  def reference(prompt: CodePrompt) -> Any:
    return list(prompt.tests)

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0) -> CodeStream:
    seed = self.cfg.seed + WORKER_SEED_STRIDE * worker_index
    if not state:
      return CodeStream(self._problems, seed)
    if state.get("seed") != seed or set(state) != {"seed", "index"}:
      raise ValueError(f"code stream state must be {{'seed': {seed}, 'index': i}} for worker "
                       f"{worker_index}, got {state!r}")
    return CodeStream(self._problems, seed, state["index"])

  def heldout(self, n: int) -> list[CodePrompt]:
    return [self._problems.prompt(True, 0, i) for i in range(n)]

  def sft_examples(self) -> Iterator[Trajectory]:
    return (supervised(p.tokens, p.target)
            for p in CodeStream(self._problems, self.cfg.seed + SFT_SEED_OFFSET))


def check(cfg: ExperimentConfig) -> None:
  """The run's checks for `task.name="code"`."""
  vocab = CharTokenizer(CODE_CHARS).vocab_size
  if cfg.model.vocab_size < vocab:
    raise ValueError(f"model.vocab_size must hold the code task's {vocab} token ids, got "
                     f"{cfg.model.vocab_size}")
  expr = max_expr_chars(cfg.task.code)
  check_char_task(cfg, max_prompt_tokens=1 + len("# print \n") + expr,
                  max_target_tokens=len(_HEADER) + expr + 2)


def make(cfg: TaskConfig) -> CodeTask:
  return CodeTask(cfg.code)
