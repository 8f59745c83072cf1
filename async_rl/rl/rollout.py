"""The rollout side of a run: a worker's prompts, the controller that keeps its generator
pool fed within the staleness gate, and the worker that holds them.

Prompts (`PromptSource`). The parameter server's ledger tells a starting worker where
to resume (`ParameterServer.register_worker`): positions of prompts whose groups were
lost, to be issued again in order, and the cursor its stream continues from. A
position is the stream's state just before the prompt was drawn, so reopening the
stream there and drawing once gives the same prompt back. A sample's random seed is a
function of the run's seed, the worker and the prompt's position (`sample_seed`), not
of how many requests came before it: a prompt issued again after a crash or a resume
is sampled exactly as it would have been.

The controller (`RolloutController`). One thread loops: hand the newest published
weights to the pool (and give it up to a poll to apply them), draw a prompt, acquire a
ticket for its group from the gate (at the pool's version, so a lagging generator
never starts a group whose tokens would arrive too stale), hand it to the task's
workflow (`rl.episodes`; single-turn by default). Trajectories are scored
asynchronously by the reward service (unless the workflow scored every one itself, as
an agent's episodes are) and offered to the parameter server as one group; nothing
here blocks the pool's decode thread.

Failures: an exception in the loop, in the workflow or in a completion callback
rejects the group it concerned (so its capacity is freed), is logged with its
traceback and kept in `error`, and the controller stops; the trainer loop then stops
the run. `waits` says what the controller has been awaiting and for how long, for the
trainer loop's deadlines.

A `RolloutWorker` (built by `rl.build.rollout_worker`) talks to the parameter server
only through its methods, so the server may be the object itself (in process) or a
proxy to a Ray actor.
"""

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import traceback
from concurrent import futures
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

from async_rl.generation import Request, SamplingParams
from async_rl.param_server.buffer import check_versions
from async_rl.rewards import RewardTask
from async_rl.rl.episodes import EpisodeRunner
from async_rl.rl.errors import RewardFailureError, RunError
from async_rl.tasks.protocol import RewardFnLike
from async_rl.tasks.workflow import Workflow
from async_rl.timeline import Span
from async_rl.trajectory import Group

_CLOSE_TIMEOUT_S = 30.0


class Drawn(NamedTuple):
  """A prompt, its position in the stream and the stream's state after it."""
  prompt: Any
  position: dict
  next_position: dict


class PromptSource:
  """Draws a worker's prompts: the replays first, then the stream from `cursor`.

  Args:
    open_stream: a stream state (or None for the start) -> an iterator of prompts
      with a `state()` method, the task's resumable stream.
    cursor: the stream state to continue from; None: the stream's start.
    replay: positions of prompts to issue again first, in order.
  """

  def __init__(self, open_stream: Callable[[Optional[dict]], Iterator], *,
               cursor: Optional[dict] = None, replay=()):
    self._open = open_stream
    self._stream = open_stream(cursor)
    self._replay = list(replay)

  def draw(self) -> Drawn:
    if self._replay:
      position = self._replay.pop(0)
      return Drawn(next(self._open(position)), position, self._stream.state())
    position = self._stream.state()
    prompt = next(self._stream)
    return Drawn(prompt, position, self._stream.state())

  def state(self) -> dict:
    """The stream's cursor (the replays are the server's to keep)."""
    return self._stream.state()


def sample_seed(seed: int, worker: int, position: dict) -> int:
  """The sampling seed, in [0, 2**32), of the group drawn at `position` by `worker`."""
  key = json.dumps([seed, worker, position], sort_keys=True).encode()
  return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


@dataclasses.dataclass
class RolloutStats:
  submitted: int = 0
  offered: int = 0
  admitted: int = 0
  filtered: int = 0
  failed: int = 0
  too_long: int = 0
  generated_tokens: int = 0


