r"""The OpenAI-compatible endpoint, measured on one pool of the quick start's model
(`tiny`, random weights, 16 slots): what it costs (`--mode=cost`), and how many
episodes of an agent that sends back only the text it was given are lost
(`--mode=echo`).

  python -m benchmarks.agent_endpoint                 # about 20 s on a 2-core CPU
  python -m benchmarks.agent_endpoint --requests=32   # the fast mode
  python -m benchmarks.agent_endpoint --mode=echo     # 1,920 episodes of each API
  python -m benchmarks.agent_endpoint --mode=echo --model=smollm2-135m-instruct

Both paths run the same single-turn requests (a 16-token prompt, 16 new tokens at
temperature 1, EOS the only stop) through `rl.episodes.EpisodeRunner` on one
`GeneratorPool` of the quick start's model (`tiny`, random weights, 16 slots), all
submitted at once, each a group of one:
  * in process: the default single-turn workflow hands the request to the pool;
  * endpoint: the agent workflow (`agents.task.AgentWorkflow`) runs an agent that
    asks `openai.AsyncOpenAI.completions.create(prompt=<the ids>, stream=True)` on
    its episode's URL, through HTTP on localhost, uvicorn and the episode's assembly.
The time to first token is, per request, from its submission to the first token the
caller sees: the future's result (in process) or the first streamed chunk the agent
reads (endpoint). The in-process path hands back whole samples, so there the first
token arrives with the last; the endpoint streams each decode chunk's tokens. Each
path runs once untimed first, so nothing compiles in the timed runs; then the two
alternate, --reps times each, and the best run of each is reported (the machine's
load moves the others).

Echo: agents that each run three turns, sending back the text of every reply they
were given followed by an environment's text (`=12` and a newline), with the stop
string `=`: one agent through the completions API (its transcript as the prompt), one
through the chat API (the replies as assistant messages, the environment as user
messages; this tokenizer has no chat template, so a conversation is its contents one
after another). The model's vocabulary (32) is larger than the tokenizer's (22), as
in the quick start: random weights sample PAD, BOS and ids the tokenizer cannot write
(decoded as U+FFFD) often, which is the hardest case for an agent that only has text.
Groups of 8 episodes, 8 groups in flight (as a run's staleness gate keeps them).
Counts the episodes lost, by reason, and checks that every kept episode's policy
tokens are what the generator sampled (their count, and their text against the
replies the agent was given).

Prints a table (cost) or the counts (echo), then, as the last line, one JSON object.
"""

import collections
import dataclasses
import json
import logging
import statistics
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import app, flags

from async_rl import models
from async_rl.agents.server import Endpoint
from async_rl.agents.task import AgentWorkflow
from async_rl.config import MODEL_PRESETS, ModelConfig
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.rl.episodes import EpisodeRunner
from async_rl.tasks.tokenizer import CharTokenizer
from benchmarks.common.peak import matmul_peak

_MODE = flags.DEFINE_enum("mode", "cost", ["cost", "echo"], "What to measure.")
_REQUESTS = flags.DEFINE_integer("requests", 128, "Requests per timed run (cost).")
_REPS = flags.DEFINE_integer("reps", 2, "Timed runs of each path (cost).")
_EPISODES = flags.DEFINE_integer("episodes", 1920, "Episodes of each API (echo).")
_MODEL = flags.DEFINE_string(
    "model", "tiny", "The echo's model: tiny (random weights, the character tokenizer), or "
    "a pretrained model with its own tokenizer and chat template: a directory, a .gguf file "
    "or a shipped name (models.pretrained), e.g. smollm2-135m-instruct.")

CFG = ModelConfig(**MODEL_PRESETS["tiny"], vocab_size=32, max_seq_len=64)
SLOTS, PROMPT_LEN, NEW_TOKENS = 16, 16, 16
TOKENIZER = CharTokenizer()  # its EOS (2) is the stop; other ids decode as U+FFFD
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS,
                          stop_token_ids=TOKENIZER.stop_ids)


def _prompts(n: int, offset: int):
  return [types.SimpleNamespace(id=f"p{offset + i}", tokens=[3 + (offset + i + k) % 19
                                                              for k in range(PROMPT_LEN)])
          for i in range(n)]


def _run(runner, prompts, first_token_at):
  """Submits every prompt at once; returns (wall s, [time to first token s]).
  `first_token_at` maps a prompt id to when its first token was read, where the
  caller reads it before the future resolves."""
  done, submitted, started = {}, {}, time.perf_counter()
  lock = threading.Lock()

  def record(p):
    def callback(_):
      with lock:
        done[p.id] = time.perf_counter()
    return callback

  futures = []
  for p in prompts:
    submitted[p.id] = time.perf_counter()
    future = runner.submit(p, Request(p.id, p.tokens, 1, SAMPLING))
    future.add_done_callback(record(p))
    futures.append(future)
  for f in futures:
    f.result(timeout=600)
  wall = time.perf_counter() - started
  return wall, [first_token_at.get(p.id, done[p.id]) - submitted[p.id] for p in prompts]


