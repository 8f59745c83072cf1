"""Runs a task's workflow (`tasks.workflow`) for each prompt group, against a generator pool.

Each group's workflow runs on a thread of its own, so a multi-turn workflow may wait on
the pool and call its environment without holding up the rollout controller or the
pool's decode thread. What it returns enters the run here and is validated once
(`trajectory.validate`).
"""

import dataclasses
import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
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

  def submit(self, prompt, request: Request) -> Future:
    """The future of the group's trajectories. `request` is the group's first request:
    its id, its prompt's tokens, its `n` samples and its sampling parameters; later
    requests of the workflow get ids `(request_id, k)` for k = 1, 2, ... and, if
    `request.sampling.seed` is set, seeds derived from it and k."""
    return self._executor.submit(self._run, prompt, request)

  def close(self) -> None:
    """Cancels groups not yet started; running ones end with the pool's requests."""
    self._executor.shutdown(wait=False, cancel_futures=True)

  def _run(self, prompt, request: Request) -> list[Trajectory]:
    calls = itertools.count()

    def generate(tokens, n=1, *, max_new_tokens=None, stop_ids=None) -> Future:
      k = next(calls)
      changes = {}
      if max_new_tokens is not None:
        changes["max_new_tokens"] = max_new_tokens
      if stop_ids is not None:
        changes["stop_token_ids"] = tuple(stop_ids)
      if k and request.sampling.seed is not None:
        changes["seed"] = int(np.random.SeedSequence([request.sampling.seed, k])
                              .generate_state(1)[0])
      return self._pool.submit(Request(
          (request.request_id, k) if k else request.request_id, list(tokens), n,
          dataclasses.replace(request.sampling, **changes)))

    try:
      trajectories = list(self._workflow.run(prompt, request.n, generate))
      if not trajectories:
        raise ValueError(f"{type(self._workflow).__name__}.run returned no trajectories")
      return [validate(t, vocab_size=self._vocab_size) for t in trajectories]
    except Exception:
      logging.exception("workflow %s failed on request %r", type(self._workflow).__name__,
                        request.request_id)
      raise
