"""A user's own data as a task: prompts and references read from JSONL or Parquet files.

`task.name="data"` reads the files of `task.data` (`config.DataConfig`), one example
per row, in the formats TRL and verl read:

    {"prompt": "What is 2+2?", "solution": "4"}                                 text
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "solution": "4"}  conversational
    {"prompt": "What is 2+2?", "completion": " 4"}                              prompt-completion

and verl's Parquet files (`prompt` a conversation; `data_source`, `reward_model`
{"ground_truth"} and `extra_info` columns). The column names are options
(`prompt_key`, `answer_key`, `completion_key`); the rows of a `datasets.Dataset`, or
any other mappings, make a task through `from_rows`.

A text prompt is encoded as it is written, a conversation as its rendering in the
tokenizer's chat template up to where the assistant begins (as TRL encodes prompts:
no special tokens added). The reference a completion is checked against is the row
(`rewards.Row`), so that a reward function of each style of `rewards.adapters`
receives what it expects. The warm start trains on the completion column's text (or
the answer column's) followed by the tokenizer's EOS.

A malformed row is an error naming its file and line (JSONL) or row (Parquet). Rows
whose prompt is longer than `task.max_prompt_len` tokens are skipped, with a warning
that says how many: the generator cannot take them. The held-out set is
`heldout_path`'s rows, or a hashed `heldout_fraction` of the training file's prompts;
either way no held-out prompt is trained on.
"""

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Optional

from absl import logging

from async_rl.config import DataConfig, ExperimentConfig, TaskConfig
from async_rl.models.hf_tokenizer import HFTokenizer
from async_rl.rewards.adapters import Row
from async_rl.tasks.list_task import Example, ListTask
from async_rl.tasks.protocol import TextTokenizer, is_heldout
from async_rl.tasks.tokenizer import ByteTokenizer

JSONL_SUFFIXES, PARQUET_SUFFIXES = (".jsonl", ".json"), (".parquet",)


class Where(NamedTuple):
  """Where a row is: "train.jsonl, line 12" (JSONL) or "train.parquet, row 12"."""
  source: str
  unit: str
  number: int

  def __str__(self) -> str:
    return f"{self.source}, {self.unit} {self.number}"

  @property
  def id(self) -> str:
    """The row's example id, `train/12`."""
    return f"{os.path.splitext(os.path.basename(self.source))[0]}/{self.number}"


def records(rows: Iterable[Any], source: str) -> list[tuple[Where, Any]]:
  """Rows of any kind (the mappings of a `datasets.Dataset`, say) numbered from 1 as
  rows of `source`."""
  return [(Where(source, "row", i), row) for i, row in enumerate(rows, start=1)]


def load_rows(path: str) -> list[tuple[Where, Any]]:
  """Each row of a JSONL (one JSON value per line; blank lines are skipped) or Parquet
  file, in file order, with where it is.

  Raises:
    ValueError: naming the file (and line) for an unknown suffix, a file that does
      not read, or a line that is not JSON.
  """
  if path.endswith(PARQUET_SUFFIXES):
    try:
      import pyarrow  # The `data` extra, needed for Parquet only.
      import pyarrow.parquet as pq
    except ImportError as e:
      raise ValueError(f"{path}: reading Parquet needs pyarrow (the `data` extra)") from e
    try:
      table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError) as e:
      raise ValueError(f"{path}: not a Parquet file that reads: {e}") from None
    return records(table.to_pylist(), path)
  if not path.endswith(JSONL_SUFFIXES):
    raise ValueError(f"{path}: a data file must end in one of "
                     f"{JSONL_SUFFIXES + PARQUET_SUFFIXES}")
  rows = []
  with open(path, "rb") as f:  # Bytes, so that a line that is not UTF-8 is named exactly.
    for line_no, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}, line {line_no}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
      if not line.strip():
        continue
      try:
        rows.append((Where(path, "line", line_no), json.loads(line.rstrip("\r\n"))))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {line_no}: invalid JSON: {e.msg} at column "
                         f"{e.colno}") from None
  return rows


