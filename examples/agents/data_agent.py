"""An agent on a TRL-style data set (JSONL rows with `prompt` and `solution` columns),
written for the `openai` client alone, that answers with a calculator tool: it asks
the model to write the sum's call up to `=` (`47+23=` for "Add 47 and 23."), computes
it, and scores the result against the row's solution.

The rows are examples/trl_style's, with the call each needs as a third column, `call`,
which the warm start trains on (`task.data.completion_key`). The model only has to
copy the numbers into the call, which a micro model learns for numbers it never saw;
adding them is the tool's.

  python -m launch.train --config=examples/agents/data_config.py --workdir=$(mktemp -d)
"""

import re

CALL = re.compile(r"(\d+)\+(\d+)")


def calculate(call: str):
  """The value of a call `a+b` (the `=` left out), or None if it is not one."""
  match = CALL.fullmatch(call)
  return None if match is None else int(match[1]) + int(match[2])


async def episode(client, row) -> float:
  """`row` is the data task's row: `row.prompt` the prompt column, `row.answer` the
  answer column (`task.data.answer_key`, the solution)."""
  out = await client.completions.create(model="policy", prompt=row.prompt, stop=["="],
                                        max_tokens=8)
  choice = out.choices[0]
  value = calculate(choice.text) if choice.finish_reason == "stop" else None
  return float(value is not None and str(value) == row.answer)


def correct(completions, solution, **kwargs):
  """TRL-style: 1.0 for each transcript (the call the model wrote, with its `=`) whose
  value is the solution, else 0.0; held-out accuracy."""
  return [float(c.endswith("=") and str(calculate(c[:-1])) == s)
          for c, s in zip(completions, solution)]
