"""The OpenAI-compatible endpoint, driven by the real `openai` client over localhost:
the wire format on a scripted pool, agent episodes on a real pool, and agents that fail."""

import asyncio
import dataclasses
import itertools
import json
import re
import string
import threading
import types
from concurrent.futures import Future

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from async_rl import models, policy  # noqa: E402
from async_rl.agents import wire  # noqa: E402
from async_rl.agents.episode import LOSSES, reply_glue  # noqa: E402
from async_rl.agents.server import Endpoint  # noqa: E402
from async_rl.agents.task import AgentWorkflow  # noqa: E402
from async_rl.chat import compile_chat_template  # noqa: E402
from async_rl.config import AgentConfig  # noqa: E402
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams  # noqa: E402
from async_rl.rl.episodes import EpisodeRunner  # noqa: E402
from async_rl.tasks.tokenizer import ByteTokenizer, CharTokenizer  # noqa: E402
from async_rl.trajectory import Trajectory  # noqa: E402
from conftest import one_layer_model  # noqa: E402

# A Hermes-style template (tool calls as <tool_call>JSON</tool_call>), as Qwen2.5's.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}"
    "{{ ' ' + t.function.name }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>' }}{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "{{ '</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class ChatChars:
  """Printable ASCII one character a token, with <|im_end|> (EOS) and <|im_start|>, and
  the template above: a tokenizer whose text round-trips exactly, except for its
  special tokens, which text leaves out, and ids past its vocabulary, which decode as
  U+FFFD and which no text encodes to."""
  SPECIALS = ("<|im_end|>", "<|im_start|>")
  bos_id = None
  eos_id = pad_id = 0
  stop_ids = (0,)

  def __init__(self):
    self._vocab = list(self.SPECIALS) + list(string.printable[:95]) + ["\n"]
    self._ids = {t: i for i, t in enumerate(self._vocab)}
    self.vocab_size = len(self._vocab)
    self._template = compile_chat_template(TEMPLATE)

  def encode(self, text):
    ids, i = [], 0
    while i < len(text):
      special = next((s for s in self.SPECIALS if text.startswith(s, i)), None)
      token = special or text[i]
      if token not in self._ids:
        raise ValueError(f"{token!r} is not in the vocabulary")
      ids.append(self._ids[token])
      i += len(token)
    return ids

  def decode(self, ids):
    out = []
    for t in ids:
      if int(t) in self.stop_ids:
        break
      out.append("" if int(t) < 2 else self._vocab[int(t)] if int(t) < self.vocab_size
                 else "\ufffd")
    return "".join(out)

  def render_chat(self, messages, *, add_generation_prompt=True, tools=None):
    return self._template.render(messages=messages, tools=tools,
                                 add_generation_prompt=add_generation_prompt)


TOK = ChatChars()


class ScriptedPool:
  """A pool whose every sample is the next scripted reply (its text, or its ids, then
  EOS unless it is cut), with log-prob -0.5 and version 3; it holds no slots. A streamed
  request gets its tokens one at a time before its future resolves."""

  def __init__(self, tok=None):
    self.replies, self.requests = [], []
    self._tok = tok or TOK

  def submit(self, request):
    self.requests.append(request)
    samples = []
    for i in range(request.n):
      reply = self.replies.pop(0) if self.replies else "ok"
      ids = self._tok.encode(reply) if isinstance(reply, str) else list(reply)
      ids = ids[:request.sampling.max_new_tokens]
      stops = [k for k, t in enumerate(ids) if t in request.sampling.stop_token_ids]
      finish = "stop" if stops else "length"
      if stops:
        ids = ids[:stops[0] + 1]
      elif len(ids) < request.sampling.max_new_tokens:
        ids, finish = ids + [self._tok.eos_id], "stop"
      for t in ids if request.on_tokens else ():
        request.on_tokens(i, [t])
      samples.append(Trajectory.from_completion(
          request.prompt, ids, np.full(len(ids), -0.5), np.full(len(ids), 3), finish,
          metadata={"request_id": request.request_id, "index": i}))
    future = Future()
    future.set_result(samples)
    return future

  def extend(self, handle, request):
    raise AssertionError("the scripted pool holds no slot")

  def release(self, handle):
    pass


@pytest.fixture(scope="module")
def scripted():
  pool = ScriptedPool()
  endpoint = Endpoint(TOK, pool=pool, max_tokens=200).start()
  yield pool, endpoint
  endpoint.close()


def _client(url, **kw):
  return openai.OpenAI(base_url=url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_chat_and_completion_requests_stream_and_not(scripted):
  pool, endpoint = scripted
  client = _client(f"{endpoint.url}/v1")
  pool.replies[:] = ["Paris.", "Rome"]
  out = client.chat.completions.create(
      model="m", messages=[{"role": "user", "content": "Capital?"}], n=2, temperature=0.5,
      top_p=0.9, seed=3, logprobs=True)
  request = pool.requests[-1]
  assert request.prompt == TOK.encode("<|im_start|>user\nCapital?<|im_end|>\n"
                                      "<|im_start|>assistant\n")
  assert (request.n, request.sampling.temperature, request.sampling.top_p,
          request.sampling.seed) == (2, 0.5, 0.9, 3)
  assert [c.message.content for c in out.choices] == ["Paris.", "Rome"]
  assert [c.finish_reason for c in out.choices] == ["stop", "stop"]
  assert [t.logprob for t in out.choices[0].logprobs.content] == [-0.5] * 7  # with EOS
  assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(request.prompt), 12)

  pool.replies[:] = ["1+2=3\n#3"]
  text = client.completions.create(model="m", prompt="Add:", stop=["="], max_tokens=20,
                                   logprobs=1)
  assert pool.requests[-1].prompt == TOK.encode("Add:")  # no BOS in this tokenizer
  assert TOK.encode("=")[0] in pool.requests[-1].sampling.stop_token_ids
  assert text.choices[0].text == "1+2"  # the stop string is left out, as OpenAI does
  assert text.choices[0].logprobs.tokens == ["1", "+", "2", "="]
  assert text.choices[0].finish_reason == "stop"

  pool.replies[:] = ["abcdefgh"]
  chunks = list(client.chat.completions.create(
      model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
      stream_options={"include_usage": True}))
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "abcd"
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].usage.completion_tokens == 4
  pool.replies[:] = ["xy"]
  streamed = list(client.completions.create(model="m", prompt=[5, 6, 7], stream=True))
  assert pool.requests[-1].prompt == [5, 6, 7]
  assert "".join(c.choices[0].text for c in streamed) == "xy"


def test_tool_calls_are_parsed_and_round_trip_through_the_template(scripted):
  pool, endpoint = scripted
  client = _client(f"{endpoint.url}/v1")
  tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
  pool.replies[:] = ['Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
                     '</tool_call>']
  out = client.chat.completions.create(model="m", tools=tools,
                                       messages=[{"role": "user", "content": "1+2?"}])
  assert pool.requests[-1].prompt[:len(TOK.encode("<|im_start|>system\nTools: add"))] == \
      TOK.encode("<|im_start|>system\nTools: add")
  choice = out.choices[0]
  assert choice.finish_reason == "tool_calls"
  assert choice.message.content == "Let me add."
  (call,) = choice.message.tool_calls
  assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
  # Sent back, the reply renders as it was generated (so an episode can continue it).
  history = wire.parse_messages({"messages": [
      {"role": "user", "content": "1+2?"}, choice.message.model_dump()]})
  rendered = TOK.render_chat(history, add_generation_prompt=False, tools=tools)
  assert rendered.endswith('assistant\nLet me add.\n<tool_call>{"name": "add", "arguments": '
                           '{"a": 1, "b": 2}}</tool_call><|im_end|>\n')


def test_bad_requests_are_refused_naming_the_field(scripted):
  _, endpoint = scripted
  client = _client(f"{endpoint.url}/v1")
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                   temperature=7)
  with pytest.raises(openai.BadRequestError, match="stop"):
    client.completions.create(model="m", prompt="x", stop=[""])
  with pytest.raises(openai.NotFoundError):
    _client(f"{endpoint.url}/episodes/nope/v1").completions.create(model="m", prompt="x")


