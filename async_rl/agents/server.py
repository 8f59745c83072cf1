"""The OpenAI-compatible endpoint: `/v1/chat/completions` and `/v1/completions` in front
of a generator pool, so that an agent written for the `openai` client runs unchanged.

Built on Starlette (routing, requests, server-sent events) served by uvicorn on a
thread of its own: the same ASGI pair vLLM's OpenAI server runs on (through FastAPI,
which adds request models we do not need: the wire format is checked by hand in
`agents.wire`, so that a malformed request names its field the way the rest of the
run names bad values). Both are small, widely used and actively kept.

Two kinds of request:
  * `/episodes/<key>/v1/...`: a turn of an episode that the run opened (`open`) for an
    agent; it samples as the run does (its temperature and top-p; the request's are
    ignored), and the episode records its tokens (`agents.episode`). An episode takes
    one request at a time and `n` = 1.
  * `/v1/...`: a plain request straight to the pool (`pool`; serving without training),
    sampled as it asks.
Each request is checked by `agents.wire` (`parse_body`, then `parse_chat` or
`parse_completion` against the endpoint's `wire.Limits`) before anything is queued: a
bad one is answered with HTTP 400 naming its field; 503 means only that the pool cannot
serve now. A chat prompt is the conversation as the tokenizer's own chat template
renders it, each assistant message that carries `token_ids` standing as those ids
(`agents.episode.conversation_ids`); a completion prompt is its text (after BOS with
`add_bos`) or its token ids. A tokenizer without a chat template renders a conversation
as its messages' contents, one after another, and offers no tools. Replies leave special
tokens out of their text; vLLM's `return_token_ids` gives their ids, with which an agent
can send back exactly what was generated. Streaming sends each choice's text as the pool
reads its tokens (a decode chunk at a time, `Request.on_tokens`), as OpenAI's chunks
followed by `data: [DONE]`; text a stop string could still take back waits, and so does
a partial character (`wire.TextStream`), and a reply with tools, whose calls are parsed
from the whole reply.

Binds 127.0.0.1 by default; with `api_key`, every request needs the header
`Authorization: Bearer <api_key>` (`config.AgentConfig` refuses another address
without one).
"""

import asyncio
import dataclasses
import functools
import hmac
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional, Union

from async_rl.agents import wire
from async_rl.agents.episode import Episode, EpisodeLost, conversation_ids
from async_rl.generation import Request, SamplingParams
from async_rl.trajectory import Trajectory

_START_TIMEOUT_S = 30.0
_KEEP_ALIVE_S = 120

# A request as `agents.wire` checked it.
Checked = Union[wire.ChatRequest, wire.CompletionRequest]


