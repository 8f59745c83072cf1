"""Math datasets: JSONL loading, answer extraction, math-verify rewards, the stream."""

import importlib.util
import itertools
import json
import threading

import pytest

from async_rl.rewards import REWARD_FNS, RewardService, RewardTask
from async_rl.tasks.math_data import (DEFAULT_TEMPLATE, MathProblem, MathStream,
                                      extract_final_answer, format_prompt, last_boxed,
                                      load_jsonl, math_reward)

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None,
    reason="needs the math extra (math-verify)")


@needs_math_verify
@pytest.mark.parametrize("completion, gold, right", [
    ("The answer is 0.5.", r"\frac{1}{2}", 1.0),
    (r"So $x = \boxed{\frac{1}{2}}$.", "0.5", 1.0),
    ("3 + 997 = 1000\n#### 1,000", "1000", 1.0),
    ("The answer is 1000.", "1,000", 1.0),
    (r"Adding them gives $\boxed{42}$.", "42", 1.0),
    (r"The answer is $\frac{3}{4}$.", "0.75", 1.0),
    (r"The answer is \frac{3}{4}", "3/4", 1.0),
    ("The answer is 18 dollars.", "18", 1.0),
    (r"The roots are $\boxed{-2, 1}$.", "1, -2", 1.0),
    # The same completions against a wrong reference.
    ("The answer is 0.5.", "1/3", 0.0),
    (r"So $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{3}", 0.0),
    ("3 + 997 = 1000\n#### 1,000", "100", 0.0),
    (r"The answer is $\frac{3}{4}$.", "0.7", 0.0),
    (r"The roots are $\boxed{-2, 1}$.", "1, 2", 0.0),
])
def test_math_reward_equivalent_forms(completion, gold, right):
  assert math_reward(completion, gold) == right


@needs_math_verify
@pytest.mark.parametrize("completion, gold", [
    ("", "42"),
    ("I do not know.", "42"),
    (r"\boxed{\frac{", "42"),
    ("}}}{{{$$$ \\ ^^ __", "42"),
    (r"The answer is $\frac{1}{0}$", r"\frac{1}{2}"),
    ("The answer is 42.", ""),
    ("The answer is 42.", r"\frac{"),
    ("The answer is 42.", "}{\\"),
])
def test_math_reward_garbage_scores_zero_without_raising(completion, gold):
  assert math_reward(completion, gold) == 0.0


@needs_math_verify
def test_math_reward_works_off_the_main_thread():
  rewards = []
  thread = threading.Thread(target=lambda: rewards.extend(
      [math_reward(r"\boxed{0.5}", r"\frac{1}{2}"), math_reward(r"\boxed{2}", "3")]))
  thread.start()
  thread.join()
  assert rewards == [1.0, 0.0]


def test_math_reward_is_the_registry_math_reward():
  assert REWARD_FNS["math"] is math_reward


@needs_math_verify
def test_math_reward_through_reward_service():
  with RewardService(num_workers=1, timeout_s=20.0) as service:
    rewards = service.score_batch([
        RewardTask("math", r"Half of it: $\boxed{\frac{1}{2}}$", "0.5"),
        RewardTask("math", "So the answer is 1,000.", "999")])
    assert rewards == [1.0, 0.0]
    assert service.metrics()["errors"] == 0


@pytest.mark.parametrize("text, answer", [
    (r"First $\boxed{1}$, then $\boxed{\frac{1}{\sqrt{2}}}$ is it.", r"\frac{1}{\sqrt{2}}"),
    ("#### 3\nOn reflection $\\boxed{4}$", "4"),
    ("#### 5\nthen $\\boxed{}$", "5"),
    (r"unclosed \boxed{7 so #### 8", "8"),
    ("#### 1,000\nthe answer is 9", "1,000"),
    ("The answer is 7. Check: 7 + 1 = 8", "7"),
    ("The final answer is $x^2 + 1$. Done: 3", "$x^2 + 1$"),
    ("the answer is: **-12**.", "-12"),
    ("Answer: 3.14.", "3.14"),
    ("The answer is\n42", "42"),
    ("so 12 apples cost 1,250.5 cents, or 5/8", "5/8"),
    ("we have 12 and -3.5.", "-3.5"),
    ("5-3", "3"),
    ("no answer here", None),
    ("", None),
])
def test_extract_final_answer(text, answer):
  assert extract_final_answer(text) == answer


def test_last_boxed_handles_nesting_and_unbalanced_braces():
  assert last_boxed(r"\boxed{a} \boxed{\frac{b}{\{c\}}} d") == r"\frac{b}{\{c\}}"
  assert last_boxed(r"\boxed{a} \boxed{b") == "a"
  assert last_boxed("no box") is None


def _write(tmp_path, name, lines):
  path = tmp_path / name
  path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                            for line in lines) + "\n")
  return path


def test_load_gsm8k_math_and_plain_rows(tmp_path):
  gsm8k = "She sells 600 + 400 = <<600+400=1000>>1000 eggs.\n#### 1,000"
  math = r"So $x = \boxed{\frac{1}{\sqrt{2}}}$, as $x > 0$."
  path = _write(tmp_path, "mixed.jsonl", [
      {"question": "How many eggs?", "answer": gsm8k},
      "",
      "   ",
      {"problem": " Solve $2x^2 = 1$, $x > 0$. ", "solution": math},
      {"question": "What is 1/2 as a decimal?", "answer": "0.5"},
      {"question": "How many legs has a cat?", "answer": 4},
  ])
  assert load_jsonl(path) == [
      MathProblem("mixed/1", "How many eggs?", "1,000", gsm8k),
      MathProblem("mixed/4", "Solve $2x^2 = 1$, $x > 0$.", r"\frac{1}{\sqrt{2}}", math),
      MathProblem("mixed/5", "What is 1/2 as a decimal?", "0.5", None),
      MathProblem("mixed/6", "How many legs has a cat?", "4", None),
  ]


