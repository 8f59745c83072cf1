"""HFTokenizer on a tiny tokenizer built in the test: round trip, special ids, chat template."""

import json

import pytest

pytest.importorskip("tokenizers")

from async_rl.models.hf_tokenizer import HFTokenizer, chat_prompt  # noqa: E402
from hf_test_utils import save_tokenizer  # noqa: E402


def _write(model_dir, name, obj):
  (model_dir / name).write_text(json.dumps(obj))


def test_round_trip_and_ids_from_generation_config(tmp_path):
  tok = save_tokenizer(tmp_path)
  endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
  _write(tmp_path, "config.json", {"eos_token_id": endoftext})
  _write(tmp_path, "generation_config.json",
         {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext})
  t = HFTokenizer(str(tmp_path))
  ids = t.encode("what is two plus two")
  assert ids == tok.encode("what is two plus two").ids and len(ids) == 5
  assert t.decode(ids) == "what is two plus two"
  assert (t.eos_id, t.pad_id) == (im_end, endoftext)
  assert t.stop_ids == (im_end, endoftext)
  assert t.decode(ids[:2] + [im_end] + ids[2:]) == "what is"
  assert t.vocab_size == tok.get_vocab_size()


def test_ids_fall_back_to_config_and_tokenizer_config(tmp_path):
  tok = save_tokenizer(tmp_path)
  endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
  _write(tmp_path, "config.json", {"eos_token_id": endoftext})
  t = HFTokenizer(str(tmp_path))
  assert (t.eos_id, t.pad_id) == (endoftext, endoftext)
  assert t.stop_ids == (endoftext, im_end)

  (tmp_path / "config.json").unlink()
  _write(tmp_path, "tokenizer_config.json",
         {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>"})
  t = HFTokenizer(str(tmp_path))
  assert (t.eos_id, t.pad_id, t.stop_ids) == (im_end, endoftext, (im_end, endoftext))


def test_missing_files_and_ids_are_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    HFTokenizer(str(tmp_path))
  save_tokenizer(tmp_path)
  with pytest.raises(ValueError, match="no EOS id"):
    HFTokenizer(str(tmp_path))
  _write(tmp_path, "tokenizer_config.json", {"eos_token": "<eos>"})
  with pytest.raises(ValueError, match="'<eos>' is not in"):
    HFTokenizer(str(tmp_path))


def test_chat_template():
  assert chat_prompt("what is two plus two", system="be brief") == (
      "<|im_start|>system\nbe brief<|im_end|>\n"
      "<|im_start|>user\nwhat is two plus two<|im_end|>\n"
      "<|im_start|>assistant\n")
  assert chat_prompt("hi", system=None) == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_prompt_encodes_special_tokens_as_single_ids(tmp_path):
  tok = save_tokenizer(tmp_path)
  _write(tmp_path, "config.json", {"eos_token_id": tok.token_to_id("<|im_end|>")})
  t = HFTokenizer(str(tmp_path))
  ids = t.encode_chat("what is two plus two", system=None)
  start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
  user, assistant = tok.token_to_id("user"), tok.token_to_id("assistant")
  assert ids == [start, user, *t.encode("what is two plus two"), end, start, assistant]
  assert t.decode(ids, skip_special_tokens=False) == "<|im_start|> user what is two plus two"
