"""Recording an asynchronous run's schedule and replaying it: the train state equals the
recorded run's at every checkpoint bit for bit, for each weight update mode, after a
resume too; a changed record, config or thread count, or a run recorded without its
schedule, is refused, naming what differs or is missing."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from async_rl.rl import checkpoint, entry, replay, schedule
from async_rl.rl.errors import ConfigError, WorkdirError
from async_rl.trajectory import Group, Trajectory
from rl_test_utils import small_config

ROOT = Path(__file__).parents[1]
ETA = 2
# Threaded micro-batches, and a reward that differs within a group, so that every
# token, log-prob and version of the batch moves the params.
# The record is kept whole (not pruned with the checkpoints), so that a replay starts
# from the initial params; `_prune` makes a pruned one from it.
RECORDED = {"staleness.max_staleness": ETA, "cpu.grad_threads": 2,
            "rollout.reward_fn": "reward_fns_for_tests:length", "run.prune_schedule": False}


def _config(mode, **overrides):
  return small_config(**{**RECORDED, "generation.update_mode": mode, **overrides})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
  """The workdir of a recorded run of each update mode (made when first asked for)."""
  runs = {}

  def get(mode):
    if mode not in runs:
      workdir = tmp_path_factory.mktemp(f"recorded_{mode}")
      entry.run(_config(mode), str(workdir), progress=False, echo=lambda _: None)
      runs[mode] = workdir
    return runs[mode]
  return get


def _lines(workdir):
  rows = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return {l["step"]: l for l in map(json.loads, rows) if "loss" in l}


def _schedule(workdir):
  return str(Path(workdir) / schedule.SCHEDULE_DIR)


def _copy(workdir, tmp_path):
  shutil.copytree(workdir, tmp_path / "recorded")
  return tmp_path / "recorded"


@pytest.mark.parametrize("mode", ["retract", "keep", "drain"])
def test_a_recorded_async_run_replays_bit_for_bit_at_every_checkpoint(tmp_path, recorded, mode):
  old = recorded(mode)
  logged = _lines(old)
  assert schedule.recorded_steps(_schedule(old)) == [1, 2, 3]
  staleness, generated = [], 0
  for step in (1, 2, 3):
    groups, context = schedule.read_batch(_schedule(old), step)
    # The record is the batch the run trained, in its order.
    assert [g.prompt_id for g in groups] == logged[step]["prompts"]
    assert context["grad_threads"] == 2 and logged[step]["time_record_s"] > 0
    versions = np.concatenate([t.versions_T[t.versions_T >= 0]
                               for g in groups for t in g.trajectories])
    staleness.append(step - 1 - versions.min())
    generated += versions.size
  assert max(staleness) > 0 and max(staleness) <= ETA  # asynchronous, within the bound

  summary = entry.replay(_config(mode), str(tmp_path / "new"), str(old), progress=False,
                         echo=lambda _: None)
  assert summary["compared"] == [1, 2, 3] and summary["end_version"] == 3
  assert 0 < summary["logp_tokens"] and summary["logp_max_abs_diff"] <= replay.LOGP_ATOL
  # Every generated token is checked under the version that produced it; with "keep",
  # all but those produced from a cache that another version computed.
  assert summary["logp_tokens"] + summary["logp_unchecked"] == generated
  assert summary["logp_unchecked"] == 0 or mode == "keep"
  replayed = _lines(tmp_path / "new")
  assert [replayed[s]["loss"] for s in (1, 2, 3)] == [logged[s]["loss"] for s in (1, 2, 3)]
  assert checkpoint.steps(str(tmp_path / "new" / "checkpoints"))[-1] == 3


def _generated(directory, steps):
  """How many generated tokens `steps`' batches hold."""
  return sum(int(np.count_nonzero(t.versions_T >= 0)) for step in steps
             for g in schedule.read_batch(directory, step)[0] for t in g.trajectories)


