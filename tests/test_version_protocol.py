"""The version protocol in a whole run: a non-finite step is skipped, counted and warned
about, the version still advances, and too many in a row stop the run."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from async_rl.param_server import ParameterServer
from async_rl.rl import build
from async_rl.rl.checkpoint import restore_params
from async_rl.rl.errors import NonFiniteError
from async_rl.tasks.registry import make_task
from async_rl.trajectory import Group
from rl_test_utils import small_config


class _Poisoning:
  """The real server, except that batches taken at `versions` carry NaN log-probs."""

  def __init__(self, server, versions):
    self._server, self._versions = server, set(versions)

  def __getattr__(self, name):
    return getattr(self._server, name)

  def get_batch(self, timeout=None):
    groups = self._server.get_batch(timeout)
    if groups is None or self._server.version() not in self._versions:
      return groups
    return [Group(g.prompt_id, tuple(
        dataclasses.replace(t, logp_T=np.where(t.loss_mask_T, np.nan, t.logp_T))
        for t in g.trajectories)) for g in groups]


# Rewards that differ within a group, so that a good step changes the params.
_VARIED = {"rollout.reward_fn": "reward_fns_for_tests:length"}


def _run(cfg, workdir, poison):
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  lines = []
  cfg = build.resolve(cfg)
  task = make_task(cfg.task)
  engines = [build.make_engine(cfg)]  # shared, as `entry.run` shares it: compiled once
  loop = build.train_loop(cfg, str(workdir), _Poisoning(server, poison), task=task,
                          engines=engines, echo=lines.append, progress=False)
  worker = build.rollout_worker(cfg, server, task=task, engines=engines)
  try:
    return loop.run([worker]), lines
  finally:
    server.close()
    worker.close()
    loop.close()


def _params(workdir, cfg, step):
  return jax.tree.map(np.asarray, restore_params(str(workdir / "checkpoints"), cfg.model,
                                                 step=step))


def test_a_non_finite_step_is_skipped_and_the_run_goes_on(tmp_path):
  cfg = small_config(num_steps=4, **{"checkpoint.keep": 10, **_VARIED})
  summary, lines = _run(cfg, tmp_path, poison={1})
  assert summary["end_version"] == 4
  steps = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [s for s in steps if "eval" not in s]
  assert [s["step"] for s in steps] == [1, 2, 3, 4]
  assert [s["skipped"] for s in steps] == [0, 1, 0, 0]
  assert [s["skipped_steps"] for s in steps] == [0, 1, 1, 1]
  assert [s["updates"] for s in steps] == [1, 1, 2, 3]
  assert [s["server"]["version"] for s in steps] == [1, 2, 3, 4]
  warnings = [l for l in lines if l.startswith("WARNING")]
  assert len(warnings) == 1 and "step 2 skipped" in warnings[0]
  assert "non-finite behaviour log-probs" in warnings[0]
  # The skipped step's groups count as consumed, like trained ones.
  assert steps[-1]["server"]["trained"] == 4 * cfg.batch_groups
  before, skipped, after = (_params(tmp_path, cfg, v) for v in (1, 2, 3))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(skipped)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(skipped), jax.tree.leaves(after)))


def test_too_many_skips_in_a_row_stop_the_run_and_keep_the_checkpoint(tmp_path):
  cfg = small_config(num_steps=6, **{"train.max_consecutive_skips": 2, **_VARIED})
  with pytest.raises(NonFiniteError, match=r"2 consecutive training steps .* step 3 "
                                           r"\(loss=nan .*non-finite behaviour log-probs"):
    _run(cfg, tmp_path, poison={1, 2, 3, 4, 5})
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved == [1, 2], "the run stops before checkpointing the failing step"
