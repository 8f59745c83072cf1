"""Multi-step arithmetic with a worked scratchpad and long-tailed solution lengths.

A problem is a chain of k single-digit operands joined by `+` and `-`, evaluated left
to right, for example `7+2-5+3=`. Its reference solution writes one line per step
and then the answer after `#`:

    7+2=9
    9-5=4
    4+3=7
    #7

so the solution grows linearly with k. The number of steps s = k - 1 follows a
truncated power law, P(s) ∝ s^-tail_exponent on [min_terms - 1, max_terms - 1]: most
problems are short and a few are long, the heavy tail of generation lengths that
stalls synchronous RL. A smaller exponent is a heavier tail; 0 is uniform.

Every running value stays in [0, max_value], so no step needs a sign or a carry past
the digits the model has seen. The verifier checks only the final answer, exactly.
"""

import dataclasses

import numpy as np

MAX_PROMPT_TOKENS = 32
MAX_SOLUTION_TOKENS = 64


def _fail(field, value, why):
  raise ValueError(f"task.{field} {why}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The arithmetic task distribution and its train / held-out split.

  Attributes:
    min_terms: fewest operands in a problem (>= 2: at least one step).
    max_terms: most operands in a problem.
    tail_exponent: P(steps = s) ∝ s^-tail_exponent; smaller is a heavier tail.
    max_operand: operands are drawn uniformly from [0, max_operand].
    max_value: running values stay in [0, max_value]; must be >= 2 * max_operand so
      that one of `+`, `-` always keeps the value in range.
    heldout_fraction: share of all prompt strings reserved for the held-out split.
    seed: seeds the training stream (the held-out set does not depend on it).
  """
  min_terms: int = 2
  max_terms: int = 8
  tail_exponent: float = 1.5
  max_operand: int = 9
  max_value: int = 99
  heldout_fraction: float = 0.1
  seed: int = 0

  def __post_init__(self):
    if self.min_terms < 2:
      _fail("min_terms", self.min_terms, "must be >= 2")
    if self.max_terms < self.min_terms:
      _fail("max_terms", self.max_terms, f"must be >= task.min_terms ({self.min_terms})")
    if self.tail_exponent < 0:
      _fail("tail_exponent", self.tail_exponent, "must be >= 0")
    if self.max_operand < 1:
      _fail("max_operand", self.max_operand, "must be >= 1")
    if self.max_value < 2 * self.max_operand:
      _fail("max_value", self.max_value,
            f"must be >= 2 * task.max_operand ({2 * self.max_operand})")
    if not 0 < self.heldout_fraction < 1:
      _fail("heldout_fraction", self.heldout_fraction, "must lie in (0, 1)")
    if self.seed < 0:
      _fail("seed", self.seed, "must be >= 0")

  def term_probs(self) -> np.ndarray:
    """P(num_terms = min_terms + i) for i = 0 .. max_terms - min_terms."""
    steps = np.arange(self.min_terms - 1, self.max_terms, dtype=np.float64)
    weights = steps ** -self.tail_exponent
    return weights / weights.sum()

  @property
  def max_prompt_tokens(self) -> int:
    """Upper bound on prompt tokens, BOS included."""
    return 1 + self.max_terms * _digits(self.max_operand) + self.max_terms

  @property
  def max_solution_tokens(self) -> int:
    """Upper bound on reference solution tokens, EOS included; attained when every
    running value has the most digits."""
    op, val = _digits(self.max_operand), _digits(self._value_cap)
    first = op + 1 + op + 1 + _digits(min(self._value_cap, 2 * self.max_operand)) + 1
    later = (self.max_terms - 2) * (val + 1 + op + 1 + val + 1)
    return first + later + 1 + val + 1

  @property
  def _value_cap(self) -> int:
    return min(self.max_value, self.max_terms * self.max_operand)


def _digits(n: int) -> int:
  return len(str(n))


@dataclasses.dataclass(frozen=True)
class Problem:
  """One arithmetic problem.

  Attributes:
    prompt: the chain and `=`, for example `7+2-5+3=`.
    answer: the value in canonical decimal, for example `7`.
    num_terms: the number of operands k.
    solution: the reference scratchpad and `#answer`, the SFT target (without EOS).
  """
  prompt: str
  answer: str
  num_terms: int
  solution: str


def make_problem(rng: np.random.Generator, cfg: TaskConfig) -> Problem:
  """Draws one problem from the task distribution using `rng`."""
  num_terms = cfg.min_terms + int(rng.choice(cfg.max_terms - cfg.min_terms + 1,
                                             p=cfg.term_probs()))
  value = int(rng.integers(0, cfg.max_operand + 1))
  prompt, lines = [str(value)], []
  for _ in range(num_terms - 1):
    operand = int(rng.integers(0, cfg.max_operand + 1))
    op = "+" if rng.random() < 0.5 else "-"
    if op == "-" and value - operand < 0:
      op = "+"
    elif op == "+" and value + operand > cfg.max_value:
      op = "-"
    result = value + operand if op == "+" else value - operand
    prompt += [op, str(operand)]
    lines.append(f"{value}{op}{operand}={result}\n")
    value = result
  return Problem(prompt="".join(prompt) + "=", answer=str(value), num_terms=num_terms,
                 solution="".join(lines) + f"#{value}")


def extract_answer(completion: str) -> str | None:
  """The text after the last `#` up to the next newline, or None if there is none.

  `completion` is decoded text, which ends at EOS. Nothing is stripped or normalised:
  `# 7` and `07` are answers that do not equal `7`.
  """
  start = completion.rfind("#")
  if start < 0:
    return None
  answer = completion[start + 1:].split("\n", 1)[0]
  return answer or None


def verify(completion: str, problem: Problem) -> float:
  """1.0 if the completion is a correct worked solution, else 0.0.

  Every step must apply the prompt's next operator and operand to the running value
  with the right result, one step per line, and end in `#answer`; for this task that
  is exactly `problem.solution`. Checking the work, not only the final answer, is
  what keeps the reward honest: answers are small numbers with a peaked
  distribution, and with answer-only checking RL learned to skip the work and guess
  the most frequent answer (every completion collapsed to `4\n#4`).
  """
  return 1.0 if completion == problem.solution else 0.0


def step_credit(completion: str, problem: Problem) -> float:
  """1.0 for a correct worked solution, else partial credit for its correct start.

  A shaped reward for RL: with L reference lines (the steps and `#answer`), a
  completion whose first m lines equal the reference's first m, and which is not the
  whole solution, scores m / (L + 1), so any wrong completion stays below a right one.
  All-or-nothing `verify` gives no signal on long chains, where almost no sample is
  fully right; credit for each leading correct step trains the single-step skill
  that every chain length shares. Evaluation counts a completion correct only at a
  reward of 1, so it stays exact under this reward.
  """
  if completion == problem.solution:
    return 1.0
  reference = problem.solution.split("\n")
  matched = 0
  for got, want in zip(completion.split("\n"), reference):
    if got != want:
      break
    matched += 1
  return min(matched, len(reference) - 1) / (len(reference) + 1)


def answer_correct(completion: str, problem: Problem) -> float:
  """1.0 if the final answer alone is right (a diagnostic; guesses can score here)."""
  return 1.0 if extract_answer(completion) == problem.answer else 0.0