def test_stop_cut_ends_at_the_token_that_completes_the_first_stop_string():
  vocab = ["ab", "c-", "->", "x"]
  decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
  assert wire.stop_cut([0, 1, 2, 3], decode, ["-->"]) == (3, "abc")
  assert wire.stop_cut([0, 1, 2, 3], decode, ["x", "c-"]) == (2, "ab")
  assert wire.stop_cut([0, 1, 2, 3], decode, ["yy"]) is None
  # A stop string's last character of several bytes is complete only with its last byte.
  byte = ByteTokenizer()
  assert wire.stop_cut(byte.encode("a。b"), byte.decode, ["。"]) == (4, "a")
  # A token that runs past the stop string is left out, so the tokens kept say no more
  # than the text and the stop string; so is a first token that does.
  past = ["ab", "c=(", "x"]
  decode_past = lambda ids: "".join(past[i] for i in ids)  # noqa: E731
  assert wire.stop_cut([0, 1, 2], decode_past, ["="]) == (1, "abc")
  assert wire.stop_cut([1, 2], decode_past, ["="]) == (0, "c")


def test_a_stop_string_of_several_tokens_ends_the_reply_and_the_episode_there(scripted):
  pool, endpoint = scripted
  pool.replies[:] = ["ab-->cd-->e"]
  out = _client(f"{endpoint.url}/v1").completions.create(
      model="m", prompt="x", stop=["-->", "?"], max_tokens=20, logprobs=1)
  assert pool.requests[-1].sampling.stop_token_ids == (TOK.eos_id, TOK.encode("?")[0])
  assert (out.choices[0].text, out.choices[0].finish_reason) == ("ab", "stop")
  assert out.choices[0].logprobs.tokens == list("ab-->")
  assert out.usage.completion_tokens == 5

  async def agent(client, row):
    out = await client.completions.create(model="m", prompt="go", stop=["-->"])
    agent.given = out.choices[0].text
    await client.completions.create(model="m", prompt="go" + agent.given + "-->env")
    return 1.0

  episode_pool = ScriptedPool()
  episode_pool.replies[:] = ["ab-->cd", "xy"]
  (e,), counts = _run(episode_pool, agent, n=1)
  assert counts["agent_episodes"] == 1 and agent.given == "ab"
  # The tokens after the stop string, never given to the agent, are not in the episode.
  policy = "".join(TOK._vocab[t] if m else "_" for t, m in zip(e.tokens_T, e.loss_mask_T))
  assert TOK.decode(e.tokens_T[e.prompt_len:]) == "ab-->envxy"
  assert policy[e.prompt_len:] == "ab-->___xy" + TOK._vocab[TOK.eos_id]


