"""Tasks: what a run trains on (`protocol.Task`), chosen by name in `registry.TASKS` or
"module:attr". Built in: arithmetic (single-turn, and with a calculator tool over
several turns), code (programs run in the sandbox), math (GSM8K/MATH files) and data
(a user's own JSONL or Parquet rows, `data_task`); `ListTask` holds a user's own
examples. Workflows (`workflow`) turn a prompt group
into trajectories."""

from async_rl.tasks.arithmetic import (MAX_PROMPT_TOKENS, MAX_SOLUTION_TOKENS, Problem, Prompt,
                                       TrainStream, extract_answer, heldout_set, length_stats,
                                       make_problem, verify)
from async_rl.tasks.list_task import Example, ListTask
from async_rl.tasks.protocol import Task, TextTokenizer, Tokenizer, is_heldout, supervised
from async_rl.tasks.tokenizer import ByteTokenizer, CharTokenizer
from async_rl.tasks.workflow import MultiTurn, SingleTurn, Workflow
