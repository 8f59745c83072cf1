r"""What a multi-turn episode pays for its later turns: re-prefilling the context, or
continuing in its slot.

  python -m benchmarks.multi_turn            # about 3 minutes on a 2-core CPU

A multi-turn workflow (`tasks.workflow.MultiTurn`) either submits each policy turn as
a new request holding the whole episode so far, which the generator prefills again
(`hold_slots=False`: "re-prefill"), or keeps the episode's slot and KV cache between
turns and feeds only the environment's tokens (`hold_slots=True`: "in slot", falling
back to re-prefill where the pool evicted the slot). On the quick start's model
(`tiny`, vocabulary 32, 16 slots, 80-token cache):

Part 1 times the engine: one prefill of each padded length (the cost of a turn's
re-prefill at that context length), one `extend` of a slot by 3 tokens (the held
last token and the environment's 2: the cost of an in-slot turn's start), and one
decode step of all slots.

Part 2 times the pool end to end: groups of 8 episodes of the same budget of tokens
after the prompt, with random weights at temperature 1, single-turn (no turn ends
but EOS) and multi-turn both ways (a turn ends at any of --turn_stops ids, and the
environment answers with two tokens), side by side in one run. Each runs twice: all
groups submitted at once (a backlog: queued samples evict held slots), and with
--in_flight groups at a time (the staleness gate's bound; 2 groups fill the 16
slots). It reports ms of wall per episode, policy tokens/s, turns per episode, the
pool's decode steps per policy token, the share of later turns continued in their
slot, and the share of the wall time that re-prefills of later turns take by part
1's costs (each re-prefilled turn prefills the episode before it, padded to its
bucket; the decode thread does nothing else meanwhile).

A float32 1024³ matmul measured in the same run tells how loaded the machine was.
Prints tables, then, as the last line, one JSON object.
"""

import concurrent.futures
import dataclasses
import json
import time
import types

import jax
import numpy as np
from absl import app, flags

from async_rl import models
from async_rl.config import MODEL_PRESETS, ModelConfig
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.generation.sampling import SlotSampling
from async_rl.rl.episodes import EpisodeRunner
from async_rl.tasks.workflow import MultiTurn
from benchmarks.common.peak import matmul_peak
from benchmarks.common.timer import median_s

_GROUPS = flags.DEFINE_integer("groups", 96, "Prompt groups of part 2 (8 episodes each).")
_TURN_STOPS = flags.DEFINE_integer("turn_stops", 4, "Token ids that end a turn in part 2.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed repetitions of each call in part 1.")
_IN_FLIGHT = flags.DEFINE_integer("in_flight", 2, "Groups in flight at once in the bounded "
                                  "runs of part 2.")

CFG = ModelConfig(**MODEL_PRESETS["tiny"], vocab_size=32, max_seq_len=96)
SLOTS, PROMPT_LEN, BUDGET, EOS = 16, 16, 64, 2
WORKFLOWS = ("single_turn", "multi_turn", "multi_turn_in_slot")


def engine_costs(engine, params, reps):
  """Median seconds of a prefill per bucket length, of extending a slot by 3 tokens,
  and of one decode step."""
  params = engine.load_params(params)
  sampling = SlotSampling.create(SamplingParams(), seed=0, index=0)
  prefill = {}
  for bucket in engine.prefill_buckets:
    tokens = np.ones(bucket, np.int32)
    prefill[bucket] = median_s(lambda: engine.prefill(
        params=params, padded_tokens=tokens, true_length=bucket, sampling=sampling), reps)
  state = engine.init_decode_state()
  prefix, _ = engine.prefill(params=params, padded_tokens=np.ones(16, np.int32),
                             true_length=16, sampling=sampling)
  M = engine.max_blocks
  for slot in range(engine.max_concurrent_decodes):
    state = engine.insert(prefix, state, slot, range(slot * M, (slot + 1) * M))
  holder = [state]

  def extend():
    holder[0], first = engine.extend(params, holder[0], 0, np.ones(3, np.int32), 16, sampling,
                                     range(M))
    return first

  def step():
    holder[0], result = engine.generate(params, holder[0])
    return result

  return prefill, median_s(extend, reps), median_s(step, reps)


def later_turn_contexts(traj) -> list[int]:
  """The context lengths that the turns after the first were prefilled at."""
  policy = np.concatenate([[0], (traj.versions_T >= 0).astype(np.int8)])
  return [int(s) for s in np.flatnonzero(np.diff(policy) == 1)[1:]]