def test_a_bearer_token_is_required_when_set():
  endpoint = Endpoint(TOK, pool=ScriptedPool(), api_key="s3cret").start()
  try:
    with pytest.raises(openai.AuthenticationError):
      _client(f"{endpoint.url}/v1", api_key="wrong").models.list()
    assert _client(f"{endpoint.url}/v1", api_key="s3cret").models.list().data[0].id
  finally:
    endpoint.close()
  with pytest.raises(ValueError, match="task.agent.api_key"):
    AgentConfig(host="0.0.0.0")


def _reply(ids, content=None):
  return {"role": "assistant", "content": content, "token_ids": ids}


def test_reply_glue_is_what_the_template_writes_after_the_generated_tokens():
  im_end, nl = TOK.encode("<|im_end|>\n")
  a, b = TOK.encode("ab")
  assert reply_glue("ab<|im_end|>\n", _reply([a, b, im_end], "ab"), TOK) == [nl]
  assert reply_glue("ab<|im_end|>\n", _reply([a, b], "ab"), TOK) == [im_end, nl]  # cut reply
  # A stop string not rendered (the content leaves it out).
  assert reply_glue("ab", _reply([a, b, 7], "ab"), TOK) == []
  # A special token the text leaves out, and an id past the vocabulary.
  im_start = TOK.encode("<|im_start|>")[0]
  assert reply_glue("ab<|im_end|>\n", _reply([a, im_start, b, im_end], "ab"), TOK) == [nl]
  assert reply_glue("a\ufffd<|im_end|>\n", _reply([a, 500, im_end], "a\ufffd"), TOK) == [nl]


class Pieces:
  """Longest-match tokens of several characters: text has more than one tokenization."""
  stop_ids = (0,)
  eos_id = 0

  def __init__(self, pieces):
    self.vocab = ["<eos>", *pieces]

  def encode(self, text):
    ids = []
    while text:
      piece = max((p for p in self.vocab[1:] if text.startswith(p)), key=len)
      ids.append(self.vocab.index(piece))
      text = text[len(piece):]
    return ids

  def decode(self, ids):
    return "".join(self.vocab[t] for t in itertools.takewhile(lambda t: t != 0, ids))


def test_reply_glue_holds_for_a_reply_that_retokenizes_otherwise():
  tok = Pieces(["lo", " hel", " hello", "\n"])
  generated = tok.encode("lo hel") + tok.encode("lo")  # the model's own split
  assert tok.encode("lo hello\n") != generated + tok.encode("\n")
  # Read in ids alone, the reply's last token appears in the reply retokenized only at
  # its start, and the glue would repeat " hello".
  assert reply_glue("lo hello\n", _reply(generated, "lo hello"), tok) == tok.encode("\n")


# Episodes on a real pool.

CFG = one_layer_model(TOK.vocab_size)
T = 160
_logp = jax.jit(policy.logp_and_entropy, static_argnums=1, static_argnames="temperature")


@pytest.fixture(scope="module")
def real():
  params = jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))
  engine = Engine(CFG, max_concurrent_decodes=4, max_prefill_length=T - 1, max_target_length=T)
  with GeneratorPool(engine, params) as pool:
    yield pool, params


STOPS = list("aeiou0123456789 .,;:!?-+=")  # so that most turns end on a stop id


async def _three_turns(client, row):
  """Asks, then answers each reply with a tool result; records the log-probs of the
  tokens it was given and whether each turn ended on a stop."""
  messages = [{"role": "user", "content": row}]
  logprobs, stopped = [], []
  for turn in range(3):
    out = await client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                                stop=STOPS, logprobs=True)
    logprobs += [t.logprob for t in out.choices[0].logprobs.content]
    stopped.append(out.choices[0].finish_reason == "stop")
    messages += [out.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "content": f"r{turn}"}]
  _three_turns.seen.append((logprobs, sum(stopped[:2])))
  return 1.0


def _run(pool, agent, *, n=2, deadline_s=60.0, max_tokens=None, vocab_size=CFG.vocab_size,
         tok=TOK):
  endpoint = Endpoint(tok)
  workflow = AgentWorkflow(endpoint, agent, row=lambda p: p.question, deadline_s=deadline_s,
                           max_tokens=max_tokens)
  runner = EpisodeRunner(pool, workflow, vocab_size=vocab_size)
  prompt = types.SimpleNamespace(id="p", tokens=(1,), question="go")
  try:
    future = runner.submit(prompt, Request("p", [1], n, SamplingParams(
        temperature=1.0, max_new_tokens=120, seed=5)))
    # The runner's counters are what the rollout controller reports to the metrics log.
    return future.result(timeout=120), runner.metrics()
  finally:
    runner.close()
    workflow.close()
    endpoint.close()


