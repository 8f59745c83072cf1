"""Reward functions as TRL and verl users write them: styles by signature or option,
what each receives of a data row, weighted sums, wrong return kinds as errors that
name the fix, the reward service's counters, and the evaluation's criterion of
correctness."""

import logging
import types
from concurrent.futures import Future

import jax
import pytest

from async_rl import models
from async_rl.cli import from_dict
from async_rl.config import EvalConfig
from async_rl.generation import Engine, GeneratorPool
from async_rl.rewards import Reward, RewardService, RewardTask, Row, style_of
from async_rl.rl import build
from async_rl.rl.errors import ConfigError
from async_rl.rl.evaluate import Evaluator
from async_rl.tasks import CharTokenizer, Example, ListTask
from conftest import one_layer_model
import reward_styles_for_tests as fns

S = "reward_styles_for_tests:"  # Top-level functions the workers import by name.
ROW = Row(prompt="Add 2 and 2.", answer="4", columns={"solution": "4", "level": 1})
CHAT = [{"role": "user", "content": "Add 2 and 2."}]
VERL_ROW = Row(prompt=CHAT, answer={"data_source": "bonus"}, columns={
    "data_source": "bonus", "reward_model": {"style": "rule", "ground_truth": "4"},
    "extra_info": {"index": 3}})


def test_auto_style_by_parameter_names():
  assert [style_of(f) for f in (fns.trl_correctness, fns.trl_seen, fns.trl_length,
                                fns.compute_score, fns.exact, len)] == [
      "trl", "trl", "trl", "verl", "single", "single"]
  assert [t.style for t in Reward(f"{S}trl_correctness, {S}compute_score,math").terms] == [
      "trl", "verl", "single"]
  assert Reward(S + "trl_correctness", style="single").terms[0].style == "single"


def test_single_style_gets_the_rows_answer_or_the_reference_itself():
  reward = Reward(S + "exact")
  assert reward(" 4 ", ROW) == 1.0 and reward("5", ROW) == 0.0 and reward("7", 7) == 1.0


def test_trl_style_gets_prompts_completions_and_columns_as_one_element_lists():
  seen = []

  def reward(prompts, completions, **columns):
    seen.append(dict(prompts=prompts, completions=completions, **columns))
    return [0.25]

  assert Reward(reward)("4", ROW) == 0.25
  assert seen[-1] == {"prompts": ["Add 2 and 2."], "completions": ["4"], "solution": ["4"],
                      "level": [1]}
  # A conversational prompt's completion is a conversation too, as TRL passes it.
  Reward(reward)("4", Row(prompt=CHAT, answer="4", columns={"solution": "4"}))
  assert seen[-1] == {"prompts": [CHAT], "completions": [[{"role": "assistant",
                                                            "content": "4"}]],
                      "solution": ["4"]}

  def no_prompts(completions, **columns):
    seen.append(dict(completions=completions, **columns))
    return [0.5]

  assert Reward(no_prompts)("4", "the reference") == 0.5  # a task without rows
  assert seen[-1] == {"completions": ["4"], "reference": ["the reference"]}


def test_the_issues_batched_reward_scores_through_the_builder():
  # `f(completions, solution, **kw) -> list[float]` named in rollout.reward_fn, as is.
  cfg = from_dict({"rollout": {"reward_fn": S + "trl_correctness"}})
  reward = build.reward_fn(cfg, types.SimpleNamespace(reward_fn=None))
  assert reward("4", ROW) == 1.0 and reward(" 5", ROW) == 0.0


def test_verl_style_reads_data_source_ground_truth_and_extra_info():
  reward = Reward(S + "compute_score")
  assert reward("4", VERL_ROW) == 11.0 and reward("5", VERL_ROW) == 10.0
  assert reward("4", ROW) == 1.0  # no reward_model column: the row's answer
  assert reward("4", "4") == 1.0  # not a row: the reference is the ground truth
  with pytest.raises(ValueError, match="returned a dict without 'score'"):
    Reward(lambda data_source, solution_str, ground_truth, extra_info: {"acc": 1})("4", ROW)


def test_several_functions_sum_with_their_weights():
  reward = Reward(f"{S}trl_correctness,{S}trl_length", weights=(2.0, 0.5))
  assert reward("4", ROW) == 2.0 + 0.5 and reward("44", ROW) == 1.0
  assert Reward([fns.exact, fns.trl_not_applicable])("4", ROW) == 1.0  # None adds nothing
  with pytest.raises(ValueError, match="every reward function .* returned None"):
    Reward(fns.trl_not_applicable)("4", ROW)
  with pytest.raises(ValueError, match="2 reward weights for the 1 reward functions of "
                                       "rollout.reward_fn"):
    Reward(fns.exact, weights=(1.0, 2.0), field="rollout.reward_fn")
  with pytest.raises(RuntimeError, match="reward fn reward_styles_for_tests:"
                                         "trl_returns_a_number: TypeError"):
    Reward([fns.exact, fns.trl_returns_a_number])("4", ROW)


