"""A calculator-tool agent for the arithmetic task, written for the `openai` client and
nothing else of the library's but the task's own shaped reward.

The model writes each step's call up to `=` (`7+2=`); the agent computes it and writes
the result and a newline (`9\\n`); the model ends with the answer line (`#7`). This is
the transcript of `task.name="arithmetic_tool"`, here driven through the OpenAI
completions API, so that task's warm start and reward apply as they are.

  python -m launch.train --config=examples/agents/calculator_config.py --workdir=$(mktemp -d)
"""

import re

from async_rl.tasks.arithmetic import step_credit

CALL = re.compile(r"(\d+)([+\-*])(\d+)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


async def episode(client, row) -> float:
  """One episode on the arithmetic problem `row` (its `prompt`, `num_terms`, `solution`);
  returns the task's step credit of the transcript."""
  transcript = ""
  for _ in range(row.num_terms):  # a call per step, then the answer
    out = await client.completions.create(model="policy", prompt=row.prompt + transcript,
                                          stop=["="])
    choice = out.choices[0]
    transcript += choice.text
    call = CALL.fullmatch(transcript.rsplit("\n", 1)[-1])
    if choice.finish_reason != "stop" or call is None:
      break  # the answer line, or a turn cut by the budget
    a, op, b = call.groups()
    transcript += f"={OPS[op](int(a), int(b))}\n"
  return step_credit(transcript, row)
