"""Tokenizers that need no download: characters of a fixed vocabulary, or UTF-8 bytes.

`CharTokenizer` is the tokenizer of the built-in synthetic tasks. `ByteTokenizer`
encodes any text as its UTF-8 bytes, for a user's data without a Hugging Face
tokenizer (`task.data.tokenizer="bytes"`).

`CharTokenizer`'s ids 0, 1 and 2 are PAD, BOS and EOS; the rest are one character each, by default
digits, `+ - * = ( ) #`, space and newline (`CHARS`, for arithmetic), or printable
ASCII (`CODE_CHARS`, for programs). The default `vocab_size` (22) fits any model whose
vocabulary is at least that large; a model with a larger vocabulary can still emit
ids the tokenizer does not know, which `decode` renders as U+FFFD (unless `strict`)
so that a verifier scores them as wrong instead of crashing.
"""

import string
from collections.abc import Iterable, Mapping, Sequence

from async_rl.chat import chatml

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = "0123456789+-*=()# \n"
CODE_CHARS = string.printable.replace("\t", "").replace("\r", "").replace(
    "\x0b", "").replace("\x0c", "")
REPLACEMENT = "\ufffd"


class CharTokenizer:
  """Maps text to ids one character at a time; the vocabulary is `chars`, fixed."""

  def __init__(self, chars: str = CHARS):
    if len(set(chars)) != len(chars):
      raise ValueError(f"chars must not repeat a character, got {chars!r}")
    self.chars = chars
    self._id_to_token = (PAD, BOS, EOS) + tuple(chars)
    self._char_to_id = {c: i for i, c in enumerate(self._id_to_token) if len(c) == 1}

  @property
  def vocab_size(self) -> int:
    return len(self._id_to_token)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Generation ends at EOS."""
    return (self.eos_id,)

  def encode(self, text: str) -> list[int]:
    """The ids of `text`, one per character, without BOS or EOS.

    Raises:
      ValueError: naming the first character outside the vocabulary and its position.
    """
    ids = []
    for position, char in enumerate(text):
      token = self._char_to_id.get(char)
      if token is None:
        raise ValueError(f"character {char!r} at position {position} of {text!r} is not "
                         f"in the vocabulary {self.chars!r}")
      ids.append(token)
    return ids

  def decode(self, ids: Iterable[int], *, strict: bool = False) -> str:
    """The text of `ids` up to (not including) the first EOS; PAD and BOS are dropped.

    Args:
      ids: token ids (Python or NumPy integers).
      strict: if true, an id outside [0, vocab_size) raises ValueError naming it and
        its position; if false (for decoding model samples), it becomes U+FFFD.
    """
    chars = []
    for position, token in enumerate(ids):
      token = int(token)
      if token == self.eos_id:
        break
      if not 0 <= token < self.vocab_size:
        if strict:
          raise ValueError(f"token id {token} at position {position} is outside the "
                           f"vocabulary [0, {self.vocab_size})")
        chars.append(REPLACEMENT)
      elif token not in (self.pad_id, self.bos_id):
        chars.append(self._id_to_token[token])
    return "".join(chars)


class ByteTokenizer:
  """UTF-8 bytes as ids 0 to 255, then PAD (256), BOS (257) and EOS (258): any text
  encodes, and nothing is unknown. A conversation renders as ChatML text."""
  vocab_size = 259
  pad_id, bos_id, eos_id = 256, 257, 258
  stop_ids = (eos_id,)

  def encode(self, text: str) -> list[int]:
    """The UTF-8 bytes of `text`, without BOS or EOS."""
    return list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids` up to (not including) the first EOS; PAD and BOS are dropped.
    An id outside [0, vocab_size) (a larger model vocabulary) and a byte sequence that
    is not UTF-8 both become U+FFFD, so a verifier scores them as wrong."""
    chunks, run = [], bytearray()
    for token in ids:
      token = int(token)
      if token == self.eos_id:
        break
      if 0 <= token < 256:
        run.append(token)
      elif token not in (self.pad_id, self.bos_id):
        chunks.append(run.decode("utf-8", errors="replace") + REPLACEMENT)
        run = bytearray()
    return "".join(chunks) + run.decode("utf-8", errors="replace")

  def render_chat(self, messages: Sequence[Mapping[str, str]], *,
                  add_generation_prompt: bool = True, **kwargs) -> str:
    """`messages` as ChatML text (`chat.chatml`); no template variables."""
    if kwargs:
      raise ValueError(f"the byte tokenizer's ChatML takes no template variables, got "
                       f"{sorted(kwargs)} (task.data.chat_template_kwargs)")
    return chatml(messages, add_generation_prompt)
