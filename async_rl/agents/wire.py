"""The OpenAI wire format: request bodies in, response bodies and stream chunks out.

Pure functions of dicts and token ids; the endpoint (`agents.server`) does the I/O.
Each request shape has one check, `parse_chat` or `parse_completion`, which takes the
body (`parse_body` reads it from its bytes) and what the endpoint serves (`Limits`), and
gives a frozen request or raises `BadRequest`, whose message names the field (the
endpoint answers it with HTTP 400 in OpenAI's error shape).

What is honoured: `n` (up to `MAX_N`), `temperature`, `top_p`, `seed`, `max_tokens` (or
`max_completion_tokens`; at most the endpoint's limit, `Limits.max_tokens`), `stop` (up
to `MAX_STOP` strings of any length, found in the decoded text as vLLM finds them: the
reply ends with the token that completes the first stop string, which the text leaves
out; see `stop_cut`), `logprobs` (the sampled token's log-prob, under the distribution
it was drawn from; alternatives are not computed, so `top_logprobs` lists are empty;
the counts asked are bounded as OpenAI bounds them), `tools` (handed to a chat template
that renders them; tool calls are parsed from the reply, see `parse_tool_calls`),
`stream` (`TextStream`, `Chunks`) and `stream_options.include_usage`, and vLLM's
`return_token_ids` (the prompt's and each reply's token ids) and
`return_tokens_as_token_ids` (log-probs name their tokens as `token_id:<id>`). An
assistant message may carry `token_ids`, the ids its reply was generated as, which the
endpoint uses instead of the text (`agents.episode.conversation_ids`). Other fields
(`presence_penalty`, `user`, ...) are accepted and ignored, as vLLM does.
"""

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

# A tool call in the Hermes / Qwen2.5 chat format: a JSON object {"name", "arguments"}
# between these tags.
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


# The most completions one request asks for, and the most stop strings (OpenAI allows
# 4; an agent may stop on many one-character strings): each costs the endpoint work
# before the request is queued.
MAX_N = 128
MAX_STOP = 32
# OpenAI's bounds: a completion request's `logprobs` (alternatives per token) and a
# chat request's `top_logprobs`.
MAX_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
# The deepest nesting of a request body: a tool's JSON schema needs a few levels; the
# template and the JSON encoder recurse through whatever the body holds.
MAX_DEPTH = 64
# Token ids as a request may send them.
MAX_ID = 2 ** 31


class BadRequest(ValueError):
  """A request the endpoint cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the endpoint serves a request, which its check enforces.

  Attributes:
    max_tokens: the most tokens a request may ask for, and what it gets when it asks
      none; None: no limit of the endpoint's (an episode's budget caps its turns).
    episode: the request is a turn of an episode: `n` must be 1.
    tools: the chat template renders `tools`; without it a request that offers tools
      is refused, since the model would never see them.
  """
  max_tokens: Optional[int] = None
  episode: bool = False
  tools: bool = True


@dataclasses.dataclass(frozen=True)
class Ask:
  """What one request asks of the generator, beyond its prompt.

  Attributes:
    n: completions of the prompt.
    max_tokens: the most tokens of each; None: as many as the episode's budget leaves.
    temperature, top_p, seed: sampling (an episode samples as the run does instead).
    stop: the request's `stop` strings.
    stop_ids: the token ids of those of `stop` that are one token each, on which the
      generator stops (the tokenizer's own stop ids come on top); the others are found
      in the decoded text (`stop_cut`).
    logprobs: return the sampled tokens' log-probs.
    tokens_as_ids: name each token of the log-probs `token_id:<id>`, not by its text.
    token_ids: return the prompt's token ids and each reply's.
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
  tokens_as_ids: bool = False
  token_ids: bool = False
  stream: bool = False
  include_usage: bool = False


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  """A checked `/v1/chat/completions` request.

  Attributes:
    ask: its sampling and reply fields.
    messages: the conversation (`parse_messages`).
    tools: the tools offered, or None.
  """
  ask: Ask
  messages: Sequence[Mapping[str, Any]]
  tools: Optional[Sequence[Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  """A checked `/v1/completions` request.

  Attributes:
    ask: its sampling and reply fields.
    prompt: the prompt's text, or its token ids.
  """
  ask: Ask
  prompt: Union[str, tuple[int, ...]]

  def prompt_ids(self, encode: Callable, bos_id: Optional[int]) -> list[int]:
    """The prompt's ids: a text encoded (after `bos_id` unless it is None), ids as given."""
    if not isinstance(self.prompt, str):
      return list(self.prompt)
    return ([] if bos_id is None else [bos_id]) + list(encode(self.prompt))


