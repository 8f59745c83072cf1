"""Exactly once, fuzzed: random interleavings of rollout workers drawing prompts from
their streams, starting, finishing and rejecting groups, applying weights late,
dying and restarting (with groups of the dead one still finishing), a trainer taking
batches and publishing, checkpoints, and resumes from any checkpoint, newest or
older. After every step, by the server's own ledger: each prompt a worker's stream
has issued is trained into the current params, finished without training (rejected
or dropped), or open or queued to be issued again, exactly one of these; none is
trained twice; and no trained token is staler than η."""

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from async_rl.config import StalenessConfig
from async_rl.param_server import ParameterServer
from async_rl.rl.rollout import PromptSource
from async_rl.trajectory import Group, Trajectory

WORKERS = 2


class _Stream:
  """Worker `w`'s prompts (w, 0), (w, 1), ...; its state is the next index."""

  def __init__(self, worker, position):
    self.worker, self.index = worker, 0 if position is None else position["index"]

  def state(self):
    return {"index": self.index}

  def __next__(self):
    self.index += 1
    return (self.worker, self.index - 1)


def _params(version):
  return {"w": np.full((2,), version, np.float32)}


def _group(prompt, versions):
  trajectory = Trajectory.from_completion(
      np.array([5, 6]), np.arange(len(versions)), np.zeros(len(versions)),
      np.array(versions, np.int32), "stop", reward=1.0)
  return Group(prompt, (trajectory,))


