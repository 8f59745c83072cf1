"""A Hugging Face model's own tokenizer, read from its directory, and the Qwen chat template.

Reads `tokenizer.json` with the `tokenizers` library (the `hf` extra); nothing is
fetched from the hub. The special ids come from the directory's JSON files, the first
that names each one winning:

  eos_id     generation_config.json `eos_token_id` (its first, if a list), then
             config.json `eos_token_id`, then tokenizer_config.json `eos_token`.
  pad_id     generation_config.json, config.json `pad_token_id`, then
             tokenizer_config.json `pad_token`; else `eos_id`.
  stop_ids   every id of generation_config.json's `eos_token_id`, `eos_id`, and
             `<|im_end|>` and `<|endoftext|>` where the vocabulary has them, so a Qwen
             chat model stops at the end of its turn whichever it emits.
"""

import json
import os
from collections.abc import Iterable
from typing import Optional

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


def chat_prompt(question: str, system: Optional[str] = None) -> str:
  """The Qwen chat template for one user turn, ending where the assistant begins.

  `<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{question}<|im_end|>\\n
  <|im_start|>assistant\\n`, without the system turn when `system` is None. This is
  what Qwen2.5's Jinja template renders for a system and a user message with
  `add_generation_prompt=True` and no tools. `system=None` omits the system turn, as
  Qwen3's template does (Qwen2.5's inserts its own default system prompt instead).
  Other templates are not implemented.
  """
  turns = [] if system is None else [("system", system)]
  turns.append(("user", question))
  return "".join(f"{IM_START}{role}\n{text}{IM_END}\n" for role, text in turns) + \
      f"{IM_START}assistant\n"


def _read_json(model_dir: str, name: str) -> dict:
  path = os.path.join(model_dir, name)
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _as_list(ids) -> list[int]:
  if ids is None:
    return []
  return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


class HFTokenizer:
  """encode/decode and the special ids of the tokenizer in a model directory."""

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

  def encode_chat(self, question: str, system: Optional[str] = None) -> list[int]:
    """The ids of `chat_prompt(question, system)`."""
    return self.encode(chat_prompt(question, system))
