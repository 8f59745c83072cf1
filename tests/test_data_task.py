"""The data task: a user's JSONL or Parquet rows in TRL's and verl's formats, column
names as options, chat templates, a warm start from the reference answers, errors that
name the file and line, skipped long prompts; and the TRL-style example trained from
the command line."""

import itertools
import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest

from async_rl.cli import from_dict
from async_rl.config import DataConfig, TaskConfig
from async_rl.rl import build
from async_rl.rl.errors import ConfigError
from async_rl.rewards import Row
from async_rl.tasks import ByteTokenizer, ListTask
from async_rl.tasks.data_task import from_rows, load_rows, records
from async_rl.tasks.registry import make_task

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ("python -m launch.train --config=examples/trl_style/config.py "
           "--workdir=$(mktemp -d)")
BYTES = ByteTokenizer()
TRAIN = [{"prompt": f"Add {a} and {b}.", "solution": str(a + b), "level": a % 3}
         for a, b in itertools.product(range(10, 16), range(20, 25))]
CHAT = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": f"Add {a} and 1."}],
         "completion": [{"role": "assistant", "content": str(a + 1)}]} for a in range(10)]


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _task(tmp_path, train=TRAIN, heldout=None, max_prompt_len=64, **data):
  data = {"train_path": _write_jsonl(tmp_path / "train.jsonl", train), "tokenizer": "bytes",
          **data}
  if heldout is not None:
    data["heldout_path"] = _write_jsonl(tmp_path / "heldout.jsonl", heldout)
  return make_task(TaskConfig(name="data", data=DataConfig(**data),
                              max_prompt_len=max_prompt_len))


def test_text_prompts_with_an_answer_column(tmp_path):
  task = _task(tmp_path, heldout=TRAIN[:3], answer_key="solution")
  assert isinstance(task, ListTask) and task.reward_fn is None
  assert len(task.train) == len(TRAIN) - 3 and len(task.heldout(10)) == 3
  prompt = task.heldout(1)[0]
  assert prompt.id == "heldout/heldout/1" and BYTES.decode(prompt.tokens) == "Add 10 and 20."
  assert task.reference(prompt) == Row("Add 10 and 20.", "30", {"solution": "30", "level": 1})
  first = next(task.stream())
  assert re.fullmatch(r"train/0/train/\d+@0", first.id)
  row = TRAIN[int(first.id.split("/")[-1].split("@")[0]) - 1]
  assert BYTES.decode(first.tokens) == row["prompt"] and first.reference.answer == row["solution"]
  # The warm start: the answer and EOS after the prompt, trained on the answer only.
  example = next(task.sft_examples())
  P = example.prompt_len
  solution = {r["prompt"]: r["solution"] for r in TRAIN}[BYTES.decode(example.tokens_T[:P])]
  assert list(example.tokens_T[P:]) == [*BYTES.encode(solution), BYTES.eos_id]
  assert not example.loss_mask_T[:P].any() and example.loss_mask_T[P:].all()


def test_without_an_answer_column_a_reference_is_the_rows_other_columns(tmp_path):
  task = _task(tmp_path)
  reference = task.reference(task.heldout(1)[0])
  assert reference.answer == reference.columns and set(reference.columns) == {"solution",
                                                                              "level"}
  with pytest.raises(ValueError, match="the warm start .* none of the"):
    task.sft_examples()


def test_a_hashed_heldout_fraction_without_a_heldout_file(tmp_path):
  task = _task(tmp_path, heldout_fraction=0.3)
  held = {BYTES.decode(p.tokens) for p in task.heldout(100)}
  trained = {BYTES.decode(e.tokens) for e in task.train}
  assert held and trained and not held & trained and len(held) + len(trained) == len(TRAIN)


def test_conversations_use_the_chat_template_and_completions_are_targets(tmp_path):
  task = _task(tmp_path, train=CHAT, heldout=CHAT[:2], completion_key="completion",
               max_prompt_len=128)
  prompt = task.heldout(1)[0]
  assert BYTES.decode(prompt.tokens) == (
      "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
      "<|im_start|>user\nAdd 0 and 1.<|im_end|>\n<|im_start|>assistant\n")
  assert task.reference(prompt).prompt == CHAT[0]["prompt"]
  example = next(task.sft_examples())
  answer = BYTES.decode(example.tokens_T[example.prompt_len:])
  assert answer.isdigit() and example.tokens_T[-1] == BYTES.eos_id


