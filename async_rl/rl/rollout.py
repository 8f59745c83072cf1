"""The rollout controller: keeps the generator pool fed within the staleness gate.

One thread loops: apply the newest published weights to the pool, acquire a prompt
group from the gate (at the pool's version, so a lagging generator never starts a
group whose tokens would arrive too stale), draw a prompt, hand it to the task's
workflow (`rl.episodes`; single-turn by default). Trajectories are scored
asynchronously by the reward service and offered to the parameter server as one
group; nothing here blocks the pool's decode thread.
"""

import dataclasses
import logging
import threading
from typing import Any, Callable, Iterator, Optional

import numpy as np

from async_rl.generation import Request, SamplingParams
from async_rl.rewards import RewardTask
from async_rl.rl.episodes import EpisodeRunner
from async_rl.tasks.protocol import RewardFnLike
from async_rl.tasks.workflow import Workflow
from async_rl.trajectory import Group


@dataclasses.dataclass
class RolloutStats:
  submitted: int = 0
  offered: int = 0
  admitted: int = 0
  filtered: int = 0
  failed: int = 0
  generated_tokens: int = 0


class RolloutController:
  """Draws prompts, generates `group_size` samples each, scores them, offers groups.

  Args:
    server: the parameter server (or a proxy with the same methods).
    pool: the `GeneratorPool` it feeds and whose weights it keeps current.
    rewards: a `RewardService`.
    prompts: an iterator of prompts with `id`, `tokens` and a reward reference.
    reference: maps a prompt to what the reward function checks against.
    decode: token ids -> completion text for the reward function.
    reward_fn: the reward function, or its registry name.
    sampling: sampling parameters (the seed is drawn per request by the pool).
    group_size: samples per prompt.
    update_mode: how the pool applies new weights: "retract", "keep" or "drain".
    dynamic_filter: drop groups whose rewards are all equal (no learning signal).
    workflow: turns a prompt group into trajectories; None is single-turn.
    vocab_size: the model's vocabulary, which a workflow's tokens must lie in.
  """

  def __init__(self, *, server, pool, rewards, prompts: Iterator, reference: Callable,
               decode: Callable, reward_fn: RewardFnLike, sampling: SamplingParams,
               group_size: int, update_mode: str, dynamic_filter: bool = False,
               poll_s: float = 0.05, workflow: Optional[Workflow] = None,
               vocab_size: Optional[int] = None):
    self.server, self.pool, self.rewards = server, pool, rewards
    self._episodes = EpisodeRunner(pool, workflow, vocab_size=vocab_size)
    self._prompts, self._reference, self._decode = prompts, reference, decode
    self._reward_fn, self._sampling = reward_fn, sampling
    self._group_size, self._update_mode = group_size, update_mode
    self._dynamic_filter, self._poll_s = dynamic_filter, poll_s
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._requested_version = pool.version
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
    with self._lock:
      return dataclasses.asdict(self.stats)

  def _run(self):
    try:
      while not self._stop.is_set():
        self._sync_weights()
        if self.server.acquire(timeout=self._poll_s, generator_version=self.pool.version):
          self._submit(next(self._prompts))
    except BaseException as e:  # surfaced to the trainer loop, which stops the run
      logging.exception("rollout controller failed")
      self.error = e

  def _sync_weights(self):
    got = self.server.fetch(self._requested_version)
    if got is not None:
      version, params = got
      self.pool.update_weights(params, version, self._update_mode)
      self._requested_version = version

  def _submit(self, prompt):
    request = Request(prompt.id, list(prompt.tokens), n=self._group_size,
                      sampling=self._sampling)
    try:
      future = self._episodes.submit(prompt, request)
    except BaseException:
      self.server.reject()
      raise
    with self._lock:
      self.stats.submitted += 1
    future.add_done_callback(lambda f: self._on_generated(prompt, f))

  def _on_generated(self, prompt, future):
    # Runs on the workflow's thread: only hands work to the reward service.
    if future.exception() is not None or any(
        s.finish_reason == "aborted" for s in future.result()):
      self._finish(None, "failed")
      return
    samples = future.result()
    reference = self._reference(prompt)
    rewards = [self.rewards.submit(RewardTask(self._reward_fn, self._decode(s.completion_C),
                                              reference)) for s in samples]
    remaining = [len(rewards)]

    def scored(_):
      with self._lock:
        remaining[0] -= 1
        if remaining[0]:
          return
      self._score(prompt, samples, [r.result() for r in rewards])

    for r in rewards:
      r.add_done_callback(scored)

  def _score(self, prompt, samples, rewards):
    group = Group(prompt.id, tuple(s.with_reward(r) for s, r in zip(samples, rewards)))
    with self._lock:
      self.stats.generated_tokens += sum(s.num_policy_tokens for s in samples)
    if self._dynamic_filter and np.ptp(rewards) == 0:
      self._finish(None, "filtered")
    else:
      self._finish(group, "offered")

  def _finish(self, group, outcome):
    if group is None:
      self.server.reject()
    else:
      admitted = self.server.offer(group)
      with self._lock:
        self.stats.admitted += int(admitted)
    with self._lock:
      setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
