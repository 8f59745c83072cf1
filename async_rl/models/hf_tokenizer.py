"""A Hugging Face model's own tokenizer and chat template, read from its directory.

Reads `tokenizer.json` with the `tokenizers` library (the `hf` extra); nothing is
fetched from the hub. The special ids come from the directory's JSON files, the first
that names each one winning:

  eos_id     generation_config.json `eos_token_id` (its first, if a list), then
             config.json `eos_token_id`, then tokenizer_config.json `eos_token`.
  pad_id     generation_config.json, config.json `pad_token_id`, then
             tokenizer_config.json `pad_token`; else `eos_id`.
  bos_id     tokenizer_config.json `bos_token`; None when it names none (Qwen).
  stop_ids   every id of generation_config.json's `eos_token_id`, `eos_id`, and
             `<|im_end|>` and `<|endoftext|>` where the vocabulary has them, so a Qwen
             chat model stops at the end of its turn whichever it emits.

A conversation is rendered with the model's own chat template, as transformers'
`apply_chat_template` renders it: the Jinja template of `chat_template.jinja`,
`chat_template.json` or tokenizer_config.json's `chat_template` (the first present;
of a list of named templates, "default"), in a sandboxed environment with the
messages, `add_generation_prompt`, the special tokens' text (`bos_token`,
`eos_token`, ...) and any extra variables. A directory with no template gets ChatML
(`chat.chatml`).
"""

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from async_rl.chat import END_OF_TEXT, IM_END, chat_messages, chatml, compile_chat_template

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(model_dir: str, name: str) -> dict:
  path = os.path.join(model_dir, name)
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _read_chat_template(model_dir: str, tok_config: dict) -> Optional[str]:
  path = os.path.join(model_dir, "chat_template.jinja")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  template = (_read_json(model_dir, "chat_template.json").get("chat_template")
              or tok_config.get("chat_template"))
  if isinstance(template, list):  # Named templates: [{"name": ..., "template": ...}].
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  return template or None


def _as_list(ids) -> list[int]:
  if ids is None:
    return []
  return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


class HFTokenizer:
  """encode/decode, the special ids and the chat template of a model directory's
  tokenizer (`tasks.protocol.TextTokenizer`)."""

  def __init__(self, model_dir: str):
    from tokenizers import Tokenizer  # the `hf` extra, imported where it is needed
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{model_dir}: no tokenizer.json (the tokenizer's own "
                              "file is needed; vocab.json + merges.txt are not read)")
    self._tok = Tokenizer.from_file(path)
    generation = _read_json(model_dir, "generation_config.json")
    config = _read_json(model_dir, "config.json")
    tok_config = _read_json(model_dir, "tokenizer_config.json")

    eos = _as_list(generation.get("eos_token_id")) or _as_list(config.get("eos_token_id"))
    if not eos and (token := self._token_text(tok_config.get("eos_token"))):
      eos = [self._id_of(token, "tokenizer_config.json eos_token")]
    if not eos:
      raise ValueError(f"{model_dir}: no EOS id in generation_config.json, config.json "
                       "(eos_token_id) or tokenizer_config.json (eos_token)")
    self.eos_id = eos[0]

    pad = _as_list(generation.get("pad_token_id")) or _as_list(config.get("pad_token_id"))
    if not pad and (token := self._token_text(tok_config.get("pad_token"))):
      pad = [self._id_of(token, "tokenizer_config.json pad_token")]
    self.pad_id = pad[0] if pad else self.eos_id
    bos = self._token_text(tok_config.get("bos_token"))
    self.bos_id = None if bos is None else self._id_of(bos, "tokenizer_config.json bos_token")

    self.chat_template = _read_chat_template(model_dir, tok_config)
    self._template = None
    if self.chat_template is not None:
      import jinja2  # noqa: PLC0415 (with the template)
      try:
        self._template = compile_chat_template(self.chat_template)
      except jinja2.TemplateError as e:
        raise ValueError(f"{model_dir}: the chat template does not parse: {e}") from None
    self._template_tokens = {name: text for name in _SPECIAL_TOKENS
                             if (text := self._token_text(tok_config.get(name)))}
    self._template_tokens.setdefault("eos_token", self._tok.id_to_token(self.eos_id))

    stops = eos + [i for i in (self._tok.token_to_id(t) for t in (IM_END, END_OF_TEXT))
                   if i is not None]
    self.stop_ids = tuple(dict.fromkeys(stops))

  @staticmethod
  def _token_text(token) -> Optional[str]:
    # tokenizer_config.json writes a special token as a string or as {"content": ...}.
    return token.get("content") if isinstance(token, dict) else token

  def _id_of(self, token: str, where: str) -> int:
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{where} {token!r} is not in tokenizer.json's vocabulary")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """The ids of `text`; special tokens written in it (`<|im_start|>`) map to their ids."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """The text of `ids` up to (not including) the first stop id."""
    kept = []
    for token in ids:
      if int(token) in self.stop_ids:
        break
      kept.append(int(token))
    return self._tok.decode(kept, skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                  add_generation_prompt: bool = True, **kwargs) -> str:
    """The text of `messages` in the model's chat template (ChatML without one), up to
    where the assistant's reply begins when `add_generation_prompt`; `kwargs` are
    extra template variables (Qwen3's `enable_thinking`, `tools`).

    Raises:
      ValueError: the template rejects the conversation (its `raise_exception`).
    """
    if self._template is None:
      return chatml(messages, add_generation_prompt)
    import jinja2  # noqa: PLC0415 (with the template)
    try:
      return self._template.render(
          **self._template_tokens, **{"tools": None, "documents": None, **kwargs},
          messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
      raise ValueError(f"the model's chat template cannot render the conversation: "
                       f"{type(e).__name__}: {e}") from None

  def encode_chat(self, question: str, system: Optional[str] = None, **kwargs) -> list[int]:
    """The ids of one user turn (after a system turn unless `system` is None) in the
    chat template, ending where the assistant begins."""
    return self.encode(self.render_chat(chat_messages(question, system), **kwargs))