def test_an_hf_tokenizer_renders_its_own_chat_template(tmp_path):
  pytest.importorskip("tokenizers")
  from hf_test_utils import save_tokenizer
  from async_rl.models.hf_tokenizer import HFTokenizer
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  save_tokenizer(model_dir, corpus=["Add and Answer with a number", "0 1 2 3 4 5 6 7 8 9"])
  template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}")
  (model_dir / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "chat_template": template}))
  data = DataConfig(train_path=_write_jsonl(tmp_path / "t.jsonl", CHAT), heldout_path=
                    _write_jsonl(tmp_path / "h.jsonl", CHAT[:1]), completion_key="completion")
  task = make_task(TaskConfig(name="data", data=data, tokenizer_dir=str(model_dir)))
  tok = HFTokenizer(str(model_dir))
  assert task.heldout(1)[0].tokens == tuple(tok.encode(
      "[system] Answer with a number. [user] Add 0 and 1. [assistant]"))
  assert next(task.sft_examples()).tokens_T[-1] == tok.eos_id


def test_parquet_rows_read_like_jsonl_rows(tmp_path):
  pq = pytest.importorskip("pyarrow.parquet")
  import pyarrow as pa
  verl = [{"data_source": "sums", "prompt": [{"role": "user", "content": r["prompt"]}],
           "reward_model": {"style": "rule", "ground_truth": r["solution"]},
           "extra_info": {"index": i}} for i, r in enumerate(TRAIN)]
  pq.write_table(pa.Table.from_pylist(verl), tmp_path / "train.parquet")
  rows = load_rows(str(tmp_path / "train.parquet"))
  assert [str(where) for where, _ in rows[:2]] == [f"{tmp_path}/train.parquet, row 1",
                                                  f"{tmp_path}/train.parquet, row 2"]
  assert rows[4][1] == verl[4]
  task = make_task(TaskConfig(name="data", data=DataConfig(
      train_path=str(tmp_path / "train.parquet"), tokenizer="bytes")))
  reference = task.reference(task.heldout(1)[0])
  assert reference.columns["reward_model"]["ground_truth"] in {r["solution"] for r in TRAIN}


def test_rows_of_any_source_make_a_task():
  # The rows of a `datasets.Dataset` are mappings: numbered, they make a task.
  task = from_rows(records(TRAIN, "sums"), records(TRAIN[:2], "sums_heldout"),
                   DataConfig(answer_key="solution"), BYTES, reward_fn="math")
  assert task.reward_fn == "math" and [p.id for p in task.heldout(5)] == [
      "heldout/sums_heldout/1", "heldout/sums_heldout/2"]


@pytest.mark.parametrize("line, data, message", [
    ('{"prompt": "Add 1 and 2."', {}, "line 3: invalid JSON: Expecting ',' delimiter"),
    ('["Add 1 and 2."]', {}, "line 3: expected an object of columns, got list"),
    ('{"question": "Add 1 and 2."}', {}, r"line 3: no column 'prompt' \(task.data.prompt_key\); "
                                         r"the row has \['question'\]"),
    ('{"prompt": "Add 1 and 2."}', {"answer_key": "solution"},
     r"line 3: no column 'solution' \(task.data.answer_key\)"),
    ('{"prompt": ""}', {}, "line 3: column 'prompt' must be a non-empty string"),
    ('{"prompt": [{"role": "user"}]}', {},
     "line 3: column 'prompt': message 0 must be a mapping with string 'role' and 'content'"),
    ('{"prompt": "Add 1 and 2.", "solution": {"x": 3}}', {"completion_key": "solution"},
     "line 3: column 'solution' must be text or a list of messages, got dict"),
])
def test_a_malformed_row_names_the_file_and_line(tmp_path, line, data, message):
  path = tmp_path / "train.jsonl"
  good = json.dumps(TRAIN[0])
  path.write_text(f"{good}\n\n{line}\n{good}\n")  # line 2 is blank
  with pytest.raises(ValueError, match=re.escape(str(path)) + ", " + message):
    make_task(TaskConfig(name="data", data=DataConfig(train_path=str(path), tokenizer="bytes",
                                                      **data)))


