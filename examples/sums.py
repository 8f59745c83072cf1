"""A user's own task: two-digit sums read from JSONL files, scored by a Python function.

Each line of a file is one example, `{"prompt": "12+47=", "answer": "59"}`. The run
names the factory below (`task.name="examples.sums:make_task"`) and passes the files
in `task.options`; nothing in the library is edited.
"""

from async_rl.tasks import CharTokenizer, Example, ListTask
from async_rl.tasks.data_task import load_rows


def exact_answer(completion: str, answer: str) -> float:
  """The reward: 1.0 if the completion is the answer, else 0.0."""
  return float(completion.strip() == answer)


def _examples(path: str, tokenizer: CharTokenizer) -> list[Example]:
  """The file's examples; a malformed line is an error naming the file and line."""
  examples = []
  for where, row in load_rows(path):  # (where, the line's JSON value)
    if not isinstance(row, dict) or not {"prompt", "answer"} <= row.keys():
      raise ValueError(f'{where}: needs "prompt" and "answer", got {row!r}')
    examples.append(Example(id=where.number, reference=row["answer"],
                            tokens=(tokenizer.bos_id, *tokenizer.encode(row["prompt"]))))
  return examples


def make_task(cfg) -> ListTask:
  """The task of a run (`cfg` is its task section): the files are
  `cfg.options["train"]` and `["heldout"]`."""
  tokenizer = CharTokenizer()  # digits, + - * = ( ) #, space and newline
  return ListTask(train=_examples(cfg.options["train"], tokenizer),
                  heldout_examples=_examples(cfg.options["heldout"], tokenizer),
                  tokenizer=tokenizer, reward_fn=exact_answer)
