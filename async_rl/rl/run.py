"""In-process placement: every component in this Python process, on threads.

The trainer loop runs on the calling thread; the rollout controller, the generator
pool's decode loop and the reward service's dispatch run on their own threads; the
reward functions run in worker processes.
"""

import threading
from typing import Any, Callable, Optional

from async_rl.config import ExperimentConfig
from async_rl.param_server import ParameterServer
from async_rl.rl.components import make_engine
from async_rl.rl.rollout_worker import RolloutWorker
from async_rl.rl.trainer_loop import TrainerLoop


def run_in_process(cfg: ExperimentConfig, workdir: str, *, init_params=None,
                   stop: Optional[threading.Event] = None,
                   echo: Callable[[str], None] = print,
                   progress: bool = True, task=None) -> dict[str, Any]:
  """Runs (or resumes from `workdir`) the experiment; returns the loop's summary.

  `task` (`tasks.protocol.Task`), if given, replaces `cfg.task_kind`'s: a task built in
  this process, say in a notebook, with a reward function defined there.
  """
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  # One engine for the rollout and held-out pools: its programs compile once.
  engine = make_engine(cfg)
  loop = TrainerLoop(cfg, workdir, server, init_params=init_params, stop=stop, echo=echo,
                     progress=progress, task=task, engine=engine)
  worker = None
  try:
    worker = RolloutWorker(cfg, server, task=task, engine=engine)
    summary = loop.run([worker])
    summary["history"] = loop.history
    return summary
  finally:
    server.close()
    if worker is not None:
      worker.close()
    loop.close()