def _messages(value: list, column: str) -> list[dict]:
  if not value:
    raise ValueError(f"column {column!r} is an empty conversation")
  for i, message in enumerate(value):
    if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)):
      raise ValueError(f"column {column!r}: message {i} must be a mapping with string "
                       f"'role' and 'content', got {message!r}")
  return [dict(m) for m in value]


def _is_text(value) -> bool:
  return isinstance(value, (str, int, float)) and not isinstance(value, bool)


class _Encoder:
  """Rows to examples: checks each row's columns and encodes its prompt and target."""

  def __init__(self, cfg: DataConfig, tokenizer: TextTokenizer):
    self.cfg, self.tokenizer = cfg, tokenizer

  def prompt_key(self, row: Mapping) -> str:
    """The prompt as a string that identifies it (a conversation as sorted JSON)."""
    prompt = row[self.cfg.prompt_key]
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)

  def check(self, where: Where, row) -> Mapping:
    """`row`, checked: a mapping with the configured columns and a usable prompt and
    completion."""
    cfg = self.cfg
    if not isinstance(row, Mapping):
      raise ValueError(f"{where}: expected an object of columns, got {type(row).__name__}")
    for field in ("prompt_key", "answer_key", "completion_key"):
      column = getattr(cfg, field)
      if column is not None and column not in row:
        raise ValueError(f"{where}: no column {column!r} (task.data.{field}); the row has "
                         f"{sorted(row)}")
    try:
      prompt = row[cfg.prompt_key]
      if isinstance(prompt, list):
        _messages(prompt, cfg.prompt_key)
      elif not isinstance(prompt, str) or not prompt:
        raise ValueError(f"column {cfg.prompt_key!r} must be a non-empty string or a list "
                         f"of messages, got {prompt!r}")
      if cfg.completion_key is not None:
        completion = row[cfg.completion_key]
        if isinstance(completion, list):
          _messages(completion, cfg.completion_key)
        elif not _is_text(completion):
          raise ValueError(f"column {cfg.completion_key!r} must be text or a list of "
                           f"messages, got {type(completion).__name__}")
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    return row

  def example(self, where: Where, row: Mapping) -> Example:
    """The example of a checked row."""
    cfg, tok = self.cfg, self.tokenizer
    prompt = row[cfg.prompt_key]
    if isinstance(prompt, str):
      tokens = tok.encode(prompt)
    else:
      try:
        tokens = tok.encode(tok.render_chat(prompt, add_generation_prompt=True,
                                            **cfg.chat_template_kwargs))
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    target = None
    if cfg.completion_key is not None:
      completion = row[cfg.completion_key]
      target = ("".join(m["content"] for m in completion) if isinstance(completion, list)
                else str(completion))
    elif cfg.answer_key is not None and _is_text(row[cfg.answer_key]):
      target = str(row[cfg.answer_key])
    columns = {k: v for k, v in row.items() if k != cfg.prompt_key}
    answer = columns if cfg.answer_key is None else row[cfg.answer_key]
    return Example(id=where.id, tokens=tuple(tokens), reference=Row(prompt, answer, columns),
                   target=None if target is None else (*tok.encode(target), tok.eos_id))


def _fitting(examples: list[Example], max_prompt_len: Optional[int], split: str,
             source: str) -> list[Example]:
  if max_prompt_len is None:
    return examples
  kept = [e for e in examples if len(e.tokens) <= max_prompt_len]
  if len(kept) < len(examples):
    logging.warning("data task: %d of %d %s rows of %s have prompts longer than "
                    "task.max_prompt_len=%d tokens and are skipped (the generator takes "
                    "no longer prompt)", len(examples) - len(kept), len(examples), split,
                    source, max_prompt_len)
  return kept


