"""Workflows: multi-turn episodes (hand-scripted and on a real pool), per-turn samples,
the runner that validates what a workflow returns, and the methods a run calls."""

import functools
import threading
import types
from concurrent.futures import Future

import jax
import numpy as np
import pytest

from async_rl import models, policy
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.rl.episodes import EpisodeRunner
from async_rl.rl import build
from async_rl.rl.errors import ConfigError
from async_rl.tasks.registry import make_task
from async_rl.tasks.workflow import MultiTurn, SingleTurn, Workflow
from async_rl.trajectory import Trajectory, split_turns
from conftest import one_layer_model, wait_until
from rl_test_utils import small_config

CALL, EOS = 9, 2  # A turn ending in CALL is answered by the environment; EOS ends it.
PROMPT = types.SimpleNamespace(id="p", tokens=(1, 5))


class Scripted:
  """A generator that answers (context, sample index) from a script; records calls."""

  def __init__(self, script):
    self.script, self.calls = script, []

  def __call__(self, tokens, n=1, *, max_new_tokens=None, stop_ids=None, hold_slot=False,
               slot=None):
    assert slot is None, "a script's turns hold no slot"
    self.calls.append((tuple(tokens), n, max_new_tokens,
                       None if stop_ids is None else tuple(stop_ids)))
    version = len(self.calls) - 1
    out = []
    for i in range(n):
      completion, finish = self.script[(tuple(tokens), i)]
      out.append(Trajectory.from_completion(
          np.array(tokens), np.array(completion), -0.1 * np.array(completion, np.float32),
          np.full(len(completion), version), finish))
    future = Future()
    future.set_result(out)
    return future


def _env(replies):
  calls = []

  def respond(prompt, tokens_T):
    assert prompt is PROMPT
    calls.append(tuple(tokens_T))
    return replies[tuple(tokens_T)]

  return respond, calls


def _workflow(respond, max_turns=4, max_tokens=20):
  return MultiTurn(respond, max_turns=max_turns, max_tokens=max_tokens, turn_stop_ids=(CALL,),
                   stop_ids=(EOS,))


def test_policy_and_environment_turns_alternate_in_one_trajectory():
  gen = Scripted({((1, 5), 0): ([3, CALL], "stop"), ((1, 5), 1): ([6, CALL], "stop"),
                  ((1, 5, 3, CALL, 7, 8), 0): ([4, EOS], "stop")})
  respond, env_calls = _env({(1, 5, 3, CALL): [7, 8], (1, 5, 6, CALL): None})
  a, b = _workflow(respond).run(PROMPT, 2, gen)

  assert a.tokens_T.tolist() == [1, 5, 3, CALL, 7, 8, 4, EOS] and a.prompt_len == 2
  assert a.loss_mask_T.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
  assert a.versions_T.tolist() == [-1, -1, 0, 0, -1, -1, 1, 1]
  np.testing.assert_allclose(a.logp_T, [0, 0, -0.3, -0.9, 0, 0, -0.4, -0.2], rtol=1e-6)
  assert a.finish_reason == "stop" and a.metadata["turns"] == 2 and a.num_policy_tokens == 4
  # The environment ended b's episode after its first call.
  assert b.tokens_T.tolist() == [1, 5, 6, CALL] and b.finish_reason == "stop"
  assert env_calls == [(1, 5, 3, CALL), (1, 5, 6, CALL)]
  # Turn 1 is one request of both samples; turn 2 continues from the whole episode,
  # with what is left of the budget (20 - 4 tokens).
  assert gen.calls == [((1, 5), 2, 20, (CALL, EOS)), ((1, 5, 3, CALL, 7, 8), 1, 16, (CALL, EOS))]


def test_the_budget_and_the_turn_limit_end_episodes():
  gen = Scripted({((1, 5), 0): ([3, CALL], "stop"), ((1, 5), 1): ([6, 6, 6], "length")})
  respond, _ = _env({(1, 5, 3, CALL): [7, 8, 8, 8]})
  cut, long = _workflow(respond, max_tokens=5).run(PROMPT, 2, gen)
  assert cut.tokens_T.tolist() == [1, 5, 3, CALL, 7, 8, 8], "the reply is cut to the budget"
  assert cut.finish_reason == "length" and cut.loss_mask_T.sum() == 2
  assert long.finish_reason == "length" and long.tokens_T.tolist() == [1, 5, 6, 6, 6]

  gen = Scripted({((1, 5), 0): ([3, CALL], "stop")})
  (capped,) = _workflow(lambda *_: pytest.fail("no turn is left to answer"),
                        max_turns=1).run(PROMPT, 1, gen)
  assert capped.finish_reason == "max_turns" and capped.tokens_T.tolist() == [1, 5, 3, CALL]

  gen = Scripted({((1, 5), 0): ([3], "aborted")})
  (aborted,) = _workflow(lambda *_: None).run(PROMPT, 1, gen)
  assert aborted.finish_reason == "aborted"