def _pool():
  params = jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))
  engine = Engine(CFG, max_concurrent_decodes=SLOTS, max_prefill_length=PROMPT_LEN,
                  max_target_length=CFG.max_seq_len)
  return GeneratorPool(engine, params)


def _cost():
  n = _REQUESTS.value
  first_token_at: dict = {}

  async def agent(client, row):
    stream = await client.completions.create(model="policy", prompt=row.tokens,
                                             max_tokens=NEW_TOKENS, stream=True)
    async for chunk in stream:
      if chunk.choices and chunk.choices[0].text:
        first_token_at.setdefault(row.id, time.perf_counter())
    return 0.0

  endpoint = Endpoint(TOKENIZER)
  rows = {}
  results = {}
  with _pool() as pool:
    workflow = AgentWorkflow(endpoint, agent, row=lambda p: rows[p.id], deadline_s=600.0)
    paths = {"in_process": EpisodeRunner(pool), "endpoint": EpisodeRunner(pool, workflow)}
    offsets = iter(range(1, 1_000))
    for rep in range(_REPS.value + 1):
      for name, runner in paths.items():
        prompts = _prompts(SLOTS if rep == 0 else n, 10_000 * next(offsets))
        rows.update({p.id: p for p in prompts})
        wall, ttft = _run(runner, prompts, first_token_at)
        if rep and n / wall > results.get(name, {}).get("requests_per_s", 0):
          results[name] = {"requests_per_s": n / wall,
                           "ttft_median_ms": 1e3 * statistics.median(ttft),
                           "ttft_p90_ms": 1e3 * statistics.quantiles(ttft, n=10)[-1]}
    for runner in paths.values():
      runner.close()
  workflow.close()
  endpoint.close()
  peak = matmul_peak() / 1e9  # after the runs, as the machine is then
  print(f"{n} single-turn requests of {NEW_TOKENS} new tokens, all submitted at once, "
        f"{SLOTS} slots; the best of {_REPS.value} runs; matmul peak {peak:.1f} GFLOP/s")
  print(f"{'path':<12}{'requests/s':>12}{'TTFT median ms':>16}{'TTFT p90 ms':>14}")
  for name, r in results.items():
    print(f"{name:<12}{r['requests_per_s']:>12.1f}{r['ttft_median_ms']:>16.0f}"
          f"{r['ttft_p90_ms']:>14.0f}")
  print(json.dumps({"requests": n, "matmul_gflops": peak, **{f"{name}/{k}": v for name, r in results.items()
                                       for k, v in r.items()}}))


# The echo agents: three turns each, the stop string "=" and the environment's "=12\n".
TURNS, TURN_TOKENS, ENV, STOP = 3, 8, "=12\n", "="
GROUP, IN_FLIGHT = 8, 8
PRETRAINED_LEN = 192  # a pretrained model's context here: its episodes' longest


def _key(client) -> str:
  return str(client.base_url).rstrip("/").split("/")[-2]  # .../episodes/<key>/v1


async def _echo_completions(client, row):
  text = row.text
  for _ in range(TURNS):
    out = await client.completions.create(model="policy", prompt=text, max_tokens=TURN_TOKENS,
                                          stop=[STOP])
    _echo_completions.given.setdefault(_key(client), []).append(out.choices[0].text)
    text += out.choices[0].text + ENV
  return 0.0


async def _echo_chat(client, row):
  messages = [{"role": "user", "content": row.text}]
  for _ in range(TURNS):
    out = await client.chat.completions.create(model="policy", messages=messages,
                                               max_tokens=TURN_TOKENS, stop=[STOP])
    content = out.choices[0].message.content
    _echo_chat.given.setdefault(_key(client), []).append(content)
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": ENV}]
  return 0.0


def _policy_runs(e):
  """The runs of consecutive policy tokens of trajectory `e`: one per turn."""
  runs, run = [], []
  for t, trained in zip(e.tokens_T[e.prompt_len:], e.loss_mask_T[e.prompt_len:]):
    if trained:
      run.append(int(t))
    elif run:
      runs.append(run)
      run = []
  return runs + ([run] if run else [])


@dataclasses.dataclass(frozen=True)
class _EchoModel:
  """The echo's model: its config and params, its tokenizer, whether a completion's text
  prompt begins with BOS, a question drawn from `rng`, and each episode's token budget."""
  cfg: ModelConfig
  params: Any
  tokenizer: Any
  add_bos: bool
  question: Callable[[np.random.Generator], str]
  budget: int


