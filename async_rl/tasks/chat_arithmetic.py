"""Arithmetic asked in a chat: one- and two-digit `a op b` questions through a
pretrained model's own chat template, the answer in a strict format
(`task.name="arithmetic_chat"`, `config.ChatArithmeticConfig`).

A problem draws an operator from `ops` and two operands from
[min_operand, max_operand], swapped for `-` so that no result is negative. Its
prompt is the conversation

    system:     Reply with only the result, written as <answer>N</answer>.
    user:       What is 3 + 5?             (one pair of turns per worked example)
    assistant:  <answer>8</answer>
    user:       What is 12 * 7?            (`question`, with a, op and b filled in)

rendered by the model's chat template up to where the assistant's reply begins, and
encoded without added special tokens (the template writes its own). The reference is
the answer with the format it must be written in (`Answer`).

Two scores, each `fn(completion, reference) -> float`:

  strict   (`strict_answer`, reward "arithmetic_chat") 1.0 when the completion's first
           `<answer>N</answer>` (or `\\boxed{N}`) holds the answer as a plain integer;
           what the run trains on and what held-out `accuracy` counts.
  lenient  (`lenient_answer`, "arithmetic_chat_lenient") 1.0 when the last integer
           written anywhere in the completion is the answer, in any format: the skill
           without the format, reported beside it so that a format gain is not read as
           a skill gain.

Splits are those of the arithmetic task: a question is held out iff a hash of its
text falls below `heldout_fraction` (`protocol.is_heldout`), and problem i of a stream
comes from a generator seeded by (stream, seed, i), so a stream resumes from
`{"seed", "index"}` alone. The training stream repeats questions; the held-out set
does not, so that its accuracy is a mean over as many questions as it has prompts.
"""

import dataclasses
import re
from typing import Optional

import numpy as np

from async_rl.config import ChatArithmeticConfig, ExperimentConfig, TaskConfig
from async_rl.models.hf_tokenizer import HFTokenizer
from async_rl.tasks.protocol import TextTokenizer, draw_in_split

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_SPANS = {"answer": re.compile(r"<answer>(.*?)</answer>", re.S),
          "boxed": re.compile(r"\\boxed\{([^{}]*)\}")}
_INTEGER = re.compile(r"-?\d+")
# What the reply must look like, per format, for the question's instruction.
FORMAT_EXAMPLES = {"answer": "<answer>N</answer>", "boxed": "\\boxed{N}"}


@dataclasses.dataclass(frozen=True)
class Answer:
  """What a completion is checked against: the value and the format it must be in."""
  value: int
  format: str


def written(value: int, answer_format: str) -> str:
  """`value` in the answer format: `<answer>42</answer>`."""
  return FORMAT_EXAMPLES[answer_format].replace("N", str(value))


def strict_answer(completion: str, reference: Answer) -> float:
  """1.0 if the completion's first answer span of the reference's format holds the
  value as a plain integer (spaces around it allowed), else 0.0."""
  span = _SPANS[reference.format].search(completion)
  return float(span is not None and span.group(1).strip() == str(reference.value))


def lenient_answer(completion: str, reference: Answer) -> float:
  """1.0 if the last integer in the completion, wherever and however written, is the
  value, else 0.0."""
  integers = _INTEGER.findall(completion)
  return float(bool(integers) and int(integers[-1]) == reference.value)


@dataclasses.dataclass(frozen=True)
class Problem:
  """`a op b`, its value, and the user's text."""
  a: int
  op: str
  b: int
  value: int
  question: str


