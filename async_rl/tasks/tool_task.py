"""Arithmetic with a calculator tool: a multi-turn task (`task.name="arithmetic_tool"`).

The problems and the transcript are those of the arithmetic task,

    7+2=9
    9-5=4
    #7

but the policy writes only each call, up to and including `=` (`7+2=`), and the answer
line (`#7`, then EOS); the calculator, an environment turn, writes each result and the
newline (`9\\n`), which are not trained on. So the policy must still chain the steps
(carry the running value, take the next operator and operand from the prompt) but no
longer computes them. The rewards are the arithmetic ones, on the whole transcript, so
accuracies compare with the single-turn task's directly.
"""

import dataclasses
import re
from collections.abc import Iterator
from typing import Optional

import numpy as np

from async_rl.config import TaskConfig
from async_rl.tasks import arithmetic
from async_rl.tasks.arithmetic import ArithmeticTask, TrainStream
from async_rl.tasks.protocol import supervised
from async_rl.tasks.tokenizer import CharTokenizer
from async_rl.tasks.workflow import MultiTurn
from async_rl.trajectory import Trajectory

_CALL = re.compile(r"(\d+)([+\-*])(\d+)=")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclasses.dataclass(frozen=True)
class Calculator:
  """The environment: answers a call `a op b=` on the transcript's last line with the
  result and a newline; anything else on that line ends the episode."""
  tokenizer: CharTokenizer

  def __call__(self, prompt, tokens_T: np.ndarray) -> Optional[list[int]]:
    transcript = self.tokenizer.decode(tokens_T[len(prompt.tokens):])
    call = _CALL.fullmatch(transcript.rsplit("\n", 1)[-1])
    if call is None:
      return None
    a, op, b = call.groups()
    return self.tokenizer.encode(f"{_OPS[op](int(a), int(b))}\n")


def policy_chars(solution: str) -> list[bool]:
  """Which characters of a worked solution the policy writes: each call up to `=`,
  and the answer line; not the results and their newlines."""
  *steps, answer = solution.split("\n")
  written = []
  for line in steps:
    call, result = line.split("=")
    written += [True] * (len(call) + 1) + [False] * (len(result) + 1)
  return written + [True] * len(answer)


@dataclasses.dataclass
class ToolTask(ArithmeticTask):
  """The arithmetic task, with the calculator answering the policy's calls.

  Attributes:
    max_turns: the most policy turns; None: `cfg.max_terms` (a call per step and the
      answer).
  """
  max_turns: Optional[int] = None

  def __post_init__(self):
    self.workflow = MultiTurn(
        Calculator(self.tokenizer), max_turns=self.max_turns or self.cfg.max_terms,
        turn_stop_ids=tuple(self.tokenizer.encode("=")),
        stop_ids=self.tokenizer.stop_ids)

  def sft_examples(self) -> Iterator[Trajectory]:
    """The warm-start stream of the arithmetic task, trained on the policy's part only."""
    stream = TrainStream(dataclasses.replace(
        self.cfg, seed=self.cfg.seed + arithmetic.SFT_SEED_OFFSET))
    return (supervised(p.tokens, p.target, policy_chars(p.problem.solution) + [True])
            for p in stream)


def make(cfg: TaskConfig) -> ToolTask:
  return ToolTask(cfg.arithmetic, max_turns=cfg.max_turns)
