"""Tests for async_rl.param_server: gate formula, admission, publishes, checkpoints, threads."""

import json
import pickle
import random
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from async_rl.config import StalenessConfig
from async_rl.param_server import ParameterServer, StalenessGate
from async_rl.param_server.buffer import ON_STALE, length_summary
from async_rl.rl.errors import VersionError
from async_rl.trajectory import Group, Trajectory


def _server(eta=1, b=2, mc=64, on_stale="drop"):
  return ParameterServer(StalenessConfig(max_staleness=eta, on_stale=on_stale,
                                         max_concurrent=mc), batch_groups=b)


def _group(versions, prompt_id=0):
  """A group with one sample per entry of `versions` (each a list of token versions)."""
  trajectories = tuple(
      Trajectory.from_completion(np.array([5, 6]), np.arange(len(v)), np.zeros(len(v)),
                                 np.array(v, np.int32), "stop", reward=1.0)
      for v in versions)
  return Group(prompt_id, trajectories)


def _params(fill=0.0):
  return {"w": np.full((2, 3), fill, np.float32), "b": np.zeros(3, np.float32)}


def _offer(server, versions, prompt_id=0):
  ticket = server.acquire()
  assert ticket is not None
  return server.offer(ticket, _group(versions, prompt_id))


# The gate formula.


def test_capacity_formula_hand_cases():
  gate = StalenessGate(max_staleness=2, batch_groups=3, max_concurrent=100)
  assert gate.capacity() == 9  # (2 + 0 + 1) * 3
  gate = StalenessGate(max_staleness=2, batch_groups=3, max_concurrent=100, running=4,
                       accepted=3)
  assert gate.capacity() == 2  # min(96, 9 - 7)
  gate.set_version(1)
  assert gate.capacity() == 5  # min(96, 12 - 7)
  gate.max_concurrent = 6
  assert gate.capacity() == 2  # min(6 - 4, 5)
  gate.max_staleness = None
  assert gate.capacity() == 2  # only the concurrency bound
  gate.max_concurrent = 100
  assert gate.capacity() == 96


def test_capacity_uses_the_generators_version_when_older():
  gate = StalenessGate(max_staleness=0, batch_groups=2, max_concurrent=10, version=1,
                       accepted=2)
  assert gate.capacity() == 2  # (0 + 1 + 1) * 2 - 2
  assert gate.capacity(generator_version=0) == 0  # its tokens would be 1 version stale
  assert not gate.acquire(generator_version=0) and gate.running == 0
  assert gate.capacity(generator_version=5) == 2  # never more than the trainer allows
  assert gate.acquire(generator_version=1) and gate.running == 1


def test_gate_bookkeeping():
  gate = StalenessGate(max_staleness=0, batch_groups=2, max_concurrent=10)
  assert gate.acquire() and gate.acquire() and not gate.acquire()
  gate.finish_rejected()  # frees capacity
  assert gate.acquire() and not gate.acquire()
  gate.finish_accepted()
  gate.drop_accepted()  # accepted -> rejected frees capacity too
  assert (gate.running, gate.accepted, gate.rejected) == (1, 0, 2)
  assert gate.acquire() and not gate.acquire()
  with pytest.raises(ValueError, match="cannot drop 1 accepted"):
    gate.drop_accepted()
  with pytest.raises(ValueError, match="may not decrease"):
    StalenessGate(0, 1, 1, version=3).set_version(2)
  with pytest.raises(ValueError, match="no group is running"):
    StalenessGate(0, 1, 1).finish_accepted()


def test_sync_eta0_admits_exactly_one_batch_per_version():
  server = _server(eta=0, b=2)
  server.publish(0, _params())
  first, second = server.acquire(), server.acquire()
  assert (first, second, server.acquire()) == (1, 2, None)
  assert server.offer(second, _group([[0, 0]], 1)) and server.offer(first, _group([[0]], 0))
  assert not server.acquire() and server.metrics()["capacity"] == 0
  assert [g.prompt_id for g in server.get_batch(timeout=1)] == [0, 1]
  assert not server.acquire()  # consumed, but v is still 0
  server.publish(1, _params(1.0))
  assert server.acquire() and server.acquire() and not server.acquire()