def parse_body(raw: bytes) -> dict:
  """The JSON object a request body holds, nested at most `MAX_DEPTH` deep."""
  try:
    body = json.loads(raw)
  except RecursionError:  # nested past the parser's own stack
    raise BadRequest(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
  except ValueError as e:  # not JSON, or not UTF-8
    raise BadRequest(f"the request body is not JSON ({e})") from None
  if not isinstance(body, dict):
    raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
  level, depth = [body], 1
  while level := [v for x in level for v in (x.values() if isinstance(x, dict) else x)
                  if isinstance(v, (dict, list))]:  # breadth first: no recursion
    depth += 1
    if depth > MAX_DEPTH:
      raise BadRequest(f"the request body is nested deeper than {MAX_DEPTH} levels")
  return body


def parse_chat(body: Mapping, encode: Callable, limits: Limits) -> ChatRequest:
  """The checked chat request of `body` (`encode` maps a stop string to ids)."""
  ask = parse_ask(body, encode, chat=True, limits=limits)
  return ChatRequest(ask, parse_messages(body), parse_tools(body, limits))


def parse_completion(body: Mapping, encode: Callable, limits: Limits) -> CompletionRequest:
  """The checked completion request of `body` (`encode` maps a stop string to ids)."""
  ask = parse_ask(body, encode, chat=False, limits=limits)
  return CompletionRequest(ask, parse_prompt(body))


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


def _in(body: Mapping, key: str, lo: int, hi: int) -> Optional[int]:
  value = _get(body, key, int)
  if value is not None and not lo <= value <= hi:
    raise BadRequest(f"{key} must be in [{lo}, {hi}], got {value}")
  return value


def _encoded(encode):
  """`encode`, giving no ids for a text the tokenizer cannot encode: such a stop string
  is still found in the decoded text (`stop_cut`)."""
  def encoded(text):
    try:
      return encode(text)
    except ValueError:
      return []
  return encoded


def parse_ask(body: Mapping, encode: Callable, *, chat: bool, limits: Limits = Limits()) -> Ask:
  """The sampling and reply fields of a request body (`encode` maps a stop string to
  ids), checked against `limits`: `n` is at most `MAX_N` (1 in an episode), `max_tokens`
  at most `limits.max_tokens`, and `stop` holds at most `MAX_STOP` strings."""
  if not isinstance(body, Mapping):
    raise BadRequest("the request body must be a JSON object")
  n = _get(body, "n", int, 1)
  if limits.episode and n != 1:
    raise BadRequest(f"n must be 1 within an episode, got {n}")
  if not 1 <= n <= MAX_N:
    raise BadRequest(f"n must be in [1, {MAX_N}], got {n}")
  key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
  max_tokens = _get(body, key, int)
  if max_tokens is not None and max_tokens < 1:
    raise BadRequest(f"{key} must be >= 1, got {max_tokens}")
  if max_tokens is not None and limits.max_tokens is not None and max_tokens > limits.max_tokens:
    raise BadRequest(f"{key} must be at most {limits.max_tokens}, the most tokens this "
                     f"endpoint generates for a request, got {max_tokens}")
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
  # Chat asks with a bool (and a count of alternatives apart), completions with a count
  # of alternatives, 0 included.
  if chat:
    logprobs = bool(_get(body, "logprobs", bool, False))
    _in(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
  else:
    logprobs = _in(body, "logprobs", 0, MAX_LOGPROBS) is not None
  options = _get(body, "stream_options", dict, {})
  return Ask(n=n, max_tokens=max_tokens or limits.max_tokens, temperature=temperature,
             top_p=top_p, seed=seed, stop=tuple(dict.fromkeys(stops)),
             stop_ids=tuple(dict.fromkeys(stop_ids)), logprobs=logprobs,
             tokens_as_ids=bool(_get(body, "return_tokens_as_token_ids", bool, False)),
             token_ids=bool(_get(body, "return_token_ids", bool, False)),
             stream=bool(_get(body, "stream", bool, False)),
             include_usage=bool(options.get("include_usage", False)))


def stop_cut(generated: Sequence[int], decode, stop: Sequence[str]
             ) -> Optional[tuple[int, str]]:
  """Where a reply ends at its first stop string: (the tokens kept, the text), or None
  if `decode(generated)` holds none of `stop`.

  The stop string that ends first in the text is the one met first in decoding order;
  the tokens kept run to the one that completes it (the fewest whose text holds it), and
  the text is what comes before it, as OpenAI leaves a stop string out. Where that token
  runs past the stop string (a token `=(` for the stop `=`), it is left out too, so that
  the tokens kept never say more than the text and the stop string: none may be kept.
  Decoding a prefix of the tokens must give a prefix of the text, as it does for a
  tokenizer that decodes token by token.
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
  return lo - (decode(generated[:lo]) != text[:end]), text[:start]


def parse_messages(body: Mapping) -> list[dict]:
  """The conversation of a chat request, checked, with each tool call's `arguments`
  decoded from its JSON string to an object, which chat templates expect. An assistant
  message may carry `token_ids`: the ids its reply was generated as."""
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
    if "token_ids" in m:
      if m["role"] != "assistant":
        raise BadRequest(f"messages[{i}].token_ids: only an assistant message carries the "
                         f"ids of its reply, not a {m['role']!r} one")
      # Empty for a reply whose only token ran past its stop string (`stop_cut`).
      m["token_ids"] = _ids(m["token_ids"], f"messages[{i}].token_ids", empty=True)
    out.append(m)
  return out


def _ids(value, field: str, empty: bool = False) -> tuple[int, ...]:
  if isinstance(value, list) and (value or empty) and all(
      isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_ID for t in value):
    return tuple(value)
  raise BadRequest(f"{field} must be a {'' if empty else 'non-empty '}list of token ids, "
                   f"each in [0, 2**31)")


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
  (name and arguments), tool_call_id, name, and `token_ids` where both carry them; ids
  of tool calls are not compared."""
  def key(m):
    calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
             for c in m.get("tool_calls") or ()]
    return (m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"), m.get("name"))
  ids = (a.get("token_ids"), b.get("token_ids"))
  return key(a) == key(b) and (None in ids or tuple(ids[0]) == tuple(ids[1]))


def parse_tools(body: Mapping, limits: Limits) -> Optional[list]:
  """The tools a chat request offers (None for none), refused where the chat template
  does not render them (`limits.tools`)."""
  tools = body.get("tools") or None
  if tools is None:
    return None
  if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
    raise BadRequest(f"tools must be a list of objects, got {tools!r}")
  if not limits.tools:
    raise BadRequest("tools: this model's chat template does not render tools, so the "
                     "model would never see them; send the request without tools")
  return tools


def renders_tools(render: Callable) -> bool:
  """Whether a chat template, `render(messages, tools=...)`, shows the model the tools it
  is given: a conversation renders differently with a tool than without."""
  probe = [{"role": "user", "content": "?"}]
  tool = {"type": "function", "function": {"name": "probe", "description": "a probe",
                                           "parameters": {"type": "object", "properties": {}}}}
  try:
    return render(probe, tools=[tool]) != render(probe)
  except ValueError:  # a renderer that takes no tools at all
    return False


def parse_prompt(body: Mapping) -> Union[str, tuple[int, ...]]:
  """A completion request's `prompt`: its text, or its token ids."""
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    return prompt
  try:
    return _ids(prompt, "prompt")
  except BadRequest:
    raise BadRequest("prompt must be a string or a non-empty list of token ids (one prompt "
                     "per request, each id in [0, 2**31))") from None


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
    text: the reply's text (without the stop string or stop token that ended it, and
      without special tokens).
    token_ids: the reply's token ids, the stop string's and stop token's included: what
      its episode holds.
    token_texts, logprobs: each of those tokens' text and behaviour log-prob.
    finish_reason: "stop", "length" or "tool_calls".
    tool_calls: parsed tool calls (chat requests with tools).
  """
  text: Optional[str]
  token_ids: Sequence[int]
  token_texts: Sequence[str]
  logprobs: Sequence[float]
  finish_reason: str
  tool_calls: Sequence[dict] = ()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def _tokens(c: Choice, ask: Ask) -> list[str]:
  if ask.tokens_as_ids:
    return [f"token_id:{t}" for t in c.token_ids]
  return list(c.token_texts)


def _logprobs(c: Choice, ask: Ask, chat: bool) -> Optional[dict]:
  if not ask.logprobs:
    return None
  tokens = _tokens(c, ask)
  if chat:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": []} for t, lp in zip(tokens, c.logprobs)]}
  offsets, at = [], 0
  for t in c.token_texts:
    offsets.append(at)
    at += len(t)
  return {"tokens": tokens, "token_logprobs": list(c.logprobs),
          "top_logprobs": [{} for _ in tokens], "text_offset": offsets}


def response(choices: Sequence[Choice], *, chat: bool, model: str, ask: Ask,
             prompt_ids: Sequence[int], usage_: dict) -> dict:
  """The body of a non-streamed answer to `ask`, whose prompt was `prompt_ids`; with
  `ask.token_ids`, vLLM's `prompt_token_ids` (on the answer for chat, on each choice
  for completions) and each choice's `token_ids`."""
  out = []
  for i, c in enumerate(choices):
    if chat:
      message: dict[str, Any] = {"role": "assistant", "content": c.text}
      if c.tool_calls:
        message["tool_calls"] = list(c.tool_calls)
      choice = {"index": i, "message": message, "finish_reason": c.finish_reason,
                "logprobs": _logprobs(c, ask, chat)}
    else:
      choice = {"index": i, "text": c.text or "", "finish_reason": c.finish_reason,
                "logprobs": _logprobs(c, ask, chat)}
      if ask.token_ids:
        choice["prompt_token_ids"] = list(prompt_ids)
    if ask.token_ids:
      choice["token_ids"] = list(c.token_ids)
    out.append(choice)
  body = {"id": _id(chat), "object": "chat.completion" if chat else "text_completion",
          "created": int(time.time()), "model": model, "choices": out, "usage": usage_}
  if chat and ask.token_ids:
    body["prompt_token_ids"] = list(prompt_ids)
  return body


