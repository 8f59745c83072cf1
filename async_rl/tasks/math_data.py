"""Math word problems from GSM8K/MATH-style JSONL files, checked with math-verify.

Each line of a file is a JSON object with a question and an answer field:

    {"question": "...", "answer": "...reasoning...\\n#### 1,000"}      GSM8K
    {"problem": "...", "solution": "... \\\\boxed{\\\\frac{1}{2}} ..."}  MATH
    {"question": "...", "answer": "1/2"}                              final answer

A `solution` field is a worked solution and must hold its final answer as the last
`\\boxed{...}` or after the last `####`; any other answer field is the final answer
itself unless it holds one of those markers (GSM8K's reasoning, say).

`MathStream` yields text prompts with their reference answers: tokenizing them is the
caller's, since which tokenizer depends on the model. `math_reward` scores a
completion against a reference answer and is the "math" reward of the registry.
"""

import dataclasses
import functools
import json
import os
import re
import threading
from collections.abc import Sequence

import numpy as np
from absl import logging

DEFAULT_TEMPLATE = "Question: {question}\nAnswer: Let's think step by step."
_MATH_VERIFY_TIMEOUT_S = 5  # Per parse and per comparison; math-verify's default.
_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_IS = re.compile(r"answer\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)|$")
_MATH_SPAN = re.compile(r"\$\$.+?\$\$|\$.+?\$")
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


@dataclasses.dataclass(frozen=True)
class MathProblem:
  """One row of a math JSONL file.

  Attributes:
    id: the file's stem and the row's line number, for example `gsm8k_test/12`.
    question: the question text.
    answer: the final answer, as written in the file (`1,000`, `\\frac{1}{2}`).
    solution: the worked solution the answer was taken from, or None when the file
      gives only the final answer.
  """
  id: str
  question: str
  answer: str
  solution: str | None = None


def last_boxed(text: str) -> str | None:
  """The contents of the last balanced `\\boxed{...}` in `text`, or None."""
  for match in reversed(list(_BOXED.finditer(text))):
    depth = 1
    for i in range(match.end(), len(text)):
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      if depth == 0:
        return text[match.end():i].strip()
  return None


def _line_after(text: str, marker: str | re.Pattern) -> str:
  """The rest of the line after the last `marker` in `text` ("" if none), stripped."""
  if isinstance(marker, str):
    start = text.rfind(marker)
    start = -1 if start < 0 else start + len(marker)
  else:
    start = max((m.end() for m in marker.finditer(text)), default=-1)
  return "" if start < 0 else text[start:].lstrip().split("\n", 1)[0].strip()


def _answer_phrase(rest: str) -> str:
  """The answer that `rest` starts with: a `$...$` span, else up to the sentence end."""
  rest = rest.strip("* ")
  if math := _MATH_SPAN.match(rest):
    return math.group(0)
  return rest[:_SENTENCE_END.search(rest).start()].strip("* ").rstrip(".,;:")


def _extract(text: str) -> tuple[str | None, bool]:
  """`extract_final_answer(text)`, and whether it came from a `\\boxed{}` (LaTeX)."""
  if answer := last_boxed(text):
    return answer, True
  if answer := _line_after(text, "####"):
    return answer, False
  if answer := _answer_phrase(_line_after(text, _ANSWER_IS)):
    return answer, False
  numbers = _NUMBER.findall(text)
  return (numbers[-1] if numbers else None), False


def extract_final_answer(text: str) -> str | None:
  """The final answer a completion states, or None if it states none.

  Tried in order, the first non-empty one wins:
    1. the contents of the last `\\boxed{...}` (braces may nest);
    2. the rest of the line after the last `####` (GSM8K's marker);
    3. after the last "answer is" or "answer:" (any case, so also "The final answer
       is"), the `$...$` span that follows, else the rest of that sentence;
    4. the last number (`-3`, `1,000`, `0.75`, `3/4`) in the text.
  """
  return _extract(text)[0]


