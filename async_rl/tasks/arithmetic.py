"""The arithmetic task: multi-step arithmetic with a worked scratchpad and long-tailed
solution lengths, its train / held-out splits, and the task a run trains on.

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
the digits the model has seen. The verifier (`verify`) checks the whole worked
solution; `step_credit` gives partial credit for its correct start.

Splits. A prompt is held out iff a hash of its string falls below `heldout_fraction`
(`protocol.is_heldout`). The train stream rejects held-out prompts and the held-out
set rejects the rest, so no prompt is ever in both, whatever the seeds, lengths or
number drawn; and a prompt keeps its side when other task fields change. Problem i of
a stream is drawn from its own generator seeded by (stream, seed, i), so the training
stream is resumed from `{"seed", "index"}` alone and continues exactly. Within a split
prompts repeat (there are only a few hundred two-term chains): each split is a sample
from the task distribution restricted to its prompts, so held-out accuracy estimates
accuracy on unseen prompts at the training mix of lengths.

`ArithmeticTask` is single-turn: the policy writes the whole scratchpad.
`tasks.tool_task` is the same problems with a calculator tool.
"""

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Optional

import numpy as np

from async_rl.config import ArithmeticConfig, ExperimentConfig, TaskConfig
from async_rl.tasks.protocol import RewardFnLike, draw_in_split, supervised
from async_rl.tasks.tokenizer import CharTokenizer
from async_rl.trajectory import Trajectory


MAX_PROMPT_TOKENS = 32
MAX_SOLUTION_TOKENS = 64


def term_probs(cfg: ArithmeticConfig) -> np.ndarray:
  """P(num_terms = min_terms + i) for i = 0 .. max_terms - min_terms."""
  steps = np.arange(cfg.min_terms - 1, cfg.max_terms, dtype=np.float64)
  weights = steps ** -cfg.tail_exponent
  return weights / weights.sum()


def max_prompt_tokens(cfg: ArithmeticConfig) -> int:
  """Upper bound on prompt tokens, BOS included."""
  return 1 + cfg.max_terms * _digits(cfg.max_operand) + cfg.max_terms


def max_solution_tokens(cfg: ArithmeticConfig) -> int:
  """Upper bound on reference solution tokens, EOS included; attained when every
  running value has the most digits."""
  cap = min(cfg.max_value, cfg.max_terms * cfg.max_operand)
  op, val = _digits(cfg.max_operand), _digits(cap)
  first = op + 1 + op + 1 + _digits(min(cap, 2 * cfg.max_operand)) + 1
  later = (cfg.max_terms - 2) * (val + 1 + op + 1 + val + 1)
  return first + later + 1 + val + 1


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


def make_problem(rng: np.random.Generator, cfg: ArithmeticConfig) -> Problem:
  """Draws one problem from the task distribution using `rng`."""
  num_terms = cfg.min_terms + int(rng.choice(cfg.max_terms - cfg.min_terms + 1,
                                             p=term_probs(cfg)))
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


_TRAIN_STREAM, _HELDOUT_STREAM = 0, 1
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



def _problem(cfg: ArithmeticConfig, heldout: bool, index: int) -> Problem:
  return draw_in_split([_HELDOUT_STREAM, index] if heldout else [_TRAIN_STREAM, cfg.seed, index],
                       lambda rng: make_problem(rng, cfg), lambda p: p.prompt, heldout,
                       cfg.heldout_fraction, "task.arithmetic.heldout_fraction")


def _prompt(id_: str, problem: Problem) -> Prompt:
  return Prompt(id=id_, tokens=(_TOKENIZER.bos_id, *_TOKENIZER.encode(problem.prompt)),
                target=(*_TOKENIZER.encode(problem.solution), _TOKENIZER.eos_id),
                problem=problem)


def heldout_set(cfg: ArithmeticConfig, n: int) -> list[Prompt]:
  """The first `n` held-out prompts; the same for every `cfg.seed`."""
  return [_prompt(f"heldout/{i}", _problem(cfg, True, i)) for i in range(n)]


