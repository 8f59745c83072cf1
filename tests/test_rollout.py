"""RolloutController with fake collaborators: grouping, filtering, failures, weight sync,
seeds, waits."""

import dataclasses
import threading
import time
from concurrent.futures import CancelledError, Future

import numpy as np
import pytest

from async_rl.generation import SamplingParams
from async_rl.rl.errors import VersionError
from async_rl.rl.rollout import PromptSource, sample_seed
from async_rl.rl.rollout import RolloutController
from async_rl.trajectory import Trajectory
from conftest import wait_until


class FakeServer:
  def __init__(self, groups_allowed):
    self.allowed, self.offered, self.rejected = groups_allowed, [], []
    self.version_published, self.params = 0, "p0"
    self.acquire_versions, self.positions = [], []
    self.lock = threading.Lock()
    self.tickets = 0

  def acquire(self, timeout, generator_version, *, worker, position, next_position):
    with self.lock:
      self.acquire_versions.append(generator_version)
      if self.allowed:
        self.allowed -= 1
        self.tickets += 1
        self.positions.append((worker, position, next_position))
        return self.tickets
    time.sleep(0.01)
    return None

  def fetch(self, have):
    return (self.version_published, self.params) if self.version_published > have else None

  def offer(self, ticket, group):
    self.offered.append((ticket, group))
    return True

  def reject(self, ticket):
    self.rejected.append(ticket)

  def finished(self):
    return len(self.offered) + len(self.rejected)


class FakePool:
  def __init__(self, rewards_by_prompt, abort=(), hang=()):
    self.version, self.updates, self.requests = 0, [], []
    self.rewards_by_prompt, self.abort, self.hang = rewards_by_prompt, abort, hang
    self.steps = 0

  @property
  def requested_version(self):  # its updates apply at once
    return self.version

  def update_weights(self, params, version, mode):
    self.updates.append((params, version, mode))
    self.version = version
    future = Future()
    future.set_result({})
    return future

  def submit(self, request):
    self.requests.append(request)
    samples = [Trajectory.from_completion(
        np.array(request.prompt, np.int32), np.array([3, 4, 2], np.int32),
        np.full(3, -1.0, np.float32), np.zeros(3, np.int32),
        "aborted" if request.request_id in self.abort else "stop") for _ in range(request.n)]
    future = Future()
    if request.request_id not in self.hang:
      future.set_result(samples)
    return future

  def metrics(self):
    return {"decode_steps": self.steps}


class FakeRewards:
  """Scores by prompt id (the reference) and sample order."""

  def __init__(self, rewards_by_prompt):
    self.rewards_by_prompt, self.calls = rewards_by_prompt, {}

  def submit(self, task):
    k = self.calls.get(task.reference, 0)
    self.calls[task.reference] = k + 1
    future = Future()
    future.set_result(self.rewards_by_prompt[task.reference][k])
    return future

  error_window = 64

  def metrics(self):
    return {"calls": sum(self.calls.values())}

  def recent_failures(self):
    return 0, min(sum(self.calls.values()), self.error_window), None


class Prompt:
  def __init__(self, i):
    self.id, self.tokens = f"p{i}", (1, 5 + i)


class Stream:
  """Prompts p<start>, p<start + 1>, ...; its state is the next index."""

  def __init__(self, state):
    self.index = 0 if state is None else state["index"]

  def __next__(self):
    self.index += 1
    return Prompt(self.index - 1)

  def state(self):
    return {"index": self.index}


def _controller(server, pool, rewards_by_prompt, *, reference=lambda p: p.id, **kwargs):
  return RolloutController(
      server=server, pool=pool, rewards=FakeRewards(rewards_by_prompt),
      prompts=PromptSource(Stream), reference=reference, decode=lambda t: "x",
      reward_fn="f", sampling=SamplingParams(), group_size=2, update_mode="keep",
      worker=3, seed=7, **kwargs)


def _run(rewards_by_prompt, *, dynamic_filter, abort=(), n_prompts=3):
  server = FakeServer(n_prompts)
  pool = FakePool(rewards_by_prompt, abort)
  controller = _controller(server, pool, rewards_by_prompt,
                           dynamic_filter=dynamic_filter).start()
  wait_until(lambda: server.finished() >= n_prompts)
  controller.stop()
  assert controller.error is None
  return server, pool, controller


