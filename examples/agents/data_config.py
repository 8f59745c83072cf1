"""The data agent (examples/agents/data_agent.py) on examples/trl_style's rows, with UTF-8
byte tokens and a micro model (seconds per step on a CPU).

  python -m launch.train --config=examples/agents/data_config.py --workdir=$(mktemp -d)

The warm start and held-out accuracy are those of examples/trl_style/config.py; RL
trains on the reward the agent returns. A few steps do not teach it to add; the run
shows the pieces working together.
"""

from examples.trl_style import config as trl_style


def get_config():
  c = trl_style.get_config()
  c.task.name = "agent"
  c.task.agent.update(episode="examples.agents.data_agent:episode", task="data")
  return c
