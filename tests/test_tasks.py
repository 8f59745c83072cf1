"""Arithmetic tasks: tokenizer, verifier, length distribution, splits, resumable stream;
and the byte tokenizer of a user's data."""

import itertools
import json
import re

import numpy as np
import pytest

from async_rl.tasks import (MAX_PROMPT_TOKENS, MAX_SOLUTION_TOKENS, CharTokenizer,
                            TrainStream, extract_answer, heldout_set,
                            is_heldout, length_stats, make_problem, verify)
from async_rl.config import ArithmeticConfig
from async_rl.tasks import arithmetic
from async_rl.tasks.arithmetic import Problem, answer_correct, step_credit
from async_rl.tasks.tokenizer import CHARS, ByteTokenizer

TOK = CharTokenizer()


def _problems(cfg, n, seed=0):
  rng = np.random.default_rng(seed)
  return [make_problem(rng, cfg) for _ in range(n)]


def test_tokenizer_ids_and_round_trip():
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
  assert TOK.vocab_size == 3 + len(CHARS) <= 64
  assert TOK.decode(TOK.encode(CHARS)) == CHARS
  text = "7+12-(5*3)=\n#17 "
  ids = TOK.encode(text)
  assert len(ids) == len(text) and all(3 <= i < TOK.vocab_size for i in ids)
  assert TOK.decode(ids) == text


def test_tokenizer_decode_drops_specials_and_stops_at_eos():
  ids = [TOK.bos_id, *TOK.encode("3+4"), TOK.pad_id, *TOK.encode("=7"), TOK.eos_id,
         *TOK.encode("#9")]
  assert TOK.decode(ids) == "3+4=7"
  assert TOK.decode(np.asarray(ids, np.int32)) == "3+4=7"


def test_tokenizer_errors_name_the_culprit():
  with pytest.raises(ValueError, match=r"'x' at position 2"):
    TOK.encode("1+x=")
  with pytest.raises(ValueError, match=r"token id 40 at position 1"):
    TOK.decode([3, 40, 4], strict=True)
  with pytest.raises(ValueError, match=r"token id -1 at position 0"):
    TOK.decode([-1], strict=True)
  assert TOK.decode([3, 40, TOK.eos_id, 50]) == "0\ufffd", "model samples decode leniently"


def test_byte_tokenizer_encodes_any_text_and_decodes_any_id():
  tok = ByteTokenizer()
  assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids) == (
      259, 256, 257, 258, (258,))
  text = "Wie viel ist 2+2? Ça fait 四.\n"
  ids = tok.encode(text)
  assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
  assert tok.decode([tok.bos_id, *ids, tok.pad_id, tok.eos_id, *tok.encode("x")]) == text
  assert tok.decode(np.asarray(ids, np.int32)) == text
  # A larger model vocabulary, a truncated character and a stray continuation byte.
  assert tok.decode([*tok.encode("a"), 300, *tok.encode("b")]) == "a\ufffdb"
  assert tok.decode(tok.encode("四")[:2] + tok.encode("!")) == "\ufffd!"
  assert tok.decode([0x80, *tok.encode("ok")]) == "\ufffdok"


def test_byte_tokenizer_renders_conversations_as_chatml():
  tok = ByteTokenizer()
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
  assert tok.render_chat(messages) == ("<|im_start|>system\nbe brief<|im_end|>\n"
                                       "<|im_start|>user\n2+2?<|im_end|>\n"
                                       "<|im_start|>assistant\n")
  with pytest.raises(ValueError, match="enable_thinking"):
    tok.render_chat(messages, enable_thinking=False)


P = Problem(prompt="7+2-5+3=", answer="7", num_terms=4,
            solution="7+2=9\n9-5=4\n4+3=7\n#7")


@pytest.mark.parametrize("completion, answer, answer_ok, reward", [
    ("7+2=9\n9-5=4\n4+3=7\n#7", "7", 1.0, 1.0),
    ("#7", "7", 1.0, 0.0),  # a guess: right answer, no work
    ("wrong scratchpad\n#7\ntrailing", "7", 1.0, 0.0),
    ("7+2=9\n9-5=4\n#7", "7", 1.0, 0.0),  # a step skipped
    ("7+2=9\n9-5=5\n5+3=7\n#7", "7", 1.0, 0.0),  # a wrong step
    ("#3\n#7", "7", 1.0, 0.0),
    ("#7\n#3", "3", 0.0, 0.0),
    ("7+2=9\n9-5=4\n4+3=8\n#8", "8", 0.0, 0.0),
    ("7+2=9\n9-5=4\n4+3=7\n#07", "07", 0.0, 0.0),
    ("7+2=9\n9-5=4\n4+3=7\n# 7", " 7", 0.0, 0.0),
    ("7+2=9\n9-5=4\n4+3=7\n#7 ", "7 ", 0.0, 0.0),
    ("7+2=9\n9-5=4\n4+3=7\n#7\n", "7", 1.0, 0.0),
    ("#-7", "-7", 0.0, 0.0),
    ("7+2=9\n9-5=4\n4+3=7\n", None, 0.0, 0.0),
    ("7+2=9\n#", None, 0.0, 0.0),
    ("#\n7", None, 0.0, 0.0),
    ("", None, 0.0, 0.0),
])
def test_extract_and_verify(completion, answer, answer_ok, reward):
  assert extract_answer(completion) == answer
  assert answer_correct(completion, P) == answer_ok
  assert verify(completion, P) == reward


