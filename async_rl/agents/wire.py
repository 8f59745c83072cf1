"""The OpenAI wire format: request bodies in, response bodies and stream chunks out.

Pure functions of dicts and token ids; the endpoint (`agents.server`) does the I/O.
A request is checked field by field and a bad one raises `BadRequest`, whose message
names the field (the endpoint answers it with HTTP 400 in OpenAI's error shape).

What is honoured: `n` (up to `MAX_N`), `temperature`, `top_p`, `seed`, `max_tokens` (or
`max_completion_tokens`), `stop` (up to `MAX_STOP` strings of any length, found in the
decoded text as vLLM finds them: the reply ends with the token that completes the first
stop string, which the text leaves out; see `stop_cut`), `logprobs` (the sampled token's
log-prob, under the distribution it was drawn from; `top_logprobs` lists are empty),
`tools` (handed to the chat template; tool calls are parsed from the reply, see
`parse_tool_calls`), `stream` (`TextStream`, `Chunks`) and
`stream_options.include_usage`. Other fields (`presence_penalty`, `user`, ...) are
accepted and ignored, as vLLM does.
"""

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Optional

# A tool call in the Hermes / Qwen2.5 chat format: a JSON object {"name", "arguments"}
# between these tags.
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


# The most completions one request asks for, and the most stop strings (OpenAI allows
# 4; an agent may stop on many one-character strings): each costs the endpoint work
# before the request is queued.
MAX_N = 128
MAX_STOP = 32


