"""Lifecycle invariants over the real parts, fuzzed: generator pools on a tiny model,
with a KV budget small enough that samples are preempted, a parameter server and
rollout controllers, under random interleavings of requests from outside the
controllers, aborts, pauses, trained batches, weight updates (each update mode), rollout
workers dying and restarting, and resumes from checkpoints. After every step: each
prompt a worker's stream issued is trained, finished untrained, or queued to be issued
again, exactly one of these, by the server's ledger; no sample of a request or a group
is lost or duplicated; a trajectory's versions never decrease; no admitted or trained
token is staler than η; and every future resolves within its deadline."""

import collections
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from async_rl import models
from async_rl.config import ModelConfig, StalenessConfig
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.generation.pool import UPDATE_MODES
from async_rl.param_server import ParameterServer
from async_rl.rl.rollout import PromptSource, RolloutController
from conftest import wait_until

CFG = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  d_ff=32)
WORKERS, GROUP = 2, 2
# Few and small shapes, so that the engine compiles few programs: one prefill bucket,
# four decode buckets.
T, Z, SLOTS = 16, 8, 4
# A sequence at full length takes T // Z = 2 blocks: three growing samples outgrow 3
# blocks, so samples are preempted and resumed.
KV_BLOCKS = 3
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=(0,))
# How long any future may take: a group or request from submission to its result, a
# weight update from its request to its swap.
DEADLINE_S = 30.0


@functools.cache
def _engine():
  """The engine every pool shares, its programs compiled by a first run through every
  slot, preemption and a retract update, so that the examples spend their time on
  schedules rather than on compiling."""
  engine = Engine(CFG, max_concurrent_decodes=SLOTS, max_prefill_length=8,
                  max_target_length=T, steps_per_call=4, kv_blocks=KV_BLOCKS, kv_block_size=Z)
  with GeneratorPool(engine, _params(0)) as pool:
    futures = [pool.submit(Request(i, [i + 1] * (i + 3), n=2, sampling=SAMPLING))
               for i in range(SLOTS)]
    pool.update_weights(_params(1), 1, "retract")
    for future in futures:
      future.result()
  return engine


_init = jax.jit(models.init_params, static_argnums=0)


@functools.cache
def _params(version):
  """A version's params: three distinct sets, taken in turn."""
  return _init(CFG, jax.random.key(version % 3))


class _Prompt:
  def __init__(self, worker, index):
    self.id = (worker, index)
    self.tokens = [1 + (index * 7 + worker * 3 + k) % 31 for k in range(3 + index % 4)]


class _Stream:
  """Worker `worker`'s prompts (worker, 0), (worker, 1), ...; its state is the next index."""

  def __init__(self, worker, position):
    self.worker, self.index = worker, 0 if position is None else position["index"]

  def state(self):
    return {"index": self.index}

  def __next__(self):
    self.index += 1
    return _Prompt(self.worker, self.index - 1)


class _Rewards:
  """Scores a completion by its length, on a thread of its own."""

  error_window = 64

  def __init__(self):
    self._executor = ThreadPoolExecutor(1)
    self.calls = 0

  def submit(self, task) -> Future:
    self.calls += 1
    return self._executor.submit(lambda: float(len(task.completion)))

  def metrics(self):
    return {"calls": self.calls}

  def recent_failures(self):
    return 0, min(self.calls, self.error_window), None

  def close(self):
    self._executor.shutdown(wait=True, cancel_futures=True)


class _Books:
  """The server, and what became of each ticket and prompt, recorded under one lock
  with the server call that decided it, so that a look at both is consistent."""

  def __init__(self, server, eta, version, trained=(), finished=()):
    self.server, self.eta, self.version = server, eta, version
    self.lock = threading.RLock()
    self.running = {}  # ticket -> (prompt, worker, when it started)
    self.buffered = {}  # ticket -> (prompt, oldest token version)
    self.pending = []  # prompts taken for training, not yet published
    self.trained, self.finished = list(trained), set(finished)

  def acquire(self, generator_version, worker, position, next_position):
    with self.lock:  # no wait here: the lock must not be held for a poll
      ticket = self.server.acquire(0, generator_version, worker=worker, position=position,
                                   next_position=next_position)
      if ticket is not None:
        self.running[ticket] = ((worker, position["index"]), worker, time.monotonic())
      return ticket

  def offer(self, ticket, group):
    with self.lock:
      prompt, _, _ = self.running[ticket]
      assert group.prompt_id == prompt
      _check_samples(group.trajectories, GROUP, newest=self.version)
      admitted = self.server.offer(ticket, group)
      del self.running[ticket]
      if admitted:
        assert group.min_version >= self.version - self.eta, "a token staler than η admitted"
        self.buffered[ticket] = (prompt, group.min_version)
      else:
        assert group.min_version < self.version - self.eta, "a fresh group was dropped"
        self.finished.add(prompt)
      return admitted

  def reject(self, ticket):
    with self.lock:
      self.server.reject(ticket)
      self.finished.add(self.running.pop(ticket)[0])

  def register(self, worker):
    """A worker (re)starts: the groups its predecessor left running are lost."""
    with self.lock:
      start = self.server.register_worker(worker)
      for ticket in [t for t, (_, w, _) in self.running.items() if w == worker]:
        del self.running[ticket]
      return start


