"""The data agent (examples/agents/data_agent.py) on examples/trl_style's rows, with UTF-8
byte tokens and a micro model (seconds per step on a CPU).

  python -m launch.train --config=examples/agents/data_config.py --workdir=$(mktemp -d)

A short warm start on the calls (`call` column) leaves about a third of the held-out
calls wrong; RL on the reward the agent returns (its calculator's result against the
solution) then raises the held-out accuracy (`eval v=0` against the last `eval`),
which counts the held-out rows whose call gives the solution.
"""

from examples.trl_style import config as trl_style

DATA = "examples/agents/data_"


def get_config():
  c = trl_style.get_config()
  c.task.name = "agent"
  c.task.data.update(train_path=f"{DATA}train.jsonl", heldout_path=f"{DATA}heldout.jsonl",
                     completion_key="call")
  c.task.agent.update(episode="examples.agents.data_agent:episode", task="data")
  c.eval.update(correct_fn="examples.agents.data_agent:correct", num_prompts=20,
                every_steps=50)
  c.sft.steps = 100
  c.num_steps = 50
  c.batch_groups = 8
  c.optimizer.learning_rate = 1e-3
  c.checkpoint.every_steps = 50
  return c