def test_split_turns_makes_one_sample_per_policy_turn():
  traj = Trajectory(tokens_T=np.array([1, 5, 3, CALL, 7, 8, 4, EOS, 6]),
                    loss_mask_T=np.array([0, 0, 1, 0, 0, 0, 1, 1, 0], bool),
                    logp_T=np.array([0, 0, -.3, -.9, 0, 0, -.4, -.2, 0], np.float32),
                    versions_T=np.array([-1, -1, 0, 0, -1, -1, 1, 1, -1]), prompt_len=2,
                    finish_reason="length", reward=0.5, metadata={"turns": 2})
  first, second = split_turns(traj)
  assert first.tokens_T.tolist() == [1, 5, 3, CALL] and first.prompt_len == 2
  assert first.loss_mask_T.tolist() == [0, 0, 1, 0], "a token masked out stays masked out"
  assert first.finish_reason == "stop" and first.reward == 0.5 and first.metadata["turn"] == 0
  assert second.tokens_T.tolist() == traj.tokens_T[:8].tolist() and second.prompt_len == 6
  assert second.versions_T.tolist() == [-1] * 6 + [1, 1], "earlier turns are its prompt"
  assert second.logp_T.tolist()[:6] == [0] * 6 and second.finish_reason == "length"
  assert sum(s.loss_mask_T.sum() for s in (first, second)) == traj.loss_mask_T.sum()
  single = Trajectory.from_completion(np.array([1, 5]), np.array([3, 4]), np.zeros(2),
                                      np.zeros(2, np.int32), "stop", reward=1.0)
  (same,) = split_turns(single)
  assert same.tokens_T.tolist() == single.tokens_T.tolist() and same.prompt_len == 2


CFG = one_layer_model(16)
T = 32
_logp_and_entropy = jax.jit(policy.logp_and_entropy, static_argnums=1,
                            static_argnames="temperature")


@pytest.fixture(scope="module")
def params():
  init = jax.jit(models.init_params, static_argnums=0)
  return init(CFG, jax.random.key(0)), init(CFG, jax.random.key(1))


@functools.cache
def _engine(slots):
  """Shared by the tests below, so that each compiles once."""
  return Engine(CFG, max_concurrent_decodes=slots, max_prefill_length=T - 1, max_target_length=T)


def _recompute_logp(p, traj):
  tokens_T = np.zeros(T, np.int32)
  tokens_T[:len(traj)] = traj.tokens_T
  segments_T = (np.arange(T) < len(traj)).astype(np.int32)
  logp_1T, _ = _logp_and_entropy(p, CFG, tokens_T[None], np.arange(T)[None], segments_T[None],
                                 temperature=1.0)
  return np.asarray(logp_1T)[0, :len(traj)]  # [t]: token t given the tokens before it


