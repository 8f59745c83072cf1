"""The KL penalty's reference policy in the trainer: the penalty in the reward by hand,
one reference forward per step and none when off, and a run that trains with it and
resumes with the same reference."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import batching, models, sharding, train_step
from async_rl.cli import from_dict
from async_rl.rl import build, entry
from async_rl.rl.checkpoint import Checkpointer
from async_rl.rl.trainer_loop import TrainLoop
from async_rl.trajectory import Group, Trajectory
from rl_test_utils import small_config

LENGTHS = (2, 3, 4, 5)  # completion lengths, one per trajectory: they tell them apart
REWARDS = (1.0, 0.0, 0.5, 0.25)


def _groups():
  rng = np.random.default_rng(0)
  trajs = [Trajectory.from_completion(rng.integers(3, 32, 4), rng.integers(3, 32, c),
                                      rng.normal(-2.5, 0.5, c), np.zeros(c, np.int32), "stop",
                                      reward=r) for c, r in zip(LENGTHS, REWARDS)]
  return [Group("g0", trajs[:2]), Group("g1", trajs[2:])]


def _trainer(**overrides):
  """The micro config's trainer on two devices, its steps recording what they are given."""
  cfg = small_config(**{"cpu.grad_threads": 1, **overrides})
  trainer = build.make_trainer(cfg, sharding.make_mesh(cfg.mesh, jax.devices()[:2]))
  record = {"batches": [], "recomputes": 0}
  steps = trainer.steps

  def step(state, batch, prox_logp):
    record["batches"].append(jax.device_get(batch))
    return steps.step(state, batch, prox_logp)

  def recompute(params, batch):
    record["recomputes"] += 1
    return steps.recompute(params, batch)

  trainer.steps = dataclasses.replace(steps, step=step, recompute=recompute)
  return cfg, trainer, record


def _ref_logp_by_trajectory(cfg, params, groups):
  """Each trajectory's log-probs of its completion under `params`, one row each."""
  out, params = [], jax.tree.map(jnp.asarray, params)
  for t in (t for g in groups for t in g.trajectories):
    alone = batching.pack([t], [0.0], [[0]], rows_per_mb=1, row_len=len(t))
    logp = train_step.recompute_logp(params, alone, model_cfg=cfg.model,
                                     temperature=cfg.generation.logp_temperature)
    out.append(np.asarray(logp)[0, 0][t.loss_mask_T])
  return out


def _by_trajectory(batch, field):
  """A packed batch's `field` on each trajectory's loss tokens, told apart by length."""
  found = {}
  mask = batch.loss_mask.reshape(-1, batch.loss_mask.shape[-1]) != 0
  segments = batch.segment_ids.reshape(mask.shape)
  values = getattr(batch, field).reshape(mask.shape)
  for row in range(mask.shape[0]):
    for seg in set(segments[row][mask[row]]):
      tokens = mask[row] & (segments[row] == seg)
      found[LENGTHS.index(int(tokens.sum()))] = values[row][tokens]
  assert sorted(found) == list(range(len(LENGTHS)))
  return [found[i] for i in range(len(LENGTHS))]


