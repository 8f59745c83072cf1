"""Generation throughput: continuous batching vs static batches vs no KV cache, and
generation under periodic weight updates (retract vs keep vs drain).

  python -m benchmarks.generation --quick   # about 3 minutes on a 2-core CPU
  python -m benchmarks.generation           # larger workload, 5 runs per variant

Prints a table, then, as the last line, one JSON object with the headline figures.

Workload: prompts of 8-24 random tokens and a long-tailed output length per
request, max_new_tokens ~ lognormal (median `--median_new_tokens`, sigma 0.8),
capped by the cache length; sampling at temperature 1 with a fixed seed per
request. No stop tokens (random weights would stop at random), so each request
produces exactly its max_new_tokens and every variant generates the same tokens.
Throughput is generated tokens over wall time, compilation excluded (each engine
is warmed up first).

  (a) pool: `GeneratorPool`, all requests submitted at once; finished slots are
      refilled between decode steps.
  (b) static: the same engine, requests in fixed batches of S; a batch runs until
      its longest sample is done (tokens are read every step, as stop-token checks
      would need).
  (c) no-cache: static batches whose every step re-runs the full forward over the
      sequences so far (padded to a power of two), without a KV cache. It is slow,
      so it runs one batch of S requests, for at most `--nocache_steps` steps;
      later steps are the costliest, so the cap flatters (c).

Weight updates: the pool on the same workload while another thread publishes new
params `--updates` times, each time a further 1 / (updates + 1) of the workload's
tokens has been generated, in each mode. Every variant runs `--repeats` times, taking
turns, and reports its median run. The AReaL paper reports +12% (1.5B) and +17% (7B)
for interruptible (retract) over non-interruptible (drain) generation.
"""

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from async_rl import models
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams, SlotSampling
from async_rl.generation import sample

_QUICK = flags.DEFINE_bool("quick", False, "Reduced run (< ~3 minutes on a 2-core CPU).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of lengths, prompts and params.")
_MEDIAN = flags.DEFINE_integer("median_new_tokens", 24, "Median of max_new_tokens.")
_UPDATES = flags.DEFINE_integer("updates", 6, "Weight updates per run in part 2.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "Runs per variant (median reported); "
                                "0: 3 with --quick, else 5.")

# preset -> (slots S, cache length T, requests, no-cache step cap)
_QUICK_SETUPS = {"tiny": (16, 128, 192, 64), "small": (8, 128, 32, 32)}
_FULL_SETUPS = {"tiny": (16, 256, 256, 256), "small": (8, 256, 64, 48)}
_MODES = ("retract", "keep", "drain")


def _workload(rng, count, max_len, median):
  requests = []
  for i in range(count):
    prompt = rng.integers(0, 256, rng.integers(8, 25)).tolist()
    new = int(np.clip(rng.lognormal(np.log(median), 0.8), 1, max_len - len(prompt)))
    requests.append(Request(i, prompt, sampling=SamplingParams(max_new_tokens=new, seed=i)))
  return requests


def _run_pool(engine, params, requests, mode=None, new_params=None):
  """Returns (generated tokens, seconds, pool metrics)."""
  total = sum(r.sampling.max_new_tokens for r in requests)
  # Updates are published at fixed fractions of the tokens to generate, so every
  # mode takes the same number of them.
  thresholds = [total * (k + 1) / (_UPDATES.value + 1) for k in range(_UPDATES.value)]
  with GeneratorPool(engine, params) as pool:
    stop, updates = threading.Event(), []

    def publish():
      for version, threshold in enumerate(thresholds, start=1):
        while pool.metrics()["generated_tokens"] < threshold:
          if stop.wait(0.001):
            return
        updates.append(pool.update_weights((params, new_params)[version % 2], version, mode))

    publisher = threading.Thread(target=publish)
    start = time.perf_counter()
    futures = [pool.submit(r) for r in requests]
    if mode:
      publisher.start()
    samples = [s for f in futures for s in f.result()]
    seconds = time.perf_counter() - start
    stop.set()
    if mode:
      publisher.join()
    for u in updates:
      u.result()
    metrics = pool.metrics()
  return sum(len(s.completion_C) for s in samples), seconds, metrics


def _run_static(engine, params, requests):
  """Returns (useful tokens, seconds, slot occupancy)."""
  S = engine.max_concurrent_decodes
  params = engine.load_params(params)
  state = engine.init_decode_state()
  tokens = steps = 0
  start = time.perf_counter()
  for b in range(0, len(requests), S):
    batch = requests[b:b + S]
    for slot, r in enumerate(batch):
      padded, length = engine.pad_tokens(r.prompt)
      prefix, result = engine.prefill(params=params, padded_tokens=padded, true_length=length,
                                      sampling=SlotSampling.create(r.sampling, r.sampling.seed, 0))
      state = engine.insert(prefix, state, slot)
    jax.device_get(result)
    longest = max(r.sampling.max_new_tokens for r in batch)
    for _ in range(longest - 1):
      state, result = engine.generate(params, state)
      jax.device_get(result)
    tokens += sum(r.sampling.max_new_tokens for r in batch)
    steps += longest
  return tokens, time.perf_counter() - start, tokens / (steps * S)


def _nocache_step(params, tokens_SP, lengths_S, sampling_S, *, cfg):
  """Full forward over the padded sequences; appends one sampled token to each."""
  S, P = tokens_SP.shape
  logits_SPV = models.forward(params, cfg, tokens_SP, jnp.broadcast_to(jnp.arange(P), (S, P)),
                              jnp.ones_like(tokens_SP))
  logits_SV = logits_SPV[jnp.arange(S), lengths_S - 1]
  new_S, _ = sample(logits_SV, sampling_S, lengths_S)
  return new_S


