"""The calculator agent (examples/agents/calculator.py) trained on the arithmetic task's
problems, on a CPU: the quick start's tool variant with the environment in the agent.

  python -m launch.train --config=examples/agents/calculator_config.py --workdir=$(mktemp -d)

A short warm start on the policy's part of the worked solutions (the tool task's), then
RL on the reward the agent returns; held-out accuracy counts the transcripts that are
exact worked solutions.
"""

from configs import tiny


def get_config():
  c = tiny.get_config("tool")
  c.task.name = "agent"
  c.task.agent.update(episode="examples.agents.calculator:episode", task="arithmetic_tool",
                      add_bos=True, deadline_s=600.0)
  c.sft.steps = 50
  c.num_steps = 40
  c.batch_groups = 8
  c.staleness.max_concurrent = 24
  c.eval.update(num_prompts=100, every_steps=20)
  c.checkpoint.every_steps = 20
  return c