def _as_math(text: str) -> str:
  return text if "$" in text else f"${text}$"


def math_reward(completion: str, reference_answer: str) -> float:
  """1.0 if the completion's final answer equals `reference_answer`, else 0.0.

  The answer is `extract_final_answer(completion)`; it and the reference are parsed
  with `math_verify.parse` and compared with `math_verify.verify`, so `\\frac{1}{2}`,
  `0.5` and `1/2` are equal, as are `1,000` and `1000`. The reference and a boxed
  answer are LaTeX, read as `$...$` math. Any other answer is prose ("18 dollars",
  "$\\frac{3}{4}$"), read as math-verify reads a completion, and as `$...$` math only
  if that finds nothing (a bare `\\frac{3}{4}`). Never raises on strings: an answer
  that is missing or does not parse scores 0.0, and so does a reference that does
  not parse, with a warning.

  math-verify bounds parsing and comparing with SIGALRM, which works only in a main
  thread, as in the RewardService workers. Called from another thread it runs with
  no time limit, so call it there only on trusted inputs.
  """
  import math_verify  # An optional dependency (the `math` extra), imported here.

  timeout_s = (_MATH_VERIFY_TIMEOUT_S
               if threading.current_thread() is threading.main_thread() else None)
  parse = functools.partial(math_verify.parse, parsing_timeout=timeout_s)
  gold = parse(_as_math(str(reference_answer).strip()))
  if not gold:
    logging.warning("math reward: math-verify cannot parse the reference answer %r",
                    reference_answer)
    return 0.0
  answer, boxed = _extract(completion)
  if answer is None:
    return 0.0
  readings = parse(_as_math(answer)) if boxed else parse(answer) or parse(_as_math(answer))
  return float(bool(readings) and
               math_verify.verify(gold, readings, timeout_seconds=timeout_s))


def _final_answer(text: str, is_solution: bool) -> tuple[str, str | None]:
  """(final answer, worked solution or None) of an answer field; raises ValueError."""
  if "####" in text:
    if not (answer := _line_after(text, "####")):
      raise ValueError("no final answer found: nothing follows its last '####'")
    return answer, text
  if (answer := last_boxed(text)) is not None:
    if not answer:
      raise ValueError("no final answer found: its last \\boxed{} is empty")
    return answer, text
  if _BOXED.search(text):
    raise ValueError("no final answer found: its \\boxed{ is never closed")
  if is_solution:
    raise ValueError("no final answer found: expected a \\boxed{...} or '#### answer'")
  if not text.strip():
    raise ValueError("no final answer found: it is empty")
  return text.strip(), None


def _field(row: dict, key: str | None, defaults: tuple[str, str]) -> tuple[str, object]:
  if key is None:
    key = next((k for k in defaults if k in row), None)
    if key is None:
      raise ValueError(f"missing field {defaults[0]!r} (or {defaults[1]!r})")
  elif key not in row:
    raise ValueError(f"missing field {key!r}")
  return key, row[key]


def _problem(row: object, id_: str, question_key: str | None,
             answer_key: str | None) -> MathProblem:
  if not isinstance(row, dict):
    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
  q_key, question = _field(row, question_key, ("question", "problem"))
  a_key, answer = _field(row, answer_key, ("answer", "solution"))
  if not isinstance(question, str):
    raise ValueError(f"field {q_key!r} must be a string, got {type(question).__name__}")
  if not question.strip():
    raise ValueError(f"field {q_key!r} is empty")
  if isinstance(answer, (int, float)) and not isinstance(answer, bool):
    answer = str(answer)
  if not isinstance(answer, str):
    raise ValueError(f"field {a_key!r} must be a string or a number, "
                     f"got {type(answer).__name__}")
  try:
    final, solution = _final_answer(answer, is_solution=a_key == "solution")
  except ValueError as e:
    raise ValueError(f"field {a_key!r}: {e}") from None
  return MathProblem(id=id_, question=question.strip(), answer=final, solution=solution)