class Lifecycle(RuleBasedStateMachine):
  """The run as the server sees it; the model records what became of each prompt."""

  @initialize(eta=st.sampled_from([0, 1, 2]), b=st.integers(1, 2), mc=st.integers(1, 4))
  def setup(self, eta, b, mc):
    self.eta, self.b, self.mc = eta, b, mc
    self.version = 0
    self.trained, self.finished = [], set()  # prompts, into the published params / not
    self.checkpoints = []
    self._start_server()
    self.server.publish(0, _params(0))

  def _start_server(self):
    self.server = ParameterServer(
        StalenessConfig(max_staleness=self.eta, on_stale="drop", max_concurrent=self.mc),
        batch_groups=self.b)
    self.buffered = {}  # ticket -> (prompt, oldest token version)
    self.pending = []  # prompts taken for training, not yet published
    self.zombies = []  # (ticket, prompt, start version) of dead workers' groups
    self.workers = [None] * WORKERS
    for w in range(WORKERS):
      self._register(w)

  def _register(self, w):
    start = self.server.register_worker(w)
    source = PromptSource(lambda position, w=w: _Stream(w, position), cursor=start["cursor"],
                          replay=start["replay"])
    # running: ticket -> (prompt, version it started at); drawn: a prompt waiting for room
    self.workers[w] = {"source": source, "weights": self.version, "running": {},
                       "drawn": None}

  @rule(w=st.integers(0, WORKERS - 1))
  def start_group(self, w):
    worker = self.workers[w]
    if worker["drawn"] is None:
      worker["drawn"] = worker["source"].draw()
    prompt, position, next_position = worker["drawn"]
    ticket = self.server.acquire(generator_version=worker["weights"], worker=w,
                                 position=position, next_position=next_position)
    if ticket is not None:
      worker["running"][ticket] = (prompt, worker["weights"])
      worker["drawn"] = None

  @rule(w=st.integers(0, WORKERS - 1))
  def apply_weights(self, w):
    self.workers[w]["weights"] = self.version

  @rule(w=st.integers(0, WORKERS - 1), data=st.data())
  def finish_group(self, w, data):
    running = self.workers[w]["running"]
    if not running:
      return
    ticket = data.draw(st.sampled_from(sorted(running)))
    prompt, started = running.pop(ticket)
    if data.draw(st.integers(0, 4)) == 0:  # filtered, or its reward failed
      self.server.reject(ticket)
      self.finished.add(prompt)
      return
    # Tokens from the version it started at to the weights applied since (update "keep").
    versions = sorted(data.draw(st.lists(st.integers(started, self.workers[w]["weights"]),
                                         min_size=1, max_size=4)))
    if self.server.offer(ticket, _group(prompt, versions)):
      self.buffered[ticket] = (prompt, versions[0])
    else:
      assert versions[0] < self.version - self.eta, "a fresh group was dropped"
      self.finished.add(prompt)

  @rule(w=st.integers(0, WORKERS - 1))
  def worker_dies_and_restarts(self, w):
    """Its running groups are written off; they may still finish, and count for nothing."""
    self.zombies += [(t, *entry) for t, entry in self.workers[w]["running"].items()]
    self._register(w)

  @precondition(lambda self: self.zombies)
  @rule(data=st.data())
  def a_dead_workers_group_finishes(self, data):
    ticket, prompt, started = self.zombies.pop(data.draw(st.integers(0, len(self.zombies) - 1)))
    if data.draw(st.booleans()):
      assert not self.server.offer(ticket, _group(prompt, [min(started, self.version)]))
    else:
      self.server.reject(ticket)

  @rule()
  def train(self):
    batch = self.server.get_batch(timeout=0)
    if batch is None:
      return
    for group in batch:
      assert self.version - group.min_version <= self.eta, "a token staler than η trains"
      ticket = next(t for t, (p, _) in self.buffered.items() if p == group.prompt_id)
      del self.buffered[ticket]
      self.pending.append(group.prompt_id)

  @rule()
  def publish(self):
    self.version += 1
    self.server.publish(self.version, _params(self.version))
    self.trained += self.pending
    self.pending = []
    for ticket, (prompt, oldest) in list(self.buffered.items()):
      if oldest < self.version - self.eta:  # purged as too stale
        del self.buffered[ticket]
        self.finished.add(prompt)

  @rule()
  def checkpoint(self):
    self.checkpoints.append((self.version, self.server.state_dict(), list(self.trained),
                             set(self.finished)))

  @precondition(lambda self: self.checkpoints)
  @rule(data=st.data())
  def kill_and_resume(self, data):
    """The process dies; a new one resumes from a checkpoint (a damaged newest one
    falls back to an older one): what came after it is gone."""
    version, state, trained, finished = data.draw(st.sampled_from(self.checkpoints))
    self.version, self.trained, self.finished = version, list(trained), set(finished)
    server = ParameterServer(
        StalenessConfig(max_staleness=self.eta, on_stale="drop", max_concurrent=self.mc),
        batch_groups=self.b)
    server.load_state_dict(state)
    server.publish(version, _params(version))
    self.server = server
    self.buffered, self.pending, self.zombies = {}, [], []
    for w in range(WORKERS):
      self._register(w)
    self.checkpoints = [c for c in self.checkpoints if c[0] <= version]

  @invariant()
  def each_issued_prompt_is_in_exactly_one_place(self):
    ledger = self.server.state_dict()["ledger"]
    assert len(set(self.trained)) == len(self.trained), "a prompt trained twice"
    for w in range(WORKERS):
      issued = ledger["cursor"].get(str(w), {"index": 0})["index"]
      queued = [(w, p["index"]) for p in ledger["replay"].get(str(w), [])]
      places = ([p for p in self.trained if p[0] == w] + [p for p in self.finished if p[0] == w]
                + queued)
      assert sorted(places) == [(w, i) for i in range(issued)], (w, sorted(places), issued)

  @invariant()
  def the_server_counts_what_the_model_holds(self):
    m = self.server.metrics()
    running = sum(len(worker["running"]) for worker in self.workers)
    assert (m["version"], m["running"], m["buffer_size"]) == (
        self.version, running, len(self.buffered))
    assert m["capacity"] >= 0


Lifecycle.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_lifecycle_interleavings = Lifecycle.TestCase