@pytest.mark.parametrize("mode", ["retract", "keep", "drain"])
def test_episodes_on_a_pool_keep_exact_versions_across_a_weight_update(params, mode):
  old, new = params
  engine = _engine(4)
  updated = threading.Event()
  with GeneratorPool(engine, old) as pool:

    def respond(prompt, tokens_T):
      if not updated.is_set():  # Between turns 1 and 2 of the group's episodes.
        updated.set()
        pool.update_weights(new, 1, mode).result()
      return [12, 13]

    workflow = MultiTurn(respond, max_turns=4, max_tokens=24, turn_stop_ids=tuple(range(3, 9)),
                         stop_ids=(EOS,))
    runner = EpisodeRunner(pool, workflow, vocab_size=CFG.vocab_size)
    request = Request("g", [1, 9, 10], n=3, sampling=SamplingParams(temperature=1.0, seed=7))
    episodes = runner.submit(types.SimpleNamespace(tokens=(1, 9, 10)), request).result()
    runner.close()
    metrics = pool.metrics()
  assert any(e.metadata["turns"] > 1 for e in episodes), "the test needs a second turn"
  # Each episode held its slot; its turn 2 was re-prefilled there under the new params
  # (its cache was computed by the old ones), later turns continued on the cache.
  assert metrics["evictions"] == 0
  assert metrics["extended_reprefilled"] == sum(e.metadata["turns"] > 1 for e in episodes)
  assert metrics["extended_in_slot"] == sum(max(e.metadata["turns"] - 2, 0) for e in episodes)
  for e in episodes:
    policy_T = e.versions_T >= 0
    np.testing.assert_array_equal(e.loss_mask_T, policy_T)
    assert (e.logp_T[~policy_T] == 0).all()
    env_T = np.zeros(len(e), bool)
    env_T[e.prompt_len:] = ~policy_T[e.prompt_len:]
    assert np.isin(e.tokens_T[env_T], [12, 13]).all()
    # Turn 1 ran on the old params, every later turn on the new ones; each token's
    # behaviour log-prob is its log-prob under its version, given the whole episode.
    first_end = e.prompt_len + np.argmin(policy_T[e.prompt_len:]) if env_T.any() else len(e)
    assert (e.versions_T[e.prompt_len:first_end] == 0).all()
    assert (e.versions_T[first_end:][policy_T[first_end:]] == 1).all()
    for version, p in ((0, old), (1, new)):
      at = e.versions_T == version
      np.testing.assert_allclose(e.logp_T[at], _recompute_logp(p, e)[at], atol=1e-4)


def _run_groups(params, *, hold_slots, slots, groups=2, n=2, await_eviction=False):
  """Runs `groups` seeded groups of `n` episodes. With `await_eviction`, the first
  environment step waits (up to 30 s) for the pool to evict a held slot, so that queued
  samples meet held slots however the threads are scheduled."""
  with GeneratorPool(_engine(slots), params) as pool:
    waited = threading.Event()

    def respond(prompt, tokens_T):
      if await_eviction and not waited.is_set():
        waited.set()
        wait_until(lambda: pool.metrics()["evictions"])
      return [12, 13]

    workflow = MultiTurn(respond, max_turns=4, max_tokens=24, turn_stop_ids=tuple(range(3, 9)),
                         stop_ids=(EOS,), hold_slots=hold_slots)
    runner = EpisodeRunner(pool, workflow)
    futures = [runner.submit(types.SimpleNamespace(tokens=(1, 9, 10)), Request(
        g, [1, 9, 10], n=n, sampling=SamplingParams(temperature=1.0, seed=g)))
        for g in range(groups)]
    episodes = [e for f in futures for e in f.result(timeout=120)]
    runner.close()
    # Episodes release their slots as they end.
    wait_until(lambda: not pool.metrics()["held_slots"])
    return episodes, pool.metrics()


@pytest.mark.parametrize("slots", [4, 2])  # Room for all 4 episodes; fewer slots than held.
def test_an_episode_continued_in_its_slot_is_the_re_prefilled_episode(params, slots):
  # With fewer slots than episodes, the second group's samples queue behind the first
  # group's held slots, which are evicted for them.
  held, held_metrics = _run_groups(params[0], hold_slots=True, slots=slots,
                                   await_eviction=slots < 4)
  again, again_metrics = _run_groups(params[0], hold_slots=False, slots=slots)
  later_turns = sum(e.metadata["turns"] - 1 for e in held)
  assert later_turns >= 4, "the test needs later turns"
  for a, b in zip(held, again):
    assert a.tokens_T.tolist() == b.tokens_T.tolist()
    np.testing.assert_array_equal(a.versions_T, b.versions_T)
    np.testing.assert_array_equal(a.loss_mask_T, b.loss_mask_T)
    assert (a.finish_reason, a.metadata) == (b.finish_reason, b.metadata)
    np.testing.assert_allclose(a.logp_T, b.logp_T, atol=1e-5)
    policy_T = a.versions_T >= 0
    np.testing.assert_allclose(a.logp_T[policy_T], _recompute_logp(params[0], a)[policy_T],
                               atol=1e-4)
  assert held_metrics["held_slots"] == 0 and held_metrics["extended_reprefilled"] == 0
  assert again_metrics["extended_in_slot"] == again_metrics["evictions"] == 0
  if slots == 4:
    assert held_metrics["extended_in_slot"] == later_turns and held_metrics["evictions"] == 0
  else:
    # Evicted episodes were re-submitted whole (by the runner) and drew the same tokens.
    assert held_metrics["evictions"] > 0
    assert held_metrics["extended_in_slot"] < later_turns


