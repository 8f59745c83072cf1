"""The code task: programs and their tests, splits and streams, and a training run whose
rewards run every completion in the sandbox."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from async_rl.cli import from_dict
from async_rl.config import CodeConfig
from async_rl.rewards import code_tests_reward, isolation
from async_rl.rl import build, entry
from async_rl.tasks.code_task import CodeTask, make_program
from rl_test_utils import small_config

TASK = CodeTask(CodeConfig(max_ops=3))


def test_expressions_mean_what_their_tests_say():
  rng = np.random.default_rng(0)
  seen_parens = False
  for _ in range(300):
    prompt, solution, tests = make_program(rng, TASK.cfg)
    expr = prompt.removeprefix("# print ").removesuffix("\n")
    assert solution == f"n=int(input())\nprint({expr})"
    seen_parens |= "(" in expr
    for case in tests:
      assert str(eval(expr, {"n": int(case["input"])})) == case["output"], (expr, case)
  assert seen_parens, "precedence needs parentheses somewhere in 300 draws"


def test_reference_programs_pass_their_tests_in_the_sandbox():
  if isolation().missing:
    pytest.skip(f"no full sandbox here: {isolation().missing}")
  tok = TASK.tokenizer
  for prompt in TASK.heldout(3):
    solution = tok.decode(prompt.target)
    assert code_tests_reward(solution, TASK.reference(prompt)) == 1.0
    assert code_tests_reward(solution.replace("print(", "print(1+"), TASK.reference(prompt)) < 1.0


def test_splits_are_disjoint_and_streams_resume():
  held = {p.tokens for p in TASK.heldout(200)}
  stream = TASK.stream()
  first = list(itertools.islice(stream, 300))
  assert not held & {p.tokens for p in first}
  again = list(itertools.islice(TASK.stream(json.loads(json.dumps(stream.state()))), 50))
  assert again == list(itertools.islice(TASK.stream(), 350))[300:]
  assert [p.id for p in itertools.islice(TASK.stream(worker_index=1), 3)] == [
      "train/1000/0", "train/1000/1", "train/1000/2"]
  with pytest.raises(ValueError, match="for worker 1"):
    TASK.stream(stream.state(), worker_index=1)


def test_code_config_is_checked():
  with pytest.raises(ValueError, match="model.vocab_size must hold the code task's 99"):
    build.check(from_dict({"task": {"name": "code"}, "model": {"vocab_size": 64}}))
  with pytest.raises(ValueError, match="code.max_ops"):
    from_dict({"task": {"code": {"min_ops": 3, "max_ops": 2}}})


def test_a_short_code_run_scores_every_sample_in_the_sandbox(tmp_path):
  if isolation().missing:
    pytest.skip(f"no full sandbox here: {isolation().missing}")
  cfg = small_config(**{"task.name": "code", "num_steps": 2, "model.vocab_size": 128,
                        "model.max_seq_len": 96, "generation.max_prompt_len": 32,
                        "generation.max_new_tokens": 48, "batching.max_tokens_per_mb": 96,
                        "sft.steps": 2, "sft.batch_size": 4, "eval.num_prompts": 2,
                        "task.code.max_ops": 1, "task.code.num_tests": 2})
  summary = entry.run(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert summary["end_version"] == 2
  lines = [json.loads(l) for l in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
  steps = [l for l in lines if "eval" not in l and "sft" not in l]
  rewards = steps[-1]["rewards"]
  # Every trained sample was scored by running its program: no call failed or timed out.
  assert rewards["calls"] >= 2 * cfg.batch_groups * cfg.generation.group_size
  assert rewards["errors"] == 0 and rewards["timeouts"] == 0
  assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps)
