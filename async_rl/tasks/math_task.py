"""GSM8K/MATH-style JSONL problems as a run's task, tokenized by the model's own tokenizer.

`MathTask` is the task `task.name="math"` (`tasks.protocol.Task`): a resumable
training stream per rollout worker, a held-out set, the tokenizer of the model
directory (its `stop_ids` end generation), the "math" reward and its reference (the
final answer).

The held-out set is `heldout_path`'s problems, or, without one, the training file's
problems whose question hashes below `heldout_fraction` (`tasks.protocol.is_heldout`).
Either way no held-out question is trained on: training problems whose question is
held out are dropped. Problems whose prompt is longer than `generation.max_prompt_len`
tokens are dropped too, with a warning that counts them; a split left empty is an
error.
"""

import dataclasses

from absl import logging

from async_rl.config import ExperimentConfig, MathConfig, TaskConfig
from async_rl.models.hf_tokenizer import HFTokenizer
from async_rl.tasks.protocol import is_heldout
from async_rl.tasks.math_data import MathProblem, MathStream, format_prompt, load_jsonl

# Each rollout worker draws from its own permutation of the training problems.
_WORKER_SEED_STRIDE = 1000


@dataclasses.dataclass(frozen=True)
class MathTaskPrompt:
  """A problem as the generator and the reward see it.

  Attributes:
    id: unique within a run (`train/{seed}/{problem id}@{epoch}`, `heldout/{problem id}`).
    tokens: the prompt's token ids.
    answer: the reference final answer.
  """
  id: str
  tokens: tuple[int, ...]
  answer: str


class MathPromptStream:
  """A `MathStream` yielding tokenized prompts; checkpoints as the stream's state."""

  def __init__(self, stream: MathStream, tokens: dict[str, tuple[int, ...]]):
    self._stream, self._tokens = stream, tokens

  def __iter__(self):
    return self

  def __next__(self) -> MathTaskPrompt:
    p = next(self._stream)
    return MathTaskPrompt(f"train/{self._stream.seed}/{p.id}", self._tokens[p.question],
                          p.answer)

  def state(self) -> dict[str, int]:
    return self._stream.state()


class MathTask:
  """Math problems for a run, through the tokenizer in `tokenizer_dir`.

  Args:
    cfg: the task's files and prompt format.
    tokenizer_dir: a Hugging Face model directory holding `tokenizer.json`.
    max_prompt_len: longer prompts are dropped (and counted in `num_too_long`).
  """
  reward_fn = "math"
  workflow = None

  def __init__(self, cfg: MathConfig, tokenizer_dir: str, *, max_prompt_len: int):
    self.cfg = cfg
    self.tokenizer = HFTokenizer(tokenizer_dir)
    self.max_prompt_len = max_prompt_len
    train = load_jsonl(cfg.train_path)
    if cfg.heldout_path is None:
      heldout = [p for p in train if is_heldout(p.question, cfg.heldout_fraction)]
    else:
      heldout = load_jsonl(cfg.heldout_path)
    held_questions = {p.question for p in heldout}
    self.num_train_held_out = sum(p.question in held_questions for p in train)
    if cfg.heldout_path is not None and self.num_train_held_out:
      logging.warning("math task: %d problems of %s are also in %s and are not trained on",
                      self.num_train_held_out, cfg.train_path, cfg.heldout_path)
    self._tokens: dict[str, tuple[int, ...]] = {}
    self.num_too_long: dict[str, int] = {}
    self._train = self._fitting("train", "train_path",
                                [p for p in train if p.question not in held_questions])
    self._heldout = self._fitting("heldout", "heldout_path" if cfg.heldout_path else "train_path",
                                  heldout)

  def _encode(self, question: str) -> tuple[int, ...]:
    text = format_prompt(question, self.cfg.template)
    if self.cfg.chat:
      return tuple(self.tokenizer.encode_chat(text, system=self.cfg.system or None))
    return tuple(self.tokenizer.encode(text))

  def _fitting(self, split: str, field: str, problems: list[MathProblem]) -> list[MathProblem]:
    """The problems whose prompt fits; `field` names the file they came from."""
    path = getattr(self.cfg, field)
    if not problems:
      raise ValueError(f"task.math.{field}: {path} gives no {split} problems" +
                       (" (every question is held out)" if split == "train" else ""))
    kept = []
    for p in problems:
      if p.question not in self._tokens:
        self._tokens[p.question] = self._encode(p.question)
      if len(self._tokens[p.question]) <= self.max_prompt_len:
        kept.append(p)
    self.num_too_long[split] = len(problems) - len(kept)
    if self.num_too_long[split]:
      logging.warning("math task: %d of %d %s problems have prompts longer than "
                      "generation.max_prompt_len=%d tokens and are skipped",
                      self.num_too_long[split], len(problems), split, self.max_prompt_len)
    if not kept:
      raise ValueError(f"task.math.{field}: none of the {len(problems)} {split} problems in "
                       f"{path} has a prompt of at most generation.max_prompt_len="
                       f"{self.max_prompt_len} tokens")
    return kept

  @staticmethod
  def reference(prompt: MathTaskPrompt) -> str:
    return prompt.answer

  def stream(self, state=None, *, worker_index: int = 0) -> MathPromptStream:
    """The training prompts of rollout worker `worker_index`, resumed from `state`."""
    seed = self.cfg.seed + _WORKER_SEED_STRIDE * worker_index
    if state:
      stream = MathStream.resume(self._train, state, template=self.cfg.template)
      if stream.seed != seed:
        raise ValueError(f"stream state seed {stream.seed} does not match task.math.seed + "
                         f"{_WORKER_SEED_STRIDE} * worker {worker_index} = {seed}")
    else:
      stream = MathStream(self._train, seed=seed, template=self.cfg.template)
    return MathPromptStream(stream, self._tokens)

  def heldout(self, n: int) -> list[MathTaskPrompt]:
    """The first `n` held-out problems in file order (all of them if there are fewer)."""
    return [MathTaskPrompt(f"heldout/{p.id}", self._tokens[p.question], p.answer)
            for p in self._heldout[:n]]


def check(cfg: ExperimentConfig) -> None:
  """The run's checks for `task.name="math"`."""
  if cfg.task.math.train_path is None:
    raise ValueError("task.math.train_path must name a JSONL file when task.name='math', "
                     "got None")
  if cfg.hf_model_dir is None and cfg.task.tokenizer_dir is None:
    raise ValueError("hf_model_dir must name the model (and tokenizer) directory when "
                     "task.name='math', got None")
  if cfg.sft.steps:
    raise ValueError(f"sft.steps must be 0 with task.name='math': the task has no reference "
                     f"solutions to warm-start on (a hf_model_dir checkpoint is the start), "
                     f"got {cfg.sft.steps}")


def make(cfg: TaskConfig) -> MathTask:
  """The math task; `cfg.tokenizer_dir` and `cfg.max_prompt_len` are set (the builder
  fills them in from `hf_model_dir` and `generation.max_prompt_len`)."""
  return MathTask(cfg.math, cfg.tokenizer_dir, max_prompt_len=cfg.max_prompt_len)