def test_the_kl_penalty_in_the_reward_by_hand():
  beta = 0.7
  cfg, trainer, record = _trainer(**{"ppo.kl_beta": beta, "ppo.kl_in": "reward",
                                     "ppo.kl_estimator": "k3", "advantage.std_level": None})
  groups = _groups()
  ref = _ref_logp_by_trajectory(cfg, jax.device_get(trainer.state.ref_params), groups)
  metrics = trainer.train(groups)
  # k3 of π_behav (the sampling policy) against π_ref, summed over each sample's
  # tokens, comes off its reward; then each group's mean reward is subtracted.
  k3 = []
  for t, r in zip((t for g in groups for t in g.trajectories), ref):
    p, q = np.exp(t.logp_T[t.loss_mask_T].astype(np.float64)), np.exp(r.astype(np.float64))
    k3.append(q / p - 1 - np.log(q / p))
  shaped = np.asarray(REWARDS) - beta * np.asarray([k.sum() for k in k3])
  want_adv = shaped - np.repeat(shaped.reshape(2, 2).mean(1), 2)
  for got, want in zip(_by_trajectory(record["batches"][0], "advantages"), want_adv):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.ptp(want_adv - (np.asarray(REWARDS) - np.repeat(
      np.reshape(REWARDS, (2, 2)).mean(1), 2))) > 0.1, "the penalty must change something"
  np.testing.assert_allclose(metrics["kl"], np.concatenate(k3).mean(), rtol=1e-5)
  assert record["recomputes"] == 2  # the reference's forward and the proximal one
  assert record["batches"][0].ref_logp is None


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_the_reference_forward_runs_only_with_the_penalty_in_the_loss(kl_beta):
  cfg, trainer, record = _trainer(**{"ppo.kl_beta": kl_beta})
  groups = _groups()
  assert (trainer.state.ref_params is None) == (kl_beta == 0)
  if kl_beta:
    ref = _ref_logp_by_trajectory(cfg, jax.device_get(trainer.state.ref_params), groups)
  metrics = trainer.train(groups)
  batch = record["batches"][0]
  assert record["recomputes"] == (2 if kl_beta else 1)
  assert "entropy" in metrics
  if not kl_beta:
    assert batch.ref_logp is None and "kl" not in metrics
    return
  for got, want in zip(_by_trajectory(batch, "ref_logp"), ref):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert 0.0 <= metrics["kl"] < 1e-8  # the policy is still the reference


@pytest.mark.parametrize("ppo, message", [
    ({"kl_beta": -0.1}, "ppo.kl_beta must be >= 0"),
    ({"kl_beta": float("nan")}, "ppo.kl_beta must be finite"),
    ({"kl_estimator": "k4"}, "ppo.kl_estimator must be one of"),
    ({"kl_in": "advantage"}, "ppo.kl_in must be one of"),
    ({"entropy_coef": -0.01}, "ppo.entropy_coef must be >= 0"),
])
def test_invalid_settings_name_the_field(ppo, message):
  with pytest.raises(ValueError, match=message.replace(".", r"\.")):
    build.check(from_dict({"ppo": ppo}))


def _steps(workdir):
  lines = [json.loads(l) for l in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return [l for l in lines if "eval" not in l]


def test_a_run_with_the_kl_penalty_trains_and_resumes_with_the_same_reference(tmp_path):
  overrides = {"ppo.kl_beta": 0.1, "ppo.entropy_coef": 0.01, "optimizer.learning_rate": 3e-3,
               "rollout.reward_fn": "reward_fns_for_tests:length"}
  cfg = small_config(**overrides, num_steps=2)
  init = jax.device_get(models.init_params(cfg.model, jax.random.key(123)))
  seeded = jax.device_get(models.init_params(cfg.model, jax.random.key(cfg.seed)))
  assert not np.array_equal(jax.tree.leaves(init)[0], jax.tree.leaves(seeded)[0])
  entry.run(cfg, str(tmp_path), init_params=init, progress=False, echo=lambda _: None)
  # The resume builds its trainer from the seed's init, then restores.
  summary = entry.run(small_config(**overrides, num_steps=3), str(tmp_path), progress=False,
                      echo=lambda _: None)
  assert (summary["start_version"], summary["end_version"]) == (2, 3)
  steps = _steps(tmp_path)
  assert [s["step"] for s in steps] == [1, 2, 3]
  assert all(s["skipped"] == 0 and s["entropy"] > 0 for s in steps)
  assert steps[0]["kl"] < 1e-8 < 1e-6 < steps[2]["kl"]
  trainer = build.make_trainer(cfg, sharding.make_mesh(cfg.mesh))
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), keep=cfg.checkpoint.keep)
  try:
    assert TrainLoop.restore(checkpointer, trainer, None, echo=lambda _: None).step == 3
  finally:
    checkpointer.close()
  for got, want in zip(jax.tree.leaves(jax.device_get(trainer.state.ref_params)),
                       jax.tree.leaves(init)):
    np.testing.assert_array_equal(got, want)
  assert not np.array_equal(jax.tree.leaves(trainer.state.params)[0], jax.tree.leaves(init)[0])