def test_a_pruned_record_replays_from_the_checkpoint_it_starts_after(tmp_path, recorded):
  # What `run.prune_schedule` leaves once checkpoint 1 is the oldest kept: steps 2 and 3.
  old = _copy(recorded("retract"), tmp_path)
  (Path(_schedule(old)) / "00000001.npz").unlink()
  lines = []
  summary = entry.replay(_config("retract"), str(tmp_path / "new"), str(old), progress=False,
                         echo=lines.append)
  assert f"the replay starts from {old}'s checkpoint 1, where its record starts" in lines
  assert summary["start_version"] == 1 and summary["compared"] == [1, 2, 3]
  # Every token is checked, those of versions before the start too (version 0: the
  # initial params, which the replay makes as the run did).
  assert summary["logp_tokens"] == _generated(_schedule(old), (2, 3)) > 0
  assert summary["logp_unchecked"] == 0
  # Once retention has deleted checkpoint 1, a replay starts from checkpoint 2, the
  # oldest the record goes on from.
  shutil.rmtree(old / "checkpoints" / "1")
  lines = []
  summary = entry.replay(_config("retract"), str(tmp_path / "other"), str(old), progress=False,
                         echo=lines.append)
  assert (f"the replay starts from {old}'s checkpoint 2, the oldest its record (from step 2) "
          f"goes on from") in lines
  assert summary["start_version"] == 2 and summary["compared"] == [2, 3]
  # With no checkpoint left that the record goes on from, there is nothing to start from.
  shutil.rmtree(old / "checkpoints" / "2")
  with pytest.raises(ConfigError, match=r"holds the batches of steps 2 to 3; a replay starts "
                     r"from a checkpoint of .* that they go on from, and none is \(its "
                     r"checkpoints: \[3\]\)"):
    entry.replay(_config("retract"), str(tmp_path / "third"), str(old), progress=False,
                 echo=lambda _: None)


def test_a_default_run_longer_than_its_kept_checkpoints_prunes_its_record_and_replays(tmp_path):
  # The default retention (checkpoint.keep=3) and prune (run.prune_schedule): checkpoints
  # 1 and 2 are deleted on the way. The record follows what retention kept (no batch a
  # replay cannot use), and a replay starts from the oldest checkpoint kept.
  cfg = _config("retract", **{"run.prune_schedule": True, "checkpoint.every_steps": 1,
                              "num_steps": 5})
  run = tmp_path / "run"
  entry.run(cfg, str(run), progress=False, echo=lambda _: None)
  assert checkpoint.steps(str(run / "checkpoints")) == [3, 4, 5]
  assert schedule.recorded_steps(_schedule(run)) == [4, 5]
  lines = []
  summary = entry.replay(cfg, str(tmp_path / "new"), str(run), progress=False,
                         echo=lines.append)
  assert f"the replay starts from {run}'s checkpoint 3, where its record starts" in lines
  assert summary["start_version"] == 3 and summary["compared"] == [3, 4, 5]
  # Tokens of versions neither the replay produced nor the run kept are counted, unchecked.
  assert summary["end_version"] == 5
  assert summary["logp_tokens"] + summary["logp_unchecked"] == _generated(_schedule(run), (4, 5))


def test_a_resumed_run_records_the_batches_its_checkpoint_keeps_and_replays_in_two_parts(
    tmp_path, recorded):
  # A run that lost its checkpoints 2 and 3 (killed before they were safe) resumes from
  # checkpoint 1: the batches of steps 2 and 3 are superseded.
  old = _copy(recorded("keep"), tmp_path)
  for step in (2, 3):
    shutil.rmtree(old / "checkpoints" / str(step))
  cfg = _config("keep", num_steps=2)
  entry.run(cfg, str(old), progress=False, echo=lambda _: None)
  assert schedule.recorded_steps(_schedule(old)) == [1, 2]
  groups, _ = schedule.read_batch(_schedule(old), 2)
  assert [g.prompt_id for g in groups] == _lines(old)[2]["prompts"]

  # A replay stopped after step 1 goes on from its own checkpoint.
  lines = []
  for steps in (1, 2):
    summary = entry.replay(_config("keep", num_steps=steps), str(tmp_path / "new"), str(old),
                           progress=False, echo=lines.append)
    # The restored state is compared too.
    assert summary["start_version"] == steps - 1 and summary["compared"] == [1, 2][:steps]
  assert "resumed from checkpoint 1 in" in " ".join(lines)
  for step in (1, 2):
    assert f"replay v={step}: the train state equals {old}'s checkpoint {step} bit for bit" in lines


def _rewrite(directory, step, change, *, digest):
  """Rewrites the record of `step` with `change(arrays)` applied, its digest recomputed
  or left as it was."""
  path = Path(directory) / f"{step:08d}.npz"
  with np.load(path) as f:
    arrays = {name: f[name] for name in f.files}
  change(arrays)
  if digest:
    arrays = schedule.encode(*schedule.decode(arrays))
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def _first_completion_token(arrays):
  i = int(arrays["prompt_lens"][0])
  arrays["tokens"][i] = (arrays["tokens"][i] + 1) % small_config().model.vocab_size


def _drop_a_trained_token(arrays):
  arrays["loss_mask"][np.flatnonzero(arrays["loss_mask"])[0]] = False