def test_unreadable_files_are_named(tmp_path):
  (tmp_path / "rows.csv").write_text("prompt\n")
  with pytest.raises(ValueError, match="rows.csv: a data file must end in one of"):
    load_rows(str(tmp_path / "rows.csv"))
  (tmp_path / "bad.parquet").write_text("not parquet")
  with pytest.raises(ValueError, match="bad.parquet: not a Parquet file that reads"):
    load_rows(str(tmp_path / "bad.parquet"))
  (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "\xe9"}\n')
  with pytest.raises(ValueError, match="latin1.jsonl, line 2: not UTF-8 text"):
    load_rows(str(tmp_path / "latin1.jsonl"))


def test_long_prompts_are_skipped_and_counted(tmp_path, caplog):
  long = [{"prompt": "Add " + "1 and " * 20 + f"{i}.", "solution": str(20 + i)}
          for i in range(4)]
  with caplog.at_level(logging.WARNING):
    task = _task(tmp_path, train=TRAIN + long[:3], heldout=TRAIN[:2] + long[3:])
  assert len(task.train) == len(TRAIN) - 2 and len(task.heldout(10)) == 2
  assert "3 of 31 train rows" in caplog.text and "1 of 3 held-out rows" in caplog.text
  assert "longer than task.max_prompt_len=64 tokens and are skipped" in caplog.text
  with pytest.raises(ValueError, match=r"heldout.jsonl: no held-out prompts \(all 1 prompts "
                                       r"are longer than task.max_prompt_len=64 tokens\)"):
    _task(tmp_path, heldout=long[:1])


@pytest.mark.parametrize("values, message", [
    ({}, "task.data.train_path must name a JSONL or Parquet file"),
    ({"data": {"train_path": "x.jsonl"}}, "task.data.tokenizer='hf' needs a tokenizer "
                                          "directory"),
    ({"data": {"train_path": "x.jsonl", "tokenizer": "bytes"}, "sft": True},
     "sft.steps=10 needs reference completions: set task.data.completion_key"),
    ({"data": {"train_path": "x.jsonl", "tokenizer": "bytes"}, "reward": None},
     "rollout.reward_fn must name the reward function when task.name='data'"),
])
def test_the_run_checks_name_the_field(values, message):
  config = {"task": {"name": "data", **{k: v for k, v in values.items() if k == "data"}},
            "rollout": {"reward_fn": None if "reward" in values else "math"}}
  if values.get("sft"):
    config["sft"] = {"steps": 10}
  with pytest.raises(ConfigError, match=message):
    build.check(from_dict(config))


def test_the_builder_makes_data_paths_absolute_and_checks_them(tmp_path):
  path = _write_jsonl(tmp_path / "train.jsonl", TRAIN)
  cfg = build.resolve(from_dict({"task": {"name": "data", "data": {
      "train_path": os.path.relpath(path), "tokenizer": "bytes"}}}))
  assert cfg.task.data.train_path == path and cfg.task.max_prompt_len == 64
  with pytest.raises(ConfigError, match="task.data.heldout_path is not a file"):
    build.resolve(from_dict({"task": {"data": {"heldout_path": str(tmp_path / "none")}}}))


def test_the_trl_style_example_trains_from_the_command_line(tmp_path):
  assert COMMAND in (ROOT / "docs/tasks.md").read_text()
  workdir = tmp_path / "run"
  command = COMMAND.replace("$(mktemp -d)", str(workdir)) + " --config.num_steps=2"
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-4000:]
  assert re.search(r"^[\d-]+ [\d:]+ sft step 200/200 nll=", out.stdout, re.M), out.stdout[-2000:]
  assert re.search(r"^[\d-]+ [\d:]+ eval v=2: accuracy=\d", out.stdout, re.M), out.stdout[-2000:]
  steps = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  rewards = [s["rewards"] for s in steps if "rewards" in s]
  assert len(rewards) == 2 and rewards[-1]["calls"] > 0
  assert rewards[-1]["errors"] == rewards[-1]["timeouts"] == 0
