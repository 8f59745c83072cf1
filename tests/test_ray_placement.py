"""The `ray` placement end to end on a local Ray instance: train, resume, stop."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray placement needs ray (pip install -e .[ray])")

import ray  # noqa: E402
from async_rl import config  # noqa: E402
from async_rl.rl import entry, ray_placement  # noqa: E402
import reward_fns_for_tests  # noqa: E402
from rl_test_utils import check_prompt_accounting, checkpoint_meta, small_config  # noqa: E402


TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def user_task(tmp_path_factory):
  """The README's user task, as a module outside the package and outside every actor's
  sys.path: the directory that the module's Ray instance ships to its actors."""
  user = tmp_path_factory.mktemp("user")
  examples = TESTS.parent / "examples"
  (user / "my_sums.py").write_text((examples / "sums.py").read_text())
  for name in ("sums_train.jsonl", "sums_heldout.jsonl"):
    (user / name).write_text((examples / name).read_text())
  return user


@pytest.fixture(scope="module", autouse=True)
def ray_instance(user_task, tmp_path_factory):
  """The module's one local Ray instance (starting one takes seconds, and each run's
  actors more), started as `run_on_ray` starts its own for a run that ships code:
  `placement.working_dir`, the user's task; `placement.py_modules`, the tests' reward
  functions. Every run finds it up, uses it and leaves it up. Its actors take the
  environment it starts with: that of `reward_fns_for_tests.kills_its_rollout_worker`,
  which only that reward reads."""
  with pytest.MonkeyPatch.context() as env:
    env.setenv(reward_fns_for_tests.KILL_COUNT_ENV,
               str(tmp_path_factory.mktemp("kill") / "calls"))
    env.setenv(reward_fns_for_tests.KILL_AT_ENV, "13")
    ray_placement._init_ray(config.PlacementConfig(
        kind="ray", working_dir=str(user_task),
        py_modules=(reward_fns_for_tests.__file__,)))
    yield
  ray.shutdown()


def _steps(workdir):
  path = Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(l) for l in path.read_text().splitlines() if '"eval"' not in l]


def _checkpoints(workdir):
  return sorted(int(p.name) for p in (Path(workdir) / "checkpoints").iterdir()
                if p.name.isdigit())


def _run(workdir, stop=None, **overrides):
  # A reward function from a test module, which the Ray instance ships to the actors.
  # A held-out set of one prompt, one sample: these tests do not check the evaluation.
  cfg = small_config(**{"staleness.max_staleness": 1, "placement.kind": "ray",
                        "rollout.reward_fn": "reward_fns_for_tests:length",
                        "eval.num_prompts": 1, "eval.pass_k": 1, **overrides})
  return entry.run(cfg, str(workdir), stop=stop, progress=False, echo=lambda _: None)


def test_actors_train_within_the_bound_and_resume(tmp_path):
  summary = _run(tmp_path, num_steps=3)
  assert summary["start_version"] == 0 and summary["end_version"] == 3
  pids = summary["pids"]
  assert pids["driver"] == os.getpid()
  assert len({pids["driver"], pids["server"], pids["trainer"], *pids["rollout"]}) == 4
  steps = _steps(tmp_path)
  assert [s["step"] for s in steps] == [1, 2, 3]
  for s in steps:
    assert s["staleness_max"] <= 1
    assert s["server"]["version"] == s["step"] and s["trained_tokens"] > 0
    assert s["rewards"]["errors"] == 0 and s["reward_mean"] > 0
  assert _checkpoints(tmp_path)[-1] == 3

  summary = _run(tmp_path, num_steps=4, **{"placement.pin_trainer_cores": (0,),
                                           "placement.pin_rollout_cores": (os.cpu_count() - 1,)})
  assert summary["start_version"] == 3 and summary["end_version"] == 4
  assert [s["step"] for s in _steps(tmp_path)] == [1, 2, 3, 4]
  assert _checkpoints(tmp_path)[-1] == 4