def test_an_episode_trains_the_generated_tokens_with_the_environment_masked(real):
  pool, params = real
  _three_turns.seen = []
  before = pool.metrics()["extended_in_slot"] + pool.metrics()["extended_reprefilled"]
  episodes, counts = _run(pool, _three_turns)
  assert counts == {"agent_episodes": 2, **{f"agent_lost_{r}": 0 for r in LOSSES}}
  # A turn after one that ended on a stop id continued in the slot its episode held.
  assert pool.metrics()["extended_in_slot"] + pool.metrics()["extended_reprefilled"] - before \
      == sum(held for _, held in _three_turns.seen)
  seen = [logprobs for logprobs, _ in _three_turns.seen]
  for e in episodes:
    assert e.reward == 1.0 and e.metadata["turns"] == 3
    policy_T = e.versions_T >= 0
    np.testing.assert_array_equal(e.loss_mask_T, policy_T)
    # The policy tokens are the replies the agent was given, token for token, and each
    # is the generator's: its behaviour log-prob is the model's log-prob of it given
    # the episode before it.
    assert any(np.allclose(e.logp_T[policy_T], s) for s in seen if len(s) == policy_T.sum())
    n = len(e)
    pad = np.zeros(T, np.int32)
    pad[:n] = e.tokens_T
    logp_1T, _ = _logp(params, CFG, pad[None], np.arange(T)[None],
                       (np.arange(T) < n).astype(np.int32)[None], temperature=1.0)
    np.testing.assert_allclose(e.logp_T[policy_T], np.asarray(logp_1T)[0, :n][policy_T],
                               atol=1e-4)
    # The environment's tokens: what the template writes after each reply, the tool's
    # message, and the next generation prompt.
    env_T = ~policy_T
    env_T[:e.prompt_len] = False
    env = "".join(TOK._vocab[t] for t in e.tokens_T[env_T])
    assert env.count("<|im_start|>tool\nr") == 2 and env.endswith("<|im_start|>assistant\n")


class FirstTokensWait:
  """A pool whose decode thread, having handed over a request's first tokens, waits
  until `seen` is set (the client read text) or a deadline passes."""

  def __init__(self, pool):
    self._pool, self.seen, self.waited = pool, threading.Event(), None

  def submit(self, request):
    forward = request.on_tokens

    def on_tokens(index, tokens):
      forward(index, tokens)
      if self.waited is None:
        self.waited = self.seen.wait(30)
    return self._pool.submit(dataclasses.replace(request, on_tokens=forward and on_tokens))


def test_a_streamed_reply_arrives_as_it_is_decoded(real):
  pool = FirstTokensWait(real[0])
  endpoint = Endpoint(TOK, pool=pool).start()
  try:
    client = _client(f"{endpoint.url}/v1")
    ask = dict(model="m", prompt="Once upon a time", max_tokens=48, seed=11)
    whole = client.completions.create(**ask)
    texts = []
    for chunk in client.completions.create(**ask, stream=True):
      if chunk.choices and chunk.choices[0].text:
        pool.seen.set()
        texts.append(chunk.choices[0].text)
  finally:
    endpoint.close()
  assert pool.waited  # the first text came while the rest of the reply waited
  assert "".join(texts) == whole.choices[0].text and len(texts) >= 3
  assert whole.usage.completion_tokens >= 24


async def _crashes(client, row):
  await client.completions.create(model="m", prompt="go", max_tokens=3)
  raise KeyError("tool failed")


async def _hangs(client, row):
  await client.completions.create(model="m", prompt="go", max_tokens=3)
  await asyncio.sleep(60)


async def _edits_history(client, row):
  out = await client.completions.create(model="m", prompt="go", max_tokens=3)
  await client.completions.create(model="m", prompt="GO" + out.choices[0].text, max_tokens=3)
  return 1.0


async def _sends_garbage(client, row):
  await client.completions.create(model="m", prompt="go", max_tokens=3, temperature=-1)
  return 1.0


async def _talks_too_long(client, row):
  prompt = "go"
  for _ in range(4):  # each reply is "o", then the stop "k" the text leaves out
    out = await client.completions.create(model="m", prompt=prompt, max_tokens=8, stop=["k"])
    prompt += out.choices[0].text + "k" + "and more environment text"
  return 1.0


async def _sends_other_ids(client, row):
  """Sends a reply back as an assistant message carrying ids other than its own."""
  messages = [{"role": "user", "content": "go"}]
  out = await client.chat.completions.create(model="m", messages=messages, max_tokens=3,
                                             extra_body={"return_token_ids": True})
  ids = out.choices[0].token_ids
  messages += [{"role": "assistant", "content": out.choices[0].message.content,
                "token_ids": [ids[0] + 1, *ids[1:]]}, {"role": "user", "content": "more"}]
  await client.chat.completions.create(model="m", messages=messages, max_tokens=3)
  return 1.0


async def _sends_other_prompt_ids(client, row):
  """Continues with the ids given, one of them changed."""
  out = await client.completions.create(model="m", prompt="go", max_tokens=3,
                                        extra_body={"return_token_ids": True})
  c = out.choices[0]
  await client.completions.create(
      model="m", prompt=[*c.prompt_token_ids, *c.token_ids[:-1], c.token_ids[-1] + 1],
      max_tokens=3)
  return 1.0


@pytest.mark.parametrize("agent, reason", [
    (_crashes, "crashed"), (_hangs, "deadline"), (_edits_history, "mismatch"),
    (_sends_garbage, "malformed"), (_talks_too_long, "budget"),
    (_sends_other_ids, "mismatch"), (_sends_other_prompt_ids, "mismatch")])