def test_load_with_explicit_keys(tmp_path):
  path = _write(tmp_path, "custom.jsonl", [{"prompt": "2+2?", "final": "4",
                                            "question": "ignored", "answer": "5"}])
  assert load_jsonl(path, question_key="prompt", answer_key="final") == [
      MathProblem("custom/1", "2+2?", "4")]


@pytest.mark.parametrize("bad_row, kwargs, message", [
    ('{"question": "q", "answer": "1"', {}, "invalid JSON"),
    ('["q", "1"]', {}, "expected a JSON object, got list"),
    ({"answer": "1"}, {}, "missing field 'question' (or 'problem')"),
    ({"question": "q"}, {}, "missing field 'answer' (or 'solution')"),
    ({"question": "q", "answer": "1"}, {"answer_key": "final"}, "missing field 'final'"),
    ({"question": "  ", "answer": "1"}, {}, "field 'question' is empty"),
    ({"question": ["q"], "answer": "1"}, {}, "field 'question' must be a string"),
    ({"question": "q", "answer": None}, {}, "field 'answer' must be a string or a number"),
    ({"question": "q", "answer": ""}, {}, "field 'answer': no final answer found"),
    ({"question": "q", "answer": "1 + 1 = 2\n####  "}, {},
     "field 'answer': no final answer found: nothing follows its last '####'"),
    ({"problem": "q", "solution": "It is $2$."}, {},
     "field 'solution': no final answer found"),
    ({"problem": "q", "solution": r"It is $\boxed{2$."}, {},
     "field 'solution': no final answer found: its \\boxed{ is never closed"),
    ({"problem": "q", "solution": r"It is $\boxed{}$."}, {},
     "field 'solution': no final answer found: its last \\boxed{} is empty"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, bad_row, kwargs, message):
  fine = {"question": "fine", "answer": "1", "final": "1"}
  path = _write(tmp_path, "bad.jsonl", [fine, "", bad_row, fine])
  with pytest.raises(ValueError) as e:
    load_jsonl(path, **kwargs)
  assert str(e.value).startswith(f"{path}, line 3: ")
  assert message in str(e.value)


def test_format_prompt():
  assert format_prompt("What is 2+2?") == DEFAULT_TEMPLATE.replace("{question}",
                                                                   "What is 2+2?")
  assert format_prompt("What is 2+2?").startswith("Question: What is 2+2?\nAnswer:")
  assert format_prompt(r"Find $\frac{a}{b}$", "Q: {question} A:") == r"Q: Find $\frac{a}{b}$ A:"
  with pytest.raises(ValueError, match="must contain"):
    format_prompt("q", "no placeholder")


PROBLEMS = [MathProblem(f"p/{i}", f"question {i}", str(i)) for i in range(7)]


def _ids(stream, n):
  return [p.id for p in itertools.islice(stream, n)]


def test_math_stream_epochs_are_seeded_permutations():
  prompts = list(itertools.islice(MathStream(PROBLEMS, seed=3), 3 * len(PROBLEMS)))
  epochs = [prompts[i:i + len(PROBLEMS)] for i in range(0, len(prompts), len(PROBLEMS))]
  for epoch, drawn in enumerate(epochs):
    assert sorted(p.id for p in drawn) == sorted(f"{q.id}@{epoch}" for q in PROBLEMS)
  orders = [[p.question for p in drawn] for drawn in epochs]
  assert orders[0] != orders[1] != orders[2]
  first = prompts[0]
  problem = next(q for q in PROBLEMS if f"{q.id}@0" == first.id)
  assert (first.question, first.answer, first.text) == (
      problem.question, problem.answer, format_prompt(problem.question))
  assert _ids(MathStream(PROBLEMS, seed=3), 21) == [p.id for p in prompts]
  assert _ids(MathStream(PROBLEMS, seed=4), 21) != [p.id for p in prompts]


@pytest.mark.parametrize("drawn", [0, 3, 7, 8, 14, 17])
def test_math_stream_resumes_exactly(drawn):
  template = "Q: {question}\nA:"
  reference = list(itertools.islice(MathStream(PROBLEMS, seed=5, template=template), 30))
  stream = MathStream(PROBLEMS, seed=5, template=template)
  _ids(stream, drawn)
  state = stream.state()
  assert set(state) == {"seed", "epoch", "index"} and state["seed"] == 5
  resumed = MathStream.resume(PROBLEMS, json.loads(json.dumps(state)), template=template)
  assert list(itertools.islice(resumed, 30 - drawn)) == reference[drawn:]


def test_math_stream_rejects_bad_arguments():
  with pytest.raises(ValueError, match="at least one problem"):
    MathStream([])
  with pytest.raises(ValueError, match=r"index must be in \[0, 7\]"):
    MathStream(PROBLEMS, index=8)
  with pytest.raises(ValueError, match="epoch must be >= 0"):
    MathStream(PROBLEMS, epoch=-1)
  with pytest.raises(ValueError, match="must contain"):
    MathStream(PROBLEMS, template="no placeholder")
  with pytest.raises(ValueError, match="keys 'seed', 'epoch' and 'index'"):
    MathStream.resume(PROBLEMS, {"seed": 0, "index": 0})
