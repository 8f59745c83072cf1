"""HFTokenizer on a tiny tokenizer built in the test: round trip, special ids, and chat
templates rendered as transformers renders them (ChatML without one)."""

import json

import pytest

pytest.importorskip("tokenizers")

from async_rl.chat import chat_messages, chatml  # noqa: E402
from async_rl.models.hf_tokenizer import HFTokenizer  # noqa: E402
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


def test_chatml():
  assert chatml(chat_messages("what is two plus two", system="be brief")) == (
      "<|im_start|>system\nbe brief<|im_end|>\n"
      "<|im_start|>user\nwhat is two plus two<|im_end|>\n"
      "<|im_start|>assistant\n")
  assert chatml(chat_messages("hi")) == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  assert chatml(chat_messages("hi"), add_generation_prompt=False) == (
      "<|im_start|>user\nhi<|im_end|>\n")


def test_chat_prompt_encodes_special_tokens_as_single_ids(tmp_path):
  tok = save_tokenizer(tmp_path)
  _write(tmp_path, "config.json", {"eos_token_id": tok.token_to_id("<|im_end|>")})
  t = HFTokenizer(str(tmp_path))
  ids = t.encode_chat("what is two plus two", system=None)
  start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
  user, assistant = tok.token_to_id("user"), tok.token_to_id("assistant")
  assert ids == [start, user, *t.encode("what is two plus two"), end, start, assistant]
  assert t.decode(ids, skip_special_tokens=False) == "<|im_start|> user what is two plus two"


# Templates in the style of Qwen2.5's (a default system turn when the conversation has
# none) and Qwen3's (no default system turn; earlier replies lose their reasoning; an
# empty reasoning block when `enable_thinking` is false; tools as JSON).
QWEN25_STYLE = """\
{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN3_STYLE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
{%- if ns.last_user < 0 and message.role == 'user' %}
{%- set ns.last_user = messages|length - 1 - loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role not in ('system', 'user', 'assistant') %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- set content = message.content %}
{%- if message.role == 'assistant' and loop.index0 < ns.last_user %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
CONVERSATION = [{"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "<think>\nfour</think>\n\nthe answer is four"},
                {"role": "user", "content": "and two plus three"}]


@pytest.mark.parametrize("template, extra, begins, ends", [
    (QWEN25_STYLE, {}, "<|im_start|>system\nYou are a helpful", "assistant\n"),
    (QWEN3_STYLE, {}, "<|im_start|>user\n", "assistant\n"),
    (QWEN3_STYLE, {"enable_thinking": False}, "<|im_start|>user\n", "</think>\n\n")],
    ids=["qwen2.5", "qwen3", "qwen3_no_thinking"])
@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_the_models_own_chat_template_renders_as_transformers_does(tmp_path, template, extra,
                                                                    begins, ends, where):
  transformers = pytest.importorskip("transformers")
  save_tokenizer(tmp_path)
  if where == "chat_template.jinja":
    (tmp_path / where).write_text(template)
    _write(tmp_path, "tokenizer_config.json", {"eos_token": "<|im_end|>"})
  else:
    _write(tmp_path, "tokenizer_config.json", {"eos_token": "<|im_end|>",
                                               "chat_template": template})
  ours = HFTokenizer(str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for messages in (CONVERSATION, [{"role": "system", "content": "be brief"}, *CONVERSATION],
                   CONVERSATION[:1]):
    expected = theirs.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=True, **extra)
    assert ours.render_chat(messages, **extra) == expected
    assert ours.render_chat(messages, add_generation_prompt=False, **extra) == (
        theirs.apply_chat_template(messages, tokenize=False, **extra))
  text = ours.render_chat(CONVERSATION, **extra)
  assert text.startswith(begins) and text.endswith(ends)
  assert ("<think>\nfour" in text) == (template == QWEN25_STYLE)  # Qwen3 drops old reasoning.
  question = "what is two plus two"
  assert ours.encode_chat(question, **extra) == ours.encode(
      ours.render_chat(chat_messages(question), **extra))


def test_templates_by_name_bad_templates_and_rejected_conversations(tmp_path):
  save_tokenizer(tmp_path)
  _write(tmp_path, "tokenizer_config.json", {"eos_token": "<|im_end|>", "chat_template": [
      {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": QWEN3_STYLE}]})
  t = HFTokenizer(str(tmp_path))
  assert t.chat_template == QWEN3_STYLE
  with pytest.raises(ValueError, match="cannot render the conversation.*unknown role tool"):
    t.render_chat([{"role": "tool", "content": "4"}])
  _write(tmp_path, "tokenizer_config.json", {"eos_token": "<|im_end|>",
                                             "chat_template": "{% if %}"})
  with pytest.raises(ValueError, match="the chat template does not parse"):
    HFTokenizer(str(tmp_path))


def test_bos_id_comes_from_tokenizer_config(tmp_path):
  tok = save_tokenizer(tmp_path)
  _write(tmp_path, "tokenizer_config.json", {"eos_token": "<|im_end|>"})
  assert HFTokenizer(str(tmp_path)).bos_id is None
  _write(tmp_path, "tokenizer_config.json", {"eos_token": "<|im_end|>",
                                             "bos_token": {"content": "<|endoftext|>"}})
  assert HFTokenizer(str(tmp_path)).bos_id == tok.token_to_id("<|endoftext|>")