@pytest.mark.parametrize("completion, credit", [
    ("7+2=9\n9-5=4\n4+3=7\n#7", 1.0),
    ("7+2=9\n9-5=4\n4+3=8\n#8", 2 / 5),  # two leading steps right
    ("7+2=9\n9-5=5\n5+3=8\n#8", 1 / 5),  # later lines follow from a wrong one
    ("7+2=8\n8-5=3\n3+3=6\n#6", 0.0),
    ("7+2=9\n9-5=4\n4+3=7", 3 / 5),  # no answer line
    ("7+2=9\n9-5=4\n4+3=7\n#7\n", 3 / 5),  # right, then more: not the solution
    ("7+2=9\n9-5=4\n4+3=7\n#7\n#7", 3 / 5),
    ("#7", 0.0),  # a guess earns nothing
    ("", 0.0),
])
def test_step_credit_rewards_the_correct_start_and_only_the_solution_fully(completion,
                                                                           credit):
  assert step_credit(completion, P) == pytest.approx(credit)
  assert (step_credit(completion, P) == 1.0) == (verify(completion, P) == 1.0)


def test_step_credit_ranks_every_wrong_completion_below_the_solution():
  for problem in _problems(ArithmeticConfig(max_terms=12), 300):
    lines = problem.solution.split("\n")
    credits = [step_credit("\n".join(lines[:m]), problem) for m in range(len(lines) + 1)]
    assert credits == sorted(credits) and credits[-1] == 1.0
    assert max(credits[:-1]) < 1.0


def test_verify_decoded_sample_ignores_tokens_after_eos():
  ids = TOK.encode(P.solution) + [TOK.eos_id] + TOK.encode("9")
  assert verify(TOK.decode(ids), P) == 1.0
  ids = TOK.encode(P.solution) + TOK.encode("9") + [TOK.eos_id]
  assert verify(TOK.decode(ids), P) == 0.0


@pytest.mark.parametrize("cfg", [ArithmeticConfig(), ArithmeticConfig(max_operand=20, max_value=40),
                                 ArithmeticConfig(min_terms=3, max_terms=12, tail_exponent=0.0)])
def test_reference_solutions_are_correct_and_verify(cfg):
  for problem in _problems(cfg, 2000):
    assert verify(problem.solution, problem) == 1.0
    chain = problem.prompt[:-1]
    # Python's + and - are left-associative with equal precedence, as the task's are.
    assert str(eval(chain)) == problem.answer
    terms = re.findall(r"[+-]?\d+", chain)
    lines = problem.solution.split("\n")
    assert len(terms) == len(lines) == problem.num_terms
    assert lines[-1] == "#" + problem.answer
    value = terms[0]
    for term, line in zip(terms[1:], lines[:-1]):
      left, right = line.split("=")
      assert left == value + term and str(eval(left)) == right
      assert 0 <= int(right) <= cfg.max_value
      value = right


def test_term_counts_follow_the_power_law():
  cfg = ArithmeticConfig()
  probs = arithmetic.term_probs(cfg)
  assert probs.shape == (cfg.max_terms - cfg.min_terms + 1,)
  assert np.isclose(probs.sum(), 1.0) and np.all(np.diff(probs) < 0)
  n = 20_000
  counts = np.bincount([p.num_terms - cfg.min_terms for p in _problems(cfg, n)],
                       minlength=len(probs))
  assert np.all(np.abs(counts / n - probs) < 5 * np.sqrt(probs * (1 - probs) / n))
  assert np.allclose(arithmetic.term_probs(ArithmeticConfig(tail_exponent=0.0)), 1 / len(probs))


def test_solution_lengths_are_long_tailed_and_controllable():
  heavy = length_stats(ArithmeticConfig(), 5000)["solution_tokens"]
  light = length_stats(ArithmeticConfig(tail_exponent=3.0), 5000)["solution_tokens"]
  assert heavy["p99"] / heavy["median"] > 3
  assert heavy["max"] >= arithmetic.max_solution_tokens(ArithmeticConfig()) - 4
  assert light["p99"] / light["median"] < heavy["p99"] / heavy["median"]
  assert light["mean"] < heavy["mean"]


