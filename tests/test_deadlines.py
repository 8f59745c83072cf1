"""No unbounded wait: the deadlines alone, then whole runs whose generator never answers
(it stops, checkpointed, naming it), whose reward function hangs (killed per call; the
run goes on), or whose rollout callback raises (it stops with the traceback)."""

import json
import re
import threading
import time
from concurrent.futures import Future

import pytest

from async_rl.param_server import ParameterServer
from async_rl.rl.deadlines import Deadlines
from async_rl.rl.errors import RolloutWorkerError, StallError, StopRequested
from rl_test_utils import checkpoint_meta, run_parts, small_config


def _deadlines(lines):
  return Deadlines(warn_after_s=10.0, stall_timeout_s=100.0, echo=lines.append, tick_s=0.01)


def test_a_wait_is_reported_past_the_soft_deadline_then_at_each_doubling():
  lines = []
  d = _deadlines(lines)
  for s in (3.0, 9.0, 10.5, 15.0, 21.5, 30.0, 44.0):
    d.observe({"the generator": s})
  assert lines == ["WARNING: waiting 10 s for the generator",
                   "WARNING: waiting 22 s for the generator",
                   "WARNING: waiting 44 s for the generator"]
  assert d.longest_unreported_s == 10.5 and d.stalled is None
  d.observe({"the generator": 2.0})  # progress: a new wait under the same name
  d.observe({"the generator": 12.0})
  assert lines[-1] == "WARNING: waiting 12 s for the generator"
  d.observe({"rewards": 7.0})  # the generator's wait ended; so will this one, unreported
  d.observe({})
  assert d.longest_unreported_s == 12.0 and d.reports == 4


def test_past_the_hard_deadline_a_stall_is_recorded_naming_the_wait_and_the_others():
  d = _deadlines([])
  d.observe({"rollout worker 0 generator": 99.0, "rollout worker 0 rewards": 50.0})
  d.check()
  d.observe({"rollout worker 0 generator": 101.0, "rollout worker 0 rewards": 52.0})
  with pytest.raises(StallError, match=r"stalled: waited 101 s for rollout worker 0 generator "
                                       r"\(run.stall_timeout_s=100\); also waiting 52 s for "
                                       r"rollout worker 0 rewards"):
    d.check()


def test_the_calling_threads_waits_are_observed_and_only_some_may_stall():
  lines = []
  d = Deadlines(warn_after_s=0.5, stall_timeout_s=1.0, echo=lines.append, tick_s=0.01)
  with d.waiting("a training step", may_stall=False):
    time.sleep(1.1)
    d.observe()
  assert lines == ["WARNING: waiting 1 s for a training step"] and d.stalled is None
  with d.waiting("a batch") as progress:
    time.sleep(0.8)
    progress()  # the clock starts again
    time.sleep(0.2)
    d.observe()
    assert d.stalled is None
    time.sleep(1.0)
    d.observe()
  with pytest.raises(StallError, match="for a batch"):
    d.check()


def test_result_and_call_return_in_time_and_raise_past_the_hard_deadline():
  d = Deadlines(warn_after_s=0.05, stall_timeout_s=0.2, echo=lambda _: None, tick_s=0.01)
  done = Future()
  done.set_result(3)
  assert d.result(done, "x") == 3 and d.call(lambda: 4, "y") == 4
  with pytest.raises(ZeroDivisionError):
    d.call(lambda: 1 / 0, "z")
  started = time.monotonic()
  with pytest.raises(StallError, match=r"waited 0 s for the checkpoint"):
    d.call(threading.Event().wait, "the checkpoint")
  assert 0.2 <= time.monotonic() - started < 2.0


def test_result_ends_as_soon_as_the_stop_event_is_set_while_it_waits():
  d, stop = _deadlines([]), threading.Event()
  threading.Timer(0.2, stop.set).start()
  with pytest.raises(StopRequested, match="stopped while waiting for held-out generation"):
    d.result(Future(), "held-out generation", stop=stop)
  done = Future()
  done.set_result(3)
  assert d.result(done, "a result", stop=threading.Event()) == 3


