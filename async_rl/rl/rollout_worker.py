"""The rollout side of a run: a generator pool, a reward service and a controller.

A `RolloutWorker` talks to the parameter server only through its methods, so the
server may be the object itself (in process) or a proxy to a Ray actor.
"""

import logging
import os
import threading
import traceback
from typing import Any, Optional

from async_rl.config import ExperimentConfig
from async_rl.generation import GeneratorPool
from async_rl.rewards import RewardService
from async_rl.rl.components import make_engine, reward_fn, sampling_params
from async_rl.rl.prompt_source import PromptSource
from async_rl.rl.rollout import RolloutController
from async_rl.tasks.registry import make_task
from async_rl.timeline import Span

_CLOSE_TIMEOUT_S = 30.0


class RolloutWorker:
  """Generates, scores and offers groups until closed; starts at the server's weights.

  It registers with the server as worker `worker_index`, which writes off anything
  an earlier worker of that index left running and says where its prompt stream
  resumes (the prompts to issue again, then the stream's cursor).

  Args:
    cfg: the experiment.
    server: the parameter server or a proxy with the same methods.
    worker_index: which worker this is (its prompt stream and seeds depend on it).
    task: the task (`tasks.protocol.Task`); None builds `cfg.task_kind`'s.
    engine: the generator engine (None: `make_engine(cfg)`); in one process the
      held-out evaluation's pool shares it, so its programs compile once.
  """

  def __init__(self, cfg: ExperimentConfig, server, *, worker_index: int = 0, task=None,
               engine=None):
    self.index = worker_index
    start = server.register_worker(worker_index)
    version, params = server.fetch(-1)
    self.task = make_task(cfg) if task is None else task
    self.prompts = PromptSource(
        lambda state: self.task.stream(state, worker_index=worker_index),
        cursor=start["cursor"], replay=start["replay"])
    self.pool = GeneratorPool(engine or make_engine(cfg), params, version=version,
                              seed=cfg.seed + worker_index)
    self.rewards = RewardService(num_workers=cfg.rollout.reward_workers,
                                 timeout_s=cfg.rollout.reward_timeout_s,
                                 allow_weak_sandbox=cfg.rollout.allow_weak_sandbox)
    self.controller = RolloutController(
        server=server, pool=self.pool, rewards=self.rewards, prompts=self.prompts,
        reference=self.task.reference, decode=self.task.tokenizer.decode,
        reward_fn=reward_fn(cfg, self.task), sampling=sampling_params(cfg, self.task),
        group_size=cfg.generation.group_size, update_mode=cfg.generation.update_mode,
        dynamic_filter=cfg.rollout.dynamic_filter, worker=worker_index, seed=cfg.seed,
        workflow=self.task.workflow, vocab_size=cfg.model.vocab_size)

  def start(self) -> None:
    self.controller.start()

  def error(self) -> Optional[str]:
    """The controller's failure with its traceback, if it failed (a string, so it
    crosses processes)."""
    e = self.controller.error
    return None if e is None else "".join(traceback.format_exception(e))

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