def episodes(pool, engine, prefill_s, name: str, groups: int, in_flight: int,
             turn_stops: int) -> dict:
  """Runs `groups` groups of 8 episodes of workflow `name`, `in_flight` groups at a
  time; their throughput and shape."""
  turn_ids = tuple(range(3, 3 + turn_stops)) if name != "single_turn" else ()
  workflow = MultiTurn(lambda prompt, tokens_T: [20, 21], max_turns=BUDGET, max_tokens=BUDGET,
                       turn_stop_ids=turn_ids, stop_ids=(EOS,),
                       hold_slots=name == "multi_turn_in_slot")
  runner = EpisodeRunner(pool, workflow)
  rng = np.random.default_rng(0)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=BUDGET, stop_token_ids=(EOS,))
  before = pool.metrics()
  start = time.perf_counter()
  futures, pending = [], set()
  for g in range(groups):
    if len(pending) == in_flight:
      _, pending = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
    prompt = types.SimpleNamespace(tokens=tuple(int(t) for t in rng.integers(3, 32, PROMPT_LEN)))
    futures.append(runner.submit(prompt, Request(f"{name}/{in_flight}/{g}", list(prompt.tokens),
                                                 8, dataclasses.replace(sampling, seed=g))))
    pending.add(futures[-1])
  done = [t for f in futures for t in f.result()]
  wall = time.perf_counter() - start
  runner.close()
  after = pool.metrics()
  policy = sum(t.num_policy_tokens for t in done)
  steps = after["decode_steps"] - before["decode_steps"]
  bucket = lambda n: next(b for b in engine.prefill_buckets if b >= n)  # noqa: E731
  contexts = [n for t in done for n in later_turn_contexts(t)]
  in_slot = after["extended_in_slot"] - before["extended_in_slot"]
  # Which later turns were re-prefilled is not recorded; they are taken to be of the
  # average context length.
  in_slot_share = in_slot / max(len(contexts), 1)
  reprefill_s = (1 - in_slot_share) * sum(prefill_s[bucket(n)] for n in contexts)
  return {"episodes": len(done), "wall_s": wall, "ms_per_episode": 1e3 * wall / len(done),
          "in_slot_share": in_slot_share, "reprefill_share": reprefill_s / wall,
          "evictions": after["evictions"] - before["evictions"],
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
  prefill, extend, decode = engine_costs(engine, params, _REPS.value)
  print(f"matmul 1024^3 float32: {gflops:.1f} GFLOP/s")
  print(f"decode step, {SLOTS} slots: {1e3 * decode:.2f} ms; extend a slot by 3 tokens: "
        f"{1e3 * extend:.2f} ms ({extend / decode:.1f} decode steps)")
  print("| prefill length | ms | decode steps |\n|---|---|---|")
  for length, s in prefill.items():
    print(f"| {length} | {1e3 * s:.2f} | {s / decode:.1f} |")
  runs = {}
  with GeneratorPool(engine, params) as pool:
    for in_flight in (_GROUPS.value, _IN_FLIGHT.value):
      for name in WORKFLOWS:
        runs[f"{name}/{in_flight}"] = episodes(pool, engine, prefill, name, _GROUPS.value,
                                               in_flight, _TURN_STOPS.value)
  print("| workflow | groups in flight | ms / episode | policy tok/s | turns | policy tok | "
        "env tok | decode steps / policy tok | turns in slot | evictions | "
        "re-prefill share of wall |\n|---|---|---|---|---|---|---|---|---|---|---|")
  for key, r in runs.items():
    name, in_flight = key.split("/")
    print(f"| {name} | {in_flight} | {r['ms_per_episode']:.2f} | "
          f"{r['policy_tokens_per_s']:.0f} | {r['turns']:.1f} | {r['policy_tokens']:.1f} | "
          f"{r['env_tokens']:.1f} | {r['decode_steps_per_policy_token']:.3f} | "
          f"{r['in_slot_share']:.2f} | {r['evictions']} | {r['reprefill_share']:.2f} |")
  speedup = {str(k): round(runs[f"multi_turn/{k}"]["ms_per_episode"]
                           / runs[f"multi_turn_in_slot/{k}"]["ms_per_episode"], 3)
             for k in (_GROUPS.value, _IN_FLIGHT.value)}
  print(f"in slot over re-prefill, episodes/s, by groups in flight: {speedup}")
  print(json.dumps({
      "matmul_gflops": round(gflops, 1), "decode_step_ms": round(1e3 * decode, 3),
      "extend_ms": round(1e3 * extend, 3),
      "prefill_ms": {k: round(1e3 * v, 3) for k, v in prefill.items()},
      "runs": {k: {m: round(v, 3) for m, v in r.items()} for k, r in runs.items()},
      "in_slot_over_reprefill_episodes_per_s": speedup}))


if __name__ == "__main__":
  app.run(main)