@pytest.mark.parametrize("change, step, digest, log, error", [
    (_drop_a_trained_token, 1, False, True,
     "the record of step 1 .* does not match its digest"),
    # Rewritten whole: the behaviour log-probs no longer fit the tokens...
    (_first_completion_token, 1, True, True,
     "step 1 of .*: a recorded behaviour log-prob differs"),
    # ...or the step is not the one the run logged...
    (_drop_a_trained_token, 2, True, True, "step 2 differs from .*'s log: trained_tokens is"),
    # ...or, without the run's log, the params are not those of its checkpoint.
    (_drop_a_trained_token, 2, True, False,
     r"the train state after step 2 differs from .*'s checkpoint 2: .*params.* elements differ"),
])
def test_a_changed_record_is_refused_naming_the_step(tmp_path, recorded, change, step, digest,
                                                     log, error):
  old = _copy(recorded("drain"), tmp_path)
  _rewrite(_schedule(old), step, change, digest=digest)
  if not log:
    (old / "metrics.jsonl").unlink()
  with pytest.raises(replay.ReplayError, match=error):
    entry.replay(_config("drain"), str(tmp_path / "new"), str(old), progress=False,
                 echo=lambda _: None)


def test_a_replay_needs_the_recorded_config_thread_count_and_schedule(tmp_path, recorded):
  old = recorded("drain")
  replay_into = lambda cfg, recorded_dir, name: entry.replay(
      cfg, str(tmp_path / name), str(recorded_dir), progress=False, echo=lambda _: None)
  with pytest.raises(ConfigError, match=r"optimizer.learning_rate: 0.0001 -> 0.5"):
    replay_into(_config("drain", **{"optimizer.learning_rate": 0.5}), old, "a")
  with pytest.raises(replay.ReplayError, match="grad_threads=2, this replay has 1.*"
                                               "set cpu.grad_threads=2"):
    replay_into(_config("drain", **{"cpu.grad_threads": 1}), old, "b")
  with pytest.raises(ConfigError, match="holds no config.json"):
    replay_into(_config("drain"), tmp_path / "nothing", "c")
  with pytest.raises(ConfigError, match="a workdir of its own"):
    replay_into(_config("drain"), old, old)
  unrecorded = _copy(old, tmp_path)
  shutil.rmtree(unrecorded / schedule.SCHEDULE_DIR)
  with pytest.raises(ConfigError, match="holds no recorded schedule .*run.record_schedule=False"):
    replay_into(_config("drain"), unrecorded, "d")


