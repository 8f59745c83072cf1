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
from rl_test_utils import check_prompt_accounting, small_config  # noqa: E402


@pytest.fixture(scope="module")
def shared_ray(tmp_path_factory):
  """One local Ray instance, started as `run_on_ray` starts its own, for the runs that
  need nothing of their own from it: `run_on_ray` uses it and leaves it up (starting
  and stopping one takes seconds). Its actors take the environment it starts with: that
  of `reward_fns_for_tests.kills_its_rollout_worker`, which only that reward reads."""
  with pytest.MonkeyPatch.context() as env:
    env.setenv(reward_fns_for_tests.KILL_COUNT_ENV,
               str(tmp_path_factory.mktemp("kill") / "calls"))
    env.setenv(reward_fns_for_tests.KILL_AT_ENV, "13")
    if not ray.is_initialized():
      ray_placement._init_ray(config.PlacementConfig(kind="ray"))
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
  # A reward function from a test module: the actors must import what the driver does.
  # A held-out set of one prompt, one sample: these tests do not check the evaluation.
  cfg = small_config(**{"staleness.max_staleness": 1, "placement.kind": "ray",
                        "rollout.reward_fn": "reward_fns_for_tests:length",
                        "eval.num_prompts": 1, "eval.pass_k": 1, **overrides})
  return entry.run(cfg, str(workdir), stop=stop, progress=False, echo=lambda _: None)


def test_actors_train_within_the_bound_and_resume(tmp_path, request):
  # The first run starts and stops its own Ray instance (run first, as it is in this
  # file); the resume uses the shared one.
  summary = _run(tmp_path, num_steps=3)
  request.getfixturevalue("shared_ray")
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


def test_stop_checkpoints_and_returns(tmp_path, shared_ray):
  stop = threading.Event()

  def stop_after_first_step():
    while not _steps(tmp_path):
      time.sleep(0.2)
    stop.set()

  threading.Thread(target=stop_after_first_step, daemon=True).start()
  summary = _run(tmp_path, stop=stop, num_steps=100)
  assert 1 <= summary["end_version"] < 100
  assert _checkpoints(tmp_path)[-1] == summary["end_version"]


def test_a_killed_rollout_worker_is_restarted_and_its_prompts_issued_again(tmp_path,
                                                                        shared_ray):
  # The rollout worker's reward subprocess SIGKILLs it while scoring its 7th group (2
  # samples each), which is running then; with η = 1 and B = 2 that group can start
  # only once version 2 is published, after step 1 is logged. The shared Ray instance
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


def test_two_rollout_workers_train_a_user_task_shipped_by_the_runtime_env(tmp_path,
                                                                          monkeypatch):
  # The README's user task, as a module outside the package and outside every actor's
  # sys.path: Ray ships its directory (`placement.working_dir`) to the actors. The
  # params cross processes in 16 bits.
  user = tmp_path / "user"
  user.mkdir()
  examples = Path(__file__).parents[1] / "examples"
  (user / "my_sums.py").write_text((examples / "sums.py").read_text())
  for name in ("sums_train.jsonl", "sums_heldout.jsonl"):
    (user / name).write_text((examples / name).read_text())
  monkeypatch.syspath_prepend(str(user))  # the driver builds the task too (its checks)
  if ray.is_initialized():  # a runtime_env is the Ray instance's: start one of our own
    ray.shutdown()
  summary = _run(tmp_path / "run", num_steps=3, **{
      "task.name": "my_sums:make_task",
      "task.options": {"train": str(user / "sums_train.jsonl"),
                       "heldout": str(user / "sums_heldout.jsonl")},
      "rollout.reward_fn": None, "model.max_seq_len": 32,
      "generation.max_prompt_len": 8, "generation.max_new_tokens": 8,
      "batching.max_tokens_per_mb": 32, "placement.rollout_workers": 2,
      "placement.working_dir": str(user), "placement.publish_dtype": "bfloat16"})
  assert summary["end_version"] == 3 and len(summary["pids"]["rollout"]) == 2
  steps = _steps(tmp_path / "run")
  assert [s["step"] for s in steps] == [1, 2, 3]
  workers = list(steps[-1]["workers"].values())
  assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
  assert all(w["rollout"]["submitted"] > 0 and w["rewards"]["calls"] > 0
             and w["rewards"]["errors"] == 0 for w in workers)
