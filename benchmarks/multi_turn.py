r"""What a multi-turn episode pays for re-prefilling its context at every turn.

  python -m benchmarks.multi_turn            # about 2 minutes on a 2-core CPU

A multi-turn workflow (`tasks.workflow.MultiTurn`) submits each policy turn as a new
request holding the whole episode so far, so the generator prefills the context again
(the pool keeps no KV cache between requests). On the quick start's model (`tiny`,
vocabulary 32, 16 slots, 96-token cache):

Part 1 times the engine: one prefill of each padded length (the cost of a turn's
re-prefill at that context length), and one decode step of all slots (which also
advances every other slot by a token). Continuing the episode in its slot instead
would feed only the environment's m new tokens through the cache: about m decode
steps' worth of one slot, or one short extension prefill.

Part 2 times the pool end to end: groups of episodes of the same budget of tokens
after the prompt, with random weights at temperature 1, single-turn (no turn ends
but EOS) and multi-turn (a turn ends at any of --turn_stops ids, and the environment
answers with two tokens), all submitted at once. It reports episodes/s, policy
tokens/s, turns per episode, the pool's decode steps per policy token, and the share
of the wall time that the prefills of later turns take by part 1's costs (each later
turn prefills the episode before it, padded to its bucket; the decode thread does
nothing else meanwhile).

A float32 1024³ matmul measured in the same run tells how loaded the machine was.
Prints tables, then, as the last line, one JSON object.
"""

import dataclasses
import json
import time
import types

import jax
import numpy as np
from absl import app, flags

from async_rl import models
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.generation.sampling import SlotSampling
from async_rl.rl.episodes import EpisodeRunner
from async_rl.tasks.workflow import MultiTurn
from benchmarks.train_step import matmul_peak

_GROUPS = flags.DEFINE_integer("groups", 96, "Prompt groups of part 2 (8 episodes each).")
_TURN_STOPS = flags.DEFINE_integer("turn_stops", 4, "Token ids that end a turn in part 2.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed repetitions of each call in part 1.")

CFG = models.ModelConfig(**models.PRESETS["tiny"], vocab_size=32, max_seq_len=96)
SLOTS, PROMPT_LEN, BUDGET, EOS = 16, 16, 64, 2


def _median_s(fn, reps):
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def engine_costs(engine, params, reps):
  """Median seconds of a prefill per bucket length, and of one decode step."""
  params = engine.load_params(params)
  sampling = SlotSampling.create(SamplingParams(), seed=0, index=0)
  prefill = {}
  for bucket in engine.prefill_buckets:
    tokens = np.ones(bucket, np.int32)
    prefill[bucket] = _median_s(lambda: engine.prefill(
        params=params, padded_tokens=tokens, true_length=bucket, sampling=sampling), reps)
  state = engine.init_decode_state()
  prefix, _ = engine.prefill(params=params, padded_tokens=np.ones(16, np.int32),
                             true_length=16, sampling=sampling)
  for slot in range(engine.max_concurrent_decodes):
    state = engine.insert(prefix, state, slot)
  holder = [state]

  def step():
    holder[0], result = engine.generate(params, holder[0])
    return result

  return prefill, _median_s(step, reps)


def later_turn_contexts(traj) -> list[int]:
  """The context lengths that the turns after the first were prefilled at."""
  policy = np.concatenate([[0], (traj.versions_T >= 0).astype(np.int8)])
  return [int(s) for s in np.flatnonzero(np.diff(policy) == 1)[1:]]


def episodes(pool, engine, prefill_s, multi_turn: bool, groups: int, turn_stops: int) -> dict:
  """Runs `groups` groups of 8 episodes at once; their throughput and shape."""
  turn_ids = tuple(range(3, 3 + turn_stops)) if multi_turn else ()
  workflow = MultiTurn(lambda prompt, tokens_T: [20, 21], max_turns=BUDGET, max_tokens=BUDGET,
                       turn_stop_ids=turn_ids, stop_ids=(EOS,))
  runner = EpisodeRunner(pool, workflow)
  rng = np.random.default_rng(0)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=BUDGET, stop_token_ids=(EOS,))
  steps_before = pool.metrics()["decode_steps"]
  start = time.perf_counter()
  futures = []
  for g in range(groups):
    prompt = types.SimpleNamespace(tokens=tuple(int(t) for t in rng.integers(3, 32, PROMPT_LEN)))
    futures.append(runner.submit(prompt, Request(f"{multi_turn}/{g}", list(prompt.tokens), 8,
                                                 dataclasses.replace(sampling, seed=g))))
  done = [t for f in futures for t in f.result()]
  wall = time.perf_counter() - start
  runner.close()
  policy = sum(t.num_policy_tokens for t in done)
  steps = pool.metrics()["decode_steps"] - steps_before
  bucket = lambda n: next(b for b in engine.prefill_buckets if b >= n)  # noqa: E731
  reprefill_s = sum(prefill_s[bucket(n)] for t in done for n in later_turn_contexts(t))
  return {"episodes": len(done), "wall_s": wall, "episodes_per_s": len(done) / wall,
          "reprefill_share": reprefill_s / wall,
          "policy_tokens_per_s": policy / wall,
          "turns": float(np.mean([t.metadata["turns"] for t in done])),
          "policy_tokens": policy / len(done),
          "env_tokens": float(np.mean([len(t) - t.prompt_len - t.num_policy_tokens
                                       for t in done])),
          "decode_steps_per_policy_token": steps / policy}


def main(argv):
  del argv
  gflops = matmul_peak(1024) / 1e9
  params = jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))
  engine = Engine(CFG, max_concurrent_decodes=SLOTS, max_prefill_length=PROMPT_LEN + BUDGET - 1,
                  max_target_length=PROMPT_LEN + BUDGET)
  engine.warmup(params)
  prefill, decode = engine_costs(engine, params, _REPS.value)
  print(f"matmul 1024^3 float32: {gflops:.1f} GFLOP/s")
  print(f"decode step, {SLOTS} slots: {1e3 * decode:.2f} ms")
  print("| prefill length | ms | decode steps |\n|---|---|---|")
  for length, s in prefill.items():
    print(f"| {length} | {1e3 * s:.2f} | {s / decode:.1f} |")
  with GeneratorPool(engine, params) as pool:
    runs = {name: episodes(pool, engine, prefill, multi, _GROUPS.value, _TURN_STOPS.value)
            for name, multi in (("single_turn", False), ("multi_turn", True))}
  print("| workflow | episodes/s | policy tok/s | turns | policy tok | env tok | "
        "decode steps / policy tok | re-prefill share of wall |\n|---|---|---|---|---|---|---|---|")
  for name, r in runs.items():
    print(f"| {name} | {r['episodes_per_s']:.1f} | {r['policy_tokens_per_s']:.0f} | "
          f"{r['turns']:.1f} | {r['policy_tokens']:.1f} | {r['env_tokens']:.1f} | "
          f"{r['decode_steps_per_policy_token']:.3f} | {r['reprefill_share']:.2f} |")
  print(json.dumps({
      "matmul_gflops": round(gflops, 1), "decode_step_ms": round(1e3 * decode, 3),
      "prefill_ms": {k: round(1e3 * v, 3) for k, v in prefill.items()},
      "runs": {k: {m: round(v, 3) for m, v in r.items()} for k, r in runs.items()},
      "multi_over_single_tokens_per_s": round(runs["multi_turn"]["policy_tokens_per_s"]
                                              / runs["single_turn"]["policy_tokens_per_s"], 3)}))


if __name__ == "__main__":
  app.run(main)