def test_acquire_returns_when_a_newer_version_is_published():
  # η = 0 and a generator still on v0: its gate stays shut after publish(1) until it
  # applies v1, so acquire must hand control back at once rather than at its timeout.
  server = _server(eta=0, b=1)
  server.publish(0, _params())
  server.offer(server.acquire(generator_version=0), _group([[0]]))
  server.get_batch(timeout=1)
  result = []
  waiter = threading.Thread(
      target=lambda: result.append(server.acquire(timeout=60, generator_version=0)))
  waiter.start()
  while not server._capacity_freed._waiters:  # noqa: SLF001 - publish once it waits
    waiter.join(timeout=0.01)
  server.publish(1, _params(1.0))
  waiter.join(timeout=10)
  assert not waiter.is_alive() and result == [None]
  assert server.acquire(generator_version=0) is None  # still shut for the old weights
  assert server.acquire(generator_version=1) is not None


def test_gate_state_dict_and_rebase():
  gate = StalenessGate(max_staleness=1, batch_groups=2, max_concurrent=8, version=3,
                       running=2, accepted=7, rejected=1)
  state = gate.state_dict()
  again = StalenessGate.from_state_dict(state, max_staleness=1, batch_groups=2,
                                        max_concurrent=8)
  assert again == gate
  again.rebase(consumed=6)
  assert (again.running, again.accepted, again.rejected, again.lost) == (0, 6, 1, 3)
  assert again.capacity() == (1 + 3 + 1) * 2 - 6
  with pytest.raises(ValueError, match="consumed must lie in"):
    again.rebase(consumed=7)


# Groups and admission.


def test_group_crosses_processes():
  group = _group([[3, 1, 2], [], [4]])
  assert (group.min_version, group.max_version) == (1, 4)
  copy = pickle.loads(pickle.dumps(group))  # crosses process boundaries as a Ray argument
  assert copy.min_version == 1
  np.testing.assert_array_equal(copy.trajectories[0].versions_T, [-1, -1, 3, 1, 2])


def test_offer_applies_the_strict_per_token_bound():
  for admit_stale in (False, True):
    server = _server(eta=1, b=4, on_stale="admit" if admit_stale else "drop")
    server.publish(3, _params())
    assert _offer(server, [[3, 2], [2]])  # staleness 1 <= η
    assert _offer(server, [[3], [3, 1]]) == admit_stale  # one token of staleness 2
    m = server.metrics()
    assert (m["admitted"], m["dropped"], m["admitted_stale"]) == (
        (2, 0, 1) if admit_stale else (1, 1, 0))
    assert (m["accepted"], m["rejected"], m["buffer_size"]) == (
        (2, 0, 2) if admit_stale else (1, 1, 1))


def test_mask_tokens_trains_a_stale_group_without_its_old_tokens():
  server = _server(eta=1, b=2, on_stale="mask_tokens")
  server.publish(3, _params())
  assert _offer(server, [[1, 2, 3], [3, 1]], "long")  # tokens of version 1 are 2 stale
  assert not _offer(server, [[1, 0]], "too old")  # nothing left to train: dropped
  server.publish(4, _params())  # now the tokens of version 2 are stale too
  assert _offer(server, [[4]], "fresh")
  long, fresh = server.get_batch(timeout=1)
  assert (long.prompt_id, fresh.prompt_id) == ("long", "fresh")
  assert [list(t.loss_mask_T[t.prompt_len:]) for t in long.trajectories] == [
      [False, False, True], [True, False]]
  assert long.min_version == 1  # the tokens are kept, only out of the loss
  m = server.metrics()
  assert (m["admitted"], m["dropped"], m["admitted_stale"], m["trained_stale"]) == (2, 1, 1, 0)
  assert m["masked_tokens"] == 3
  assert m["staleness_hist"] == [1, 2]  # trained tokens only: 4 (fresh), 3 and 3 (long)
  # Lengths count policy tokens per sample, whether or not some were masked.
  assert server.length_histograms() == {
      "generated": [0, 1, 2, 1], "admitted": [0, 1, 1, 1], "dropped": [0, 0, 1],
      "trained": [0, 1, 1, 1], "trained_tokens": [0, 1, 1, 1]}