def test_groups_are_scored_in_sample_order_and_offered():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 0.0], "p2": [1.0, 1.0]}
  server, _, controller = _run(rewards, dynamic_filter=False)
  assert sorted(g.prompt_id for _, g in server.offered) == ["p0", "p1", "p2"]
  for ticket, g in server.offered:
    assert g.prompt_id == f"p{ticket - 1}"  # each group is finished with its own ticket
    assert [t.reward for t in g.trajectories] == rewards[g.prompt_id]
    assert list(g.trajectories[0].completion_C) == [3, 4, 2]
  assert controller.metrics()["offered"] == 3 and server.rejected == []


def test_dynamic_filter_rejects_groups_with_equal_rewards_and_counts_them():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 0.0], "p2": [1.0, 1.0]}
  server, _, controller = _run(rewards, dynamic_filter=True)
  assert [g.prompt_id for _, g in server.offered] == ["p0"]
  assert sorted(server.rejected) == [2, 3] and controller.metrics()["filtered"] == 2


def test_aborted_generation_releases_the_groups_capacity():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 1.0], "p2": [1.0, 0.0]}
  server, _, controller = _run(rewards, dynamic_filter=False, abort=("p1",))
  assert sorted(g.prompt_id for _, g in server.offered) == ["p0", "p2"]
  assert server.rejected == [2] and controller.metrics()["failed"] == 1


def test_new_weights_reach_the_pool_before_the_next_acquire():
  server = FakeServer(0)
  server.version_published, server.params = 3, "p3"
  pool = FakePool({})
  controller = _controller(server, pool, {}).start()
  time.sleep(0.2)
  controller.stop()
  assert pool.updates == [("p3", 3, "keep")]
  assert server.acquire_versions and set(server.acquire_versions) == {3}


class LaggingPool(FakePool):
  """Applies a weight update on another thread a little later, as the real pool's
  decode thread does between two chunks."""

  def update_weights(self, params, version, mode):
    self.updates.append((params, version, mode))
    future = Future()

    def apply():
      self.version = version
      future.set_result({})

    threading.Timer(0.02, apply).start()
    return future


def test_the_first_acquire_after_new_weights_waits_for_the_pool_to_apply_them():
  # Acquiring at the pool's old version would find no room at η = 0 and hold the
  # loop for a whole poll; the controller gives the swap up to that poll instead.
  server = FakeServer(1)
  server.version_published, server.params = 3, "p3"
  pool = LaggingPool({"p0": [1.0, 0.0]})
  controller = _controller(server, pool, {"p0": [1.0, 0.0]}, poll_s=5.0).start()
  wait_until(lambda: server.acquire_versions)
  controller.stop()
  assert pool.updates == [("p3", 3, "keep")]
  assert server.acquire_versions[0] == 3


def test_groups_carry_their_stream_position_and_a_seed_derived_from_it():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 1.0]}
  server = FakeServer(2)
  pool = FakePool(rewards)
  controller = _controller(server, pool, rewards).start()
  wait_until(lambda: server.finished() >= 2)
  controller.stop()
  # The prompt drawn while waiting for capacity is not counted as started.
  assert server.positions == [(3, {"index": 0}, {"index": 1}), (3, {"index": 1}, {"index": 2})]
  assert [r.sampling.seed for r in pool.requests] == [
      sample_seed(7, 3, {"index": i}) for i in range(2)]
  assert len({r.sampling.seed for r in pool.requests}) == 2
  assert sample_seed(7, 3, {"index": 0}) != sample_seed(7, 4, {"index": 0})


def test_a_prompt_source_replays_lost_positions_then_continues_its_stream():
  source = PromptSource(Stream, cursor={"index": 5}, replay=[{"index": 1}, {"index": 3}])
  drawn = [source.draw() for _ in range(3)]
  assert [d.prompt.id for d in drawn] == ["p1", "p3", "p5"]
  assert [d.position for d in drawn] == [{"index": 1}, {"index": 3}, {"index": 5}]
  assert [d.next_position for d in drawn] == [{"index": 5}, {"index": 5}, {"index": 6}]


def test_a_failing_callback_is_reported_and_frees_its_group():
  rewards = {"p0": [1.0, 0.0]}
  server = FakeServer(1)

  def reference(prompt):
    raise KeyError(f"no reference for {prompt.id}")

  controller = _controller(server, FakePool(rewards), rewards, reference=reference).start()
  wait_until(lambda: controller.error is not None)
  controller.stop()
  assert isinstance(controller.error, KeyError) and "no reference for p0" in str(controller.error)
  assert server.rejected == [1] and controller.metrics()["failed"] == 1