def test_default_config_fits_the_token_budgets():
  cfg = ArithmeticConfig()
  assert arithmetic.max_prompt_tokens(cfg) <= MAX_PROMPT_TOKENS
  assert arithmetic.max_solution_tokens(cfg) <= MAX_SOLUTION_TOKENS
  for prompt in itertools.islice(TrainStream(cfg), 5000):
    assert len(prompt.tokens) <= arithmetic.max_prompt_tokens(cfg)
    assert len(prompt.target) <= arithmetic.max_solution_tokens(cfg)
    assert max(prompt.tokens + prompt.target) < TOK.vocab_size <= 64


@pytest.mark.parametrize("cfg", [ArithmeticConfig(min_terms=8, max_terms=8),
                                 ArithmeticConfig(min_terms=3, max_terms=3, max_operand=20,
                                            max_value=40),
                                 ArithmeticConfig(min_terms=2, max_terms=2)])
def test_length_bounds_are_tight(cfg):
  problems = _problems(cfg, 3000)
  prompt_lengths = [len(p.prompt) + 1 for p in problems]
  solution_lengths = [len(p.solution) + 1 for p in problems]
  assert max(prompt_lengths) == arithmetic.max_prompt_tokens(cfg)
  assert max(solution_lengths) == arithmetic.max_solution_tokens(cfg)


def test_prompt_records_tokenize_the_problem():
  for prompt in itertools.islice(TrainStream(ArithmeticConfig()), 200):
    assert prompt.tokens[0] == TOK.bos_id and prompt.target[-1] == TOK.eos_id
    assert TOK.decode(prompt.tokens) == prompt.problem.prompt
    assert TOK.decode(prompt.target) == prompt.problem.solution


def test_train_and_heldout_never_overlap():
  cfg = ArithmeticConfig()
  train = {p.problem.prompt for p in itertools.islice(TrainStream(cfg), 20_000)}
  for seed in (1, 2):
    train |= {p.problem.prompt
              for p in itertools.islice(TrainStream(ArithmeticConfig(seed=seed)), 5000)}
  heldout = {p.problem.prompt for p in heldout_set(cfg, 3000)}
  assert not train & heldout
  assert all(is_heldout(p, cfg.heldout_fraction) for p in heldout)
  assert not any(is_heldout(p, cfg.heldout_fraction) for p in train)
  # The hash spreads prompts evenly: about heldout_fraction of distinct prompts.
  both = train | heldout
  share = np.mean([is_heldout(p, cfg.heldout_fraction) for p in both])
  assert abs(share - cfg.heldout_fraction) < 5 * np.sqrt(0.1 * 0.9 / len(both))
  two_term_heldout = {p for p in heldout if p.count("+") + p.count("-") == 1}
  assert two_term_heldout and not two_term_heldout & train


def test_same_seed_same_data():
  first = list(itertools.islice(TrainStream(ArithmeticConfig(seed=3)), 300))
  again = list(itertools.islice(TrainStream(ArithmeticConfig(seed=3)), 300))
  other = list(itertools.islice(TrainStream(ArithmeticConfig(seed=4)), 300))
  assert first == again
  assert [p.problem for p in first] != [p.problem for p in other]
  assert len({p.id for p in first + other}) == 600
  assert heldout_set(ArithmeticConfig(seed=3), 100) == heldout_set(ArithmeticConfig(seed=4), 100)


def test_stream_resumes_exactly():
  cfg = ArithmeticConfig(seed=5)
  stream = TrainStream(cfg)
  reference = list(itertools.islice(TrainStream(cfg), 120))
  head = list(itertools.islice(stream, 37))
  state = json.loads(json.dumps(stream.state()))
  assert state == {"seed": 5, "index": 37}
  tail = list(itertools.islice(TrainStream.resume(cfg, state), 83))
  assert head + tail == reference
  assert list(itertools.islice(stream, 83)) == tail


def test_stream_resume_rejects_a_mismatched_state():
  with pytest.raises(ValueError, match="seed 1 does not match task.arithmetic.seed 0"):
    TrainStream.resume(ArithmeticConfig(), {"seed": 1, "index": 0})
  with pytest.raises(ValueError, match="keys"):
    TrainStream.resume(ArithmeticConfig(), {"index": 0})
  with pytest.raises(ValueError, match="index"):
    TrainStream(ArithmeticConfig(), index=-1)


@pytest.mark.parametrize("values, field", [
    ({"min_terms": 1}, "task.arithmetic.min_terms"),
    ({"max_terms": 1}, "task.arithmetic.max_terms"),
    ({"tail_exponent": -0.5}, "task.arithmetic.tail_exponent"),
    ({"max_operand": 0}, "task.arithmetic.max_operand"),
    ({"max_value": 17}, "task.arithmetic.max_value"),
    ({"heldout_fraction": 0.0}, "task.arithmetic.heldout_fraction"),
    ({"heldout_fraction": 1.0}, "task.arithmetic.heldout_fraction"),
    ({"seed": -1}, "task.arithmetic.seed"),
])
def test_invalid_config_names_the_field(values, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    ArithmeticConfig(**values)
