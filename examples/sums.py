"""A user's own task: two-digit sums read from JSONL files, scored by a Python function.

Each line of a file is one example, `{"prompt": "12+47=", "answer": "59"}`. The run
names the factory below (`task.name="examples.sums:make_task"`) and passes the files
in `task.options`; nothing in the library is edited.
"""

import json

from async_rl.tasks import CharTokenizer, Example, ListTask


def exact_answer(completion: str, answer: str) -> float:
  """The reward: 1.0 if the completion is the answer, else 0.0."""
  return float(completion.strip() == answer)


def _examples(path: str, tokenizer: CharTokenizer) -> list[Example]:
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return [Example(id=i, tokens=(tokenizer.bos_id, *tokenizer.encode(row["prompt"])),
                  reference=row["answer"]) for i, row in enumerate(rows)]


def make_task(cfg) -> ListTask:
  """The task of a run (`cfg` is its task section): the files are
  `cfg.options["train"]` and `["heldout"]`."""
  tokenizer = CharTokenizer()  # digits, + - * = ( ) #, space and newline
  return ListTask(train=_examples(cfg.options["train"], tokenizer),
                  heldout_examples=_examples(cfg.options["heldout"], tokenizer),
                  tokenizer=tokenizer, reward_fn=exact_answer)