def test_a_failing_agent_loses_its_episode_not_the_run(agent, reason):
  pool = ScriptedPool()
  # A short deadline only where it is the fault: a loaded machine can take a second over
  # the other agents' two requests.
  episodes, counts = _run(pool, agent, deadline_s=1.0 if reason == "deadline" else 60.0,
                          max_tokens=40)
  assert counts == {"agent_episodes": 2,
                    **{f"agent_lost_{r}": 2 if r == reason else 0 for r in LOSSES}}
  # Each comes back as an aborted sample of the prompt alone, which fails its group.
  for e in episodes:
    assert (e.finish_reason, e.reward, e.metadata["lost"], len(e)) == ("aborted", 0.0, reason, 1)


def test_the_example_agents_pass_the_run_checks_and_score_their_calls():
  from async_rl import cli  # noqa: PLC0415
  from async_rl.agents import task  # noqa: PLC0415
  from examples.agents import calculator_config, data_agent, data_config  # noqa: PLC0415
  for example in (calculator_config, data_config):
    task.check(cli.from_dict(example.get_config()))
  assert data_agent.correct(["47+23=", "47+23", "4+23=", "47-23="], ["70"] * 4) == [1, 0, 0, 0]


def test_the_registry_loads_the_agent_task_by_name_with_its_checks():
  from async_rl import cli  # noqa: PLC0415
  from async_rl.agents import task  # noqa: PLC0415
  from async_rl.tasks import registry  # noqa: PLC0415
  from examples.agents import calculator_config  # noqa: PLC0415
  assert registry.resolve_task("agent") is task.make
  cfg = cli.from_dict(calculator_config.get_config())
  registry.check_task(cfg)
  agent = dataclasses.replace(cfg.task.agent, episode="examples.agents:nowhere")
  bad = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, agent=agent))
  with pytest.raises(ValueError, match="task.agent.episode"):
    registry.check_task(bad)


def test_serving_alone_refuses_an_open_address_without_a_key():
  from async_rl import cli  # noqa: PLC0415
  from async_rl.agents import serve  # noqa: PLC0415
  from async_rl.configs import micro  # noqa: PLC0415
  c = micro.get_config()
  c.hf_model_dir = "/nonexistent"
  with pytest.raises(ValueError, match="api_key"):
    with serve.serve(cli.from_dict(c), host="0.0.0.0"):
      pass


class PendingGenerate:
  """An episode's `generate` whose turns wait until the test resolves them."""

  def __init__(self):
    self.futures, self.released = [], []

  def __call__(self, tokens, n=1, **kw):
    self.futures.append(Future())
    return self.futures[-1]

  def release(self, slot):
    self.released.append(slot)


def test_an_agent_that_closes_a_streamed_tool_turn_loses_its_episode_and_the_turn_is_recorded(
    scripted):
  import httpx  # noqa: PLC0415 (the `openai` client's)
  from conftest import wait_until  # noqa: PLC0415
  _, endpoint = scripted
  generate = PendingGenerate()
  episode = endpoint.open(generate, budget=100)
  tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
  body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
          "stream": True}
  with httpx.stream("POST", f"{endpoint.episode_url(episode)}/chat/completions", json=body,
                    timeout=30) as r:
    next(r.iter_lines())  # the role chunk; then the agent goes away
  wait_until(lambda: episode.lost is not None, timeout=10)
  assert episode.lost.reason == "malformed"
  prompt = episode.ids
  ids = TOK.encode("ok") + [TOK.eos_id]
  generate.futures[0].set_result([Trajectory.from_completion(
      prompt, ids, np.full(3, -0.5), np.full(3, 3), "stop", metadata={"slot": 7})])
  wait_until(lambda: episode.turns == 1)  # the turn is recorded, so its slot is freed
  endpoint.finish(episode)
  assert generate.released == [7]


@pytest.mark.parametrize("body, field", [
    ({"n": 100_000_000, "stream": True}, "n"), ({"stop": list(string.ascii_letters)}, "stop")])
def test_the_work_a_request_asks_for_is_bounded(body, field):
  with pytest.raises(wire.BadRequest, match=f"^{field} "):
    wire.parse_ask(body, TOK.encode, chat=False)


def test_a_stop_string_the_tokenizer_cannot_encode_is_found_in_the_text():
  def encode(text):
    if "é" in text:
      raise ValueError(f"{text!r} is outside the vocabulary")
    return TOK.encode(text)
  ask = wire.parse_ask({"stop": ["é", "?"]}, encode, chat=False)
  assert ask.stop == ("é", "?") and ask.stop_ids == tuple(TOK.encode("?"))


def test_a_closed_workflow_frees_its_endpoint_port_and_a_taken_port_is_a_runtime_error():
  endpoint = Endpoint(TOK).start()
  port = int(endpoint.url.rsplit(":", 1)[1])
  workflow = AgentWorkflow(endpoint, _crashes, row=str, deadline_s=1.0)
  with pytest.raises(RuntimeError, match=f"cannot bind 127.0.0.1:{port}"):
    Endpoint(TOK, port=port).start()
  workflow.close()
  Endpoint(TOK, port=port).start().close()


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     r"messages\[0\].content"),
    ({"messages": [{"role": "assistant", "tool_calls": 5}]}, r"messages\[0\].tool_calls"),
    ({"prompt": "x", "temperature": 10 ** 400}, "temperature"),
    ({"prompt": "x", "top_p": 10 ** 400}, "top_p"),
    ({"prompt": [5, 1099511627776]}, "prompt")])