def make_problem(rng: np.random.Generator, cfg: ChatArithmeticConfig) -> Problem:
  """One problem of the task's distribution, drawn with `rng`."""
  op = cfg.ops[int(rng.integers(len(cfg.ops)))]
  a, b = (int(x) for x in rng.integers(cfg.min_operand, cfg.max_operand + 1, size=2))
  if op == "-" and b > a:
    a, b = b, a
  return Problem(a, op, b, _OPS[op](a, b), cfg.question.format(a=a, op=op, b=b))


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A problem as the generator and the reward see it.

  Attributes:
    id: unique within a run: `train/{seed}/{index}` or `heldout/{index}`.
    tokens: the conversation's ids, up to where the assistant begins.
    answer: the reference.
    problem: what was asked (`ChatArithmeticTask.messages` gives the conversation).
  """
  id: str
  tokens: tuple[int, ...]
  answer: Answer
  problem: Problem


_TRAIN_STREAM, _HELDOUT_STREAM = 0, 1
_WORKER_SEED_STRIDE = 1000
# Held-out draws repeat questions; a split of fewer than n questions ends the search here.
_HELDOUT_DRAWS_PER_PROMPT = 20


def _problem(cfg: ChatArithmeticConfig, heldout: bool, seed: int, index: int) -> Problem:
  return draw_in_split([_HELDOUT_STREAM, index] if heldout else [_TRAIN_STREAM, seed, index],
                       lambda rng: make_problem(rng, cfg), lambda p: p.question, heldout,
                       cfg.heldout_fraction, "task.arithmetic_chat.heldout_fraction")


class ChatArithmeticStream:
  """An endless, seeded stream of training prompts; checkpoints as `{"seed", "index"}`.
  Not thread-safe: one consumer draws from it."""

  def __init__(self, task: "ChatArithmeticTask", seed: int, index: int = 0):
    self._task, self.seed, self.index = task, seed, index

  def __iter__(self):
    return self

  def __next__(self) -> Prompt:
    problem = _problem(self._task.cfg, False, self.seed, self.index)
    prompt = self._task.prompt(f"train/{self.seed}/{self.index}", problem)
    self.index += 1
    return prompt

  def state(self) -> dict[str, int]:
    return {"seed": self.seed, "index": self.index}


class ChatArithmeticTask:
  """Arithmetic questions through `tokenizer`'s chat template, scored strictly.

  Args:
    cfg: the problems, the prompt's wording and the answer format.
    tokenizer: a tokenizer with a chat template (`protocol.TextTokenizer`).
  """
  reward_fn = "arithmetic_chat"
  workflow = None

  def __init__(self, cfg: ChatArithmeticConfig, tokenizer: TextTokenizer):
    self.cfg, self.tokenizer = cfg, tokenizer

  def messages(self, problem: Problem) -> list[dict[str, str]]:
    """The conversation that asks `problem`: the system turn, the worked examples, the
    question."""
    cfg = self.cfg
    turns = []
    if cfg.system:
      turns.append({"role": "system",
                    "content": cfg.system.replace("{format}", FORMAT_EXAMPLES[cfg.answer_format])})
    for example in cfg.examples:
      a, op, b = example.split()
      turns += [{"role": "user", "content": cfg.question.format(a=a, op=op, b=b)},
                {"role": "assistant", "content": written(_OPS[op](int(a), int(b)),
                                                         cfg.answer_format)}]
    return turns + [{"role": "user", "content": problem.question}]

  def prompt(self, id_: str, problem: Problem) -> Prompt:
    text = self.tokenizer.render_chat(self.messages(problem), add_generation_prompt=True)
    return Prompt(id_, tuple(self.tokenizer.encode(text)),
                  Answer(problem.value, self.cfg.answer_format), problem)

  @staticmethod
  def reference(prompt: Prompt) -> Answer:
    return prompt.answer

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0
             ) -> ChatArithmeticStream:
    """The training prompts of rollout worker `worker_index`, resumed from `state`."""
    seed = self.cfg.seed + _WORKER_SEED_STRIDE * worker_index
    if not state:
      return ChatArithmeticStream(self, seed)
    if set(state) != {"seed", "index"} or state["seed"] != seed:
      raise ValueError(f"stream state must have keys seed={seed} and index for worker "
                       f"{worker_index}, got {state!r}")
    return ChatArithmeticStream(self, seed, state["index"])

  def heldout(self, n: int) -> list[Prompt]:
    """The first `n` distinct held-out questions (fewer where the split holds fewer: the
    draws stop after `_HELDOUT_DRAWS_PER_PROMPT * n`); the same for every `cfg.seed`."""
    problems: dict[str, tuple[int, Problem]] = {}
    for i in range(_HELDOUT_DRAWS_PER_PROMPT * n):
      if len(problems) == n:
        break
      problem = _problem(self.cfg, True, 0, i)
      problems.setdefault(problem.question, (i, problem))
    return [self.prompt(f"heldout/{i}", problem) for i, problem in problems.values()]


_NO_TOKENIZER = ("task.name='arithmetic_chat' asks through a model's chat template: set "
                 "hf_model_dir (or task.tokenizer_dir) to the model's directory, got None")


def check(cfg: ExperimentConfig) -> None:
  """The run's checks for `task.name="arithmetic_chat"`."""
  if cfg.hf_model_dir is None and cfg.task.tokenizer_dir is None:
    raise ValueError(_NO_TOKENIZER)
  if cfg.sft.steps:
    raise ValueError(f"sft.steps must be 0 with task.name='arithmetic_chat': the pretrained "
                     f"model is the start, got {cfg.sft.steps}")


def make(cfg: TaskConfig) -> ChatArithmeticTask:
  """The task; `cfg.tokenizer_dir` is set (the builder fills it in from `hf_model_dir`)."""
  if cfg.tokenizer_dir is None:
    raise ValueError(_NO_TOKENIZER)
  return ChatArithmeticTask(cfg.arithmetic_chat, HFTokenizer(cfg.tokenizer_dir))