def _echo_model() -> _EchoModel:
  if _MODEL.value == "tiny":
    params = jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))
    return _EchoModel(CFG, params, TOKENIZER, True, lambda rng: "".join(
        rng.choice(list("0123456789+-*")) for _ in range(PROMPT_LEN - 2)) + "=\n",
        budget=TURNS * (TURN_TOKENS + len(ENV)))
  from async_rl.models import hf, pretrained  # noqa: PLC0415 (the `hf` extra)
  from async_rl.models.hf_config import read_config  # noqa: PLC0415
  from async_rl.models.hf_tokenizer import HFTokenizer  # noqa: PLC0415
  model_dir = pretrained.model_dir(_MODEL.value)
  cfg = ModelConfig(**{**read_config(model_dir), "max_seq_len": PRETRAINED_LEN})
  # A chat turn's environment is the template's close of the reply, a user message
  # and the generation prompt: about 12 tokens in ChatML.
  return _EchoModel(cfg, hf.load_hf(model_dir, cfg), HFTokenizer(model_dir), False,
                    lambda rng: f"What is {rng.integers(100)} + {rng.integers(100)}?",
                    budget=TURNS * (TURN_TOKENS + 24))


def _echo():
  """Runs `_EPISODES` episodes of each echo agent; returns {api: counts}."""
  model = _echo_model()
  tok = model.tokenizer
  sampling = SamplingParams(temperature=1.0, max_new_tokens=model.budget,
                            stop_token_ids=tok.stop_ids)
  rng = np.random.default_rng(0)
  results = {}
  engine = Engine(model.cfg, max_concurrent_decodes=SLOTS,
                  max_prefill_length=model.cfg.max_seq_len - 1,
                  max_target_length=model.cfg.max_seq_len)
  with GeneratorPool(engine, model.params) as pool:
    for api, agent in (("completions", _echo_completions), ("chat", _echo_chat)):
      agent.given = {}
      endpoint = Endpoint(tok, add_bos=model.add_bos)
      workflow = AgentWorkflow(endpoint, agent, row=lambda p: p, deadline_s=600.0)
      runner = EpisodeRunner(pool, workflow, vocab_size=model.cfg.vocab_size)
      prompts = []
      for i in range(_EPISODES.value // GROUP):
        text = model.question(rng)
        prompts.append(types.SimpleNamespace(id=f"{api}{i}", text=text, tokens=tok.encode(text)))
      # A window of groups in flight, as a run's staleness gate keeps: with every group
      # at once, each turn would queue behind every episode's turn before it.
      window, done = collections.deque(), []
      for p in prompts:
        window.append(runner.submit(p, Request(p.id, p.tokens, GROUP, sampling)))
        if len(window) == IN_FLIGHT:
          done += window.popleft().result(timeout=3600)
      done += [e for f in window for e in f.result(timeout=3600)]
      kept = [e for e in done if e.finish_reason != "aborted"]
      # Every kept episode holds, turn by turn, the tokens of the replies given (with
      # the stop string "=" where it ended one).
      wrong = sum(len(runs := _policy_runs(e)) != len(given := agent.given[e.metadata["episode"]])
                  or any(tok.decode(r) not in (g, g + STOP) for r, g in zip(runs, given))
                  for e in kept)
      counts = {k.removeprefix("agent_"): v for k, v in runner.metrics().items() if v}
      results[api] = {**counts, "kept": len(kept), "kept_not_as_given": wrong}
      runner.close()
      workflow.close()
  return results


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
  if _MODE.value == "cost":
    _cost()
    return
  started = time.perf_counter()
  results = _echo()
  wall = time.perf_counter() - started
  print(f"echoing agents on {_MODEL.value}, {TURNS} turns of at most {TURN_TOKENS} tokens, "
        f"stop {STOP!r}, groups of {GROUP}, {IN_FLIGHT} in flight; {wall:.0f} s")
  print(f"{'API':<14}{'episodes':>10}{'lost':>8}{'lost %':>9}  by reason")
  for api, r in results.items():
    lost = {k.removeprefix("lost_"): v for k, v in r.items() if k.startswith("lost_")}
    print(f"{api:<14}{r['episodes']:>10}{sum(lost.values()):>8}"
          f"{100 * sum(lost.values()) / r['episodes']:>8.2f}%  {lost or ''}")
  print(json.dumps({"wall_s": wall, **{f"{api}/{k}": v for api, r in results.items()
                                       for k, v in r.items()}}))


if __name__ == "__main__":
  app.run(main)
