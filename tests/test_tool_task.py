"""The calculator tool task: the environment, the policy's part of a transcript, its warm
start, a scripted perfect policy, and a short training run over several turns."""

import dataclasses
import itertools
import json
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from async_rl import sharding
from async_rl.config import ArithmeticConfig
from async_rl.rl import build, entry
from async_rl.tasks import Problem, TrainStream, verify
from async_rl.tasks.arithmetic import step_credit
from async_rl.tasks.arithmetic import SFT_SEED_OFFSET
from async_rl.tasks.tool_task import Calculator, ToolTask, policy_chars
from async_rl.trajectory import Group, Trajectory
from rl_test_utils import small_config

P = Problem(prompt="7+2-5+3=", answer="7", num_terms=4, solution="7+2=9\n9-5=4\n4+3=7\n#7")
TASK = ToolTask(ArithmeticConfig())
TOK = TASK.tokenizer
PROMPT = type("Prompt", (), {"tokens": (TOK.bos_id, *TOK.encode(P.prompt)), "problem": P})()


def _after_prompt(text):
  return np.array([*PROMPT.tokens, *TOK.encode(text)], np.int32)


def test_the_calculator_answers_the_call_on_the_last_line():
  calc = Calculator(TOK)
  assert TOK.decode(calc(PROMPT, _after_prompt("7+2="))) == "9\n"
  assert TOK.decode(calc(PROMPT, _after_prompt("7+2=9\n9-5="))) == "4\n"
  assert TOK.decode(calc(PROMPT, _after_prompt("7+2=9\n12*11="))) == "132\n"
  assert TOK.decode(calc(PROMPT, _after_prompt("3-5="))) == "-2\n"
  # The prompt's own `7+2-5+3=` is not a call, nor is anything malformed.
  for text in ("", "7+=", "7+2-5=", "#7=", "7+2=9\n"):
    assert calc(PROMPT, _after_prompt(text)) is None, text


def test_the_policy_writes_the_calls_and_the_answer_only():
  written = policy_chars(P.solution)
  assert "".join(c for c, w in zip(P.solution, written) if w) == "7+2=9-5=4+3=#7"
  assert "".join(c for c, w in zip(P.solution, written) if not w) == "9\n4\n7\n"
  assert policy_chars("#4") == [True, True]


def test_warm_start_targets_mask_the_tools_output():
  stream = TrainStream(dataclasses.replace(TASK.cfg, seed=TASK.cfg.seed + SFT_SEED_OFFSET))
  for prompt, example in zip(itertools.islice(stream, 20), TASK.sft_examples()):
    assert example.tokens_T.tolist() == [*prompt.tokens, *prompt.target]
    trained = example.loss_mask_T[example.prompt_len:]
    text = prompt.problem.solution
    assert trained.tolist() == policy_chars(text) + [True], "EOS is the policy's"
    assert (example.versions_T == -1).all()


def _perfect_policy(solution):
  """A generator that writes the policy's next part of `solution`: a call or the answer."""

  def generate(tokens, n=1, *, max_new_tokens=None, stop_ids=None, hold_slot=False, slot=None):
    assert slot is None, "these turns hold no slot"
    done = TOK.decode(tokens[len(PROMPT.tokens):])
    assert solution.startswith(done)
    rest = solution[len(done):]
    turn = TOK.encode(rest[:rest.index("=") + 1]) if "=" in rest else [*TOK.encode(rest), 2]
    assert len(turn) <= max_new_tokens and set(stop_ids) == {TOK.encode("=")[0], TOK.eos_id}
    future = Future()
    future.set_result([Trajectory.from_completion(
        np.array(tokens), np.array(turn), np.full(len(turn), -0.5), np.zeros(len(turn), int),
        "stop") for _ in range(n)])
    return future

  generate.max_new_tokens = 64  # the episode's budget (`tasks.workflow.Generate`)
  return generate


def test_a_perfect_policy_writes_the_reference_transcript():
  (episode,) = TASK.workflow.run(PROMPT, 1, _perfect_policy(P.solution))
  transcript = TOK.decode(episode.completion_C)
  assert transcript == P.solution and verify(transcript, P) == step_credit(transcript, P) == 1.0
  assert episode.finish_reason == "stop" and episode.metadata["turns"] == 4
  trained = episode.loss_mask_T[episode.prompt_len:]
  assert trained.tolist() == policy_chars(P.solution) + [True]
  # With fewer turns than steps the episode is cut off, and scores as unfinished.
  capped = dataclasses.replace(TASK.workflow, max_turns=2)
  (cut,) = capped.run(PROMPT, 1, _perfect_policy(P.solution))
  assert cut.finish_reason == "max_turns" and TOK.decode(cut.completion_C) == "7+2=9\n9-5="


def test_a_sample_per_turn_trains_the_same_tokens_with_the_episodes_advantage():
  right, = TASK.workflow.run(PROMPT, 1, _perfect_policy(P.solution))
  wrong, = TASK.workflow.run(PROMPT, 1, _perfect_policy("7+2=9\n9+5=14\n#14"))
  groups = [Group("g", (right.with_reward(1.0), wrong.with_reward(0.25)))]
  packed = {}
  for per_turn in (False, True):
    cfg = small_config(**{"task.name": "arithmetic_tool", "task.sample_per_turn": per_turn})
    packed[per_turn] = build.make_trainer(cfg, sharding.make_mesh(cfg.mesh)).pack(groups)
  episode, turns = packed[False], packed[True]
  assert turns.loss_mask.sum() == episode.loss_mask.sum() == right.loss_mask_T.sum() + \
      wrong.loss_mask_T.sum()
  assert turns.segment_ids.max(axis=-1).sum() == 4 + 3, "one sample per call and answer"
  for field in ("advantages", "behav_logp"):
    at = lambda b: np.sort(getattr(b, field)[b.loss_mask > 0])  # noqa: E731
    np.testing.assert_array_equal(at(turns), at(episode))
  low, high = np.unique(episode.advantages[episode.loss_mask > 0])
  assert low < 0 < high and np.isclose(low, -high), "each token has its episode's advantage"


def test_a_short_tool_run_trains_on_policy_tokens_within_the_bound(tmp_path):
  cfg = small_config(**{"task.name": "arithmetic_tool", "num_steps": 2, "sft.steps": 3,
                        "sft.batch_size": 4, "rollout.reward_fn": "arithmetic_steps",
                        "task.sample_per_turn": True,
                        "eval.num_prompts": 2, "generation.max_new_tokens": 40,
                        "batching.max_tokens_per_mb": 64})
  summary = entry.run(cfg, str(tmp_path), progress=False, echo=lambda _: None)
  assert summary["end_version"] == 2
  lines = [json.loads(l) for l in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
  steps = [l for l in lines if "eval" not in l and "sft" not in l]
  for s in steps:
    assert s["staleness_max"] <= cfg.staleness.max_staleness and s["skipped"] == 0
    assert 0 < s["trained_tokens"] <= s["rollout"]["generated_tokens"]
    assert s["rewards"]["errors"] == 0