def test_waits_name_the_part_that_holds_a_group_without_progress():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 1.0]}
  server = FakeServer(2)
  pool = FakePool(rewards, hang=("p1",))
  controller = _controller(server, pool, rewards).start()
  wait_until(lambda: server.offered)
  time.sleep(0.3)
  first = controller.waits()
  assert set(first) == {"generator"} and first["generator"] >= 0.3
  pool.steps += 1  # the pool makes progress: the wait starts again
  assert controller.waits()["generator"] < 0.1
  time.sleep(0.2)
  assert controller.waits()["generator"] == pytest.approx(0.2, abs=0.1)
  controller.stop()


class NeverRewards(FakeRewards):
  def submit(self, task):
    return Future()


def _awaiting_rewards():
  """A started controller whose one group waits on two reward calls it never gets."""
  server = FakeServer(1)
  controller = _controller(server, FakePool({}), {})
  pending = []
  controller.rewards.submit = lambda task: pending.append(Future()) or pending[-1]
  controller.start()
  wait_until(lambda: len(pending) >= 2)
  return server, controller, pending


def test_calls_cancelled_as_the_run_closes_free_their_group_without_an_error():
  server, controller, pending = _awaiting_rewards()
  controller.stop()
  for future in pending:  # as RewardService.close does with its queue
    future.cancel()
  assert controller.error is None
  assert server.rejected == [1] and controller.metrics()["failed"] == 1
  # Before the stop, a cancelled call is a failure like any other.
  server, controller, pending = _awaiting_rewards()
  for future in pending:
    future.cancel()
  wait_until(lambda: controller.error is not None)
  controller.stop()
  assert isinstance(controller.error, CancelledError) and server.rejected == [1]


class ClosingRewards(FakeRewards):
  """Refuses every call, as a closed executor does, once `closed` is set."""

  def __init__(self):
    super().__init__({})
    self.called, self.closed = threading.Event(), threading.Event()

  def submit(self, task):
    self.called.set()
    self.closed.wait(10)
    raise RuntimeError("cannot schedule new futures after shutdown")


def test_a_group_scored_as_the_run_closes_frees_its_capacity_without_an_error():
  server = FakeServer(1)
  controller = _controller(server, FakePool({}), {})
  controller.rewards = rewards = ClosingRewards()
  controller.start()
  assert rewards.called.wait(10)  # its generation is done; the run now closes under it
  controller.stop()
  rewards.closed.set()
  wait_until(lambda: server.rejected)
  assert controller.error is None
  assert server.rejected == [1] and controller.metrics()["failed"] == 1
  # Before the stop, the same refusal is a failure.
  server = FakeServer(1)
  controller = _controller(server, FakePool({}), {})
  controller.rewards = rewards = ClosingRewards()
  rewards.closed.set()
  controller.start()
  wait_until(lambda: controller.error is not None)
  controller.stop()
  assert isinstance(controller.error, RuntimeError) and server.rejected == [1]


def test_waits_name_a_reward_service_that_never_answers():
  server = FakeServer(1)
  controller = _controller(server, FakePool({}), {})
  controller.rewards = NeverRewards({})
  controller.start()
  time.sleep(0.3)
  waits = controller.waits()
  controller.stop()
  assert set(waits) == {"rewards"} and waits["rewards"] >= 0.25


class AheadPool(FakePool):
  """Tags its tokens with version 4 while it reports version 0 live."""

  def submit(self, request):
    samples = [dataclasses.replace(t, versions_T=np.where(t.versions_T >= 0, 4, -1))
               for t in super().submit(request).result()]
    future = Future()
    future.set_result(samples)
    return future


def test_a_token_newer_than_the_generators_live_version_stops_the_controller():
  server = FakeServer(1)
  controller = _controller(server, AheadPool({}), {"p0": [1.0, 0.0]}).start()
  wait_until(lambda: controller.error is not None)
  controller.stop()
  assert isinstance(controller.error, VersionError) and server.offered == []
  assert str(controller.error).startswith(
      "rollout worker 3's generator (live version 0): token 2 of sample 0 of group 'p0' was "
      "made by version 4, outside [0, 0]")