class BadRequest(ValueError):
  """A request the endpoint cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Ask:
  """What one request asks of the generator, beyond its prompt.

  Attributes:
    n: completions of the prompt.
    max_tokens: the most tokens of each; None: the endpoint's limit.
    temperature, top_p, seed: sampling (an episode samples as the run does instead).
    stop: the request's `stop` strings.
    stop_ids: the token ids of those of `stop` that are one token each, on which the
      generator stops (the tokenizer's own stop ids come on top); the others are found
      in the decoded text (`stop_cut`).
    logprobs: return the sampled tokens' log-probs.
    stream: answer with server-sent events.
    include_usage: a streamed answer ends with a chunk of token counts.
  """
  n: int = 1
  max_tokens: Optional[int] = None
  temperature: float = 1.0
  top_p: float = 1.0
  seed: Optional[int] = None
  stop: tuple[str, ...] = ()
  stop_ids: tuple[int, ...] = ()
  logprobs: bool = False
  stream: bool = False
  include_usage: bool = False


def _get(body: Mapping, key: str, types, default=None):
  value = body.get(key, default)
  if value is None:
    return default
  if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
    raise BadRequest(f"{key} must be {_names(types)}, got {value!r}")
  if not isinstance(value, types):
    raise BadRequest(f"{key} must be {_names(types)}, got {value!r}")
  return value


def _names(types) -> str:
  types = types if isinstance(types, tuple) else (types,)
  return " or ".join(t.__name__ for t in types)


def _float(body: Mapping, key: str) -> float:
  value = _get(body, key, (int, float), 1.0)
  try:
    return float(value)
  except OverflowError:  # an integer of hundreds of digits
    raise BadRequest(f"{key} must be a number in range, got an integer of "
                     f"{len(str(abs(value)))} digits") from None


def _encoded(encode):
  """`encode`, giving no ids for a text the tokenizer cannot encode: such a stop string
  is still found in the decoded text (`stop_cut`)."""
  def encoded(text):
    try:
      return encode(text)
    except ValueError:
      return []
  return encoded


def parse_ask(body: Mapping, encode, *, chat: bool) -> Ask:
  """The sampling fields of a request body (`encode` maps a stop string to ids).
  `n` is at most `MAX_N` and `stop` holds at most `MAX_STOP` strings."""
  if not isinstance(body, Mapping):
    raise BadRequest("the request body must be a JSON object")
  n = _get(body, "n", int, 1)
  if not 1 <= n <= MAX_N:
    raise BadRequest(f"n must be in [1, {MAX_N}], got {n}")
  max_tokens = _get(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                    else "max_tokens", int)
  if max_tokens is not None and max_tokens < 1:
    raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")
  temperature = _float(body, "temperature")
  if not 0 <= temperature <= 2:
    raise BadRequest(f"temperature must be in [0, 2], got {temperature}")
  top_p = _float(body, "top_p")
  if not 0 < top_p <= 1:
    raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
  seed = _get(body, "seed", int)
  if seed is not None:
    seed %= 2 ** 32
  stop = body.get("stop")
  stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise BadRequest(f"stop must be a string or a list of strings, got {stop!r}")
  if len(stops) > MAX_STOP:
    raise BadRequest(f"stop holds at most {MAX_STOP} strings, got {len(stops)}")
  stop_ids = [ids[0] for ids in map(_encoded(encode), stops) if len(ids) == 1]
  # Chat asks with a bool, completions with a count of alternatives (0 included).
  logprobs = (bool(_get(body, "logprobs", bool, False)) if chat
              else _get(body, "logprobs", int) is not None)
  options = _get(body, "stream_options", dict, {})
  return Ask(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
             stop=tuple(dict.fromkeys(stops)), stop_ids=tuple(dict.fromkeys(stop_ids)),
             logprobs=logprobs,
             stream=bool(_get(body, "stream", bool, False)),
             include_usage=bool(options.get("include_usage", False)))


def stop_cut(generated: Sequence[int], decode, stop: Sequence[str]
             ) -> Optional[tuple[int, str]]:
  """Where a reply ends at its first stop string: (the tokens kept, the text), or None
  if `decode(generated)` holds none of `stop`.

  The stop string that ends first in the text is the one met first in decoding order;
  the tokens kept run to the one that completes it (the fewest whose text holds it), and
  the text is what comes before it, as OpenAI leaves a stop string out. Decoding a
  prefix of the tokens must give a prefix of the text, as it does for a tokenizer that
  decodes token by token.
  """
  text = decode(generated)
  ends = [(at + len(s), at) for s in stop if (at := text.find(s)) >= 0]
  if not ends:
    return None
  end, start = min(ends)
  lo, hi = 1, len(generated)  # the fewest tokens whose text reaches `end`
  while lo < hi:
    mid = (lo + hi) // 2
    # Compared, not measured: a partial character's U+FFFD has a length too.
    if decode(generated[:mid])[:end] == text[:end]:
      hi = mid
    else:
      lo = mid + 1
  return lo, text[:start]


def parse_messages(body: Mapping) -> list[dict]:
  """The conversation of a chat request, checked, with each tool call's `arguments`
  decoded from its JSON string to an object, which chat templates expect."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise BadRequest("messages must be a non-empty list")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise BadRequest(f"messages[{i}] must be an object with a string role")
    m = {k: v for k, v in m.items() if v is not None}
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones are understood
      if not all(isinstance(p, dict) and p.get("type") == "text"
                 and isinstance(p.get("text", ""), str) for p in content):
        raise BadRequest(f"messages[{i}].content: only text parts (with string text) are "
                         f"supported")
      m["content"] = "".join(p.get("text", "") for p in content)
    elif content is not None and not isinstance(content, str):
      raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
    if "tool_calls" in m:
      if not isinstance(m["tool_calls"], list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list, got {m['tool_calls']!r}")
      m["tool_calls"] = [_decoded_call(i, c) for c in m["tool_calls"]]
    out.append(m)
  return out


def _decoded_call(i: int, call) -> dict:
  try:
    function = call["function"]
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
      arguments = json.loads(arguments)
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}
  except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
    raise BadRequest(f"messages[{i}].tool_calls: not a function call with JSON arguments "
                     f"({type(e).__name__}: {e})") from None


def same_message(a: Mapping, b: Mapping) -> bool:
  """Whether two messages say the same: role, content (None and "" alike), tool calls
  (name and arguments), tool_call_id and name; ids of tool calls are not compared."""
  def key(m):
    calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
             for c in m.get("tool_calls") or ()]
    return (m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"), m.get("name"))
  return key(a) == key(b)


def parse_prompt(body: Mapping, encode, bos_id: Optional[int]) -> list[int]:
  """The token ids of a completion request's `prompt`: a string (encoded, after
  `bos_id` unless it is None) or a list of token ids (taken as they are)."""
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    return ([] if bos_id is None else [bos_id]) + list(encode(prompt))
  if isinstance(prompt, list) and prompt and all(
      isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 31 for t in prompt):
    return list(prompt)
  raise BadRequest("prompt must be a string or a non-empty list of token ids (one prompt "
                   "per request, each id in [0, 2**31))")


def parse_tool_calls(text: str) -> tuple[Optional[str], list[dict]]:
  """(content, tool calls) of a reply that may hold `<tool_call>` blocks. The content
  is the text before the first block, its trailing newlines dropped (a chat template
  writes them back before the block). A block that is not a JSON object with a
  "name" stays in the content, and so does everything when none parses."""
  calls = []
  for match in TOOL_CALL.finditer(text):
    try:
      call = json.loads(match.group(1))
    except json.JSONDecodeError:
      continue
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
      continue
    calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": call["name"],
                               "arguments": json.dumps(call.get("arguments", {}),
                                                       ensure_ascii=False)}})
  if not calls:
    return text, []
  content = text[:text.index("<tool_call>")].rstrip("\n")
  return content or None, calls