class RolloutController:
  """Draws prompts, generates `group_size` samples each, scores them, offers groups.

  Args:
    server: the parameter server (or a proxy with the same methods).
    pool: the `GeneratorPool` it feeds and whose weights it keeps current.
    rewards: a `RewardService`.
    prompts: the worker's `PromptSource` (prompts with `id`, `tokens` and a reward
      reference).
    reference: maps a prompt to what the reward function checks against.
    decode: token ids -> completion text for the reward function.
    reward_fn: the reward function, or its registry name.
    sampling: sampling parameters; each request's seed is `sample_seed(seed,
      worker, position)`.
    group_size: samples per prompt.
    update_mode: how the pool applies new weights: "retract", "keep" or "drain".
    dynamic_filter: drop groups whose rewards are all equal (no learning signal).
    worker: this rollout worker's index (the server's ledger records it).
    seed: the run's seed.
    workflow: turns a prompt group into trajectories; None is single-turn.
    vocab_size: the model's vocabulary, which a workflow's tokens must lie in.
    max_prompt_len: a longer prompt's group is rejected (counted in `too_long`): the
      generator would leave it too little room to answer.
    max_reward_error_rate: the controller fails (`RewardFailureError`, naming the
      function and its first error) once more than this share of the reward service's
      last `error_window` calls failed: a reward that cannot score would otherwise
      train on zeros; 1 never fails.
  """

  def __init__(self, *, server, pool, rewards, prompts: PromptSource, reference: Callable,
               decode: Callable, reward_fn: RewardFnLike, sampling: SamplingParams,
               group_size: int, update_mode: str, dynamic_filter: bool = False,
               worker: int = 0, seed: int = 0, poll_s: float = 0.05,
               workflow: Optional[Workflow] = None, vocab_size: Optional[int] = None,
               max_prompt_len: Optional[int] = None, max_reward_error_rate: float = 1.0):
    self.server, self.pool, self.rewards = server, pool, rewards
    self._max_prompt_len = max_prompt_len
    self._max_reward_error_rate = max_reward_error_rate
    self._episodes = EpisodeRunner(pool, workflow, vocab_size=vocab_size)
    self._prompts, self._reference, self._decode = prompts, reference, decode
    self._reward_fn, self._sampling = reward_fn, sampling
    self._group_size, self._update_mode = group_size, update_mode
    self._dynamic_filter, self._poll_s = dynamic_filter, poll_s
    self._worker, self._seed = worker, seed
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._swap = None  # The future of the newest weight update until the pool applies it.
    self._drawn = None
    # ticket -> (the part it waits on: "generator", "rewards" or "server", since when)
    self._in_flight: dict[int, tuple[str, float]] = {}
    # part -> (its progress counter when last read, when it last changed)
    self._progress = {"generator": (None, 0.0), "rewards": (None, 0.0)}
    self._activity = None  # (what the loop is doing, since when), outside acquire
    self.stats = RolloutStats()
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)

  def start(self) -> "RolloutController":
    self._thread.start()
    return self

  def stop(self, timeout: float = 30.0) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout)
    self._episodes.close()

  def metrics(self) -> dict[str, Any]:
    """The controller's counters (`RolloutStats`) and its workflow's (`EpisodeRunner.metrics`)."""
    with self._lock:
      stats = dataclasses.asdict(self.stats)
    return {**stats, **self._episodes.metrics()}

  def waits(self) -> dict[str, float]:
    """What this controller awaits, and for how many seconds without progress.

    "generator" and "rewards": the oldest group in the pool (in the reward service)
    since it got there or since the pool's last decode step (the service's last
    finished call), whichever is later; "server": the oldest offer or reject under
    way; "controller: <what>": the loop's current step (drawing a prompt, applying
    weights), except waiting for capacity, which is the trainer's pace.
    """
    now = time.monotonic()
    counters = {"generator": self.pool.metrics()["decode_steps"],
                "rewards": self.rewards.metrics()["calls"]}
    with self._lock:
      for part, count in counters.items():
        last, changed = self._progress[part]
        self._progress[part] = (count, changed if last in (None, count) else now)
      oldest = {}
      for part, since in self._in_flight.values():
        oldest[part] = min(oldest.get(part, since), since)
      waits = {part: now - max(since, self._progress.get(part, (0, since))[1])
               for part, since in oldest.items()}
      if self._activity is not None:
        waits[f"controller: {self._activity[0]}"] = now - self._activity[1]
      return waits

  def _run(self):
    try:
      while not self._stop.is_set():
        self._doing("fetching and applying weights")
        self._sync_weights()
        if self._drawn is None:
          self._doing("drawing a prompt")
          self._drawn = self._prompts.draw()
        self._doing(None)
        prompt, position, next_position = self._drawn
        ticket = self.server.acquire(timeout=self._poll_s,
                                     generator_version=self.pool.version, worker=self._worker,
                                     position=position, next_position=next_position)
        if ticket is not None:
          self._drawn = None
          self._doing("submitting a group")
          self._submit(ticket, prompt, position)
    except BaseException as e:  # surfaced to the trainer loop, which stops the run
      self._fail(e)

  def _doing(self, what):
    with self._lock:
      self._activity = None if what is None else (what, time.monotonic())

  def _fail(self, error):
    with self._lock:
      first, self.error = self.error is None, self.error or error
    self._stop.set()
    if not first:  # the first failure is the one reported
      logging.debug("rollout controller of worker %d: also %r", self._worker, error)
    elif isinstance(error, RunError):  # its message says what failed
      logging.error("rollout controller of worker %d failed: %s", self._worker, error)
    else:
      logging.error("rollout controller of worker %d failed", self._worker, exc_info=error)

  def _sync_weights(self):
    got = self.server.fetch(self.pool.requested_version)
    if got is not None:
      version, params = got
      self._swap = self.pool.update_weights(params, version, self._update_mode)
    if self._swap is not None:
      # Until the pool applies the weights, `acquire` counts at its old version, where
      # the gate may have no room (with η = 0 it has none) and would hold the loop for
      # a whole poll; a swap with nothing to drain is live within a decode chunk.
      futures.wait([self._swap], timeout=self._poll_s)
      if self._swap.done():
        self._swap = None

  def _submit(self, ticket, prompt, position):
    if self._max_prompt_len is not None and len(prompt.tokens) > self._max_prompt_len:
      # Rejected, not skipped: the ledger accounts for every prompt drawn.
      self.server.reject(ticket)
      with self._lock:
        self.stats.too_long += 1
        count = self.stats.too_long
      if count & (count - 1) == 0:  # the 1st, 2nd, 4th, ... such prompt
        logging.warning("rollout worker %d: prompt %r has %d tokens, more than "
                        "task.max_prompt_len=%d; its group is rejected (%d so far)",
                        self._worker, prompt.id, len(prompt.tokens), self._max_prompt_len,
                        count)
      return
    sampling = dataclasses.replace(self._sampling,
                                   seed=sample_seed(self._seed, self._worker, position))
    request = Request(prompt.id, list(prompt.tokens), n=self._group_size, sampling=sampling)
    self._wait_on(ticket, "generator")
    try:
      future = self._episodes.submit(prompt, request)
    except BaseException:
      self._release(ticket)
      raise
    with self._lock:
      self.stats.submitted += 1
    future.add_done_callback(self._guarded(ticket, self._on_generated, prompt))

  def _wait_on(self, ticket, part):
    with self._lock:
      self._in_flight[ticket] = (part, time.monotonic())

  def _guarded(self, ticket, callback, *args):
    """`callback(ticket, *args, future)` as a future's done-callback; an exception
    there would otherwise be swallowed and leave the ticket running for ever. Once the
    controller stops, an error only frees its group: the run is ending and the services
    are closing under the callbacks still in flight (the reward service cancels its
    queue, or refuses a group whose generation finished as the run closed)."""
    def run(future):
      try:
        callback(ticket, *args, future)
      except BaseException as e:  # noqa: BLE001 - reported, and the run stops.
        ending = self._stop.is_set()
        self._release(ticket)  # before the report: whoever sees the error sees it freed
        if ending:
          logging.debug("rollout controller of worker %d: group %d ended with the run: %r",
                        self._worker, ticket, e)
        else:
          self._fail(e)
    return run

  def _release(self, ticket):
    """Rejects `ticket` if it is still in flight, so that a failure frees its capacity."""
    with self._lock:
      held = self._in_flight.pop(ticket, None) is not None
      if held:
        self.stats.failed += 1
    if held:
      try:
        self.server.reject(ticket)
      except Exception:  # noqa: BLE001 - the first failure is the one reported.
        logging.exception("could not reject group %d after a failure", ticket)

  def _on_generated(self, ticket, prompt, future):
    # Runs on the workflow's thread: only hands work to the reward service.
    if future.exception() is not None or any(
        s.finish_reason == "aborted" for s in future.result()):
      self._finish(ticket, None, "failed")
      return
    samples = future.result()
    if all(s.reward is not None for s in samples):  # scored by the workflow (an agent)
      self._score(ticket, prompt, samples, [s.reward for s in samples])
      return
    reference = self._reference(prompt)
    self._wait_on(ticket, "rewards")
    rewards = [self.rewards.submit(RewardTask(self._reward_fn, self._decode(s.completion_C),
                                              reference)) for s in samples]
    remaining = [len(rewards)]

    def scored(ticket, _):
      with self._lock:
        remaining[0] -= 1
        if remaining[0]:
          return
      self._score(ticket, prompt, samples, [r.result() for r in rewards])

    for r in rewards:
      r.add_done_callback(self._guarded(ticket, scored))

  def _score(self, ticket, prompt, samples, rewards):
    self._check_reward_failures()
    group = Group(prompt.id, tuple(s.with_reward(r) for s, r in zip(samples, rewards)))
    # Versions only increase: a token newer than the generator's live version was made
    # by params the pool does not say it holds.
    live = self.pool.version
    check_versions([group], newest=live, oldest=None,
                   where=f"rollout worker {self._worker}'s generator (live version {live})")
    with self._lock:
      self.stats.generated_tokens += sum(s.num_policy_tokens for s in samples)
    if self._dynamic_filter and np.ptp(rewards) == 0:
      self._finish(ticket, None, "filtered")
    else:
      self._finish(ticket, group, "offered")

  def _check_reward_failures(self):
    failed, calls, first = self.rewards.recent_failures()
    if calls >= self.rewards.error_window and failed > self._max_reward_error_rate * calls:
      name = getattr(self._reward_fn, "__qualname__", self._reward_fn)
      raise RewardFailureError(
          f"the reward function {name} failed on {failed} of its last {calls} calls, more "
          f"than rollout.max_reward_error_rate={self._max_reward_error_rate:g}; its first "
          f"error: {first}")

  def _finish(self, ticket, group, outcome):
    self._wait_on(ticket, "server")
    if group is None:
      self.server.reject(ticket)
    else:
      admitted = self.server.offer(ticket, group)
      with self._lock:
        self.stats.admitted += int(admitted)
    with self._lock:
      del self._in_flight[ticket]
      setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)