def test_a_malformed_body_is_a_bad_request_naming_its_field(scripted, body, field):
  import httpx  # noqa: PLC0415 (the `openai` client's)
  _, endpoint = scripted
  route = "chat/completions" if "messages" in body else "completions"
  r = httpx.post(f"{endpoint.url}/v1/{route}", json={"model": "m", **body}, timeout=30)
  assert r.status_code == 400 and re.match(field, r.json()["error"]["message"])


class FailedPool:
  """A pool whose decode thread failed: every request's future fails."""

  def submit(self, request):
    future = Future()
    future.set_exception(RuntimeError("the decode thread failed"))
    return future


def test_a_failed_pool_is_answered_as_unavailable_streamed_or_not():
  endpoint = Endpoint(TOK, pool=FailedPool()).start()
  try:
    client = _client(f"{endpoint.url}/v1")
    with pytest.raises(openai.InternalServerError, match="decode thread failed"):
      client.completions.create(model="m", prompt="x")
    with pytest.raises(openai.APIError, match="decode thread failed"):
      list(client.completions.create(model="m", prompt="x", stream=True))
  finally:
    endpoint.close()


# Requests OpenAI and vLLM refuse, answered as they answer them.

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("route, body, message", [
    ("completions", {"prompt": "x", "max_tokens": 10 ** 9}, r"max_tokens must be at most 200,"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 10 ** 9},
     r"max_completion_tokens must be at most 200,"),
    ("completions", {"prompt": "x", "logprobs": 10 ** 6}, r"logprobs must be in \[0, 5\]"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 10 ** 6},
     r"top_logprobs must be in \[0, 20\]")])
def test_a_request_past_a_limit_is_refused_naming_the_limit(scripted, route, body, message):
  pool, endpoint = scripted
  served = len(pool.requests)
  client = _client(f"{endpoint.url}/v1")
  create = client.chat.completions.create if "messages" in body else client.completions.create
  with pytest.raises(openai.BadRequestError, match=message):
    create(model="m", **body)
  assert len(pool.requests) == served  # refused before anything was queued


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000,
                                 json.dumps({"prompt": "x", "tools": [[[[[[[[[[[[[[[[[[[[[
                                     [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[
                                     ]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
                                     ]]]]]]]]]]]]]]]]]]]]]}).encode()])
def test_a_deeply_nested_body_is_the_clients_fault(scripted, raw):
  import httpx  # noqa: PLC0415 (the `openai` client's)
  _, endpoint = scripted
  r = httpx.post(f"{endpoint.url}/v1/completions", content=raw, timeout=30)
  assert r.status_code == 400, r.text
  assert r.json()["error"]["message"] == "the request body is nested deeper than 64 levels"
  assert _client(f"{endpoint.url}/v1").completions.create(model="m", prompt="x").choices


def test_a_body_nested_as_deep_as_allowed_is_read():
  body = {"prompt": "x"}
  leaf = body
  for _ in range(wire.MAX_DEPTH - 1):
    leaf["x"] = {}
    leaf = leaf["x"]
  assert wire.parse_body(json.dumps(body).encode()) == body
  leaf["x"] = [1]
  with pytest.raises(wire.BadRequest, match="nested deeper than 64"):
    wire.parse_body(json.dumps(body).encode())
  for raw, message in [(b"{", "not JSON"), (b"\xff", "not JSON"), (b"[1]", "JSON object")]:
    with pytest.raises(wire.BadRequest, match=message):
      wire.parse_body(raw)


def test_a_burst_of_requests_is_served_beside_half_open_connections(scripted):
  import socket  # noqa: PLC0415
  _, endpoint = scripted
  host, port = endpoint.url.removeprefix("http://").rsplit(":", 1)
  half_open = []
  try:
    for _ in range(50):  # each sends part of a request and waits
      sock = socket.create_connection((host, int(port)), timeout=10)
      sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
      half_open.append(sock)

    async def burst():
      async with openai.AsyncOpenAI(base_url=f"{endpoint.url}/v1", api_key="unused",
                                    max_retries=0) as client:
        return await asyncio.gather(*(client.completions.create(model="m", prompt=f"x{i}")
                                      for i in range(64)))
    assert all(out.choices[0].text == "ok" for out in asyncio.run(burst()))
  finally:
    for sock in half_open:
      sock.close()


def test_an_episode_turn_asking_past_the_budget_gets_what_remains():
  async def agent(client, row):
    out = await client.completions.create(model="m", prompt="go", max_tokens=10 ** 9)
    agent.finish = out.choices[0].finish_reason
    return 1.0

  pool = ScriptedPool()
  pool.replies[:] = ["abcdefgh"]
  (e,), counts = _run(pool, agent, n=1, max_tokens=5)
  assert counts["agent_episodes"] == 1 and not any(
      v for k, v in counts.items() if k.startswith("agent_lost"))
  assert agent.finish == "length" and len(e) - e.prompt_len == 5


# Tools need a template that renders them.

class NoToolChars(ChatChars):
  """ChatChars with a ChatML template that has no tools."""

  def __init__(self):
    super().__init__()
    self._template = compile_chat_template(
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("tok", [NoToolChars(), ByteTokenizer(), CharTokenizer()],
                         ids=["template without tools", "ChatML", "no template"])
def test_tools_sent_to_a_template_without_tools_are_refused(tok):
  pool = ScriptedPool(TOK)
  endpoint = Endpoint(tok, pool=pool).start()
  tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
  try:
    client = _client(f"{endpoint.url}/v1")
    with pytest.raises(openai.BadRequestError, match="^Error code: 400 .*tools: this model's "
                       "chat template does not render tools"):
      client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}],
                                     tools=tools)
    assert not pool.requests
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
    assert len(pool.requests) == 1
  finally:
    endpoint.close()


