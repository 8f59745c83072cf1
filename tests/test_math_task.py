"""The math task of a run: config validation, stop ids, prompts, resumable streams, splits."""

import dataclasses
import itertools
import json
import os

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from async_rl.chat import chat_messages, chatml  # noqa: E402
from async_rl.cli import from_dict, to_dict  # noqa: E402
from async_rl.config import DEFAULT_MATH_SYSTEM, MathConfig  # noqa: E402
from async_rl.rl import build  # noqa: E402
from async_rl.tasks.arithmetic import ArithmeticTask  # noqa: E402
from async_rl.tasks.math_task import MathTask  # noqa: E402
from async_rl.tasks.registry import TASKS, make_task  # noqa: E402
from conftest import one_layer_model  # noqa: E402
from hf_test_utils import (MATH_CORPUS, MATH_HELDOUT, MATH_TRAIN, NUMBERS,  # noqa: E402
                           write_jsonl, write_model_dir)

MODEL = one_layer_model(64, rms_eps=1e-5, rope_theta=5000.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("math")
  tok = write_model_dir(root / "model", MODEL, corpus=MATH_CORPUS)
  return {"model": str(root / "model"), "tok": tok,
          "train": write_jsonl(root / "train.jsonl", MATH_TRAIN),
          "heldout": write_jsonl(root / "heldout.jsonl", MATH_HELDOUT)}


def _checked(values):
  """The config of `values` as a run starts it: resolved and checked."""
  return build.check(build.resolve(from_dict(values)))


def _cfg(files, **math):
  return _checked({
      "task": {"name": "math", "math": {"train_path": files["train"],
                                        "heldout_path": files["heldout"], **math}},
      "hf_model_dir": files["model"],
      "model": {"max_seq_len": 256, "remat": True},
      "generation": {"max_prompt_len": 48, "max_new_tokens": 16},
      "batching": {"max_tokens_per_mb": 64}})


def test_model_architecture_comes_from_the_directory(files):
  cfg = _cfg(files)
  assert cfg.model == dataclasses.replace(MODEL, max_seq_len=256, remat=True)
  assert os.path.isabs(cfg.hf_model_dir) and os.path.isabs(cfg.task.math.train_path)
  assert dataclasses.replace(cfg, num_steps=7).model == cfg.model
  assert to_dict(cfg)["model"]["d_model"] == MODEL.d_model


def test_make_task_by_name(files):
  assert {"arithmetic", "math"} <= set(TASKS)
  arithmetic = make_task(from_dict({}).task)
  assert isinstance(arithmetic, ArithmeticTask) and arithmetic.tokenizer.stop_ids == (2,)
  cfg = _cfg(files)
  task = make_task(cfg.task)
  assert isinstance(task, MathTask)
  assert [(t.name, t.style) for t in build.reward_fn(cfg, task).terms] == [("math", "single")]
  object.__setattr__(cfg.task, "name", "poetry")  # past validation, to reach the factory
  with pytest.raises(ValueError, match="task.name must be one of .* got 'poetry'"):
    make_task(cfg.task)


def test_stop_ids_decode_and_reference(files):
  cfg = _cfg(files)
  task = make_task(cfg.task)
  tok = files["tok"]
  im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
  assert task.tokenizer.stop_ids == (im_end, endoftext)
  assert build.sampling_params(cfg, task).stop_token_ids == (im_end, endoftext)
  words = [tok.token_to_id(w) for w in ("two", "plus", "two")]
  assert task.tokenizer.decode(words + [endoftext] + words) == "two plus two"
  for prompt in itertools.islice(task.stream(), len(MATH_TRAIN)):
    line = int(prompt.id.split("@")[0].rsplit("/", 1)[1])  # train/0/train/{line}@0
    assert task.reference(prompt) == MATH_TRAIN[line - 1]["answer"].split("#### ")[1]
  assert [task.reference(p) for p in task.heldout(5)] == ["5", "10"]


def test_prompts_use_the_chat_template_or_the_plain_template(files):
  question = MATH_HELDOUT[0]["question"]
  chat = make_task(_cfg(files).task).heldout(1)[0]
  assert chat.tokens == tuple(files["tok"].encode(
      chatml(chat_messages(question, DEFAULT_MATH_SYSTEM))).ids)
  plain = make_task(_cfg(files, chat=False, template="what is {question}").task).heldout(1)[0]
  assert plain.tokens == tuple(files["tok"].encode(f"what is {question}").ids)
  no_system = make_task(_cfg(files, system="").task).heldout(1)[0]
  assert no_system.tokens == tuple(files["tok"].encode(chatml(chat_messages(question))).ids)


def test_stream_resumes_exactly_per_worker(files):
  task = make_task(_cfg(files).task)
  epoch = len(MATH_TRAIN) - task.num_train_held_out
  reference = list(itertools.islice(task.stream(), 2 * epoch))
  stream = task.stream()
  list(itertools.islice(stream, epoch + 3))
  state = json.loads(json.dumps(stream.state()))
  assert list(itertools.islice(task.stream(state), epoch - 3)) == reference[epoch + 3:]
  other = list(itertools.islice(task.stream(worker_index=1), 2 * epoch))
  assert [p.id for p in other] != [p.id for p in reference]
  assert sorted(p.id.split("/", 2)[2] for p in other) == sorted(
      p.id.split("/", 2)[2] for p in reference)
  with pytest.raises(ValueError, match="seed 0 does not match"):
    task.stream(state, worker_index=1)


def test_heldout_questions_are_never_trained_on(files, tmp_path):
  overlap = write_jsonl(tmp_path / "heldout.jsonl",
                        [*MATH_HELDOUT, MATH_TRAIN[3],
                         {"question": MATH_TRAIN[5]["question"], "answer": "7"}])
  task = make_task(_cfg(files, heldout_path=overlap).task)
  held = {p.tokens for p in task.heldout(10)}
  # MATH_HELDOUT[0] is MATH_TRAIN[6]'s question, so three training problems are held out.
  assert len(held) == 4 and task.num_train_held_out == 3
  trained = list(itertools.islice(task.stream(), 3 * len(MATH_TRAIN)))
  assert not held & {p.tokens for p in trained}
  assert len({p.tokens for p in trained}) == len(MATH_TRAIN) - 3

  hashed = make_task(_cfg(files, heldout_path=None, heldout_fraction=0.3).task)
  held = {p.tokens for p in hashed.heldout(100)}
  trained = {p.tokens for p in itertools.islice(hashed.stream(), 2 * len(MATH_TRAIN))}
  assert held and trained and not held & trained
  assert len(held) + len(trained) == len(MATH_TRAIN) and hashed.num_train_held_out == len(held)


def test_long_prompts_are_skipped_and_counted(files, tmp_path):
  long_question = "what is " + " plus ".join(NUMBERS)
  train = write_jsonl(tmp_path / "train.jsonl",
                      [*MATH_TRAIN, {"question": long_question, "answer": "45"}])
  cfg = _cfg(files, train_path=train, system="")
  short = MathTask(cfg.task.math, cfg.hf_model_dir, max_prompt_len=16)
  assert short.num_too_long == {"train": 1, "heldout": 0}
  assert all(len(p.tokens) <= 16 for p in itertools.islice(short.stream(), 2 * len(MATH_TRAIN)))
  with pytest.raises(ValueError, match=r"math.train_path: none of the 16 train problems .* "
                                       r"generation.max_prompt_len=4 tokens"):
    MathTask(cfg.task.math, cfg.hf_model_dir, max_prompt_len=4)
  all_held_out = dataclasses.replace(cfg.task.math, heldout_path=cfg.task.math.train_path)
  with pytest.raises(ValueError, match="gives no train problems .every question is held out"):
    MathTask(all_held_out, cfg.hf_model_dir, max_prompt_len=48)


def test_a_tokenizer_larger_than_the_model_is_an_error(files, tmp_path):
  small = dataclasses.replace(MODEL, vocab_size=8)
  write_model_dir(tmp_path / "model", small, corpus=MATH_CORPUS)
  cfg = _checked({
      "task": {"name": "math", "math": {"train_path": files["train"]}},
      "hf_model_dir": str(tmp_path / "model"), "rollout": {"reward_fn": "math"}})
  with pytest.raises(ValueError, match=r"model.vocab_size must hold the task's tokenizer "
                                       r"\(\d+ ids\), got 8"):
    build.preflight(cfg, make_task(cfg.task))


@pytest.mark.parametrize("values, message", [
    ({"task": {"name": "poetry"}}, "task.name"),
    ({"task": {"name": "math"}, "hf_model_dir": "{model}"},
     "math.train_path must name a JSONL file"),
    ({"task": {"name": "math", "math": {"train_path": "{train}"}}}, "hf_model_dir must name"),
    ({"task": {"name": "math", "math": {"train_path": "{train}"}}, "hf_model_dir": "{model}",
      "sft": {"steps": 5}}, "sft.steps must be 0"),
    ({"hf_model_dir": "{model}"}, "hf_model_dir needs task.name='math'"),
    ({"hf_model_dir": "{root}"}, "hf_model_dir must be a directory holding config.json"),
    ({"task": {"math": {"train_path": "{root}/nope.jsonl"}}}, r"math.train_path .*/nope.jsonl"),
    ({"task": {"math": {"heldout_path": "{root}/nope.jsonl"}}},
     r"math.heldout_path .*/nope.jsonl"),
    ({"task": {"math": {"template": "no placeholder"}}}, "math.template"),
    ({"task": {"math": {"heldout_fraction": 1.5}}}, "math.heldout_fraction"),
    ({"task": {"math": {"seed": -1}}}, "math.seed"),
])
def test_invalid_math_and_hf_values_name_the_field(files, values, message):
  root = os.path.dirname(files["train"])
  text = json.dumps(values).replace("{model}", files["model"]).replace(
      "{train}", files["train"]).replace("{root}", root)
  with pytest.raises(ValueError, match=message):
    _checked(json.loads(text))


def test_math_config_defaults_need_no_files():
  assert MathConfig().train_path is None
  assert from_dict({}).task.math == MathConfig()