class Chunks:
  """The chunks of one streamed answer to `ask` (OpenAI's `chat.completion.chunk`s or
  streamed `text_completion`s), sharing its id and creation time. With `ask.token_ids`,
  each choice's first chunk carries `prompt_token_ids` (once, for chat) and every chunk
  of a choice `token_ids`: none but in its last text chunk, which has all of the
  reply's, since a stop string may take back tokens until the reply ends."""

  def __init__(self, *, chat: bool, model: str, ask: Ask, prompt_ids: Sequence[int]):
    self._chat, self._model, self._ask, self._prompt_ids = chat, model, ask, list(prompt_ids)
    self._id, self._created = _id(chat), int(time.time())

  def _chunk(self, choice: Optional[dict], **extra) -> dict:
    if choice is not None and self._ask.token_ids:
      choice.setdefault("token_ids", [])
    return {"id": self._id, "object": "chat.completion.chunk" if self._chat
            else "text_completion", "created": self._created, "model": self._model,
            "choices": [choice] if choice else [], **extra}

  def start(self, index: int) -> Optional[dict]:
    """The chunk that opens choice `index` (a chat reply's role, or a completion's
    prompt ids), or None."""
    if self._chat:
      first = {"prompt_token_ids": self._prompt_ids} if self._ask.token_ids and not index else {}
      return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}, **first)
    if not self._ask.token_ids:
      return None
    return self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": None,
                        "prompt_token_ids": self._prompt_ids})

  def text(self, index: int, text: str, choice: Optional[Choice] = None) -> dict:
    """More text of choice `index`; with the finished `choice`, its tool calls and, if
    asked, its log-probs and token ids."""
    lp = None if choice is None else _logprobs(choice, self._ask, self._chat)
    if self._chat:
      delta: dict[str, Any] = {"content": text}
      if choice is not None and choice.tool_calls:
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(choice.tool_calls)]
      out = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}
    else:
      out = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
    if self._ask.token_ids and choice is not None:
      out["token_ids"] = list(choice.token_ids)
    return self._chunk(out)

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