def load_jsonl(path: str | os.PathLike, *, question_key: str | None = None,
               answer_key: str | None = None) -> list[MathProblem]:
  """The problems in a GSM8K/MATH-style JSONL file, in file order.

  Args:
    path: the file; blank lines are skipped.
    question_key: the question's field; by default "question", else "problem".
    answer_key: the answer's field; by default "answer", else "solution".

  Raises:
    ValueError: naming the file and line, for a line that is not a JSON object, a
      missing, empty or mistyped field, or an answer field with no final answer.
  """
  stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
  problems = []
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from None
        problems.append(_problem(row, f"{stem}/{line_no}", question_key, answer_key))
      except ValueError as e:
        raise ValueError(f"{os.fspath(path)}, line {line_no}: {e}") from None
  return problems


def format_prompt(question: str, template: str = DEFAULT_TEMPLATE) -> str:
  """`template` with `{question}` replaced by the question, as plain text.

  The default, "Question: ...\\nAnswer: Let's think step by step.", suits a base
  model; a chat model's template is applied by its tokenizer, not here. Only the
  literal `{question}` is replaced, so other braces (LaTeX) need no escaping.
  """
  if "{question}" not in template:
    raise ValueError(f"prompt template must contain '{{question}}', got {template!r}")
  return template.replace("{question}", question)


@dataclasses.dataclass(frozen=True)
class MathPrompt:
  """A problem as the generator and the reward see it.

  Attributes:
    id: the problem's id and the epoch it was drawn in (`gsm8k_train/12@3`), unique
      within a stream.
    question: the question text.
    answer: the reference final answer, for `math_reward`.
    text: the formatted prompt; the caller tokenizes it.
  """
  id: str
  question: str
  answer: str
  text: str


class MathStream:
  """An endless iterator over `problems`, reshuffled each epoch, that checkpoints as
  `{"seed", "epoch", "index"}`.

  Epoch e visits every problem once, in the order of a permutation seeded by
  (seed, e), so `MathStream.resume(problems, stream.state())` yields exactly what
  `stream` would have yielded next, given the same problems. Not thread-safe.
  """

  def __init__(self, problems: Sequence[MathProblem], *, seed: int = 0,
               template: str = DEFAULT_TEMPLATE, epoch: int = 0, index: int = 0):
    if not problems:
      raise ValueError("MathStream needs at least one problem")
    if epoch < 0:
      raise ValueError(f"epoch must be >= 0, got {epoch}")
    if not 0 <= index <= len(problems):
      raise ValueError(f"index must be in [0, {len(problems)}], got {index}")
    format_prompt("", template)
    self.problems = problems
    self.seed = seed
    self.template = template
    self.epoch = epoch
    self.index = index
    self._order = self._permutation(epoch)

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))

  def __iter__(self):
    return self

  def __next__(self) -> MathPrompt:
    if self.index == len(self.problems):
      self.epoch, self.index = self.epoch + 1, 0
      self._order = self._permutation(self.epoch)
    problem = self.problems[self._order[self.index]]
    self.index += 1
    return MathPrompt(id=f"{problem.id}@{self.epoch}", question=problem.question,
                      answer=problem.answer,
                      text=format_prompt(problem.question, self.template))

  def state(self) -> dict[str, int]:
    return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

  @classmethod
  def resume(cls, problems: Sequence[MathProblem], state: dict[str, int], *,
             template: str = DEFAULT_TEMPLATE) -> "MathStream":
    """The stream continuing from `state`, over the same `problems`."""
    if set(state) != {"seed", "epoch", "index"}:
      raise ValueError("stream state must have keys 'seed', 'epoch' and 'index', "
                       f"got {state!r}")
    return cls(problems, seed=state["seed"], template=template, epoch=state["epoch"],
               index=state["index"])