def test_a_masked_group_that_ages_out_in_the_buffer_is_dropped():
  server = _server(eta=1, b=2, on_stale="mask_tokens")
  server.publish(1, _params())
  assert _offer(server, [[0, 1]], "a")
  capacity = server.metrics()["capacity"]
  server.publish(3, _params())  # every token of "a" is now 2 or 3 versions old
  m = server.metrics()
  assert (m["buffer_size"], m["dropped"], m["rejected"]) == (0, 1, 1)
  assert m["capacity"] == capacity + 2 * 2 + 1
  assert server.length_histograms()["dropped"] == [0, 0, 1]


def test_length_summary():
  assert length_summary([]) == {"n": 0}
  hist = [0, 2, 0, 3, 0, 0, 0, 0, 0, 0, 5]  # lengths 1, 1, 3, 3, 3 and five of 10
  assert length_summary(hist) == {"n": 10, "mean": 6.1, "p10": 1, "p50": 3, "p90": 10,
                                  "max": 10}


def test_bad_offers_change_nothing():
  server = _server()
  server.publish(1, _params())
  with pytest.raises(ValueError, match="ticket 1 is not running"):
    server.offer(1, _group([[1]]))
  with pytest.raises(ValueError, match="ticket 7 is not running"):
    server.reject(7)
  ticket = server.acquire()
  before = server.metrics()
  with pytest.raises(VersionError, match=r"offered at published version 1: token 3 of sample 0 "
                     r"of group 0 was made by version 2, outside \[0, 1\]"):
    server.offer(ticket, _group([[1, 2]]))
  with pytest.raises(ValueError, match="expects a Group"):
    server.offer(ticket, [np.array([1])])
  assert server.metrics() == before
  server.reject(ticket)
  with pytest.raises(ValueError, match=f"ticket {ticket} is not running"):
    server.reject(ticket)


def test_buffer_hands_out_oldest_min_version_first():
  server = _server(eta=None, b=1)
  server.publish(2, _params())
  for prompt_id, versions in (("a", [[2]]), ("b", [[2, 0]]), ("c", [[1]]), ("d", [[0]])):
    _offer(server, versions, prompt_id)
  assert [server.get_batch(timeout=1)[0].prompt_id for _ in range(4)] == ["b", "d", "c", "a"]


def test_groups_that_grow_stale_in_the_buffer_are_dropped_or_counted():
  for admit_stale in (False, True):
    server = _server(eta=1, b=3, on_stale="admit" if admit_stale else "drop")
    server.publish(1, _params())
    _offer(server, [[0]], "old")
    _offer(server, [[1]], "new")
    capacity = server.metrics()["capacity"]
    server.publish(2, _params())  # "old" now has staleness 2
    m = server.metrics()
    if admit_stale:
      assert (m["dropped"], m["buffer_size"]) == (0, 2)
      _offer(server, [[2]], "newest")
      assert [g.prompt_id for g in server.get_batch(timeout=1)] == ["old", "new", "newest"]
      assert server.metrics()["trained_stale"] == 1
    else:
      assert (m["dropped"], m["buffer_size"], m["accepted"], m["rejected"]) == (1, 1, 1, 1)
      assert m["capacity"] == capacity + 4  # B = 3 for the version, 1 for the dropped group


def test_staleness_histogram_counts_trained_tokens():
  server = _server(eta=None, b=2)
  server.publish(3, _params())
  _offer(server, [[3, 3, 2], [1]])
  _offer(server, [[0]])
  server.get_batch(timeout=1)
  assert server.metrics()["staleness_hist"] == [2, 1, 1, 1]


# Publish and fetch.


