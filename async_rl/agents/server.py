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
A prompt is the conversation as the tokenizer's own chat template renders it (chat), or
the prompt's text (after BOS with `add_bos`) or token ids (completions). A
tokenizer without a chat template renders a conversation as its messages' contents,
one after another. Streaming sends each choice's text as the pool reads its tokens
(a decode chunk at a time, `Request.on_tokens`), as OpenAI's chunks followed by
`data: [DONE]`; text a stop string could still take back waits (`wire.TextStream`),
and so does a reply with tools, whose calls are parsed from the whole reply.

Binds 127.0.0.1 by default; with `api_key`, every request needs the header
`Authorization: Bearer <api_key>` (`config.AgentConfig` refuses another address
without one).
"""

import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Optional

from async_rl.agents import wire
from async_rl.agents.episode import Episode, EpisodeLost
from async_rl.generation import Request, SamplingParams
from async_rl.trajectory import Trajectory

_START_TIMEOUT_S = 30.0
_KEEP_ALIVE_S = 120


class Endpoint:
  """An OpenAI-compatible HTTP endpoint on a thread; `start` binds it, `close` stops it.

  Args:
    tokenizer: encodes prompts, renders conversations (`render_chat`, if it has one),
      decodes replies; its stop ids end every reply.
    host, port: where to bind; port 0 takes a free one (`url` says which).
    api_key: the bearer token requests must carry; None: none.
    pool: the `GeneratorPool` that plain `/v1/...` requests go to; None: episodes only.
    model: the model name the endpoint reports.
    max_tokens: a plain request's `max_tokens` when it gives none.
    add_bos: put the tokenizer's BOS before a completion request's text prompt.
  """

  def __init__(self, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
               api_key: Optional[str] = None, pool=None, model: str = "async_rl",
               max_tokens: int = 256, add_bos: bool = False):
    self._tok, self._host, self._port, self._api_key = tokenizer, host, port, api_key
    self._pool, self.model, self._max_tokens = pool, model, max_tokens
    self._bos_id = tokenizer.bos_id if add_bos else None
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
    response = None
    try:
      try:
        body = await request.json()
      except ValueError:
        raise wire.BadRequest("the request body is not JSON") from None
      response = await self._answer(body, chat, episode)
      return response
    except ValueError as e:  # `wire.BadRequest`, or what the tokenizer or the pool refuses
      return self._bad(episode, str(e))
    except EpisodeLost as e:
      return _json(wire.error(str(e)), 503 if e.reason == "aborted" else 400)
    except _Aborted:
      return _json(wire.error(_Aborted.MESSAGE, "server_error"), 503)
    except RuntimeError as e:  # the pool is shut down, or its decode thread failed
      return _json(wire.error(_unavailable(e), "server_error"), 503)
    finally:
      if episode is not None and not getattr(response, "ends_turn", False):
        episode.busy = False

  @staticmethod
  def _bad(episode: Optional[Episode], message: str, status: int = 400):
    if episode is not None:
      message = str(episode.lose("malformed", message))
    return _json(wire.error(message), status)

  async def _answer(self, body, chat: bool, episode: Optional[Episode]):
    ask = wire.parse_ask(body, self._tok.encode, chat=chat)
    messages, tools, text = None, None, None
    if chat:
      messages = wire.parse_messages(body)
      tools = body.get("tools") or None
      if tools is not None and not isinstance(tools, list):
        raise wire.BadRequest(f"tools must be a list, got {tools!r}")
      text = self._render(messages, tools, True)
      prompt_ids = None
    else:
      prompt_ids = wire.parse_prompt(body, self._tok.encode, self._bos_id)
    # A streamed reply's text is sent as the pool reads its tokens, except with tools,
    # whose calls are parsed from the whole reply.
    if episode is not None:
      episode.check()
      if ask.n != 1:
        raise wire.BadRequest(f"n must be 1 within an episode, got {ask.n}")
    streams, on_tokens = None, None
    if ask.stream and not tools:
      loop, queue = asyncio.get_running_loop(), asyncio.Queue()
      streams = [wire.TextStream(self._tok.decode, ask.stop) for _ in range(ask.n)]

      def put(item):  # on the pool's threads
        try:
          loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the server's loop has closed: no one reads this stream
          pass

      def on_tokens(index, tokens):
        put((index, tokens))
    if episode is None:
      future = self._submit(prompt_ids or self._tok.encode(text), ask, on_tokens)
    else:
      env = (episode.env_of_chat(messages, tools, text, self._tok.encode) if chat
             else episode.env_of_tokens(prompt_ids))
      try:
        future = episode.turn(env, ask.max_tokens, ask.stop_ids, on_tokens=on_tokens)
      except RuntimeError as e:  # the pool or the episode runner is closing
        raise episode.lose("aborted", f"the turn was not generated: {e}") from None

    async def finish(recording=lambda: None):
      """The turn's choices and usage; `recording()` runs when the turn is about to be
      recorded, after the last await, so a disconnect before it leaves the turn to
      `_stream`'s cleanup."""
      try:
        # Shielded: a disconnect cancels this wait, and must not cancel the turn.
        samples = await asyncio.shield(asyncio.wrap_future(future))
      except RuntimeError as e:  # the pool or the episode runner is closing
        if episode is None:
          raise
        raise episode.lose("aborted", f"the turn was not generated: {e}") from None
      recording()
      return self._finish(samples, ask, chat, episode, messages, tools, text)

    if not ask.stream:
      choices, counts = await finish()
      return _json(wire.response(choices, chat=chat, model=self.model, logprobs=ask.logprobs,
                                 usage_=counts))
    if streams is not None:
      future.add_done_callback(lambda _: put(None))
    return self._stream(finish, future, queue if streams is not None else None, streams, ask,
                        chat, episode)

  def _finish(self, samples: list[Trajectory], ask: wire.Ask, chat: bool,
              episode: Optional[Episode], messages, tools, text):
    """The choices and usage of finished `samples`, recorded in `episode` if any."""
    cuts = [self._stop_cut(s, ask) for s in samples]
    if episode is not None:
      episode.record(samples[0], kept=cuts[0] and cuts[0][0])
      episode.check()
    if any(s.finish_reason == "aborted" for s in samples):
      raise _Aborted()
    samples = [_cut(s, c[0]) if c else s for s, c in zip(samples, cuts)]
    choices = [self._choice(s, c and c[1], ask, tools) for s, c in zip(samples, cuts)]
    if episode is not None and chat:
      reply = {"role": "assistant", "content": choices[0].text,
               "tool_calls": list(choices[0].tool_calls) or None}
      history = messages + wire.parse_messages({"messages": [reply]})
      episode.replied(history, tools, text, self._render(history, tools, False))
    elif episode is not None:
      episode.completed()
    return choices, wire.usage(samples[0].prompt_len,
                               sum(len(s.completion_C) for s in samples))

  def _stream(self, finish, future: Future, queue, streams, ask: wire.Ask, chat: bool,
              episode: Optional[Episode]):
    """A server-sent-event response: each choice's text as its tokens arrive (from
    `queue`, None once the pool is done; no queue: all of it at the end), then its
    finish reason, the usage if asked, and `[DONE]`. A failure after the response has
    begun is sent as an error event, which the `openai` client raises. An agent that
    closes the stream before the turn is recorded loses its episode; the turn is
    recorded when it ends, which frees its slot."""
    from starlette.responses import StreamingResponse  # noqa: PLC0415 (the `agents` extra)
    chunks = wire.Chunks(chat=chat, model=self.model)

    def event(chunk):
      return f"data: {json.dumps(chunk)}\n\n"

    async def events():
      recorded = False

      def recording():
        nonlocal recorded
        recorded = True

      try:
        for i in range(ask.n):
          if (chunk := chunks.start(i)) is not None:
            yield event(chunk)
        while queue is not None and (item := await queue.get()) is not None:
          index, tokens = item
          if delta := streams[index].add(tokens):
            yield event(chunks.text(index, delta))
        choices, counts = await finish(recording)
        for i, c in enumerate(choices):
          rest = streams[i].rest(c.text or "") if streams else c.text or ""
          if rest or c.tool_calls or ask.logprobs:
            yield event(chunks.text(i, rest, c, ask.logprobs))
          yield event(chunks.finish(i, c.finish_reason))
        if ask.include_usage:
          yield event(chunks.usage(counts))
        yield "data: [DONE]\n\n"
      except _Aborted:
        yield event(wire.error(_Aborted.MESSAGE, "server_error"))
      except RuntimeError as e:
        yield event(wire.error(_unavailable(e), "server_error"))
      except (ValueError, EpisodeLost) as e:
        yield event(wire.error(str(e)))
      finally:
        if episode is not None and not recorded:
          episode.lose("malformed", "the agent closed the stream before the turn ended")
          future.add_done_callback(
              lambda done: done.exception() is None and episode.record(done.result()[0]))
        if episode is not None:
          episode.busy = False

    response = StreamingResponse(events(), media_type="text/event-stream")
    response.ends_turn = True  # `events` frees the episode for its next request
    return response

  def _render(self, messages: list, tools, add_generation_prompt: bool) -> str:
    render = getattr(self._tok, "render_chat", None)
    if render is None:
      return "".join(m.get("content") or "" for m in messages)
    return render(messages, add_generation_prompt=add_generation_prompt,
                  **({"tools": tools} if tools else {}))

  def _submit(self, prompt_ids, ask: wire.Ask, on_tokens) -> Future:
    sampling = SamplingParams(temperature=ask.temperature, top_p=ask.top_p,
                              max_new_tokens=ask.max_tokens or self._max_tokens,
                              stop_token_ids=(*self._tok.stop_ids, *ask.stop_ids), seed=ask.seed)
    return self._pool.submit(Request(f"openai/{next(self._ids)}", prompt_ids, ask.n, sampling,
                                     on_tokens=on_tokens))

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
    return wire.Choice(text, token_texts, logprobs, finish, tuple(calls))


def _unavailable(e: RuntimeError) -> str:
  return f"the generator cannot serve requests now ({e})"


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
