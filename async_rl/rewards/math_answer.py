"""Reward for math answers, checked for mathematical equality with math-verify."""


def math_answer_reward(completion: str, answer: str) -> float:
  """1.0 if the completion's final answer equals `answer` mathematically, else 0.0.

  `answer` may be plain ("0.5", "1/2") or LaTeX with or without `$...$`. Needs the
  `math` extra (math-verify). math-verify bounds its parsing with SIGALRM, which works
  only in a main thread, as in the reward workers.
  """
  import math_verify  # An optional dependency, imported where it is used.

  gold = math_verify.parse(answer) or math_verify.parse(f"${answer}$")
  if not gold:
    raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
  return float(math_verify.verify(gold, math_verify.parse(completion)))
