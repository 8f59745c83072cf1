r"""What the OpenAI-compatible endpoint costs: requests/s and time to first token through
it, against the in-process workflow path, on one pool.

  python -m benchmarks.agent_endpoint                 # about 20 s on a 2-core CPU
  python -m benchmarks.agent_endpoint --requests=32   # the fast mode

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
path runs once untimed first, so nothing compiles in the timed runs; then the two alternate, --reps times each, and the best run of each is
reported (the machine's load moves the others).

Prints a table, then, as the last line, one JSON object.
"""

import json
import statistics
import threading
import time
import types

import jax
from absl import app, flags

from async_rl import models
from async_rl.agents.server import Endpoint
from async_rl.agents.task import AgentWorkflow
from async_rl.config import MODEL_PRESETS, ModelConfig
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.rl.episodes import EpisodeRunner
from async_rl.tasks.tokenizer import CharTokenizer
from benchmarks.common.peak import matmul_peak

_REQUESTS = flags.DEFINE_integer("requests", 128, "Requests per timed run.")
_REPS = flags.DEFINE_integer("reps", 2, "Timed runs of each path.")

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


def main(argv):
  del argv
  n = _REQUESTS.value
  params = jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))
  engine = Engine(CFG, max_concurrent_decodes=SLOTS, max_prefill_length=PROMPT_LEN,
                  max_target_length=CFG.max_seq_len)
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
  with GeneratorPool(engine, params) as pool:
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


if __name__ == "__main__":
  app.run(main)
