"""The quick start with a calculator tool: the arithmetic task over several turns.

  python -m launch.train --config=configs/tiny_tool.py --workdir=/tmp/async_rl_tiny_tool

Everything is `configs/tiny.py` (model, warm-start and RL budget, rewards, staleness),
but `task_kind="arithmetic_tool"` (`tasks.tool_task`): the policy writes each call
(`7+2=`) and the answer line, a calculator writes each result, and every call is a
new turn that continues from the whole episode so far. The warm start trains on the
policy's part of the same worked solutions. `python -m benchmarks.tool_use` measures
held-out accuracy by chain length for both; the README records it.
"""

import importlib.util
import os


def get_config():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")
  spec = importlib.util.spec_from_file_location("tiny", path)
  tiny = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny)
  c = tiny.get_config()
  c.task_kind = "arithmetic_tool"
  return c
