"""The calculator agent (examples/agents/calculator.py) trained on the arithmetic task's
problems, on a CPU: the quick start's tool variant with the environment in the agent.

  python -m launch.train --config=examples/agents/calculator_config.py --workdir=$(mktemp -d)

Problems of two to four operands. A short warm start on the policy's part of the
worked solutions (the tool task's) leaves about half the held-out problems wrong; RL
on the reward the agent returns (the task's step credit) then raises the training
reward and the held-out accuracy, which counts the transcripts that are exact worked
solutions (`eval v=0` against the last `eval`). A larger learning rate or fewer
groups per step than here (3e-4 and 8 groups) make the updates noisy enough to
unlearn the warm start, with or without the agent.
"""

from configs import tiny


def get_config():
  c = tiny.get_config("tool")
  c.task.name = "agent"
  c.task.agent.update(episode="examples.agents.calculator:episode", task="arithmetic_tool",
                      add_bos=True, deadline_s=600.0)
  c.task.arithmetic.max_terms = 4
  c.sft.steps = 30
  c.num_steps = 60
  c.batch_groups = 16
  c.optimizer.learning_rate = 2e-4
  c.staleness.max_concurrent = 24
  c.eval.update(num_prompts=100, every_steps=30)
  c.checkpoint.every_steps = 60
  return c
