"""RolloutController with fake collaborators: grouping, filtering, failures, weight sync."""

import threading
import time
from concurrent.futures import Future

import numpy as np

from async_rl.generation import SamplingParams
from async_rl.rl.rollout import RolloutController
from async_rl.trajectory import Trajectory


class FakeServer:
  def __init__(self, groups_allowed):
    self.allowed, self.offered, self.rejected = groups_allowed, [], 0
    self.version_published, self.params = 0, "p0"
    self.acquire_versions = []
    self.lock = threading.Lock()

  def acquire(self, timeout, generator_version):
    with self.lock:
      self.acquire_versions.append(generator_version)
      if self.allowed:
        self.allowed -= 1
        return True
    time.sleep(0.01)
    return False

  def fetch(self, have):
    return (self.version_published, self.params) if self.version_published > have else None

  def offer(self, group):
    self.offered.append(group)
    return True

  def reject(self):
    self.rejected += 1


class FakePool:
  def __init__(self, rewards_by_prompt, abort=()):
    self.version, self.updates = 0, []
    self.rewards_by_prompt, self.abort = rewards_by_prompt, abort

  def update_weights(self, params, version, mode):
    self.updates.append((params, version, mode))
    self.version = version

  def submit(self, request):
    samples = [Trajectory.from_completion(
        np.array(request.prompt, np.int32), np.array([3, 4, 2], np.int32),
        np.full(3, -1.0, np.float32), np.zeros(3, np.int32),
        "aborted" if request.request_id in self.abort else "stop") for _ in range(request.n)]
    future = Future()
    future.set_result(samples)
    return future


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


class Prompt:
  def __init__(self, i):
    self.id, self.tokens = f"p{i}", (1, 5 + i)


def _run(rewards_by_prompt, *, dynamic_filter, abort=(), n_prompts=3):
  server = FakeServer(n_prompts)
  pool = FakePool(rewards_by_prompt, abort)
  prompts = iter([Prompt(i) for i in range(n_prompts)] + [None] * 100)
  controller = RolloutController(
      server=server, pool=pool, rewards=FakeRewards(rewards_by_prompt), prompts=prompts,
      reference=lambda p: p.id, decode=lambda t: "x", reward_fn="f",
      sampling=SamplingParams(), group_size=2, update_mode="keep",
      dynamic_filter=dynamic_filter).start()
  deadline = time.time() + 10
  while len(server.offered) + server.rejected < n_prompts and time.time() < deadline:
    time.sleep(0.01)
  controller.stop()
  assert controller.error is None
  return server, pool, controller


def test_groups_are_scored_in_sample_order_and_offered():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 0.0], "p2": [1.0, 1.0]}
  server, _, controller = _run(rewards, dynamic_filter=False)
  assert sorted(g.prompt_id for g in server.offered) == ["p0", "p1", "p2"]
  for g in server.offered:
    assert [t.reward for t in g.trajectories] == rewards[g.prompt_id]
    assert list(g.trajectories[0].completion_C) == [3, 4, 2]
  assert controller.metrics()["offered"] == 3 and server.rejected == 0


def test_dynamic_filter_rejects_groups_with_equal_rewards_and_counts_them():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 0.0], "p2": [1.0, 1.0]}
  server, _, controller = _run(rewards, dynamic_filter=True)
  assert [g.prompt_id for g in server.offered] == ["p0"]
  assert server.rejected == 2 and controller.metrics()["filtered"] == 2


def test_aborted_generation_releases_the_groups_capacity():
  rewards = {"p0": [1.0, 0.0], "p1": [0.0, 1.0], "p2": [1.0, 0.0]}
  server, _, controller = _run(rewards, dynamic_filter=False, abort=("p1",))
  assert sorted(g.prompt_id for g in server.offered) == ["p0", "p2"]
  assert server.rejected == 1 and controller.metrics()["failed"] == 1


def test_new_weights_reach_the_pool_before_the_next_acquire():
  server = FakeServer(0)
  server.version_published, server.params = 3, "p3"
  pool = FakePool({})
  controller = RolloutController(
      server=server, pool=pool, rewards=FakeRewards({}), prompts=iter([]),
      reference=lambda p: p.id, decode=lambda t: "x", reward_fn="f",
      sampling=SamplingParams(), group_size=2, update_mode="retract").start()
  time.sleep(0.2)
  controller.stop()
  assert pool.updates == [("p3", 3, "retract")]
  assert server.acquire_versions and set(server.acquire_versions) == {3}