@dataclasses.dataclass(frozen=True)
class Choice:
  """One completion as the endpoint returns it.

  Attributes:
    text: the reply's text (without the stop string or stop token that ended it).
    token_texts, logprobs: each generated token's text and behaviour log-prob.
    finish_reason: "stop", "length" or "tool_calls".
    tool_calls: parsed tool calls (chat requests with tools).
  """
  text: Optional[str]
  token_texts: Sequence[str]
  logprobs: Sequence[float]
  finish_reason: str
  tool_calls: Sequence[dict] = ()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def _chat_logprobs(c: Choice):
  return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                      for t, lp in zip(c.token_texts, c.logprobs)]}


def _completion_logprobs(c: Choice):
  offsets, at = [], 0
  for t in c.token_texts:
    offsets.append(at)
    at += len(t)
  return {"tokens": list(c.token_texts), "token_logprobs": list(c.logprobs),
          "top_logprobs": [{} for _ in c.token_texts], "text_offset": offsets}


def response(choices: Sequence[Choice], *, chat: bool, model: str, logprobs: bool,
             usage_: dict) -> dict:
  """The body of a non-streamed answer."""
  out = []
  for i, c in enumerate(choices):
    if chat:
      message: dict[str, Any] = {"role": "assistant", "content": c.text}
      if c.tool_calls:
        message["tool_calls"] = list(c.tool_calls)
      out.append({"index": i, "message": message, "finish_reason": c.finish_reason,
                  "logprobs": _chat_logprobs(c) if logprobs else None})
    else:
      out.append({"index": i, "text": c.text or "", "finish_reason": c.finish_reason,
                  "logprobs": _completion_logprobs(c) if logprobs else None})
  return {"id": _id(chat), "object": "chat.completion" if chat else "text_completion",
          "created": int(time.time()), "model": model, "choices": out, "usage": usage_}


class Chunks:
  """The chunks of one streamed answer (OpenAI's `chat.completion.chunk`s or streamed
  `text_completion`s), sharing its id and creation time."""

  def __init__(self, *, chat: bool, model: str):
    self._chat, self._model = chat, model
    self._id, self._created = _id(chat), int(time.time())

  def _chunk(self, choice: Optional[dict], **extra) -> dict:
    return {"id": self._id, "object": "chat.completion.chunk" if self._chat
            else "text_completion", "created": self._created, "model": self._model,
            "choices": [choice] if choice else [], **extra}

  def start(self, index: int) -> Optional[dict]:
    """The chunk that opens choice `index` (a chat reply's role), or None."""
    if not self._chat:
      return None
    return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None})

  def text(self, index: int, text: str, choice: Optional[Choice] = None,
           logprobs: bool = False) -> dict:
    """More text of choice `index`; with the finished `choice`, its tool calls and, if
    asked, its log-probs."""
    lp = None
    if logprobs and choice is not None:
      lp = _chat_logprobs(choice) if self._chat else _completion_logprobs(choice)
    if not self._chat:
      return self._chunk({"index": index, "text": text, "logprobs": lp,
                          "finish_reason": None})
    delta: dict[str, Any] = {"content": text}
    if choice is not None and choice.tool_calls:
      delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(choice.tool_calls)]
    return self._chunk({"index": index, "delta": delta, "logprobs": lp, "finish_reason": None})

  def finish(self, index: int, reason: str) -> dict:
    if self._chat:
      return self._chunk({"index": index, "delta": {}, "logprobs": None,
                          "finish_reason": reason})
    return self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": reason})

  def usage(self, usage_: dict) -> dict:
    return self._chunk(None, usage=usage_)


class TextStream:
  """A reply's text as its tokens arrive, for streaming: `add` returns the text that
  may be sent now, never any that a stop string (`stop`) could take back: the text
  stops short of a stop string found in it, and of a tail as long as the longest stop
  string but one, which could begin one; a trailing U+FFFD (a character whose bytes
  are still to come) waits too. `rest` is what the finished reply adds to it.

  Decoding a prefix of the tokens must give a prefix of the text (`stop_cut`)."""

  def __init__(self, decode, stop: Sequence[str]):
    self._decode, self._stop = decode, tuple(stop)
    self._hold = max((len(x) for x in self._stop), default=1) - 1
    self._tokens: list[int] = []
    self.sent = ""

  def add(self, tokens: Sequence[int]) -> str:
    self._tokens += tokens
    text = self._decode(self._tokens)
    end = min([len(text) - self._hold] + [at for x in self._stop if (at := text.find(x)) >= 0])
    while end > 0 and text[end - 1] == "\ufffd":
      end -= 1
    if end <= len(self.sent) or not text.startswith(self.sent):
      return ""
    delta, self.sent = text[len(self.sent):end], text[:end]
    return delta

  def rest(self, text: str) -> str:
    """What the finished reply's `text` adds to the text sent."""
    return text[len(self.sent):] if text.startswith(self.sent) else ""


def error(message: str, kind: str = "invalid_request_error") -> dict:
  """OpenAI's error body."""
  return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _id(chat: bool) -> str:
  return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