class Endpoint:
  """An OpenAI-compatible HTTP endpoint on a thread; `start` binds it, `close` stops it.

  Args:
    tokenizer: encodes prompts, renders conversations (`render_chat`, if it has one),
      decodes replies; its stop ids end every reply.
    host, port: where to bind; port 0 takes a free one (`url` says which).
    api_key: the bearer token requests must carry; None: none.
    pool: the `GeneratorPool` that plain `/v1/...` requests go to; None: episodes only.
    model: the model name the endpoint reports.
    max_tokens: the most tokens a plain request may ask for, and what it gets when it
      asks none (a larger `max_tokens` is refused, as OpenAI refuses it).
    add_bos: put the tokenizer's BOS before a completion request's text prompt.
  """

  def __init__(self, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
               api_key: Optional[str] = None, pool=None, model: str = "async_rl",
               max_tokens: int = 256, add_bos: bool = False):
    self._tok, self._host, self._port, self._api_key = tokenizer, host, port, api_key
    self._pool, self.model, self._max_tokens = pool, model, max_tokens
    self._bos_id = tokenizer.bos_id if add_bos else None
    # A tokenizer without a chat template renders a conversation as its contents.
    self._render_chat = getattr(tokenizer, "render_chat", None)
    self._tools = self._render_chat is not None and wire.renders_tools(self._render_chat)
    self._lock = threading.Lock()
    self._episodes: dict[str, Episode] = {}
    self._ids = itertools.count()
    self._server = None
    self._thread: Optional[threading.Thread] = None
    self.url: Optional[str] = None

  # Lifecycle, from any thread.

  def start(self) -> "Endpoint":
    """Binds and starts serving (idempotent); raises RuntimeError if it cannot."""
    import uvicorn  # the `agents` extra
    with self._lock:
      if self._server is not None:
        return self
      family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
      sock = socket.socket(family, socket.SOCK_STREAM)
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        sock.bind((self._host, self._port))
      except OSError as e:
        sock.close()
        raise RuntimeError(f"the OpenAI endpoint cannot bind {self._host}:{self._port} "
                           f"({e})") from e
      port = sock.getsockname()[1]
      # Agents pause between turns (their tools run); a connection kept alive across
      # the pause spares a reconnect and the race of a close meeting the next request.
      server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning",
                                             access_log=False, lifespan="off",
                                             timeout_keep_alive=_KEEP_ALIVE_S))
      thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                name="openai-endpoint", daemon=True)
      thread.start()
      deadline = time.monotonic() + _START_TIMEOUT_S
      while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
          server.should_exit = True
          sock.close()
          raise RuntimeError(f"the OpenAI endpoint did not start on {self._host}:{port}")
        time.sleep(0.01)
      self._server, self._thread = server, thread
      host = f"[{self._host}]" if family == socket.AF_INET6 else self._host
      self.url = f"http://{host}:{port}"
    logging.info("OpenAI-compatible endpoint at %s/v1", self.url)
    return self

  def close(self) -> None:
    with self._lock:
      server, thread, self._server = self._server, self._thread, None
    if server is not None:
      server.should_exit = True
      thread.join(_START_TIMEOUT_S)

  def open(self, generate, *, budget: int) -> Episode:
    """A new episode whose turns `generate` (a `tasks.workflow.Generate`) samples;
    its base URL is `episode_url(episode)`."""
    episode = Episode(uuid.uuid4().hex, generate, budget=budget,
                      stop_ids=self._tok.stop_ids)
    with self._lock:
      self._episodes[episode.key] = episode
    return episode

  def finish(self, episode: Episode) -> None:
    """Closes `episode`: later requests get 404, its held slot is freed."""
    with self._lock:
      self._episodes.pop(episode.key, None)
    episode.close()

  def episode_url(self, episode: Episode) -> str:
    """The `base_url` of an OpenAI client for `episode`."""
    return f"{self.url}/episodes/{episode.key}/v1"

  # The ASGI application, on the endpoint's thread.

  def _app(self):
    from starlette.applications import Starlette  # the `agents` extra
    from starlette.routing import Route

    async def chat(request):
      return await self._handle(request, chat=True)

    async def completions(request):
      return await self._handle(request, chat=False)

    async def models(request):
      if (denied := self._denied(request)) is not None:
        return denied
      return _json({"object": "list", "data": [
          {"id": self.model, "object": "model", "created": 0, "owned_by": "async_rl"}]})

    routes = [Route(f"{prefix}/v1/chat/completions", chat, methods=["POST"])
              for prefix in ("", "/episodes/{key}")]
    routes += [Route(f"{prefix}/v1/completions", completions, methods=["POST"])
               for prefix in ("", "/episodes/{key}")]
    routes += [Route(f"{prefix}/v1/models", models, methods=["GET"])
               for prefix in ("", "/episodes/{key}")]
    return Starlette(routes=routes)

  def _denied(self, request):
    if self._api_key is None:
      return None
    given = request.headers.get("authorization", "")
    if hmac.compare_digest(given.encode(), f"Bearer {self._api_key}".encode()):
      return None
    return _json(wire.error("a valid bearer token is required", "authentication_error"), 401)

  async def _handle(self, request, *, chat: bool):
    if (denied := self._denied(request)) is not None:
      return denied
    episode = None
    if "key" in request.path_params:
      with self._lock:
        episode = self._episodes.get(request.path_params["key"])
      if episode is None:
        return _json(wire.error(f"no open episode {request.path_params['key']!r}",
                                "not_found_error"), 404)
      if episode.busy:
        return self._bad(episode, "another request of this episode is running", 409)
      episode.busy = True
    elif self._pool is None:
      return _json(wire.error("this endpoint serves the run's episodes only "
                              "(/episodes/<key>/v1/...)", "not_found_error"), 404)
    streamed = False
    try:
      body = wire.parse_body(await request.body())
      limits = wire.Limits(max_tokens=None if episode else self._max_tokens,
                           episode=episode is not None, tools=self._tools)
      checked = (wire.parse_chat(body, self._tok.encode, limits) if chat
                 else wire.parse_completion(body, self._tok.encode, limits))
      turn = self._begin(checked, episode)
      if checked.ask.stream:
        streamed = True  # the stream frees the episode when it ends
        return self._stream(turn)
      choices, counts = await self._finish(turn)
      return _json(wire.response(choices, chat=chat, model=self.model, ask=checked.ask,
                                 prompt_ids=turn.prompt_ids, usage_=counts))
    except ValueError as e:  # `wire.BadRequest`, or what the tokenizer or the pool refuses
      return self._bad(episode, str(e))
    except EpisodeLost as e:
      return _json(wire.error(str(e)), 503 if e.reason == "aborted" else 400)
    except _Aborted:
      return _json(wire.error(_Aborted.MESSAGE, "server_error"), 503)
    except _Unavailable as e:
      return _json(wire.error(str(e), "server_error"), 503)
    finally:
      if episode is not None and not streamed:
        episode.busy = False

  @staticmethod
  def _bad(episode: Optional[Episode], message: str, status: int = 400):
    if episode is not None:
      message = str(episode.lose("malformed", message))
    return _json(wire.error(message), status)

  def _begin(self, checked: Checked, episode: Optional[Episode]) -> "_Turn":
    """Submits the generation `checked` asks for: to the pool, or as `episode`'s turn."""
    ask = checked.ask
    chat = isinstance(checked, wire.ChatRequest)
    tools = checked.tools if chat else None
    render = functools.partial(self._render, tools=tools)
    # A streamed reply's text is sent as the pool reads its tokens, except with tools,
    # whose calls are parsed from the whole reply.
    streams, queue, on_tokens = None, None, None
    if ask.stream and not tools:
      loop, queue = asyncio.get_running_loop(), asyncio.Queue()
      streams = [wire.TextStream(self._tok.decode, ask.stop) for _ in range(ask.n)]

      def on_tokens(index, tokens):  # on the pool's threads
        _put(loop, queue, (index, tokens))
    if episode is None:
      prompt_ids = (conversation_ids(checked.messages, render, self._tok) if chat
                    else checked.prompt_ids(self._tok.encode, self._bos_id))
      future = self._submit(prompt_ids, ask, on_tokens)
    else:
      episode.check()
      env = (episode.env_of_chat(checked.messages, tools, render, self._tok) if chat
             else episode.env_of_completion(checked.prompt, self._tok.encode, self._bos_id))
      try:
        future = episode.turn(env, ask.max_tokens, ask.stop_ids, on_tokens=on_tokens)
      except RuntimeError as e:  # the pool or the episode runner is closing
        raise episode.lose("aborted", f"the turn was not generated: {e}") from None
      prompt_ids = [int(t) for t in episode.ids]  # it holds the environment's turn now
    if queue is not None:
      future.add_done_callback(lambda _: _put(loop, queue, None))
    return _Turn(checked, episode, prompt_ids, future, streams, queue)

  async def _finish(self, turn: "_Turn") -> tuple[list[wire.Choice], dict]:
    """The choices and usage of `turn`'s samples, recorded in its episode if any."""
    episode, ask = turn.episode, turn.checked.ask
    try:
      # Shielded: a disconnect cancels this wait, and must not cancel the turn.
      samples = await asyncio.shield(asyncio.wrap_future(turn.future))
    except RuntimeError as e:  # the pool or the episode runner is closing
      if episode is None:
        raise _Unavailable(e) from None
      raise episode.lose("aborted", f"the turn was not generated: {e}") from None
    turn.recorded = True  # no await from here on: a disconnect cannot come between
    cuts = [self._stop_cut(s, ask) for s in samples]
    if episode is not None:
      episode.record(samples[0], kept=cuts[0] and cuts[0][0])
      episode.check()
    if any(s.finish_reason == "aborted" for s in samples):
      raise _Aborted()
    samples = [_cut(s, c[0]) if c else s for s, c in zip(samples, cuts)]
    tools = turn.checked.tools if isinstance(turn.checked, wire.ChatRequest) else None
    choices = [self._choice(s, c and c[1], ask, tools) for s, c in zip(samples, cuts)]
    if episode is not None and isinstance(turn.checked, wire.ChatRequest):
      reply = {"role": "assistant", "content": choices[0].text,
               "tool_calls": list(choices[0].tool_calls) or None,
               "token_ids": list(choices[0].token_ids)}
      episode.replied(wire.parse_messages({"messages": [reply]})[0])
    elif episode is not None:
      episode.completed(self._tok.decode(choices[0].token_ids))
    return choices, wire.usage(samples[0].prompt_len,
                               sum(len(s.completion_C) for s in samples))

  def _stream(self, turn: "_Turn"):
    """A server-sent-event response: each choice's text as its tokens arrive (from the
    turn's queue, None once the pool is done; no queue: all of it at the end), then its
    finish reason, the usage if asked, and `[DONE]`. A failure after the response has
    begun is sent as an error event, which the `openai` client raises. An agent that
    closes the stream before the turn is recorded loses its episode; the turn is
    recorded when it ends, which frees its slot. The episode takes its next request
    once the stream has ended."""
    from starlette.responses import StreamingResponse  # noqa: PLC0415 (the `agents` extra)
    ask, episode = turn.checked.ask, turn.episode
    chunks = wire.Chunks(chat=isinstance(turn.checked, wire.ChatRequest), model=self.model,
                         ask=ask, prompt_ids=turn.prompt_ids)

    def event(chunk):
      return f"data: {json.dumps(chunk)}\n\n"

    async def events():
      try:
        for i in range(ask.n):
          if (chunk := chunks.start(i)) is not None:
            yield event(chunk)
        while turn.queue is not None and (item := await turn.queue.get()) is not None:
          index, tokens = item
          if delta := turn.streams[index].add(tokens):
            yield event(chunks.text(index, delta))
        choices, counts = await self._finish(turn)
        for i, c in enumerate(choices):
          rest = turn.streams[i].rest(c.text or "") if turn.streams else c.text or ""
          if rest or c.tool_calls or ask.logprobs or ask.token_ids:
            yield event(chunks.text(i, rest, c))
          yield event(chunks.finish(i, c.finish_reason))
        if ask.include_usage:
          yield event(chunks.usage(counts))
        yield "data: [DONE]\n\n"
      except _Aborted:
        yield event(wire.error(_Aborted.MESSAGE, "server_error"))
      except _Unavailable as e:
        yield event(wire.error(str(e), "server_error"))
      except (ValueError, EpisodeLost) as e:
        yield event(wire.error(str(e)))
      finally:
        if episode is not None and not turn.recorded:
          episode.lose("malformed", "the agent closed the stream before the turn ended")
          turn.future.add_done_callback(
              lambda done: done.exception() is None and episode.record(done.result()[0]))
        if episode is not None:
          episode.busy = False

    return StreamingResponse(events(), media_type="text/event-stream")

  def _render(self, messages: Sequence, add_generation_prompt: bool, tools=None) -> str:
    if self._render_chat is None:
      return "".join(m.get("content") or "" for m in messages)
    return self._render_chat(messages, add_generation_prompt=add_generation_prompt,
                             **({"tools": tools} if tools else {}))

  def _submit(self, prompt_ids, ask: wire.Ask, on_tokens) -> Future:
    sampling = SamplingParams(temperature=ask.temperature, top_p=ask.top_p,
                              max_new_tokens=ask.max_tokens,
                              stop_token_ids=(*self._tok.stop_ids, *ask.stop_ids), seed=ask.seed)
    try:
      return self._pool.submit(Request(f"openai/{next(self._ids)}", prompt_ids, ask.n,
                                       sampling, on_tokens=on_tokens))
    except RuntimeError as e:  # the pool is shut down, or its decode thread failed
      raise _Unavailable(e) from None

  def _stop_cut(self, sample: Trajectory, ask: wire.Ask) -> Optional[tuple[int, str]]:
    """Where `sample`'s reply ends at a stop string (`wire.stop_cut`), if it holds one."""
    if not ask.stop:
      return None
    return wire.stop_cut([int(t) for t in sample.completion_C], self._tok.decode, ask.stop)

  def _choice(self, sample: Trajectory, text: Optional[str], ask: wire.Ask,
              tools) -> wire.Choice:
    """`sample`'s reply; `text` is its text when a stop string ended it."""
    generated = [int(t) for t in sample.completion_C]
    if text is None:
      text = self._tok.decode(generated)
    calls: list[dict[str, Any]] = []
    if tools:
      text, calls = wire.parse_tool_calls(text)
    finish = "tool_calls" if calls else sample.finish_reason
    token_texts = [self._tok.decode([t]) for t in generated] if ask.logprobs else []
    logprobs = [float(x) for x in sample.logp_T[sample.prompt_len:]] if ask.logprobs else []
    return wire.Choice(text, generated, token_texts, logprobs, finish, tuple(calls))