class _Link:
  """What one incarnation of a rollout worker reaches of the server: nothing once it
  is dead, as a dead process's calls never arrive; no new group once it drains."""

  def __init__(self, books):
    self._books, self._lock = books, threading.Lock()
    self.dead = self.draining = False

  def fetch(self, have_version):
    return None if self.dead else self._books.server.fetch(have_version)

  def acquire(self, timeout, generator_version, *, worker, position, next_position):
    with self._lock:
      if not (self.dead or self.draining):
        ticket = self._books.acquire(generator_version, worker, position, next_position)
        if ticket is not None:
          return ticket
    time.sleep(min(timeout, 0.01))
    return None

  def offer(self, ticket, group):
    with self._lock:
      return False if self.dead else self._books.offer(ticket, group)

  def reject(self, ticket):
    with self._lock:
      if not self.dead:
        self._books.reject(ticket)

  def kill(self):
    with self._lock:  # waits out a call under way
      self.dead = True


def _check_samples(samples, n, newest):
  """`n` samples, each index once, versions -1 on the prompt and then non-decreasing
  and at most `newest` on the completion."""
  assert sorted(s.metadata["index"] for s in samples) == list(range(n)), "a sample lost or doubled"
  for s in samples:
    prompt, gen = s.versions_T[:s.prompt_len], s.versions_T[s.prompt_len:]
    assert np.all(prompt == -1) and np.all(gen >= 0) and np.all(gen <= newest), s.versions_T
    assert np.all(np.diff(gen) >= 0), f"versions decrease within a trajectory: {gen}"
    assert len(gen) == len(s.completion_C) and s.finish_reason in ("stop", "length", "aborted")


class _Worker:
  """One incarnation of rollout worker `index`: its pool, controller and link."""

  def __init__(self, index, books, mode):
    self.index, self.mode = index, mode
    start = books.register(index)
    self.link = _Link(books)
    self.pool = GeneratorPool(_engine(), _params(books.version), version=books.version)
    self.rewards = _Rewards()
    prompts = PromptSource(lambda position: _Stream(index, position), cursor=start["cursor"],
                           replay=start["replay"])
    self.controller = RolloutController(
        server=self.link, pool=self.pool, rewards=self.rewards, prompts=prompts,
        reference=lambda p: p.id, decode=lambda tokens: list(tokens), reward_fn="unused",
        sampling=SAMPLING, group_size=GROUP, update_mode=mode, worker=index, seed=0,
        poll_s=0.01).start()
    self.swap_seen = {}  # requested version -> when first seen behind the pool's

  def stop(self, stats):
    self.controller.stop()
    self.pool.shutdown()
    self.rewards.close()
    m = self.pool.metrics()
    stats[f"updates {self.mode}"] += m["weight_updates"]
    stats["preemptions"] += m["preemptions"]
    stats["resumed"] += m["resumed_samples"]
    assert self.controller.error is None, self.controller.error