def test_a_seeded_group_repeats_exactly(params):
  engine = _engine(4)
  workflow = MultiTurn(lambda prompt, tokens_T: [12, 13], max_turns=4, max_tokens=24,
                       turn_stop_ids=tuple(range(3, 9)), stop_ids=(EOS,))
  prompt = types.SimpleNamespace(tokens=(1, 9, 10))
  with GeneratorPool(engine, params[0]) as pool:
    runner = EpisodeRunner(pool, workflow)
    runs = [runner.submit(prompt, Request(name, [1, 9, 10], n=3, sampling=SamplingParams(
        temperature=1.0, seed=seed))).result() for name, seed in (("a", 7), ("b", 7), ("c", 8))]
    runner.close()
  a, b, c = [[e.tokens_T.tolist() for e in run] for run in runs]
  assert a == b, "later turns' seeds derive from the group's"
  assert a != c and len({tuple(e) for e in a}) == 3, "and differ between samples and seeds"


class _Returns(Workflow):
  def __init__(self, trajectories):
    self.trajectories = trajectories

  def run(self, prompt, n, generate):
    return self.trajectories


def test_the_runner_validates_what_a_workflow_returns():
  pool = types.SimpleNamespace(submit=None)
  bad = Trajectory.from_completion(np.array([1]), np.array([99]), np.zeros(1),
                                   np.zeros(1, np.int32), "stop")
  request = Request("r", [1], n=1)
  for returned, message in (([bad], r"tokens_T must lie in \[0, 16\)"),
                            ([], "returned no trajectories")):
    runner = EpisodeRunner(pool, _Returns(returned), vocab_size=16)
    with pytest.raises(ValueError, match=message):
      runner.submit(PROMPT, request).result()
    runner.close()


def test_closing_the_runner_frees_workflows_waiting_on_a_pool_that_never_answers():
  # A stalled generator: its futures never complete. A workflow thread waiting on one
  # would otherwise outlive the run and keep the process from exiting.
  pool = types.SimpleNamespace(submit=lambda request: Future())
  runner = EpisodeRunner(pool)
  episode = runner.submit(PROMPT, Request("r", [1, 5], n=2))
  runner.close()
  with pytest.raises(RuntimeError, match="episode runner was closed"):
    episode.result(timeout=10)
  answered = Future()
  runner = EpisodeRunner(types.SimpleNamespace(submit=lambda request: answered))
  episode = runner.submit(PROMPT, Request("r", [1, 5], n=1))
  sample = Trajectory.from_completion(np.array([1, 5]), np.array([3]), np.zeros(1),
                                      np.zeros(1, np.int32), "stop")
  answered.set_result([sample])
  assert episode.result(timeout=10)[0].completion_C.tolist() == [3]
  runner.close()


def test_single_turn_is_one_request_of_the_group():
  gen = Scripted({((1, 5), 0): ([3, EOS], "stop"), ((1, 5), 1): ([4, EOS], "stop")})
  out = SingleTurn().run(PROMPT, 2, gen)
  assert [t.completion_C.tolist() for t in out] == [[3, EOS], [4, EOS]]
  assert gen.calls == [((1, 5), 2, None, None)]


class _Counting(_Returns):
  def metrics(self):
    return {"episodes": len(self.trajectories)}


class _RunOnly:
  def run(self, prompt, n, generate):
    return []


def test_a_workflow_s_optional_methods_are_declared_and_one_without_them_is_refused_first():
  pool = types.SimpleNamespace(submit=None)
  assert SingleTurn().metrics() == {} and SingleTurn().close() is None
  for workflow, metrics in ((_Returns([]), {}), (_Counting([1, 2]), {"episodes": 2})):
    runner = EpisodeRunner(pool, workflow)
    assert runner.metrics() == metrics
    runner.close()
  cfg = build.resolve(small_config())
  task = make_task(cfg.task)
  task.workflow = _RunOnly()
  with pytest.raises(ConfigError, match=r"workflow must have run, metrics and close .*"
                     r"_RunOnly has no metrics, close"):
    build.preflight(cfg, task)
  task.workflow = _Counting([])
  assert build.preflight(cfg, task) is task