def test_a_template_that_renders_tools_is_told_apart():
  assert wire.renders_tools(TOK.render_chat)
  assert not wire.renders_tools(NoToolChars().render_chat)
  assert not wire.renders_tools(ByteTokenizer().render_chat)


# Token ids out, token ids in.

A, B, C = TOK.encode("abc")
IM_START = TOK.encode("<|im_start|>")[0]
PAST_VOCAB = 500  # an id of a model's vocabulary larger than the tokenizer's


def test_replies_carry_their_token_ids_and_log_probs_as_vllm_spells_them(scripted):
  pool, endpoint = scripted
  client = _client(f"{endpoint.url}/v1")
  ids = [A, IM_START, B, PAST_VOCAB]  # a special token and an id past the vocabulary
  as_ids = {"return_token_ids": True, "return_tokens_as_token_ids": True}
  pool.replies[:] = [ids]
  out = client.completions.create(model="m", prompt="x", logprobs=0, extra_body=as_ids)
  c = out.choices[0]
  assert c.text == "ab\ufffd"  # the special token left out
  assert c.token_ids == ids + [TOK.eos_id] and c.prompt_token_ids == pool.requests[-1].prompt
  assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]
  assert c.logprobs.token_logprobs == [-0.5] * 5

  pool.replies[:] = [ids]
  out = client.chat.completions.create(model="m", messages=CHAT, logprobs=True,
                                       extra_body=as_ids)
  assert out.prompt_token_ids == pool.requests[-1].prompt
  assert out.choices[0].token_ids == ids + [TOK.eos_id]
  assert out.choices[0].message.content == "ab\ufffd"
  assert [t.token for t in out.choices[0].logprobs.content] == [
      f"token_id:{t}" for t in ids + [TOK.eos_id]]

  for chat in (True, False):
    pool.replies[:] = [ids]
    ask = dict(messages=CHAT) if chat else dict(prompt="x")
    create = client.chat.completions.create if chat else client.completions.create
    chunks = list(create(model="m", stream=True, extra_body={"return_token_ids": True}, **ask))
    first = chunks[0] if chat else chunks[0].choices[0]
    assert first.prompt_token_ids == pool.requests[-1].prompt
    assert sum((c.choices[0].token_ids for c in chunks if c.choices), []) == ids + [TOK.eos_id]
    text = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks
            if c.choices]
    assert "".join(text) == "ab\ufffd"

  out = client.completions.create(model="m", prompt="x")
  assert "token_ids" not in out.choices[0].model_extra


def test_an_assistant_message_carrying_its_ids_enters_the_prompt_as_those_ids(scripted):
  pool, endpoint = scripted
  ids = [A, IM_START, B, TOK.eos_id]  # its text, "ab", encodes to other ids
  client = _client(f"{endpoint.url}/v1")
  client.chat.completions.create(model="m", messages=[
      *CHAT, {"role": "assistant", "content": "ab", "token_ids": ids},
      {"role": "user", "content": "more"}])
  assert pool.requests[-1].prompt == [
      *TOK.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), *ids,
      *TOK.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")]
  with pytest.raises(openai.BadRequestError, match=r"messages\[0\].token_ids: only an "
                     "assistant"):
    client.chat.completions.create(model="m", messages=[{**CHAT[0], "token_ids": [1]}])


async def _echoes_text(client, row):
  """Three completions, each prompt the last one, the text given and an environment's."""
  prompt = "go"
  for turn in range(3):
    out = await client.completions.create(model="m", prompt=prompt, max_tokens=8)
    prompt += out.choices[0].text + f"r{turn}"
  return 1.0


async def _echoes_chat(client, row):
  """Three chat turns, each reply sent back as its text, then an environment's."""
  messages = [{"role": "user", "content": "go"}]
  for turn in range(3):
    out = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": out.choices[0].message.content},
                 {"role": "user", "content": f"r{turn}"}]
  return 1.0


async def _echoes_ids(client, row):
  """Three completions, each prompt the ids given, then an environment's."""
  prompt = TOK.encode("go")
  for turn in range(3):
    out = await client.completions.create(model="m", prompt=prompt, max_tokens=8,
                                          extra_body={"return_token_ids": True})
    c = out.choices[0]
    prompt = [*c.prompt_token_ids, *c.token_ids, *TOK.encode(f"r{turn}")]
  return 1.0


def _runs(e):
  """The episode's tokens after its prompt as (trained, ids) runs."""
  runs = []
  for t, trained in zip(e.tokens_T[e.prompt_len:], e.loss_mask_T[e.prompt_len:]):
    if not runs or runs[-1][0] != trained:
      runs.append((bool(trained), []))
    runs[-1][1].append(int(t))
  return runs