def test_the_binary_says_why_it_cannot_replay(tmp_path):
  out = subprocess.run([sys.executable, "-m", "launch.train", "--config=micro",
                        f"--workdir={tmp_path / 'new'}", f"--replay={tmp_path / 'nothing'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  assert f"invalid config: --replay needs the workdir of a recorded run; {tmp_path / 'nothing'} " \
         "holds no config.json" in out.stderr


def _traj(versions, prompt_len=2):
  C = len(versions)
  return Trajectory.from_completion(np.arange(prompt_len), np.arange(C), np.zeros(C),
                                    np.asarray(versions), "stop", reward=0.0)


def test_the_recomputable_tokens_are_those_whose_cache_their_version_computed():
  traj = _traj([3, 3, 4, 3, 4])
  got = {mode: replay.recomputable_T(traj, 3, mode)[2:].tolist()
         for mode in ("retract", "keep", "drain")}
  assert got["retract"] == got["drain"] == [True, True, False, True, False]
  assert got["keep"] == [True, True, False, False, False]  # the cache holds version 4 after
  assert replay.recomputable_T(traj, 4, "keep")[2:].tolist() == [False] * 5
  assert not replay.recomputable_T(traj, 3, "retract")[:2].any()  # the prompt


def test_the_record_keeps_the_truncation_the_log_probs_are_under():
  truncated = dataclasses.replace(_traj([0, 0]), top_k=8, top_p=0.9)
  groups, _ = schedule.decode(schedule.encode([Group("p", (truncated, _traj([0])))], {}))
  assert [(t.top_k, t.top_p) for t in groups[0].trajectories] == [(8, 0.9), (0, 1.0)]


def test_a_resume_keeps_the_record_through_its_checkpoint_and_a_gap_stops_recording(tmp_path):
  batch = [Group("p", (_traj([0, 0]).with_reward(1.0), _traj([0]).with_reward(0.5)))]
  context = {"grad_threads": 1}
  record = schedule.recorder(str(tmp_path), None, context)
  for step in (1, 2, 3, 4):
    record.record(step, batch)
  record = schedule.recorder(str(tmp_path), 2, context)
  assert schedule.recorded_steps(str(tmp_path)) == [1, 2]
  record.record(3, batch)
  groups, got = schedule.read_batch(str(tmp_path), 3)
  assert got == context and groups[0].prompt_id == "p"
  for a, b in zip(groups[0].trajectories, batch[0].trajectories, strict=True):
    for field in ("tokens_T", "loss_mask_T", "logp_T", "versions_T"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert (a.prompt_len, a.finish_reason, a.reward) == (b.prompt_len, b.finish_reason, b.reward)

  warnings = []
  record = schedule.recorder(str(tmp_path), 5, context, echo=warnings.append)  # 4 and 5 missing
  record.record(6, batch)
  assert schedule.recorded_steps(str(tmp_path)) == [1, 2, 3]
  assert "does not record its schedule" in warnings[0]
  schedule.recorder(str(tmp_path), None, context, enabled=False)  # a fresh run keeps none
  assert schedule.recorded_steps(str(tmp_path)) == []


def test_the_first_difference_names_the_leaf_and_how_many_elements_differ():
  a = {"w": np.zeros(4, np.float32), "b": np.ones(2, np.float32)}
  b = {"w": np.zeros(4, np.float32), "b": np.array([1, 1.5], np.float32)}
  assert replay.first_difference(a, a) is None
  assert replay.first_difference(a, b) == "['b']: 1 of 2 elements differ (by up to 0.5)"
  # Bit for bit: -0.0 is not 0.0.
  c = {"w": np.array([0, 0, 0, -0.0], np.float32), "b": a["b"]}
  assert "['w']: 1 of 4" in replay.first_difference(a, c)


def test_a_replay_starts_from_the_initial_params_or_the_oldest_checkpoint_the_record_goes_on_from():
  assert schedule.replay_start([1, 2, 3], [2, 3]) == 0
  # The record and checkpoints of a default micro run of 16 steps, every 4th kept 3 deep.
  assert schedule.replay_start(list(range(5, 17)), [8, 12, 16]) == 8
  assert schedule.replay_start(list(range(5, 17)), [4, 8, 12]) == 4
  assert schedule.replay_start([2, 3], [1, 3]) == 1
  assert schedule.replay_start([2, 3], [3]) is None  # a batch after it is needed
  assert schedule.replay_start([], [1]) is None


def test_the_record_is_pruned_up_to_the_oldest_kept_checkpoint_and_resumes_after_it(tmp_path):
  batch = [Group("p", (_traj([0, 0]).with_reward(1.0),))]
  directory, checkpoints = str(tmp_path / "schedule"), tmp_path / "checkpoints"
  kept = lambda: checkpoint.steps(str(checkpoints))
  record = schedule.recorder(directory, None, {}, checkpoints=kept)
  record.record(1, batch)
  record.record(2, batch)
  assert schedule.recorded_steps(directory) == [1, 2]  # no checkpoint yet
  for step in (2, 3):
    (checkpoints / str(step)).mkdir(parents=True)
  record.record(3, batch)
  assert schedule.recorded_steps(directory) == [3]  # a replay starts from checkpoint 2
  # Resumed from checkpoint 3, the run goes on recording after it...
  record = schedule.recorder(directory, 3, {}, checkpoints=kept)
  record.record(4, batch)
  assert schedule.recorded_steps(directory) == [3, 4]
  # ...and once retention has deleted checkpoint 2, the prune follows: a replay starts
  # from checkpoint 3 (`replay_start`), and a resume goes on recording.
  (checkpoints / "2").rmdir()
  record.prune()
  assert schedule.recorded_steps(directory) == [4]
  warnings = []
  schedule.recorder(directory, 4, {}, checkpoints=kept, echo=warnings.append).record(5, batch)
  assert schedule.recorded_steps(directory) == [4, 5] and not warnings
  # Compressed: a batch of repeated tokens takes fewer bytes than its arrays.
  long = [Group("p", (_traj([0] * 4000).with_reward(1.0),))]
  schedule.write_batch(directory, 9, long, context={})
  assert (Path(directory) / "00000009.npz").stat().st_size < 4000 * 4


def test_a_record_that_cannot_be_written_stops_the_run_naming_the_file(tmp_path):
  record = schedule.recorder(str(tmp_path / "schedule"), None, {})
  shutil.rmtree(tmp_path / "schedule")  # the workdir went away
  with pytest.raises(WorkdirError, match=r"writing the record of step 1 to .*schedule/00000001"
                     r"\.npz failed \(FileNotFoundError: .*\); the directory is gone"):
    record.record(1, [Group("p", (_traj([0]).with_reward(1.0),))])
