"""Runs a task's workflow (`tasks.workflow`) for each prompt group, against a generator pool.

Each group's workflow runs on a thread of its own, so a multi-turn workflow may wait on
the pool and call its environment without holding up the rollout controller or the
pool's decode thread. What it returns enters the run here and is validated once
(`trajectory.validate`). A workflow waits on futures of the runner's own, which follow
the pool's; `close` fails those still waiting, so a pool that never answers (a stalled
generator) cannot keep a workflow thread, and with it the process, alive.

A turn that continues an episode in its held slot (`generate(..., slot=handle)`) goes
to the pool's `extend`; if the pool no longer holds the slot, the runner submits the
same request (id, seed and all) instead, so the turn draws the tokens it would have
drawn in the slot, and the workflow sees one future either way.
"""

import dataclasses
import itertools
import logging
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Optional

import numpy as np

from async_rl.generation import Request
from async_rl.tasks.workflow import SingleTurn, Workflow
from async_rl.trajectory import Trajectory, validate

# Threads block on generator futures and start lazily, one per group in flight: allow
# more than the staleness gate ever lets run at once (staleness.max_concurrent).
_MAX_THREADS = 1024


class EpisodeRunner:
  """`submit(prompt, request)` runs the workflow for one prompt group.

  Args:
    pool: the `GeneratorPool` (anything with its `submit`).
    workflow: None is `SingleTurn`.
    vocab_size: the model's vocabulary; tokens a workflow adds must lie in it.
  """

  def __init__(self, pool, workflow: Optional[Workflow] = None, *,
               vocab_size: Optional[int] = None):
    self._pool = pool
    self._workflow = SingleTurn() if workflow is None else workflow
    self._vocab_size = vocab_size
    self._executor = ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="workflow")
    self._lock = threading.Lock()
    self._waiting: set[Future] = set()
    self._closed = False

  def submit(self, prompt, request: Request) -> Future:
    """The future of the group's trajectories. `request` is the group's first request:
    its id, its prompt's tokens, its `n` samples and its sampling parameters; later
    requests of the workflow get ids `(request_id, k)` for k = 1, 2, ... and, if
    `request.sampling.seed` is set, seeds derived from it and k."""
    return self._executor.submit(self._run, prompt, request)

  def metrics(self) -> dict[str, int]:
    """The workflow's own counters (an agent's lost episodes, say; `Workflow.metrics`)."""
    return self._workflow.metrics()

  def close(self) -> None:
    """Cancels groups not yet started and fails the pool requests running ones wait on."""
    self._executor.shutdown(wait=False, cancel_futures=True)
    with self._lock:
      self._closed = True
      waiting, self._waiting = self._waiting, set()
    for future in waiting:
      _settle(future, exception=RuntimeError("the episode runner was closed"))

  def _follow(self, pool_future: Future, fallback=None) -> Future:
    """A future that takes `pool_future`'s outcome, unless `close` fails it first. If
    `pool_future` resolves to None, it follows the pool future `fallback()` returns."""
    future = Future()
    with self._lock:
      if self._closed:
        future.set_exception(RuntimeError("the episode runner was closed"))
        return future
      self._waiting.add(future)

    def copy(done: Future, fallback=fallback):
      if done.exception() is None and done.result() is None and fallback is not None:
        try:
          fallback().add_done_callback(copy)
        except Exception as e:  # noqa: BLE001 - the waiting workflow learns of it.
          copy_outcome(exception=e)
        return
      if done.exception() is not None:
        copy_outcome(exception=done.exception())
      else:
        copy_outcome(result=done.result())

    def copy_outcome(**outcome):
      with self._lock:
        self._waiting.discard(future)
      _settle(future, **outcome)

    pool_future.add_done_callback(copy)
    return future

  def _run(self, prompt, request: Request) -> list[Trajectory]:
    try:
      generate = _Generate(self._pool, self._follow, request)
      trajectories = list(self._workflow.run(prompt, request.n, generate))
      if not trajectories:
        raise ValueError(f"{type(self._workflow).__name__}.run returned no trajectories")
      # Every turn is sampled with the request's params: its record names the
      # truncation the log-probs are under, whoever built the trajectory.
      top_k, top_p = request.sampling.logp_truncation
      return [dataclasses.replace(validate(t, vocab_size=self._vocab_size), top_k=top_k,
                                  top_p=top_p) for t in trajectories]
    except Exception:
      if self._closed:  # the run is ending; the waits were failed on purpose
        raise
      logging.exception("workflow %s failed on request %r", type(self._workflow).__name__,
                        request.request_id)
      raise


class _Generate:
  """The `generate` of one group's workflow (see `tasks.workflow.Generate`)."""

  def __init__(self, pool, follow, request: Request):
    self._pool, self._follow, self._request = pool, follow, request
    self._calls = itertools.count()
    self.max_new_tokens = request.sampling.max_new_tokens

  def __call__(self, tokens, n=1, *, max_new_tokens=None, stop_ids=None, hold_slot=False,
               slot=None, on_tokens=None) -> Future:
    k, sampling = next(self._calls), self._request.sampling
    changes = {}
    if max_new_tokens is not None:
      changes["max_new_tokens"] = max_new_tokens
    if stop_ids is not None:
      changes["stop_token_ids"] = tuple(stop_ids)
    if k and sampling.seed is not None:
      changes["seed"] = int(np.random.SeedSequence([sampling.seed, k]).generate_state(1)[0])
    request = Request((self._request.request_id, k) if k else self._request.request_id,
                      list(tokens), n, dataclasses.replace(sampling, **changes), hold_slot,
                      on_tokens)
    if slot is None:
      return self._follow(self._pool.submit(request))
    return self._follow(self._pool.extend(slot, request), lambda: self._pool.submit(request))

  def release(self, slot) -> None:
    self._pool.release(slot)


def _settle(future: Future, *, result=None, exception=None) -> None:
  """Sets `future`'s outcome unless the other side (pool or `close`) already did."""
  try:
    if exception is not None:
      future.set_exception(exception)
    else:
      future.set_result(result)
  except InvalidStateError:
    pass