@dataclasses.dataclass
class _Turn:
  """A request being answered: its check, its episode (None: a plain request), its
  prompt's ids, the generator's future of its samples and, streamed, each choice's
  text as its tokens arrive (`_put` on `queue`); `recorded` once its samples are taken."""
  checked: Checked
  episode: Optional[Episode]
  prompt_ids: list[int]
  future: Future
  streams: Optional[list[wire.TextStream]] = None
  queue: Optional[asyncio.Queue] = None
  recorded: bool = False


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
  """Hands a stream's tokens (index, tokens), or its end (None), from the pool's threads
  to the server's loop."""
  try:
    loop.call_soon_threadsafe(queue.put_nowait, item)
  except RuntimeError:  # the server's loop has closed: no one reads this stream
    pass


class _Unavailable(Exception):
  """The pool cannot serve: it is shut down, or its decode thread failed."""

  def __init__(self, cause: Exception):
    super().__init__(f"the generator cannot serve requests now ({cause})")


class _Aborted(Exception):
  """The pool aborted a sample of the request."""
  MESSAGE = "generation was aborted (the run is ending)"


def _cut(sample: Trajectory, kept: int) -> Trajectory:
  """`sample` ended by a stop string: its first `kept` generated tokens, finish "stop"."""
  T = sample.prompt_len + kept
  metadata = {k: v for k, v in sample.metadata.items() if k != "slot"}
  return dataclasses.replace(sample, tokens_T=sample.tokens_T[:T],
                             loss_mask_T=sample.loss_mask_T[:T], logp_T=sample.logp_T[:T],
                             versions_T=sample.versions_T[:T], finish_reason="stop",
                             metadata=metadata)


def _json(body: dict, status: int = 200):
  from starlette.responses import JSONResponse  # noqa: PLC0415 (the `agents` extra)
  return JSONResponse(body, status_code=status)