class PoolLifecycle(RuleBasedStateMachine):
  """A run with real pools, controllers and server; the test plays the trainer."""

  def __init__(self, stats):
    super().__init__()
    self.stats = stats

  @initialize(eta=st.sampled_from([0, 1, 2]), b=st.integers(1, 2), mc=st.sampled_from([2, 4]),
              modes=st.lists(st.sampled_from(UPDATE_MODES), min_size=WORKERS,
                             max_size=WORKERS))
  def setup(self, eta, b, mc, modes):
    self.staleness = StalenessConfig(max_staleness=eta, on_stale="drop", max_concurrent=mc)
    self.b = b
    self.checkpoints, self.requests, self.next_request = [], [], 0
    server = ParameterServer(self.staleness, batch_groups=b)
    server.publish(0, _params(0))
    self.books = _Books(server, eta, 0)
    self.workers = [_Worker(w, self.books, m) for w, m in enumerate(modes)]

  # The trainer.

  @rule(wait_ms=st.integers(0, 300), save_between=st.booleans())
  def train_step(self, wait_ms, save_between):
    """Takes a batch, once B groups are admitted, and publishes the params it trained;
    `save_between`: a checkpoint is taken between the two."""
    books = self.books
    batch = books.server.get_batch(timeout=wait_ms / 1000)
    if batch is None:
      return
    with books.lock:  # once the offers of the groups taken are recorded
      for group in batch:
        assert books.version - group.min_version <= books.eta, "a token staler than η trains"
        ticket = next(t for t, (p, _) in books.buffered.items() if p == group.prompt_id)
        del books.buffered[ticket]
        books.pending.append(group.prompt_id)
      if save_between:
        self._save()
      self._publish()

  @rule()
  def publish(self):
    """Publishes a version without taking a batch, so that the pools get weight updates
    whatever the pace of generation."""
    with self.books.lock:
      self._publish()

  def _publish(self):
    books = self.books
    books.version += 1
    books.server.publish(books.version, _params(books.version))
    books.trained += books.pending
    books.pending = []
    for ticket, (prompt, oldest) in list(books.buffered.items()):
      if oldest < books.version - books.eta:  # purged as too stale
        del books.buffered[ticket]
        books.finished.add(prompt)

  @rule()
  def checkpoint(self):
    self._save()

  def _save(self):
    with self.books.lock:
      self.checkpoints.append((self.books.version, self.books.server.state_dict(),
                               list(self.books.trained), set(self.books.finished)))

  @precondition(lambda self: self.checkpoints)
  @rule(data=st.data(), modes=st.lists(st.sampled_from(UPDATE_MODES), min_size=WORKERS,
                                       max_size=WORKERS))
  def kill_all_and_resume(self, data, modes):
    """The process dies with every worker in it; a new one resumes from a checkpoint
    (the newest, or an older one when the newest is damaged)."""
    version, state, trained, finished = data.draw(st.sampled_from(self.checkpoints))
    for worker in self.workers:
      worker.link.kill()
    for worker in self.workers:
      worker.stop(self.stats)
    self._settle_requests(timeout=DEADLINE_S)
    server = ParameterServer(self.staleness, batch_groups=self.b)
    server.load_state_dict(state)
    server.publish(version, _params(version))
    self.books = _Books(server, self.books.eta, version, trained, finished)
    self.workers = [_Worker(w, self.books, m) for w, m in enumerate(modes)]
    self.checkpoints = [c for c in self.checkpoints if c[0] <= version]

  # The rollout side.

  @rule(w=st.integers(0, WORKERS - 1), mode=st.sampled_from(UPDATE_MODES))
  def worker_dies_and_restarts(self, w, mode):
    """Its running groups are lost, and their prompts issued again to its successor."""
    old = self.workers[w]
    old.link.kill()
    self.workers[w] = _Worker(w, self.books, mode)
    old.stop(self.stats)

  @rule(w=st.integers(0, WORKERS - 1), n=st.integers(1, 3), max_new=st.integers(1, 12),
        length=st.integers(1, 8))
  def submit(self, w, n, max_new, length):
    """A request from outside the controller (an evaluation's), sharing the pool."""
    k = self.next_request
    self.next_request += 1
    prompt = [(k + i) % 31 + 1 for i in range(length)]
    request = Request(f"x{k}", prompt, n=n, sampling=SamplingParams(
        temperature=1.0, max_new_tokens=max_new, stop_token_ids=(0,), seed=k))
    pool = self.workers[w].pool
    self.requests.append((pool.submit(request), n, pool, time.monotonic()))

  @rule(w=st.integers(0, WORKERS - 1), data=st.data())
  def abort(self, w, data):
    """Aborts a request of its own, or a controller's group (which then fails)."""
    with self.books.lock:
      ids = [p for p, worker, _ in self.books.running.values() if worker == w]
    ids += [f"x{k}" for k in range(max(0, self.next_request - 4), self.next_request)]
    pick = data.draw(st.integers(0, 99))  # not drawn from `ids`, which timing decides
    if ids:
      self.workers[w].pool.abort(ids[pick % len(ids)])

  @rule(w=st.integers(0, WORKERS - 1), hold_ms=st.integers(0, 30))
  def pause(self, w, hold_ms):
    pool = self.workers[w].pool
    pool.pause()
    steps = pool.metrics()["decode_steps"]
    time.sleep(hold_ms / 1000)
    assert pool.metrics()["decode_steps"] == steps, "a paused pool decoded"
    pool.resume()

  @rule(ms=st.integers(1, 100))
  def time_passes(self, ms):
    time.sleep(ms / 1000)

  # After every step.

  @invariant()
  def each_issued_prompt_is_in_exactly_one_place(self):
    books = self.books
    with books.lock:
      ledger = books.server.state_dict()["ledger"]
      assert len(set(books.trained)) == len(books.trained), "a prompt trained twice"
      for w in range(WORKERS):
        issued = ledger["cursor"].get(str(w), {"index": 0})["index"]
        queued = [(w, p["index"]) for p in ledger["replay"].get(str(w), [])]
        places = ([p for p in books.trained if p[0] == w]
                  + [p for p in books.finished if p[0] == w] + queued)
        assert sorted(places) == [(w, i) for i in range(issued)], (w, sorted(places), issued)
      m = books.server.metrics()
      assert (m["version"], m["running"], m["buffer_size"]) == (
          books.version, len(books.running), len(books.buffered))
      now = time.monotonic()
      assert all(now - since < DEADLINE_S for _, _, since in books.running.values()), (
          "a group outlived its deadline")

  @invariant()
  def no_controller_failed(self):
    for worker in self.workers:
      assert worker.controller.error is None, worker.controller.error

  @invariant()
  def futures_resolve_within_their_deadline(self):
    self._settle_requests(timeout=0)
    now = time.monotonic()
    for worker in self.workers:
      pool = worker.pool
      requested, live = pool.requested_version, pool.version
      worker.swap_seen = {v: t for v, t in worker.swap_seen.items() if v > live}
      if requested > live:
        since = worker.swap_seen.setdefault(requested, now)
        assert now - since < DEADLINE_S, f"a {worker.mode} update is not live after {now - since} s"

  def _settle_requests(self, timeout):
    """Checks the finished requests from outside the controllers; the others must be
    younger than the deadline (or finish within `timeout`)."""
    left = []
    for future, n, pool, since in self.requests:
      if not future.done():
        try:
          future.exception(timeout=max(0.0, min(timeout, since + DEADLINE_S - time.monotonic())))
        except TimeoutError:
          pass
      if future.done():
        _check_samples(future.result(), n, newest=pool.version)
      else:
        assert time.monotonic() - since < DEADLINE_S, "a request outlived its deadline"
        left.append((future, n, pool, since))
    self.requests = left

  def teardown(self):
    """Drains: no new groups start, and what runs finishes within the deadline; then
    every KV block comes back."""
    if not hasattr(self, "workers"):
      return
    for worker in self.workers:
      worker.link.draining = True
    wait_until(lambda: not self.books.running, timeout=DEADLINE_S, interval=0.01,
               message="a group outlived its deadline")
    self._settle_requests(timeout=DEADLINE_S)
    assert not self.requests
    self.each_issued_prompt_is_in_exactly_one_place()
    for worker in self.workers:
      wait_until(lambda: not worker.pool.metrics()["kv_blocks_used"], timeout=DEADLINE_S,
                 interval=0.01)
      m = worker.pool.metrics()
      assert (m["kv_blocks_used"], m["active_slots"], m["preempted_samples"]) == (0, 0, 0), m
      worker.stop(self.stats)
    m = self.books.server.metrics()
    self.stats["trained"] += len(self.books.trained)
    self.stats["lost"] += m["lost_groups"]
    self.stats["dropped"] += m["dropped"]


def test_random_interleavings_over_real_pools_keep_every_lifecycle_invariant():
  stats = collections.Counter()
  _engine()
  run_state_machine_as_test(
      lambda: PoolLifecycle(stats),
      settings=settings(max_examples=8, stateful_step_count=25, deadline=None,
                        derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.too_slow]))
  # The schedules reached what they are meant to: preemption under the KV budget, weight
  # updates in each mode, groups trained, lost with a worker or a process, and dropped.
  assert stats["preemptions"] > 0 and stats["resumed"] > 0, stats
  assert stats["trained"] > 0 and stats["lost"] > 0 and stats["dropped"] > 0, stats
  assert all(stats[f"updates {mode}"] > 0 for mode in UPDATE_MODES), stats