def test_fetch_and_wait_return_nothing_until_something_newer():
  server = _server()
  assert server.fetch(-1) is None
  assert server.wait_for_version(-1, timeout=0.01) is None
  params = _params()
  server.publish(0, params)
  version, got = server.fetch(-1)
  assert version == 0 and got is params  # a reference, not a copy
  assert server.fetch(0) is None and server.fetch(7) is None
  assert server.wait_for_version(0, timeout=0.01) is None
  result = []
  waiter = threading.Thread(target=lambda: result.append(server.wait_for_version(0, 10)))
  waiter.start()
  server.publish(4, _params(4.0))
  waiter.join(timeout=10)
  assert result == [4]


_BAD_PUBLISHES = {
    "older": (1, _params(), "versions must increase"),
    "equal": (2, _params(), "versions must increase"),
    "extra leaf": (3, {**_params(), "c": np.zeros(1)}, r"unexpected leaves \[\"\['c'\]\"\]"),
    "missing leaf": (3, {"w": _params()["w"]}, r"missing leaves \[\"\['b'\]\"\]"),
    "container": (3, [_params()["b"], _params()["w"]], "tree structure"),
    "shape": (3, {**_params(), "w": np.zeros((3, 2), np.float32)}, r"\['w'\]: shape \(3, 2\)"),
    "dtype": (3, {**_params(), "b": np.zeros(3, np.float16)}, r"\['b'\].*dtype float16"),
    "jax dtype": (3, {**_params(), "b": jnp.zeros(3, jnp.bfloat16)}, "dtype bfloat16"),
    "none": (3, None, "got None"),
    "negative": (-1, _params(), "must be >= 0"),
    "not an int": (3.0, _params(), "must be an int"),
}


@pytest.mark.parametrize("name", _BAD_PUBLISHES)
def test_rejected_publish_changes_nothing(name):
  version, params, message = _BAD_PUBLISHES[name]
  server = _server()
  server.publish(0, _params())
  good = {k: jnp.asarray(v) for k, v in _params(2.0).items()}  # jax and numpy leaves mix
  server.publish(2, good)
  _offer(server, [[1]])
  before = server.metrics()
  with pytest.raises(ValueError, match=message):
    server.publish(version, params)
  assert server.metrics() == before
  assert server.fetch(-1)[1] is good and server.fetch(2) is None


# Blocking and shutdown.


def test_get_batch_times_out_and_close_wakes_every_waiter():
  server = _server(eta=0, b=1, mc=1)
  server.publish(0, _params())
  assert server.get_batch(timeout=0.01) is None
  assert server.acquire()
  results = []
  waiters = [threading.Thread(target=lambda f=f: results.append(f())) for f in (
      server.get_batch, lambda: server.acquire(timeout=None),
      lambda: server.wait_for_version(0))]
  for t in waiters:
    t.start()
  server.close()
  for t in waiters:
    t.join(timeout=10)
  assert not any(t.is_alive() for t in waiters)
  assert results == [None, None, None]
  assert server.acquire() is None and server.get_batch() is None


# Checkpoints.


def test_state_dict_round_trip_rebases_the_gate():
  server = _server(eta=1, b=2)
  server.publish(0, _params())
  _offer(server, [[0]], 0)
  _offer(server, [[0]], 1)
  server.reject(server.acquire())
  server.get_batch(timeout=1)
  server.publish(1, _params())  # the batch is now trained into version 1
  _offer(server, [[1]], 2)
  _offer(server, [[1]], 3)
  server.get_batch(timeout=1)  # taken, not published: lost on resume
  _offer(server, [[0]], 4)  # buffered: lost on resume
  assert server.acquire()  # in flight: lost on resume
  saved = server.metrics()
  state = server.state_dict()
  assert json.loads(json.dumps(state)) == state

  restored = _server(eta=1, b=2)
  restored.load_state_dict(state)
  m = restored.metrics()
  assert (m["version"], m["running"], m["accepted"], m["lost_groups"], m["buffer_size"]) == (
      1, 0, 2, 4, 0)
  for key in ("rejected", "admitted", "dropped", "trained", "staleness_hist"):
    assert m[key] == saved[key]
  assert m["capacity"] == (1 + 1 + 1) * 2 - 2
  again = _server(eta=1, b=2)
  again.load_state_dict(restored.state_dict())
  assert again.state_dict() == restored.state_dict()

  with pytest.raises(ValueError, match="older than the restored version 1"):
    restored.publish(0, _params())
  restored.publish(1, _params())  # the checkpoint's own params
  with pytest.raises(ValueError, match="versions must increase"):
    restored.publish(1, _params())
  with pytest.raises(ValueError, match="before the first publish"):
    restored.load_state_dict(state)


