"""Synthetic verifiable tasks: a character tokenizer, arithmetic problems, splits."""

from async_rl.tasks.arithmetic import (MAX_PROMPT_TOKENS, MAX_SOLUTION_TOKENS, Problem,
                                       TaskConfig, extract_answer, make_problem, verify)
from async_rl.tasks.dataset import Prompt, TrainStream, heldout_set, is_heldout, length_stats
from async_rl.tasks.tokenizer import CharTokenizer
