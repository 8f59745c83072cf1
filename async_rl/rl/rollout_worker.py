"""The rollout side of a run: a generator pool, a reward service and a controller.

A `RolloutWorker` talks to the parameter server only through its methods, so the
server may be the object itself (in process) or a proxy to a Ray actor.
"""

import traceback
from typing import Any, Optional

from async_rl.config import ExperimentConfig
from async_rl.generation import GeneratorPool
from async_rl.rewards import RewardService
from async_rl.rl.components import make_engine, reward_fn, sampling_params
from async_rl.rl.rollout import RolloutController
from async_rl.tasks.registry import make_task
from async_rl.timeline import Span


class RolloutWorker:
  """Generates, scores and offers groups until closed; starts at the server's weights.

  Args:
    cfg: the experiment.
    server: the parameter server or a proxy with the same methods.
    worker_index: which worker this is (its prompt stream and seeds depend on it).
    stream_state: the prompt stream's position to resume from, if any.
    task: the task (`tasks.protocol.Task`); None builds `cfg.task_kind`'s.
  """

  def __init__(self, cfg: ExperimentConfig, server, *, worker_index: int = 0,
               stream_state: Optional[dict] = None, task=None):
    version, params = server.fetch(-1)
    self.task = make_task(cfg) if task is None else task
    self.prompts = self.task.stream(stream_state, worker_index=worker_index)
    self.pool = GeneratorPool(make_engine(cfg), params, version=version,
                              seed=cfg.seed + worker_index)
    self.rewards = RewardService(num_workers=cfg.rollout.reward_workers,
                                 timeout_s=cfg.rollout.reward_timeout_s,
                                 allow_weak_sandbox=cfg.rollout.allow_weak_sandbox)
    self.controller = RolloutController(
        server=server, pool=self.pool, rewards=self.rewards, prompts=self.prompts,
        reference=self.task.reference, decode=self.task.tokenizer.decode,
        reward_fn=reward_fn(cfg, self.task), sampling=sampling_params(cfg, self.task),
        group_size=cfg.generation.group_size, update_mode=cfg.generation.update_mode,
        dynamic_filter=cfg.rollout.dynamic_filter, workflow=self.task.workflow,
        vocab_size=cfg.model.vocab_size)

  def start(self) -> None:
    self.controller.start()

  def error(self) -> Optional[str]:
    """The controller's failure with its traceback, if it failed (a string, so it
    crosses processes)."""
    e = self.controller.error
    return None if e is None else "".join(traceback.format_exception(e))

  def prompt_state(self) -> dict:
    return self.prompts.state()

  def timeline(self) -> list[Span]:
    """The generator's busy spans so far."""
    return self.pool.timeline.spans()

  def metrics(self) -> dict[str, Any]:
    return {"rollout": self.controller.metrics(), "pool": self.pool.metrics(),
            "rewards": self.rewards.metrics()}

  def close(self) -> None:
    self.controller.stop()
    self.pool.shutdown()
    self.rewards.close()
