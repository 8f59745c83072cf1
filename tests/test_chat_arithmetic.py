"""The chat arithmetic task: its problems and splits, the strict and lenient scores, and
its prompts through the shipped SmolLM2's own chat template, checked against
transformers."""

import dataclasses
import itertools

import numpy as np
import pytest

from async_rl import cli
from async_rl.config import ChatArithmeticConfig, TaskConfig
from async_rl.rl import build
from async_rl.rl.errors import ConfigError
from async_rl.tasks import chat_arithmetic as ca
from async_rl.tasks.chat_arithmetic import Answer, lenient_answer, strict_answer
from async_rl.tasks.protocol import is_heldout

A56, B56 = Answer(56, "answer"), Answer(56, "boxed")


@pytest.mark.parametrize("completion, strict, lenient", [
    ("<answer>56</answer>", 1, 1),
    ("<answer> 56 </answer>", 1, 1),
    ("7 * 8 = 56, so <answer>56</answer>", 1, 1),
    ("<answer>056</answer>", 0, 1),  # not the integer as written plainly
    ("<answer>56.0</answer>", 0, 0),
    ("The answer is 56.", 0, 1),  # right value, no format
    ("<answer>54</answer> no, 56", 0, 1),  # the first span counts, the last number too
    ("<answer>56</answer> or 54", 1, 0),
    ("<answer>56", 0, 1),  # unclosed
    ("\\boxed{56}", 0, 1),  # the other format
    ("", 0, 0),
])
def test_strict_needs_the_format_and_lenient_the_last_number(completion, strict, lenient):
  assert (strict_answer(completion, A56), lenient_answer(completion, A56)) == (strict, lenient)


def test_boxed_format_and_negative_values():
  assert strict_answer("so \\boxed{56}.", B56) == 1.0
  assert strict_answer("\\boxed{ 56 }", B56) == 1.0
  assert strict_answer("<answer>56</answer>", B56) == 0.0
  assert strict_answer("<answer>-3</answer>", Answer(-3, "answer")) == 1.0
  assert lenient_answer("it is -3", Answer(-3, "answer")) == 1.0
  assert lenient_answer("it is 3", Answer(-3, "answer")) == 0.0


def _problems(cfg, n=2000):
  rng = np.random.default_rng(0)
  return [ca.make_problem(rng, cfg) for _ in range(n)]


def test_problems_cover_the_operators_and_operands_with_no_negative_result():
  cfg = ChatArithmeticConfig(ops="+-*", min_operand=2, max_operand=12)
  problems = _problems(cfg)
  assert {p.op for p in problems} == {"+", "-", "*"}
  assert {p.a for p in problems} | {p.b for p in problems} == set(range(2, 13))
  for p in problems:
    assert p.value == {"+": p.a + p.b, "-": p.a - p.b, "*": p.a * p.b}[p.op] >= 0
    assert p.question == f"What is {p.a} {p.op} {p.b}?"
  assert {p.op for p in _problems(ChatArithmeticConfig(ops="*"), 50)} == {"*"}