def _run_nocache(cfg, params, requests, S, max_steps):
  """One static batch of S requests without a KV cache; returns (tokens, seconds)."""
  step = jax.jit(lambda p, t, n, s: _nocache_step(p, t, n, s, cfg=cfg))
  batch = requests[:S]
  sampling_S = jax.tree.map(lambda *x: np.stack(x), *[
      SlotSampling.create(r.sampling, r.sampling.seed, 0) for r in batch])
  max_new_S = np.array([r.sampling.max_new_tokens for r in batch])
  steps = min(int(max_new_S.max()), max_steps)
  prompt_len_S = np.array([len(r.prompt) for r in batch])
  max_len = int((prompt_len_S + steps).max())
  buckets = [b for b in (2 ** np.arange(4, 16)) if b < max_len] + [max_len]
  for b in buckets:  # compile every padded length before timing
    step(params, np.zeros((S, b), np.int32), np.ones(S, np.int32), sampling_S).block_until_ready()
  seqs = np.zeros((S, max_len), np.int32)
  for i, r in enumerate(batch):
    seqs[i, :len(r.prompt)] = r.prompt
  lengths_S = prompt_len_S.copy()
  start = time.perf_counter()
  for _ in range(steps):
    width = next(b for b in buckets if b >= lengths_S.max())
    new_S = np.asarray(step(params, seqs[:, :width], lengths_S.astype(np.int32), sampling_S))
    seqs[np.arange(S), np.minimum(lengths_S, max_len - 1)] = new_S
    lengths_S = np.minimum(lengths_S + 1, max_len)
  return int(np.minimum(max_new_S, steps).sum()), time.perf_counter() - start


def _pool_row(tokens, seconds, m):
  row = dict(tokens=tokens, seconds=seconds, occupancy=m["slot_occupancy"])
  if m["weight_updates"]:
    row.update(updates=m["weight_updates"],
               pause_ms=1e3 * m["swap_pause_s_total"] / m["weight_updates"],
               transfer_ms=1e3 * m["swap_transfer_s_total"] / m["weight_updates"])
  return row


def _bench_preset(name, setup, seed, repeats):
  S, T, count, nocache_steps = setup
  cfg = models.preset(name)
  key, new_key = jax.random.split(jax.random.key(seed))
  init = jax.jit(models.init_params, static_argnums=0)
  params = init(cfg, key)
  new_params = jax.tree.map(lambda x, y: x + 0.01 * y, params, init(cfg, new_key))
  engine = Engine(cfg, max_concurrent_decodes=S, max_prefill_length=32, max_target_length=T)
  engine.warmup(params)
  requests = _workload(np.random.default_rng(seed), count, T, _MEDIAN.value)
  variants = {
      "pool": lambda: _pool_row(*_run_pool(engine, params, requests)),
      "static": lambda: dict(zip(("tokens", "seconds", "occupancy"),
                                 _run_static(engine, params, requests))),
      "nocache": lambda: dict(zip(("tokens", "seconds"),
                                  _run_nocache(cfg, params, requests, S, nocache_steps)),
                              occupancy=float("nan")),
  }
  for mode in _MODES:
    variants[mode] = lambda mode=mode: _pool_row(
        *_run_pool(engine, params, requests, mode, new_params))
  # Variants take turns, so a slow spell of a shared machine hits them alike; each
  # reports its median run.
  runs = {v: [] for v in variants}
  for _ in range(repeats):
    for v, run in variants.items():
      runs[v].append(run())
  rows = {v: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2] for v, rs in runs.items()}
  for row in rows.values():
    row["tokens_per_s"] = row["tokens"] / row["seconds"]
  return rows


def main(argv):
  del argv
  setups = _QUICK_SETUPS if _QUICK.value else _FULL_SETUPS
  headline = {"quick": _QUICK.value, "device": jax.devices()[0].platform}
  print(f"{'preset':7} {'variant':9} {'tokens':>7} {'seconds':>8} {'tok/s':>9} "
        f"{'occupancy':>9} {'updates':>7} {'pause ms':>9} {'xfer ms':>8}")
  for name, setup in setups.items():
    rows = _bench_preset(name, setup, _SEED.value, _REPEATS.value or (3 if _QUICK.value else 5))
    for variant, r in rows.items():
      extra = (f"{r['updates']:>7} {r['pause_ms']:>9.1f} {r['transfer_ms']:>8.1f}"
               if "updates" in r else "")
      print(f"{name:7} {variant:9} {r['tokens']:>7} {r['seconds']:>8.2f} "
            f"{r['tokens_per_s']:>9.1f} {r['occupancy']:>9.2f} {extra}")
      headline[f"{name}_{variant}_tokens_per_s"] = r["tokens_per_s"]
    tps = {v: r["tokens_per_s"] for v, r in rows.items()}
    headline[f"{name}_pool_over_static"] = tps["pool"] / tps["static"]
    headline[f"{name}_pool_over_nocache"] = tps["pool"] / tps["nocache"]
    headline[f"{name}_retract_over_drain"] = tps["retract"] / tps["drain"]
    headline[f"{name}_keep_over_drain"] = tps["keep"] / tps["drain"]
    headline[f"{name}_retract_swap_pause_ms"] = rows["retract"]["pause_ms"]
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                    for k, v in headline.items()}))


if __name__ == "__main__":
  app.run(main)