def test_wrong_return_kinds_name_the_function_and_the_fix():
  with pytest.raises(TypeError, match=r"reward fn reward_styles_for_tests:single_returns_a_list "
                                      r"returned a list where a number is expected.*"
                                      r"rollout.reward_style='trl'"):
    Reward(S + "single_returns_a_list")("4", ROW)
  # The issue's function forced into the single style: a list, not a silent 0.
  with pytest.raises(TypeError, match="trl_correctness returned a list"):
    Reward(S + "trl_correctness", style="single")("4", ROW)
  with pytest.raises(TypeError, match="TRL's batched style .* got float 1.0.*"
                                      "rollout.reward_style='single'"):
    Reward(S + "trl_returns_a_number")("4", ROW)
  with pytest.raises(ValueError, match="returned 2 rewards for 1 completion"):
    Reward(lambda completions, **kw: [1.0, 1.0])("4", ROW)
  with pytest.raises(TypeError, match="must return a number, got str"):
    Reward(lambda completion, reference: "1")("4", ROW)


def test_the_service_runs_styles_by_value_and_counts_a_misstyled_reward(caplog):
  good, bad = Reward(S + "trl_correctness"), Reward(S + "trl_correctness", style="single")
  with RewardService(num_workers=1, timeout_s=20.0) as service:
    assert service.score_batch([RewardTask(good, "4", ROW), RewardTask(good, "5", ROW),
                                RewardTask(Reward(S + "compute_score"), "4", VERL_ROW)]
                               ) == [1.0, 0.0, 11.0]
    assert service.metrics()["errors"] == 0
    with caplog.at_level(logging.WARNING):
      assert service.submit(RewardTask(bad, "4", ROW)).result() == 0.0
    assert service.metrics()["errors"] == 1
  assert "trl_correctness returned a list" in caplog.text
  assert "rollout.reward_style='trl'" in caplog.text


@pytest.mark.parametrize("values, message", [
    ({"rollout": {"reward_fn": "reward_styles_for_tests:nothing"}},
     "rollout.reward_fn 'reward_styles_for_tests:nothing': cannot load"),
    ({"eval": {"correct_fn": "nowhere"}}, "eval.correct_fn must be one of"),
])
def test_reward_names_are_checked_before_the_run(values, message):
  task = ListTask([Example(0, (1, 3), "0")], [Example(1, (1, 4), "1")], CharTokenizer(),
                  "arithmetic")
  with pytest.raises(ConfigError, match=message):
    build.preflight(from_dict(values), task)


CFG = one_layer_model(16)


class _Rewards:
  """Scores in this process (the reward service's submit, without workers)."""

  def __init__(self):
    self.calls = 0

  def submit(self, task):
    self.calls += 1
    future = Future()
    future.set_result(task.fn(task.completion, task.reference))
    return future

  def metrics(self):
    return {"calls": float(self.calls), "errors": 0.0, "timeouts": 0.0}

  def close(self):
    pass


def test_accuracy_is_the_correct_fns_score_at_or_above_the_threshold():
  params = jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))
  engine = Engine(CFG, max_concurrent_decodes=4, max_prefill_length=8, max_target_length=24)
  tok = CharTokenizer()
  task = ListTask([Example(9, (1, 12), "9")], [Example(i, (1, 3 + i), str(i)) for i in range(4)],
                  tok, "arithmetic")
  # A reward on another scale: 10 points for a prompt of digit 2 or 3, else 4.
  scale = lambda completion, reference: 10.0 if reference in ("2", "3") else 4.0
  cfg = from_dict({"eval": {"correct_fn": "reward_styles_for_tests:exact"}})
  assert build.correct_fn(cfg, task).terms[0].fn is fns.exact
  for threshold, accuracy in ((1.0, 1.0), (5.0, 0.5), (10.5, 0.0)):
    evaluator = Evaluator(GeneratorPool(engine, params), _Rewards(), task,
                          EvalConfig(num_prompts=4, pass_k=2, correct_threshold=threshold),
                          reward_fn=Reward(scale), max_new_tokens=4)
    try:
      metrics = evaluator.evaluate()
    finally:
      evaluator.close()
    assert metrics["accuracy"] == accuracy and metrics["pass_at_2"] == accuracy