# The prompt ledger: lost groups are written off and their prompts issued again.


def _at(i):
  return {"index": i}


def _start(server, worker, i):
  return server.acquire(worker=worker, position=_at(i), next_position=_at(i + 1))


def test_a_restarted_worker_writes_off_what_its_predecessor_left_running():
  server = _server(eta=None, b=4, mc=8)
  server.publish(0, _params())
  assert server.register_worker(0) == {"cursor": None, "replay": []}
  assert server.register_worker(1) == {"cursor": None, "replay": []}
  tickets = {i: _start(server, 0, i) for i in range(4)}
  other = _start(server, 1, 0)
  assert server.offer(tickets[1], _group([[0]], "w0/1"))  # buffered: survives the worker
  server.reject(tickets[2])  # filtered: never issued again
  assert server.metrics()["running"] == 3
  # Worker 0 dies and is replaced: its running groups (0 and 3) are lost.
  assert server.register_worker(0) == {"cursor": _at(4), "replay": [_at(0), _at(3)]}
  m = server.metrics()
  assert (m["running"], m["lost_groups"], m["capacity"]) == (1, 2, 8 - 1)
  # A late answer of the dead worker is ignored, not admitted twice.
  assert not server.offer(tickets[0], _group([[0]], "w0/0"))
  server.reject(tickets[3])
  assert server.metrics() == m
  # The new worker issues the lost prompts first, each leaving the replay queue; its
  # stream's cursor stays where it was.
  assert server.acquire(worker=0, position=_at(0), next_position=_at(4))
  assert server.register_worker(1) == {"cursor": _at(1), "replay": [_at(0)]}  # it died too
  assert server.register_worker(0) == {"cursor": _at(4), "replay": [_at(3), _at(0)]}
  assert not server.offer(other, _group([[0]], "w1/0"))


def test_a_checkpoint_replays_every_group_not_trained_into_its_params():
  server = _server(eta=None, b=1, mc=8)
  server.publish(0, _params())
  server.register_worker(0)
  trained, taken, buffered, running, dropped = (_start(server, 0, i) for i in range(5))
  for ticket, i in ((trained, 0), (taken, 1), (buffered, 2)):
    assert server.offer(ticket, _group([[0]], i))
  server.reject(dropped)
  assert server.get_batch(timeout=1)[0].prompt_id == 0
  server.publish(1, _params())  # group 0 is trained into version 1
  assert server.get_batch(timeout=1)[0].prompt_id == 1  # taken, never published
  state = server.state_dict()
  assert json.loads(json.dumps(state)) == state
  restored = _server(eta=None, b=1, mc=8)
  restored.load_state_dict(state)
  assert restored.metrics()["lost_groups"] == 3
  assert restored.register_worker(0) == {"cursor": _at(5), "replay": [_at(1), _at(2), _at(3)]}
  assert restored.acquire() > running  # tickets are never reused


# Random interleavings against an independent model.