def test_stop_checkpoints_and_returns(tmp_path):
  stop = threading.Event()

  def stop_after_first_step():
    while not _steps(tmp_path):
      time.sleep(0.2)
    stop.set()

  threading.Thread(target=stop_after_first_step, daemon=True).start()
  summary = _run(tmp_path, stop=stop, num_steps=100)
  assert 1 <= summary["end_version"] < 100
  assert _checkpoints(tmp_path)[-1] == summary["end_version"]


def test_a_killed_rollout_worker_is_restarted_and_its_prompts_issued_again(tmp_path):
  # The rollout worker's reward subprocess SIGKILLs it while scoring its 7th group (2
  # samples each), which is running then; with η = 1 and B = 2 that group can start
  # only once version 2 is published, after step 1 is logged. The module's Ray instance
  # gives its actors the reward's environment (its one use of the reward).
  summary = _run(tmp_path, num_steps=5,
                 **{"rollout.reward_fn": "reward_fns_for_tests:kills_its_rollout_worker"})
  assert summary["end_version"] == 5
  steps = _steps(tmp_path)
  assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
  assert steps[0]["worker_restarts"] == 0 and steps[-1]["worker_restarts"] == 1
  assert (steps[0]["workers"]["0"]["pid"] == summary["pids"]["rollout"][0]
          != steps[-1]["workers"]["0"]["pid"])
  assert steps[-1]["server"]["lost_groups"] >= 1
  check_prompt_accounting(tmp_path)


def test_pinning_moves_every_thread_of_the_process():
  script = (
      "import os, threading\n"
      "from async_rl.rl.ray_placement import _pin\n"
      "done = threading.Event()\n"
      "threading.Thread(target=done.wait).start()\n"
      "_pin(None, {0})\n"
      "print(sorted({tuple(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}))\n"
      "done.set()\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True).stdout
  assert out.strip() == "[(0,)]"


def test_two_rollout_workers_train_a_user_task_shipped_by_the_runtime_env(
    tmp_path, monkeypatch, user_task):
  # The README's user task, which the module's Ray instance ships to the actors
  # (`placement.working_dir`); its task and held-out set, read by the rollout workers'
  # streams and the trainer. The params cross processes in 16 bits.
  monkeypatch.syspath_prepend(str(user_task))  # the driver builds the task too (its checks)
  train = user_task / "sums_train.jsonl"
  summary = _run(tmp_path, num_steps=3, **{
      "task.name": "my_sums:make_task",
      "task.options": {"train": str(train), "heldout": str(user_task / "sums_heldout.jsonl")},
      "rollout.reward_fn": None, "model.max_seq_len": 32,
      "generation.max_prompt_len": 8, "generation.max_new_tokens": 8,
      "batching.max_tokens_per_mb": 32, "placement.rollout_workers": 2,
      "placement.publish_dtype": "bfloat16"})
  assert summary["end_version"] == 3 and len(summary["pids"]["rollout"]) == 2
  steps = _steps(tmp_path)
  assert [s["step"] for s in steps] == [1, 2, 3]
  # Both workers are up and report to the trainer: each actor built the user's task in
  # its constructor, so each imported the shipped module. Which of them made the groups
  # trained is the scheduler's affair, and under load one may make them all.
  workers = list(steps[-1]["workers"].values())
  assert len(workers) == 2 and {w["pid"] for w in workers} == set(summary["pids"]["rollout"])
  assert sum(w["rollout"]["submitted"] for w in workers) > 0
  assert sum(w["rewards"]["calls"] for w in workers) > 0
  assert all(w["rewards"]["errors"] == 0 for w in workers)
  # Every prompt that either worker's stream gave out, by the last checkpoint, was
  # trained once, rejected, or is queued to be issued again.
  server = checkpoint_meta(tmp_path).server
  rows = len(train.read_text().splitlines())
  drawn = sum(c["epoch"] * rows + c["index"] for c in server["ledger"]["cursor"].values())
  queued = sum(len(r) for r in server["ledger"]["replay"].values())
  trained = [p for s in steps for p in s["prompts"]]
  assert set(server["ledger"]["cursor"]) == {"0", "1"}
  assert drawn == len(trained) + server["gate"]["rejected"] + queued > 0, server