class RolloutWorker:
  """Generates, scores and offers groups until closed (`rl.build.rollout_worker` builds
  one).

  Args:
    index: which worker this is (its prompt stream and seeds depend on it).
    controller: the rollout controller, which feeds `pool` and scores with `rewards`.
    pool: the `GeneratorPool`.
    rewards: the `RewardService`.
  """

  def __init__(self, index: int, controller: RolloutController, pool, rewards):
    self.index, self.controller, self.pool, self.rewards = index, controller, pool, rewards

  def start(self) -> None:
    self.controller.start()

  def error(self) -> Optional[str]:
    """The controller's failure, if it failed (a string, so it crosses processes): a
    `RunError`'s message, which says what failed, or any other error's traceback."""
    e = self.controller.error
    if e is None:
      return None
    return str(e) if isinstance(e, RunError) else "".join(traceback.format_exception(e))

  def waits(self) -> dict[str, float]:
    """What this worker awaits and for how many seconds (`RolloutController.waits`),
    each named with the worker's index."""
    return {f"rollout worker {self.index} {what}": s
            for what, s in self.controller.waits().items()}

  def timeline(self) -> list[Span]:
    """The generator's busy spans so far."""
    return self.pool.timeline.spans()

  def metrics(self) -> dict[str, Any]:
    return {"rollout": self.controller.metrics(), "pool": self.pool.metrics(),
            "rewards": self.rewards.metrics(), "pid": os.getpid()}

  def close(self) -> None:
    """Stops the controller, the pool and the reward service, each within a deadline
    (a hung decode step must not keep the run from ending)."""
    self.controller.stop(_CLOSE_TIMEOUT_S)
    for name, closer in (("generator pool", self.pool.shutdown),
                         ("reward service", self.rewards.close)):
      thread = threading.Thread(target=closer, name=f"close {name}", daemon=True)
      thread.start()
      thread.join(_CLOSE_TIMEOUT_S)
      if thread.is_alive():
        logging.error("rollout worker %d: the %s did not shut down in %.0f s; left behind",
                      self.index, name, _CLOSE_TIMEOUT_S)
