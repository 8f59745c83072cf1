"""Versions asserted at every hand-off: a token newer than the published params, staler
than the bound, or in a loss without a version, and a version that does not advance,
stop the run with an error naming the sample and the versions; nothing is trained."""

import types

import numpy as np
import pytest

from async_rl.config import StalenessConfig
from async_rl.param_server import ParameterServer
from async_rl.param_server.buffer import check_versions
from async_rl.rl.deadlines import Deadlines
from async_rl.rl.errors import VersionError
from async_rl.rl.trainer_loop import Outputs, Settings, TrainLoop
from async_rl.trajectory import Group, Trajectory


def _group(*versions, prompt_id="p"):
  """One sample per entry of `versions` (its completion tokens' versions), after a prompt
  of two tokens."""
  return Group(prompt_id, tuple(
      Trajectory.from_completion(np.array([5, 6]), np.arange(len(v)), np.zeros(len(v)),
                                 np.array(v, np.int32), "stop", reward=1.0)
      for v in versions))


def test_check_versions_bounds_every_trained_token_and_names_the_first_outside():
  check_versions([_group([3, 4, 5], [5])], newest=5, oldest=3, where="w")  # both ends in
  check_versions([_group([0, 9])], newest=9, oldest=None, where="w")
  with pytest.raises(VersionError, match=r"^step 7: token 3 of sample 1 of group 'q' was made "
                     r"by version 2, outside \[3, 5\] \(2 such tokens in that sample\)"):
    check_versions([_group([5], prompt_id="p"), _group([4], [5, 2, 1], prompt_id="q")],
                   newest=5, oldest=3, where="step 7")
  with pytest.raises(VersionError, match=r"token 2 of sample 0 .* was made by version 6, "
                     r"outside \[0, 5\]"):
    check_versions([_group([6])], newest=5, oldest=None, where="w")
  # A token in the loss must say which params made it.
  untagged = _group([5, 5])
  traj = untagged.trajectories[0]
  traj.versions_T[3] = -1
  with pytest.raises(VersionError, match="token 3 of sample 0 .* carries no version"):
    check_versions([untagged], newest=5, oldest=None, where="w")
  # Masked out of the loss, an old token is not trained and breaks nothing.
  traj.loss_mask_T[3] = False
  check_versions([untagged], newest=5, oldest=5, where="w")


def test_the_server_refuses_a_future_token_and_a_publish_that_does_not_advance():
  server = ParameterServer(StalenessConfig(max_staleness=1, max_concurrent=8), batch_groups=1)
  params = {"w": np.zeros(2, np.float32)}
  server.publish(1, params)
  ticket = server.acquire()
  with pytest.raises(VersionError, match=r"offered at published version 1: token 3 of sample 0 "
                     r"of group 'p' was made by version 2"):
    server.offer(ticket, _group([1, 2]))
  assert server.offer(ticket, _group([0, 1]))
  for version in (1, 0):
    with pytest.raises(VersionError, match="versions must increase"):
      server.publish(version, params)


class _Trainer:
  def __init__(self, version, advance=1):
    self.version, self.advance, self.trained = version, advance, []

  def train(self, groups):
    self.trained.append(groups)
    self.version += self.advance
    return {}


def _loop(trainer, max_staleness, recorded):
  settings = Settings(num_steps=10, eval_every=0, checkpoint_every=1, max_consecutive_skips=1,
                      learning_rate=lambda _: 0.0, decode=str, max_staleness=max_staleness)
  schedule = types.SimpleNamespace(record=lambda step, groups: recorded.append(step))
  outputs = Outputs(checkpointer=None, log=types.SimpleNamespace(evals={}), schedule=schedule)
  return TrainLoop(trainer, None, None, Deadlines(60, 600, echo=lambda _: None), settings,
                   outputs)


def test_the_trainer_refuses_a_batch_outside_the_bound_before_it_records_or_trains():
  recorded = []
  trainer = _Trainer(version=5)
  loop = _loop(trainer, max_staleness=2, recorded=recorded)
  loop._train([_group([3, 5], [4])])  # staleness 2 at most: trained
  assert recorded == [6] and len(trainer.trained) == 1
  with pytest.raises(VersionError, match=r"the batch of training step 7 \(params of version 6, "
                     r"max_staleness 2\): token 2 of sample 0 of group 'p' was made by version 3, "
                     r"outside \[4, 6\]"):
    loop._train([_group([3, 6])])
  with pytest.raises(VersionError, match="token 2 .* was made by version 7, outside \\[4, 6\\]"):
    loop._train([_group([7])])
  assert recorded == [6] and len(trainer.trained) == 1
  # Without a bound (on_stale="admit") only a token newer than the params stops it.
  _loop(trainer, max_staleness=None, recorded=recorded)._train([_group([0, 6])])
  assert trainer.version == 7


def test_a_step_that_does_not_advance_the_version_by_one_stops_the_run():
  loop = _loop(_Trainer(version=5, advance=0), max_staleness=1, recorded=[])
  with pytest.raises(VersionError, match="training step 6 left the trainer at version 5, not 6"):
    loop._train([_group([5])])