def test_the_watchdog_records_a_probe_that_stalls():
  d = Deadlines(warn_after_s=0.05, stall_timeout_s=0.1, echo=lambda _: None, tick_s=0.01)

  def probe():
    raise StallError("stalled: the Ray call rollout worker 0.waits got no answer")

  with d.watching(probe):
    time.sleep(0.1)
  with pytest.raises(StallError, match="rollout worker 0.waits"):
    d.check()


# Whole runs, in process. Deadlines of seconds (the config's defaults are minutes), but
# long enough for the first compilations on a loaded CPU. The held-out set is one
# prompt, one sample: these runs check the deadlines, not the evaluation, and each
# held-out reward call of `hangs` costs its timeout.

_FAST = {"run.warn_after_s": 1.0, "run.stall_timeout_s": 45.0, "rollout.reward_timeout_s": 1.0,
         "rollout.reward_fn": "reward_fns_for_tests:length", "num_steps": 2,
         "eval.num_prompts": 1, "eval.pass_k": 1}
# The generator test waits the stall timeout out. Before the hang, the waits that may
# stall are the held-out generation's first compilation (about 3 s on 2 idle cores, with
# the held-out set above) and the rollout worker's first weight fetch: 15 s leaves them
# a 5x margin.
_STALL_S = 15.0


def _run(tmp_path, cfg, inject):
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  lines = []
  loop, worker = run_parts(cfg, tmp_path, server, echo=lines.append, progress=False)
  release = threading.Event()
  inject(worker, release)
  try:
    return loop.run([worker]), lines
  finally:
    release.set()
    server.close()
    worker.close()
    loop.close()


class _HangingEngine:
  """The engine, except that decoding never returns until `release` is set."""

  def __init__(self, engine, release):
    self._engine, self._release = engine, release

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def generate_chunk(self, *args, **kwargs):
    self._release.wait()


def _hang_generator(worker, release):
  # Only the rollout pool's: the held-out pool shares the engine.
  scheduler = worker.pool._scheduler
  scheduler.engine = _HangingEngine(scheduler.engine, release)


def test_a_generator_that_never_returns_stops_the_run_checkpointed_and_named(tmp_path):
  cfg = small_config(**{**_FAST, "run.stall_timeout_s": _STALL_S})
  started = time.monotonic()
  with pytest.raises(StallError) as stall:
    _run(tmp_path, cfg, _hang_generator)
  assert time.monotonic() - started < 180
  message = str(stall.value)
  assert f"for rollout worker 0 generator (run.stall_timeout_s={_STALL_S:g})" in message
  assert "checkpoint 0 holds the params; rerun the same command to resume" in message
  assert checkpoint_meta(tmp_path).version == 0


def test_a_reward_function_that_never_returns_is_killed_and_the_run_goes_on(tmp_path):
  cfg = small_config(**{**_FAST, "rollout.reward_fn": "reward_fns_for_tests:hangs"})
  summary, lines = _run(tmp_path, cfg, lambda worker, release: None)
  assert summary["end_version"] == 2
  steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [s for s in steps if "eval" not in s]
  assert steps[-1]["rewards"]["timeouts"] >= 2 * 2 * 2 and steps[-1]["reward_mean"] == 0.0
  # Each call runs 1 s before it is killed, past the 1 s soft deadline: reported.
  assert any(l.startswith("WARNING: waiting") and l.endswith("s for rollout worker 0 rewards")
             for l in lines)
  assert summary["longest_unreported_wait_s"] < 3.0


def test_a_failing_rollout_callback_stops_the_run_with_its_traceback(tmp_path):
  def broken_reference(worker, release):
    def reference(prompt):
      raise KeyError(f"no reference for {prompt.id}")
    worker.controller._reference = reference

  started = time.monotonic()
  with pytest.raises(RolloutWorkerError) as failure:
    _run(tmp_path, small_config(**_FAST), broken_reference)
  assert time.monotonic() - started < 180
  message = str(failure.value)
  assert re.search(r"KeyError: 'no reference for train/0/\d+'", message), message
  assert "Traceback" in message and "checkpoint 0 holds the params" in message