class TrainStream:
  """An endless, seeded iterator of training prompts that checkpoints as a small dict.

  `TrainStream.resume(cfg, stream.state())` yields exactly what `stream` would have
  yielded next. Not thread-safe: one consumer draws from it.
  """

  def __init__(self, cfg: ArithmeticConfig, *, index: int = 0):
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
  def resume(cls, cfg: ArithmeticConfig, state: dict[str, int]) -> "TrainStream":
    """The stream continuing from `state`; its seed must be `cfg.seed`."""
    if set(state) != {"seed", "index"}:
      raise ValueError(f"stream state must have keys 'seed' and 'index', got {state!r}")
    if state["seed"] != cfg.seed:
      raise ValueError(f"stream state seed {state['seed']} does not match "
                       f"task.arithmetic.seed {cfg.seed}")
    return cls(cfg, index=state["index"])


def length_stats(cfg: ArithmeticConfig, n: int = 10_000) -> dict[str, dict[str, float]]:
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


# Each rollout worker draws from its own stream; the warm start from another one, so RL
# does not begin on memorised prompts.
WORKER_SEED_STRIDE = 1000
SFT_SEED_OFFSET = 7919


@dataclasses.dataclass
class ArithmeticTask:
  """Arithmetic problems whose reference is the `Problem` (what the verifiers check).

  Attributes:
    cfg: the problem distribution and split.
    reward_fn: "arithmetic" (the exact worked solution), "arithmetic_steps" (credit
      per correct leading step), or any reward function.
  """
  cfg: ArithmeticConfig
  reward_fn: RewardFnLike = "arithmetic"
  tokenizer: CharTokenizer = dataclasses.field(default_factory=CharTokenizer)
  workflow = None

  @staticmethod
  def reference(prompt: Prompt):
    return prompt.problem

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0) -> TrainStream:
    """The training prompts of rollout worker `worker_index` (each has its own seed)."""
    cfg = dataclasses.replace(self.cfg, seed=self.cfg.seed + WORKER_SEED_STRIDE * worker_index)
    return TrainStream.resume(cfg, state) if state else TrainStream(cfg)

  def heldout(self, n: int) -> list[Prompt]:
    return heldout_set(self.cfg, n)

  def sft_examples(self) -> Iterator[Trajectory]:
    """Prompts of their own stream with their reference solutions, all trained on."""
    stream = TrainStream(dataclasses.replace(self.cfg, seed=self.cfg.seed + SFT_SEED_OFFSET))
    return (supervised(p.tokens, p.target) for p in stream)


def check_char_task(cfg: ExperimentConfig, *, max_prompt_tokens: int,
                    max_target_tokens: int) -> None:
  """The checks of a run on a character-tokenized task whose prompts and reference
  solutions are at most the given lengths (BOS and EOS included)."""
  if cfg.hf_model_dir is not None:
    raise ValueError(f"hf_model_dir needs task.name='math': the {cfg.task.name} task's "
                     f"character tokenizer does not share a pretrained model's vocabulary, "
                     f"got {cfg.hf_model_dir!r}")
  if max_prompt_tokens > cfg.generation.max_prompt_len:
    raise ValueError(f"generation.max_prompt_len must hold the task's longest prompt "
                     f"({max_prompt_tokens} tokens), got {cfg.generation.max_prompt_len}")
  longest = max_prompt_tokens + max_target_tokens
  if cfg.sft.steps and cfg.batching.max_tokens_per_mb < longest:
    raise ValueError(f"batching.max_tokens_per_mb must hold the longest warm-start sequence "
                     f"({longest} tokens) when sft.steps > 0, got "
                     f"{cfg.batching.max_tokens_per_mb}")


def check(cfg: ExperimentConfig) -> None:
  """The run's checks for the arithmetic tasks (with or without the tool)."""
  check_char_task(cfg, max_prompt_tokens=max_prompt_tokens(cfg.task.arithmetic),
                  max_target_tokens=max_solution_tokens(cfg.task.arithmetic))


def make(cfg: TaskConfig) -> ArithmeticTask:
  return ArithmeticTask(cfg.arithmetic)