@pytest.mark.parametrize("overrides, field", [
    ({"ops": "+/"}, "task.arithmetic_chat.ops"),
    ({"ops": "++"}, "task.arithmetic_chat.ops"),
    ({"min_operand": -1}, "task.arithmetic_chat.min_operand"),
    ({"min_operand": 5, "max_operand": 4}, "task.arithmetic_chat.max_operand"),
    ({"answer_format": "json"}, "task.arithmetic_chat.answer_format"),
    ({"question": "What is {a} {op}?"}, "task.arithmetic_chat.question"),
    ({"examples": ("3+5",)}, "task.arithmetic_chat.examples"),
    ({"heldout_fraction": 1.0}, "task.arithmetic_chat.heldout_fraction"),
])
def test_bad_settings_name_their_field(overrides, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    ChatArithmeticConfig(**overrides)


class _Template:
  """A stand-in tokenizer for the splits and streams: a conversation's text, one id per
  character."""

  @staticmethod
  def render_chat(messages, add_generation_prompt=True):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

  @staticmethod
  def encode(text):
    return [ord(c) for c in text]


def _questions(prompts):
  return [p.problem.question for p in prompts]


def test_splits_are_disjoint_resumable_and_the_heldout_set_ignores_the_seed():
  cfg = ChatArithmeticConfig(max_operand=9, heldout_fraction=0.2)
  task = ca.ChatArithmeticTask(cfg, _Template())
  heldout = task.heldout(30)
  assert len(set(_questions(heldout))) == 30, "held-out questions are distinct"
  assert all(is_heldout(q, 0.2) for q in _questions(heldout))
  stream = task.stream()
  train = list(itertools.islice(stream, 300))
  assert not any(is_heldout(q, 0.2) for q in _questions(train))
  assert len(set(_questions(train))) < 300, "the training stream repeats questions"
  assert [p.id for p in train[:2]] == ["train/0/0", "train/0/1"]
  resumed = task.stream(stream.state())
  assert [p.tokens for p in itertools.islice(resumed, 5)] == [
      p.tokens for p in itertools.islice(stream, 5)]
  other_seed = ca.ChatArithmeticTask(dataclasses.replace(cfg, seed=3), _Template())
  assert [p.tokens for p in other_seed.heldout(30)] == [p.tokens for p in heldout]
  assert [p.tokens for p in itertools.islice(other_seed.stream(), 5)] != [
      p.tokens for p in train[:5]]
  assert [p.tokens for p in itertools.islice(task.stream(worker_index=1), 5)] != [
      p.tokens for p in train[:5]]
  with pytest.raises(ValueError, match="seed=1000"):
    task.stream({"seed": 0, "index": 3}, worker_index=1)


def test_a_small_split_gives_the_questions_it_has():
  # 0..2 with + only: 9 questions, about a third of them held out.
  task = ca.ChatArithmeticTask(ChatArithmeticConfig(ops="+", max_operand=2,
                                                    heldout_fraction=0.3), _Template())
  held = [q for q in (f"What is {a} + {b}?" for a in range(3) for b in range(3))
          if is_heldout(q, 0.3)]
  assert 0 < len(held) < 9
  assert sorted(_questions(task.heldout(100))) == sorted(held)


def test_a_run_needs_the_model_directory_for_its_template():
  cfg = build.resolve(cli.from_dict({"task": {"name": "arithmetic_chat"}}))
  with pytest.raises(ConfigError, match="hf_model_dir"):
    build.check(cfg)
  with pytest.raises(ValueError, match="hf_model_dir"):
    ca.make(TaskConfig(name="arithmetic_chat"))


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_gguf):
  from async_rl.models import pretrained  # noqa: PLC0415 (the hf extra)
  return pretrained.model_dir(smollm2_gguf)


def test_prompts_are_the_models_template_as_transformers_renders_it(smollm2_dir):
  transformers = pytest.importorskip("transformers")
  reference = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
  for overrides in ({}, {"system": ""}, {"answer_format": "boxed", "examples": ("3 + 5", "6 * 7")}):
    task = ca.make(TaskConfig(name="arithmetic_chat", tokenizer_dir=smollm2_dir,
                              arithmetic_chat=ChatArithmeticConfig(**overrides)))
    for prompt in task.heldout(3):
      problem = prompt.problem
      messages = task.messages(problem)
      expected = reference.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
      assert list(prompt.tokens) == list(expected)
      text = reference.decode(prompt.tokens)
      assert text.endswith(f"<|im_start|>user\n{problem.question}<|im_end|>\n"
                           "<|im_start|>assistant\n")
      if overrides.get("examples"):
        assert "<|im_start|>assistant\n\\boxed{42}<|im_end|>" in text
      if overrides.get("system") == "":  # the template writes its own system turn
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
      elif "system" not in overrides:
        assert ca.FORMAT_EXAMPLES[task.cfg.answer_format] in text.split("<|im_end|>")[0]