def from_rows(train: Sequence[tuple[Where, Any]],
              heldout: Optional[Sequence[tuple[Where, Any]]], cfg: DataConfig,
              tokenizer: TextTokenizer, *, max_prompt_len: Optional[int] = None,
              reward_fn=None) -> ListTask:
  """The task of rows (`load_rows`, or `records` of a `datasets.Dataset`).

  Args:
    train: the training rows.
    heldout: the held-out rows; None holds out a hashed `cfg.heldout_fraction` of the
      training prompts.
    cfg: the column names and the rest of `task.data`.
    tokenizer: encodes the prompts and targets.
    max_prompt_len: longer prompts are skipped (None: none is).
    reward_fn: the task's own reward function; None: `rollout.reward_fn` names it.

  Raises:
    ValueError: a malformed row (naming where it is), or a split left empty.
  """
  enc = _Encoder(cfg, tokenizer)
  train = [(where, enc.check(where, row)) for where, row in train]
  train_source = train[0][0].source if train else "the training rows"
  hashed = heldout is None
  if hashed:
    heldout = [(w, r) for w, r in train if is_heldout(enc.prompt_key(r), cfg.heldout_fraction)]
    heldout_source = f"{train_source} (task.data.heldout_fraction={cfg.heldout_fraction})"
  else:
    heldout = [(where, enc.check(where, row)) for where, row in heldout]
    heldout_source = heldout[0][0].source if heldout else "the held-out rows"
  held = {enc.prompt_key(r) for _, r in heldout}
  kept = [(w, r) for w, r in train if enc.prompt_key(r) not in held]
  if not hashed and len(kept) < len(train):
    logging.warning("data task: %d rows of %s have a prompt of %s and are not trained on",
                    len(train) - len(kept), train_source, heldout_source)
  splits = {}
  for split, rows, source in (("train", kept, train_source),
                              ("held-out", heldout, heldout_source)):
    examples = [enc.example(where, row) for where, row in rows]
    splits[split] = _fitting(examples, max_prompt_len, split, source)
    if not splits[split]:
      why = (f"all {len(examples)} prompts are longer than task.max_prompt_len="
             f"{max_prompt_len} tokens" if examples else "there are no rows")
      raise ValueError(f"{source}: no {split} prompts ({why})")
  return ListTask(splits["train"], splits["held-out"], tokenizer, reward_fn, seed=cfg.seed)


def tokenizer_of(cfg: TaskConfig) -> TextTokenizer:
  """The tokenizer `task.data.tokenizer` names."""
  if cfg.data.tokenizer == "bytes":
    return ByteTokenizer()
  if cfg.tokenizer_dir is None:
    raise ValueError(_NO_TOKENIZER)
  return HFTokenizer(cfg.tokenizer_dir)


_NO_TRAIN_PATH = ("task.data.train_path must name a JSONL or Parquet file when "
                  "task.name='data', got None")
_NO_TOKENIZER = ("task.data.tokenizer='hf' needs a tokenizer directory: set hf_model_dir or "
                 "task.tokenizer_dir (or task.data.tokenizer='bytes')")


def make(cfg: TaskConfig) -> ListTask:
  """The data task of `cfg.data`; `cfg.tokenizer_dir` and `cfg.max_prompt_len` are set
  (the builder fills them in from `hf_model_dir` and `generation.max_prompt_len`)."""
  data = cfg.data
  if data.train_path is None:
    raise ValueError(_NO_TRAIN_PATH)
  return from_rows(load_rows(data.train_path),
                   None if data.heldout_path is None else load_rows(data.heldout_path),
                   data, tokenizer_of(cfg), max_prompt_len=cfg.max_prompt_len)


def check(cfg: ExperimentConfig) -> None:
  """The run's checks for `task.name="data"`."""
  data = cfg.task.data
  if data.train_path is None:
    raise ValueError(_NO_TRAIN_PATH)
  if data.tokenizer == "hf" and cfg.hf_model_dir is None and cfg.task.tokenizer_dir is None:
    raise ValueError(_NO_TOKENIZER)
  if cfg.sft.steps and data.answer_key is None and data.completion_key is None:
    raise ValueError(f"sft.steps={cfg.sft.steps} needs reference completions: set "
                     f"task.data.completion_key or task.data.answer_key to their column")
  if cfg.rollout.reward_fn is None:
    raise ValueError("rollout.reward_fn must name the reward function when "
                     "task.name='data' (a registered name such as 'math', or "
                     "'module:function'; several separated by commas), got None")
