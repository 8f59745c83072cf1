"""What a new user runs into on the first day, replayed: each mistake gets a clear message
naming the field, before anything compiles, and leaves the workdir as it was."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_rl import cli
from async_rl.cli import from_dict
from async_rl.rl import build, entry
from async_rl.rl.errors import ConfigError, NoTrainableGroupError
from rl_test_utils import small_config

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("values, field", [
    ({"rollout": {"reward_timeout_s": float("nan")}}, "rollout.reward_timeout_s"),
    ({"generation": {"temperature": float("nan")}}, "generation.temperature"),
    ({"optimizer": {"learning_rate": float("nan")}}, "optimizer.learning_rate"),
    ({"advantage": {"reward_scale": float("inf")}}, "advantage.reward_scale"),
])
def test_non_finite_values_name_the_field(values, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.") + " must be finite"):
    from_dict(values)


@pytest.mark.parametrize("overrides, message", [
    ({"generation.group_size": 1}, "generation.group_size must be >= 2"),
    ({"generation.temperature": 0.0}, "generation.temperature must be > 0 for training"),
])
def test_settings_that_train_on_no_signal_are_refused(overrides, message):
  with pytest.raises(ConfigError, match=message):
    build.check(small_config(**overrides))


class _LongPrompts:
  """A task whose prompts are `length` tokens (all of them, or every other one)."""

  def __init__(self, length, every=1):
    from async_rl.tasks import CharTokenizer  # noqa: PLC0415
    self.tokenizer, self.reward_fn, self.workflow = CharTokenizer(), "arithmetic", None
    self._length, self._every = length, every

  def _prompt(self, i):
    from async_rl.tasks.arithmetic import Prompt  # noqa: PLC0415
    from async_rl.tasks.arithmetic import Problem  # noqa: PLC0415
    n = self._length if i % self._every == 0 else 4
    return Prompt(f"p{i}", (1,) + (3,) * (n - 1), (2,), Problem("1=", "1", 2, "#1"))

  def stream(self, state=None, *, worker_index=0):
    task, start = self, (state or {}).get("index", 0)

    class Stream:
      index = start

      def __iter__(self):
        return self

      def __next__(self):
        self.index += 1
        return task._prompt(self.index - 1)

      def state(self):
        return {"index": self.index}
    return Stream()

  def heldout(self, n):
    return [self._prompt(i) for i in range(n)]

  @staticmethod
  def reference(prompt):
    return prompt.problem


def test_a_task_whose_prompts_never_fit_is_refused_at_once():
  cfg = build.resolve(small_config())
  with pytest.raises(ConfigError, match=r"all 64 held-out prompts drawn are longer than 24"):
    build.preflight(cfg, _LongPrompts(40))


def test_prompts_too_long_are_rejected_and_counted_and_the_run_goes_on(tmp_path):
  lines = []
  summary = entry.run(small_config(**{"num_steps": 2}), str(tmp_path), task=_LongPrompts(40, 2),
                      echo=lines.append, progress=False)
  assert summary["end_version"] == 2
  rollout = summary["history"][-1]["rollout"]
  assert rollout["too_long"] >= 2 and rollout["admitted"] >= 4
  # The step line shows the reward error rate.
  step = next(line for line in lines if " v=1 reward=" in line)
  assert step.endswith("reward_err=0.00")


def _train(workdir, *args):
  return subprocess.run(
      [sys.executable, "-m", "launch.train", "--config=configs/micro.py", f"--workdir={workdir}",
       *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_a_resume_with_another_config_names_the_fields_and_keeps_the_workdir(tmp_path):
  out = _train(tmp_path, "--config.num_steps=1", "--config.staleness.max_staleness=None")
  assert out.returncode == 0, out.stderr[-2000:]
  before = (tmp_path / "config.json").read_text()
  assert json.loads(before)["staleness"]["max_staleness"] is None
  out = _train(tmp_path, "--config.num_steps=2", "--config.optimizer.learning_rate=0.5",
               "--config.generation.top_k=3")
  assert out.returncode != 0
  assert "optimizer.learning_rate: 0.0001 -> 0.5" in out.stderr
  assert "generation.top_k: 0 -> 3" in out.stderr and "num_steps" not in out.stderr
  assert (tmp_path / "config.json").read_text() == before  # untouched
  out = _train(tmp_path, "--config.num_steps=2", "--config.staleness.max_staleness=None")
  assert out.returncode == 0, out.stderr[-2000:]  # the run's own config resumes


@pytest.mark.parametrize("arg, message", [
    ("--config.batch_groups=2.5", "--config.batch_groups=2.5: invalid literal for int()"),
    ("--config.optimizer.learning_rate=abc", "could not convert string to float: 'abc'"),
    ("--config.ppo.bogus=1", "unknown config key 'ppo.bogus'; did you mean"),
])
def test_a_bad_flag_is_one_line_and_status_2(tmp_path, arg, message):
  out = _train(tmp_path, arg)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], out.stderr[-2000:]
  assert not any(tmp_path.iterdir()), "nothing written"


def test_every_key_has_a_type_a_default_and_help():
  keys = cli.describe()
  assert sorted(k.name for k in keys) == cli.keys()
  missing = [k.name for k in keys if not k.help]
  assert not missing, f"give these fields their help (`config._field`): {missing}"
  by_name = {k.name: k for k in keys}
  assert by_name["staleness.max_staleness"].type == "int | None"
  assert by_name["rollout.reward_weights"].type == "tuple[float, ...]"
  # The two fields of a pair share one help.
  assert by_name["placement.trainer_gpus"].help == by_name["placement.rollout_gpus"].help


def test_the_key_reference_in_docs_is_the_generated_one():
  generated = cli.key_reference() + "\n"
  assert (ROOT / "docs" / "config.md").read_text() == generated, (
      "docs/config.md is stale: python -m async_rl.cli > docs/config.md")


def test_print_config_lists_every_key_as_the_binary_would_run_it():
  out = subprocess.run(
      [sys.executable, "-m", "launch.train", "--config=configs/micro.py", "--print_config",
       "--config.optimizer.learning_rate=0.5", "--config.staleness.max_staleness=None"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]  # no --workdir needed to look
  lines = out.stdout.splitlines()
  names = [line.split(":")[0] for line in lines if not line.startswith(" ")]
  assert names == [k.name for k in cli.describe()]
  assert "optimizer.learning_rate: float = 0.5  (default 0.0001)" in lines
  assert "staleness.max_staleness: int | None = None  (default 4)" in lines
  assert "seed: int = 0" in lines  # a default value shows no default beside it
  assert ("    the peak learning rate; 0 keeps the params as they are (every update is zero), "
          "for measuring throughput at a fixed policy.") in lines


def test_print_config_of_a_bad_value_is_one_line_and_status_2():
  out = subprocess.run(
      [sys.executable, "-m", "launch.train", "--config=configs/micro.py", "--print_config",
       "--config.generation.num_slots=0"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "generation.num_slots" in lines[0], out.stderr


def test_a_reward_that_keeps_failing_stops_the_run_naming_it_and_its_first_error(tmp_path):
  start = time.monotonic()
  out = subprocess.run(
      [sys.executable, "-m", "launch.train", "--config=configs/micro.py",
       f"--workdir={tmp_path}", "--config.num_steps=50",
       "--config.rollout.reward_fn=reward_fns_for_tests:raises",
       "--config.rollout.reward_error_window=16"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}"))
  assert out.returncode == 1, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()
  message = next(line for line in last if line.startswith("train: the run stopped"))
  assert "reward function reward_fns_for_tests:raises failed on 16 of its last 16" in message
  assert "its first error: reward_fns_for_tests:raises: failed: RuntimeError: bad completion" \
      in message
  assert time.monotonic() - start < 300  # not after run.stall_timeout_s (600 s)
  # Not a log line per failure: the 1st, 2nd, 4th, ... of each reward service (the
  # rollouts' and the held-out evaluation's).
  assert out.stderr.count("failed calls so far") <= 2 * 7, out.stderr[-3000:]
  assert out.stderr.count("rollout controller of worker 0 failed") == 1
  assert (tmp_path / "config.json").exists()


def test_groups_that_can_never_be_trained_stop_the_run_saying_why(tmp_path):
  cfg = small_config(**{"num_steps": 50, "rollout.dynamic_filter": True,
                        "rollout.reward_fn": "reward_fns_for_tests:zero",
                        "run.max_untrainable_groups": 12})
  lines = []
  with pytest.raises(NoTrainableGroupError) as e:
    entry.run(cfg, str(tmp_path), echo=lines.append, progress=False)
  message = str(e.value)
  in_a_row = int(re.match(r"(\d+) groups in a row finished and none could be trained "
                          r"\(run.max_untrainable_groups=12\)", message).group(1))
  assert in_a_row >= 12
  assert "were filtered as all rewards equal" in message
  assert "checkpoint 0 holds the params" in message  # saved on the way out
  assert not any(re.search(r"\bv=\d+ reward=", line) for line in lines)  # none trained


def test_a_warm_start_without_reference_completions_is_refused_up_front():
  cfg = build.resolve(small_config(**{"sft.steps": 10}))
  with pytest.raises(ConfigError, match=r"sft.steps > 0 needs a task with reference "
                                        r"completions \(sft_examples\); _LongPrompts has none"):
    build.preflight(cfg, _LongPrompts(4))
  from async_rl.tasks import CharTokenizer, Example, ListTask  # noqa: PLC0415
  tokenizer = CharTokenizer()
  rows = [Example(id=i, tokens=(tokenizer.bos_id, *tokenizer.encode(f"{i}+1=")),
                  reference=str(i + 1)) for i in range(5)]  # answers to score, none to imitate
  no_targets = ListTask(train=rows[:4], heldout_examples=rows[4:], tokenizer=tokenizer,
                        reward_fn="arithmetic")
  with pytest.raises(ConfigError, match=r"sft.steps > 0 needs reference completions: .*"
                                        r"none of the 4 has one"):
    build.preflight(cfg, no_targets)