@pytest.mark.parametrize("agent", [_echoes_text, _echoes_chat, _echoes_ids])
def test_an_agent_that_sends_back_what_it_was_given_loses_no_episode(agent):
  """Replies whose text does not encode to their ids (a special token the text leaves
  out, an id past the tokenizer's vocabulary) are trained as they were generated."""
  replies = [[A, IM_START, B], [C, PAST_VOCAB], [IM_START]]
  pool = ScriptedPool()
  pool.replies[:] = [list(r) for r in replies]
  (e,), counts = _run(pool, agent, n=1, vocab_size=PAST_VOCAB + 1)
  assert counts == {"agent_episodes": 1, **{f"agent_lost_{r}": 0 for r in LOSSES}}
  runs = _runs(e)
  assert [ids for trained, ids in runs if trained] == [r + [TOK.eos_id] for r in replies]
  env = ["".join(TOK._vocab[t] for t in ids) for trained, ids in runs if not trained]
  if agent is _echoes_chat:
    assert env == [f"\n<|im_start|>user\nr{k}<|im_end|>\n<|im_start|>assistant\n"
                   for k in range(2)]
  else:
    assert env == ["r0", "r1"]


def _smollm2_tokenizer(gguf_path):
  from async_rl.models import pretrained  # noqa: PLC0415 (the `hf` extra)
  from async_rl.models.hf_tokenizer import HFTokenizer  # noqa: PLC0415
  model_dir = pretrained.model_dir(gguf_path)
  return model_dir, HFTokenizer(model_dir)


def test_tools_sent_to_smollm2_are_refused_since_its_template_has_none(smollm2_gguf):
  _, tok = _smollm2_tokenizer(smollm2_gguf)
  pool = ScriptedPool(tok)
  endpoint = Endpoint(tok, pool=pool).start()
  tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
  try:
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
      _client(f"{endpoint.url}/v1").chat.completions.create(model="m", messages=CHAT,
                                                            tools=tools)
  finally:
    endpoint.close()
  assert not pool.requests


@pytest.mark.parametrize("agent", [_echoes_text, _echoes_chat])
def test_an_echoing_agent_loses_no_episode_on_smollm2s_tokenizer(smollm2_gguf, agent):
  """SmolLM2's byte-level BPE (49,152 ids) and chat template: a reply split other than
  its text encodes, a character as its two bytes, BOS amid a reply, half a character."""
  tokenizers = pytest.importorskip("tokenizers")
  model_dir, tok = _smollm2_tokenizer(smollm2_gguf)
  byte = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json").token_to_id
  replies = [tok.encode("hel") + tok.encode("lo"), [byte("Ã"), byte("©"), tok.bos_id],
             [byte("Ã")]]
  assert tok.encode("hello") != replies[0] and tok.encode("é") != replies[1][:2]
  assert [tok.decode(r) for r in replies] == ["hello", "é", "\ufffd"]
  pool = ScriptedPool(tok)
  pool.replies[:] = [list(r) for r in replies]
  (e,), counts = _run(pool, agent, n=1, vocab_size=tok.vocab_size, tok=tok)
  assert counts == {"agent_episodes": 1, **{f"agent_lost_{r}": 0 for r in LOSSES}}
  assert [ids for trained, ids in _runs(e) if trained] == [r + [tok.eos_id] for r in replies]


async def _echoes_past_stop_completions(client, row):
  prompt = "go"
  for _ in range(3):
    out = await client.completions.create(model="m", prompt=prompt, max_tokens=8, stop=["="])
    prompt += out.choices[0].text + "=1\n"
  return 1.0


async def _echoes_past_stop_chat(client, row):
  messages = [{"role": "user", "content": "go"}]
  for _ in range(3):
    out = await client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                               stop=["="])
    messages += [{"role": "assistant", "content": out.choices[0].message.content},
                 {"role": "user", "content": "=1\n"}]
  return 1.0


@pytest.mark.parametrize("agent", [_echoes_past_stop_completions, _echoes_past_stop_chat])
def test_a_reply_whose_token_runs_past_its_stop_string_loses_no_echoed_episode(agent):
  tok = Pieces(["g", "o", "ab", "c", "c=(", "=", "1", "\n"])
  tok.vocab_size = len(tok.vocab)
  ab, c_stop = tok.encode("ab") + tok.encode("c=(")
  pool = ScriptedPool(tok)
  pool.replies[:] = [[ab, c_stop], [c_stop], [ab]]  # "abc=(": the text "abc"; "c=(": "c"
  (e,), counts = _run(pool, agent, n=1, vocab_size=tok.vocab_size, tok=tok)
  assert counts == {"agent_episodes": 1, **{f"agent_lost_{r}": 0 for r in LOSSES}}
  # The tokens past the stop string are not trained; the text the agent was given and
  # sent back is the environment's.
  assert [ids for trained, ids in _runs(e) if trained] == [[ab], [ab, tok.eos_id]]
  assert tok.decode(e.tokens_T[e.prompt_len:]) == "abc=1\nc=1\nab"


@pytest.mark.parametrize("stop", [[], ["界"]])
def test_a_streamed_reply_never_shows_part_of_a_character(stop):
  byte = ByteTokenizer()
  pool = ScriptedPool(byte)
  endpoint = Endpoint(byte, pool=pool).start()
  try:
    pool.replies[:] = ["é世界🚀!"]  # one byte a token, handed over one at a time
    chunks = [c.choices[0].text for c in _client(f"{endpoint.url}/v1").completions.create(
        model="m", prompt="x", stream=True, stop=stop) if c.choices]
  finally:
    endpoint.close()
  assert "".join(chunks) == ("é世" if stop else "é世界🚀!")
  assert not any("\ufffd" in c for c in chunks) and len([c for c in chunks if c]) >= 2
