"""A user's own task: `ListTask`, the task registry's "module:attr", and the README's
example (examples/sums.py), run exactly as the README writes it."""

import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from async_rl.cli import from_dict
from async_rl.config import TaskConfig
from async_rl.rl import build
from async_rl.tasks import CharTokenizer, Example, ListTask
from async_rl.tasks.registry import make_task

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
COMMAND = "python -m launch.train --config=examples/sums_config.py --workdir=$(mktemp -d)"
TOK = CharTokenizer()


def _examples(n, start=0):
  return [Example(i, (1, *TOK.encode(f"{i}=")), str(i)) for i in range(start, start + n)]


def test_list_streams_visit_every_example_each_epoch_and_resume():
  task = ListTask(_examples(5), _examples(2, start=10), TOK, "arithmetic", seed=3)
  stream = task.stream()
  first = list(itertools.islice(stream, 12))
  for epoch in (0, 1):
    assert sorted(p.reference for p in first[5 * epoch:5 * epoch + 5]) == list("01234")
  assert [p.id for p in first[:5]] != [p.id for p in first[5:10]]
  assert first[5].id.startswith("train/3/") and first[5].id.endswith("@1")
  state = json.loads(json.dumps(stream.state()))
  assert list(itertools.islice(task.stream(state), 8)) == list(
      itertools.islice(task.stream(), 20))[12:]
  other = list(itertools.islice(task.stream(worker_index=1), 5))
  assert [p.reference for p in other] != [p.reference for p in first[:5]]
  with pytest.raises(ValueError, match="seed=1003"):
    task.stream(state, worker_index=1)
  assert [(p.id, task.reference(p)) for p in task.heldout(5)] == [("heldout/10", "10"),
                                                                ("heldout/11", "11")]


def test_examples_with_targets_are_the_warm_starts_and_no_target_is_an_error():
  train = [Example(i, (1, *TOK.encode(f"{i}=")), str(i), (*TOK.encode(str(i)), TOK.eos_id)
                   if i % 2 else None) for i in range(6)]
  task = ListTask(train, _examples(1, start=10), TOK, "arithmetic")
  sequences = list(itertools.islice(task.sft_examples(), 6))
  texts = sorted(TOK.decode(s.tokens_T[s.prompt_len:]) for s in sequences)
  assert texts == ["1", "1", "3", "3", "5", "5"]  # every odd one, once per epoch
  for s in sequences:
    assert s.tokens_T[-1] == TOK.eos_id and s.loss_mask_T[s.prompt_len:].all()
    assert not s.loss_mask_T[:s.prompt_len].any()
  with pytest.raises(ValueError, match="warm start .* none of the 5 has one"):
    ListTask(_examples(5), _examples(1, start=10), TOK, "arithmetic").sft_examples()


def test_a_training_prompt_may_not_be_held_out():
  with pytest.raises(ValueError, match="2 training examples have the prompt of a held-out"):
    ListTask(_examples(5), _examples(2, start=3), TOK, "arithmetic")


def test_a_task_factory_is_named_module_attr_and_reads_task_options():
  cfg = from_dict({"task": {"name": "examples.sums:make_task",
                            "options": {"train": "examples/sums_train.jsonl",
                                        "heldout": "examples/sums_heldout.jsonl"}}})
  task = make_task(cfg.task)
  assert isinstance(task, ListTask) and len(task.train) == 200
  prompt = task.heldout(1)[0]
  assert TOK.decode(prompt.tokens) + task.reference(prompt) == "22+39=61"
  assert task.reward_fn("61\n", "61") == 1.0 and task.reward_fn("6", "61") == 0.0


@pytest.mark.parametrize("values, message", [
    ({"task": {"name": "examples.nothing_here:make_task"}}, "cannot load the task factory"),
    ({"task": {"name": "no_colon"}}, "or 'module:attr'"),
    ({"task": {"options": {"f": float("nan")}}}, "task.options must hold plain data"),
    ({"task": {"options": ["a"]}}, "task.options must be a mapping"),
])
def test_bad_task_names_and_options_name_the_field(values, message):
  with pytest.raises(ValueError, match=message):
    build.check(from_dict(values))


def test_a_factory_that_makes_no_task_is_an_error(monkeypatch):
  module = types.ModuleType("not_a_task_module")
  module.make = lambda cfg: types.SimpleNamespace(tokenizer=TOK, stream=None)
  monkeypatch.setitem(sys.modules, "not_a_task_module", module)
  cfg = from_dict({"task": {"name": "not_a_task_module:make"}})
  with pytest.raises(ValueError, match="without reward_fn, workflow, heldout, reference"):
    make_task(cfg.task)


def test_the_readme_shows_the_example_files_verbatim():
  for path in ("examples/sums.py", "examples/sums_config.py"):
    assert (ROOT / path).read_text() in README, f"README must include {path} verbatim"
  first = (ROOT / "examples/sums_train.jsonl").read_text().splitlines()[0]
  assert first in README and COMMAND in README


def test_the_readme_example_runs_as_written():
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  out = subprocess.run(["bash", "-c", COMMAND], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-4000:]
  assert re.search(r"^[\d-]+ [\d:]+ eval v=2: accuracy=\d", out.stdout, re.M), out.stdout[-2000:]


def test_the_readme_examples_loader_names_the_file_and_line_of_a_bad_row(tmp_path):
  from examples import sums  # noqa: PLC0415
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "1+2="}\n')
  with pytest.raises(ValueError, match=r'bad.jsonl, line 3: needs "prompt" and "answer"'):
    sums.make_task(TaskConfig(options={"train": str(bad), "heldout": str(bad)}))
  bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2="\n')
  with pytest.raises(ValueError, match=r"bad.jsonl, line 2: invalid JSON: Expecting ',' "
                                       r"delimiter at column 18"):
    sums.make_task(TaskConfig(options={"train": str(bad), "heldout": str(bad)}))
