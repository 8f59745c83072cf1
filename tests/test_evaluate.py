"""Held-out evaluation: what counts as correct, greedy accuracy and pass@k."""

import types

import jax
import pytest

from async_rl import models
from async_rl.generation import Engine, GeneratorPool
from async_rl.rl.evaluate import evaluate
from conftest import one_layer_model

CFG = one_layer_model(16)


@pytest.fixture(scope="module")
def pool():
  params = jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))
  engine = Engine(CFG, max_concurrent_decodes=4, max_prefill_length=8, max_target_length=24)
  pool = GeneratorPool(engine, params)
  yield pool
  pool.shutdown()


PROMPTS = [types.SimpleNamespace(tokens=(1, 3 + i), name=f"p{i}") for i in range(4)]


def _run(pool, score_of):
  return evaluate(pool, PROMPTS, max_new_tokens=6, stop_token_ids=(2,), pass_k=3,
                  decode=lambda tokens: ",".join(map(str, tokens)),
                  score=lambda pairs: [score_of(p, text) for p, text in pairs])


def test_only_a_full_reward_counts_as_correct(pool):
  # Partial credit from a shaped reward (step_credit) must not count as solved.
  metrics = _run(pool, lambda p, text: 0.99)
  assert metrics["accuracy"] == 0.0 and metrics["pass_at_3"] == 0.0
  metrics = _run(pool, lambda p, text: 1.0)
  assert metrics["accuracy"] == 1.0 and metrics["pass_at_3"] == 1.0


def test_accuracy_and_pass_at_k_are_fractions_of_prompts(pool):
  greedy = _run(pool, lambda p, text: 1.0)["completion_len"]
  assert 1 <= greedy <= 6
  solved = {"p0", "p2"}
  metrics = _run(pool, lambda p, text: float(p.name in solved))
  assert metrics["accuracy"] == 0.5 and metrics["pass_at_3"] == 0.5


def test_other_criteria_score_the_greedy_completions_and_pass_k_zero_samples_none(pool):
  scored = []

  def strict(pairs):
    scored.append(len(pairs))
    return [float(p.name == "p0") for p, _ in pairs]

  metrics = evaluate(pool, PROMPTS, max_new_tokens=6, stop_token_ids=(2,), pass_k=0,
                     decode=lambda tokens: ",".join(map(str, tokens)), score=strict,
                     also_scores={"lenient": lambda pairs: [1.0 for _ in pairs],
                                  "none": lambda pairs: [0.5 for _ in pairs]})
  assert metrics == {"accuracy": 0.25, "accuracy_lenient": 1.0, "accuracy_none": 0.0,
                     "completion_len": metrics["completion_len"]}
  assert scored == [len(PROMPTS)], "with pass_k=0 only the greedy completions are scored"
