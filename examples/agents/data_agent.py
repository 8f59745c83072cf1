"""An agent on a TRL-style data set (a JSONL file with `prompt` and `solution` columns),
written for the `openai` client alone: it asks for a completion of the row's prompt and
scores the reply against the row's solution, as `examples/trl_style/rewards.py`'s
`correctness_reward` does.

  python -m launch.train --config=examples/agents/data_config.py --workdir=$(mktemp -d)
"""


async def episode(client, row) -> float:
  """`row` is the data task's row: `row.prompt` the prompt column, `row.answer` the
  answer column (`task.data.answer_key`, here the solution)."""
  out = await client.completions.create(model="policy", prompt=row.prompt, max_tokens=8)
  return float(out.choices[0].text.strip() == str(row.answer))