class ServerMachine(RuleBasedStateMachine):
  """Drives one server with random schedules; a plain model predicts every outcome."""

  @initialize(eta=st.sampled_from([0, 1, 2, None]), b=st.integers(1, 3),
              mc=st.integers(1, 6), on_stale=st.sampled_from(ON_STALE))
  def setup(self, eta, b, mc, on_stale):
    self.eta, self.b, self.mc, self.on_stale = eta, b, mc, on_stale
    self.server = _server(eta, b, mc, on_stale)
    self.server.publish(0, _params())
    self.version = self.consumed = self.pending = self.restores = 0
    self.rejected = self.lost = self.dropped = self.violations = self.admitted_stale = 0
    self.masked = 0
    self.running = []  # tickets
    self.buffer = []  # (min_version, ticket, prompt_id, versions)
    self.offered, self.trained, self.lost_ids, self.hist = [], [], [], []

  def _oldest(self):
    return -1 if self.eta is None else self.version - self.eta

  def _accepted(self):
    return self.consumed + self.pending + len(self.buffer)

  def _trainable(self, versions):
    """Whether a group may stay, and whether it is stale, at the current version."""
    flat = [v for vs in versions for v in vs]
    stale = min(flat) < self._oldest()
    if not stale or self.on_stale == "admit":
      return True, stale
    return self.on_stale == "mask_tokens" and max(flat) >= self._oldest(), stale

  @rule(data=st.data())
  def generate(self, data):
    """Tries to start some groups, then finishes some of those running, in any order."""
    for _ in range(data.draw(st.integers(1, 3))):
      window = (float("inf") if self.eta is None else
                (self.eta + self.version + 1) * self.b - self._accepted() - len(self.running))
      expected = min(self.mc - len(self.running), window) > 0
      ticket = self.server.acquire()
      assert (ticket is not None) == expected
      if expected:
        self.running.append(ticket)
    for _ in range(data.draw(st.integers(0, len(self.running)))):
      ticket = data.draw(st.sampled_from(self.running))
      self.running.remove(ticket)
      if data.draw(st.integers(0, 3)) == 0:  # filtered out by the rollout side
        self.server.reject(ticket)
        self.rejected += 1
        continue
      token = st.integers(max(0, self.version - 3), self.version)  # weights may lag
      versions = data.draw(st.lists(st.lists(token, max_size=4), min_size=1, max_size=3))
      versions[0] += data.draw(st.lists(token, min_size=1, max_size=2))
      prompt_id = len(self.offered)
      self.offered.append(prompt_id)
      keep, stale = self._trainable(versions)
      admitted = self.server.offer(ticket, _group(versions, prompt_id))
      assert admitted == keep
      if admitted:
        self.buffer.append((min(min(v) for v in versions if v), ticket, prompt_id, versions))
        self.admitted_stale += stale
      else:
        self.rejected += 1
        self.dropped += 1

  @rule()
  def take_batch(self):
    batch = self.server.get_batch(timeout=0)
    if len(self.buffer) < self.b:
      assert batch is None
      return
    self.buffer.sort(key=lambda e: e[:2])
    expected, self.buffer = self.buffer[:self.b], self.buffer[self.b:]
    assert [g.prompt_id for g in batch] == [e[2] for e in expected]
    for group, entry in zip(batch, expected):
      versions = np.array([v for vs in entry[3] for v in vs])
      masked = versions < self._oldest() if self.on_stale == "mask_tokens" else 0 * versions
      self.masked += int(np.sum(masked))
      trained = np.concatenate([t.versions_T[t.loss_mask_T] for t in group.trajectories])
      np.testing.assert_array_equal(np.sort(trained), np.sort(versions[~masked.astype(bool)]))
      staleness = self.version - trained
      if self.on_stale != "admit" and self.eta is not None:
        assert staleness.max() <= self.eta, "a trained token breaks the staleness bound"
      self.violations += self.eta is not None and staleness.max() > self.eta
      for k in staleness:
        self.hist += [0] * (k + 1 - len(self.hist))
        self.hist[k] += 1
      self.trained.append(group.prompt_id)
    self.pending += self.b

  @rule(step=st.integers(-1, 3))
  def publish(self, step):
    if step <= 0:  # an older or equal version: rejected, nothing changes
      before = self.server.metrics()
      with pytest.raises(ValueError, match="versions must increase"):
        self.server.publish(max(0, self.version + step), _params())
      assert self.server.metrics() == before
      return
    self.version += step
    self.server.publish(self.version, _params(self.version))
    self.consumed += self.pending
    self.pending = 0
    kept = [e for e in self.buffer if self._trainable(e[3])[0]]
    self.dropped += len(self.buffer) - len(kept)
    self.rejected += len(self.buffer) - len(kept)
    self.buffer = kept

  @precondition(lambda self: self.restores < 2)  # rare in real runs; keep the rest busy
  @rule()
  def restore(self):
    self.restores += 1
    state = self.server.state_dict()
    self.server = _server(self.eta, self.b, self.mc, self.on_stale)
    self.server.load_state_dict(state)
    self.server.publish(self.version, _params(self.version))
    self.lost += len(self.running) + self.pending + len(self.buffer)
    self.lost_ids += [e[2] for e in self.buffer]
    self.running, self.pending, self.buffer = [], 0, []

  @invariant()
  def counters_match_the_model(self):
    m = self.server.metrics()
    assert m["capacity"] >= 0
    assert 0 <= m["running"] <= self.mc
    assert (m["version"], m["running"], m["accepted"], m["rejected"], m["lost_groups"]) == (
        self.version, len(self.running), self._accepted(), self.rejected, self.lost)
    assert (m["dropped"], m["buffer_size"], m["trained"]) == (
        self.dropped, len(self.buffer), len(self.trained))
    assert (m["trained_stale"], m["admitted_stale"]) == (self.violations, self.admitted_stale)
    assert m["masked_tokens"] == self.masked
    assert m["staleness_hist"] == self.hist
    assert self.server.state_dict()["consumed"] == self.consumed

  @invariant()
  def nothing_lost_or_duplicated(self):
    buffered = [e[2] for e in self.buffer]
    accounted = self.trained + buffered + self.lost_ids
    assert len(set(accounted)) == len(accounted)
    assert len(accounted) + self.dropped == len(self.offered)


ServerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                           deadline=None)
test_random_interleavings = ServerMachine.TestCase


# Threads.


def test_concurrent_publisher_generators_and_trainer():
  eta, b, mc = 1, 2, 4
  server = _server(eta=eta, b=b, mc=mc)
  server.publish(0, _params(0.0))
  stop = threading.Event()
  errors, offered, trained, observed = [], [], [], []

  def guarded(fn):
    def run():
      try:
        fn()
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
    return run

  def trainer():
    version = 0
    while not stop.is_set():
      batch = server.get_batch(timeout=0.02)
      if batch is None:
        continue
      for group in batch:
        assert version - group.min_version <= eta
        trained.append(group.prompt_id)
      version += 1
      server.publish(version, _params(float(version)))

  def generator(seed):
    rng, have = random.Random(seed), -1
    while not stop.is_set():
      got = server.fetch(have)
      if got is not None:
        assert got[0] > have and np.all(got[1]["w"] == got[0])
        have = got[0]
      ticket = server.acquire(timeout=0.02)
      if ticket is None:
        continue
      if rng.random() < 0.1:
        server.reject(ticket)
        continue
      prompt_id = (seed, len(offered))
      offered.append(prompt_id)
      versions = [rng.randint(max(0, have - 2), have) for _ in range(3)]  # lagging weights
      server.offer(ticket, _group([versions], prompt_id))

  def watcher():
    have = -1
    while not stop.is_set():
      newer = server.wait_for_version(have, timeout=0.02)
      have = have if newer is None else newer
      m = server.metrics()
      observed.append((m["capacity"], m["running"]))

  threads = [threading.Thread(target=guarded(f)) for f in (
      trainer, watcher, *(lambda s=s: generator(s) for s in range(4)))]
  for t in threads:
    t.start()
  stop.wait(1.0)
  stop.set()
  server.close()
  for t in threads:
    t.join(timeout=10)
  assert not any(t.is_alive() for t in threads), "deadlock"
  assert not errors, errors
  m = server.metrics()
  assert m["version"] >= 5, "training made no progress"
  assert len(set(trained)) == len(trained) and set(trained) <= set(offered)
  assert len(offered) == len(trained) + m["dropped"] + m["buffer_size"]
  assert m["running"] == 0
  assert all(c >= 0 and 0 <= r <= mc for c, r in observed)
