"""Generation throughput: continuous batching vs static batches vs no KV cache, the
pool against a fully jitted static sampler, decode steps per host round trip, and
generation under periodic weight updates (retract vs keep vs drain).

  python -m benchmarks.generation --quick   # about 4 minutes on a 2-core CPU
  python -m benchmarks.generation           # larger workload, 5 runs per variant

Prints a table, then, as the last line, one JSON object with the headline figures
and the best float32 1024^3 matmul GFLOP/s of the same run.

Workload: prompts of 8-24 random tokens and a long-tailed output length per
request, max_new_tokens ~ lognormal (median `--median_new_tokens`, sigma 0.8),
capped by the cache length; sampling at temperature 1 with a fixed seed per
request. No stop tokens (random weights would stop at random), so each request
produces exactly its max_new_tokens and every variant generates the same tokens.
Throughput is generated tokens over wall time, compilation excluded (each engine
is warmed up first).

  (a) pool: `GeneratorPool`, all requests submitted at once; finished slots are
      refilled between decode chunks of `generation.steps_per_call` steps (its
      default); pool_k<k>: the same with k steps per call.
  (b) static: the same engine, requests in fixed batches of S; a batch runs until
      its longest sample is done (one `generate` step per host visit, tokens read
      every step, as host-side stop-token checks would need).
  (c) no-cache: static batches whose every step re-runs the full forward over the
      sequences so far (padded to a power of two), without a KV cache. It is slow,
      so it runs one batch of S requests, for at most `--nocache_steps` steps;
      later steps are the costliest, so the cap flatters (c).

Workload batch (`benchmarks/grpo_step.py`'s; `--workload_repeats` runs): the Qwen2 shape `_W_CFG`,
weights ~ N(0, 0.02), 16 prompts of 16 random ids, 4 samples each, exactly 64 new
tokens at temperature 1. static_sampler is the reference, as Tunix's static sampler
does it: prefill the 64 rows, then one jitted `while_loop` over the new tokens, no
host visit between; static_shared prefills each prompt once and copies its cache to
its 4 rows, as the pool does; pool and pool_k<k> run the 64-slot pool on the same
requests, which draw the same random streams, so all generate the same tokens
(`token_agreement`). These decode from one thread, as the static samplers do; on the
CPU pool_w<W> is the pool with its slots in W groups decoded at once from W threads
(`cpu.SlotGroupEngine`, one group per core). Each reports its fastest run (others'
load on a shared machine only adds time). Steps: decode steps per host round trip (`generate_chunk` call).

Weight updates: the pool on the same workload while another thread publishes new
params `--updates` times, each time a further 1 / (updates + 1) of the workload's
tokens has been generated, in each mode. Every variant runs `--repeats` times, taking
turns, and reports its median run. The AReaL paper reports +12% (1.5B) and +17% (7B)
for interruptible (retract) over non-interruptible (drain) generation.
"""

import functools
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from async_rl import cpu, models
from async_rl.config import GenerationConfig, ModelConfig, model_preset
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams, SlotSampling, sample
from benchmarks.common.peak import matmul_peak
from benchmarks.common.timer import timed

_QUICK = flags.DEFINE_bool("quick", False, "Reduced run (< ~3 minutes on a 2-core CPU).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of lengths, prompts and params.")
_MEDIAN = flags.DEFINE_integer("median_new_tokens", 24, "Median of max_new_tokens.")
_UPDATES = flags.DEFINE_integer("updates", 6, "Weight updates per run in part 2.")
_REPEATS = flags.DEFINE_integer("repeats", 0, "Runs per variant (median reported); "
                                "0: 3 with --quick, else 5.")
_WORKLOAD_REPEATS = flags.DEFINE_integer("workload_repeats", 15, "Runs per variant on the "
                                         "workload batch (fastest reported).")
_STEPS = flags.DEFINE_list("steps_per_call", ["1", "4", "16"],
                           "Decode steps per call to sweep besides the default (pool_k<k> "
                           "variants, on the workload batch and the tiny preset).")

# preset -> (slots S, cache length T, requests, no-cache step cap)
_QUICK_SETUPS = {"tiny": (16, 128, 192, 64), "small": (8, 128, 32, 32)}
_FULL_SETUPS = {"tiny": (16, 256, 256, 256), "small": (8, 256, 64, 48)}
_MODES = ("retract", "keep", "drain")
_DEFAULT_STEPS = GenerationConfig().steps_per_call
# The workload batch: prompts x samples, prompt and completion lengths.
_W_PROMPTS, _W_SAMPLES, _W_PROMPT_LEN, _W_NEW = 16, 4, 16, 64
_W_CFG = ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                     head_dim=32, d_ff=512, qkv_bias=True, tie_embeddings=True,
                     rope_theta=1e6)


def _workload(rng, count, max_len, median):
  requests = []
  for i in range(count):
    prompt = rng.integers(0, 256, rng.integers(8, 25)).tolist()
    new = int(np.clip(rng.lognormal(np.log(median), 0.8), 1, max_len - len(prompt)))
    requests.append(Request(i, prompt, sampling=SamplingParams(max_new_tokens=new, seed=i)))
  return requests


def _run_pool(engine, params, requests, mode=None, new_params=None):
  """Returns (samples, seconds, pool metrics)."""
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
  return samples, seconds, metrics


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
      M = engine.max_blocks
      state = engine.insert(prefix, state, slot, range(slot * M, (slot + 1) * M))
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


def _pool_row(samples, seconds, m):
  row = dict(tokens=sum(len(s.completion_C) for s in samples), seconds=seconds,
             occupancy=m["slot_occupancy"],
             wasted=m["wasted_fraction"], steps_per_call=m["steps_per_call"])
  if m["weight_updates"]:
    row.update(updates=m["weight_updates"],
               pause_ms=1e3 * m["swap_pause_s_total"] / m["weight_updates"],
               transfer_ms=1e3 * m["swap_transfer_s_total"] / m["weight_updates"])
  return row


def _swept():  # The swept steps_per_call values but the default (variant "pool").
  return [k for k in map(int, _STEPS.value) if k != _DEFAULT_STEPS]


def _decoding():
  """How the builder's engine reads the paged cache on this device: the CPU's own
  `cpu.PagedDecoding`, else the core's (the engine's default)."""
  return cpu.PagedDecoding() if jax.devices()[0].platform == "cpu" else None


def _engines(cfg, params, S, max_prefill, T, sweep):
  """A warmed-up engine for the default steps_per_call, and one per swept value."""
  engines = {}
  for k in [_DEFAULT_STEPS, *(_swept() if sweep else [])]:
    engines[k] = Engine(cfg, max_concurrent_decodes=S, max_prefill_length=max_prefill,
                        max_target_length=T, steps_per_call=k, decoding=_decoding())
    engines[k].warmup(params)
  return engines


def _medians(variants, repeats, fastest=False):
  """Runs the variants in turns, so a slow spell of a shared machine hits them alike;
  returns each one's median (or fastest) run, with its tokens per second."""
  runs = {v: [] for v in variants}
  for _ in range(repeats):
    for v, run in variants.items():
      runs[v].append(run())
  pick = 0 if fastest else repeats // 2
  rows = {v: sorted(rs, key=lambda r: r["seconds"])[pick] for v, rs in runs.items()}
  for row in rows.values():
    row["tokens_per_s"] = row["tokens"] / row["seconds"]
  return rows


def _bench_preset(name, setup, seed, repeats, sweep):
  S, T, count, nocache_steps = setup
  cfg = model_preset(name)
  key, new_key = jax.random.split(jax.random.key(seed))
  init = jax.jit(models.init_params, static_argnums=0)
  params = init(cfg, key)
  new_params = jax.tree.map(lambda x, y: x + 0.01 * y, params, init(cfg, new_key))
  engines = _engines(cfg, params, S, 32, T, sweep)
  engine = engines[_DEFAULT_STEPS]
  requests = _workload(np.random.default_rng(seed), count, T, _MEDIAN.value)
  variants = {
      "pool": lambda: _pool_row(*_run_pool(engine, params, requests)),
      "static": lambda: dict(zip(("tokens", "seconds", "occupancy"),
                                 _run_static(engine, params, requests))),
      "nocache": lambda: dict(zip(("tokens", "seconds"),
                                  _run_nocache(cfg, params, requests, S, nocache_steps))),
  }
  if sweep:
    for k in _swept():
      variants[f"pool_k{k}"] = lambda k=k: _pool_row(*_run_pool(engines[k], params, requests))
  for mode in _MODES:
    variants[mode] = lambda mode=mode: _pool_row(
        *_run_pool(engine, params, requests, mode, new_params))
  return _medians(variants, repeats)


def _static_sampler(params, prompts_BP, sampling_N, *, cfg, new_tokens, share_prefill):
  """Prefill of the batch, then one `while_loop` over the new tokens, no host visit.

  The N rows are N / B samples of each of the B prompts. Every row is prefilled, as
  Tunix's static sampler does; with `share_prefill` each prompt is prefilled once
  and its cache copied to its rows, as the pool does. Returns the tokens [N,
  new_tokens]; token t sits at position P + t and is keyed as the pool keys it, so
  the same seeds and sample indices draw the same tokens.
  """
  (B, P), N = prompts_BP.shape, sampling_N.seed.shape[0]
  params = models.split_layers(params)  # The layout the pool's engine decodes with.
  if share_prefill:
    logits_BV, prompt_cache = models.prefill(params, cfg, prompts_BP, jnp.full(B, P))
    logits_NV = jnp.repeat(logits_BV, N // B, axis=0)
    prompt_cache = jax.tree.map(lambda c: jnp.repeat(c, N // B, axis=0), prompt_cache)
  else:
    logits_NV, prompt_cache = models.prefill(params, cfg, jnp.repeat(prompts_BP, N // B, axis=0),
                                             jnp.full(N, P))
  lengths_N = jnp.full(N, P, jnp.int32)
  first_N, _ = sample(logits_NV, sampling_N, lengths_N)
  # The prompts' K/V go to positions 0..P-1 of each layer's [N, K, T, E] cache.
  cache = jax.tree.map(lambda c, p: c.at[:, :, :P].set(p),
                       models.init_cache(cfg, N, P + new_tokens), prompt_cache)
  tokens_NT = jnp.zeros((N, new_tokens), jnp.int32).at[:, 0].set(first_N)

  def body(carry):
    t, cache, tokens_NT = carry
    logits_NV, cache = models.decode(params, cfg, cache, tokens_NT[:, t - 1], lengths_N + t - 1)
    next_N, _ = sample(logits_NV, sampling_N, lengths_N + t)
    return t + 1, cache, tokens_NT.at[:, t].set(next_N)

  _, _, tokens_NT = jax.lax.while_loop(lambda c: c[0] < new_tokens, body, (1, cache, tokens_NT))
  return tokens_NT


def _workload_params(seed):
  """Weight matrices ~ N(0, 0.02); biases 0 and norm scales 1, as `init_params` has them."""
  params = models.init_params(_W_CFG, jax.random.key(seed))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  new = [x if "bias" in jax.tree_util.keystr(path) or "norm" in jax.tree_util.keystr(path)
         else 0.02 * jax.random.normal(k, x.shape, x.dtype)
         for (path, x), k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, new)


def _bench_workload(seed, repeats):
  """The pool and the static samplers on the GRPO workload's generation batch, side by side."""
  params = _workload_params(seed)
  prompts_BP = np.random.default_rng(seed).integers(3, 256, (_W_PROMPTS, _W_PROMPT_LEN),
                                                    dtype=np.int32)
  requests = [Request(i, p.tolist(), n=_W_SAMPLES,
                      sampling=SamplingParams(max_new_tokens=_W_NEW, seed=i))
              for i, p in enumerate(prompts_BP)]
  N = _W_PROMPTS * _W_SAMPLES
  engines = _engines(_W_CFG, params, N, _W_PROMPT_LEN, _W_PROMPT_LEN + _W_NEW, sweep=True)
  sampling_N = jax.tree.map(lambda *x: np.stack(x), *[
      SlotSampling.create(r.sampling, r.sampling.seed, j)
      for r in requests for j in range(_W_SAMPLES)])
  static_params = jax.device_put(params)
  statics = {share: jax.jit(functools.partial(_static_sampler, cfg=_W_CFG, new_tokens=_W_NEW,
                                              share_prefill=share))
             for share in (False, True)}
  references = {share: jax.device_get(f(static_params, prompts_BP, sampling_N))
                for share, f in statics.items()}
  pool_tokens = {}

  def run_static(share):
    _, seconds = timed(lambda: jax.device_get(statics[share](static_params, prompts_BP,
                                                             sampling_N)))
    return dict(tokens=N * _W_NEW, seconds=seconds)

  def run_pool(k):
    samples, seconds, m = _run_pool(engines[k], params, requests)
    pool_tokens[k] = np.stack([s.completion_C for s in samples])
    return dict(_pool_row(samples, seconds, m),
                round_trip_tokens=m["generated_tokens"] / max(m["decode_calls"], 1))

  variants = {"static_sampler": lambda: run_static(False),
              "static_shared": lambda: run_static(True),
              "pool": lambda: run_pool(_DEFAULT_STEPS)}
  for k in _swept():
    variants[f"pool_k{k}"] = lambda k=k: run_pool(k)
  groups = cpu.engine.num_groups(N, cpu.cores()) if jax.default_backend() == "cpu" else 1
  if groups > 1:  # Its slots in groups, one per core.
    engines["groups"] = cpu.SlotGroupEngine(
        Engine(_W_CFG, max_concurrent_decodes=N // groups, max_prefill_length=_W_PROMPT_LEN,
               max_target_length=_W_PROMPT_LEN + _W_NEW, decoding=cpu.PagedDecoding()), groups)
    engines["groups"].warmup(params)
    variants[f"pool_w{groups}"] = lambda: run_pool("groups")
  rows = _medians(variants, repeats, fastest=True)
  for share, name in ((False, "static_sampler"), (True, "static_shared")):
    rows[name]["token_agreement"] = float(np.mean(pool_tokens[_DEFAULT_STEPS]
                                                  == references[share]))
  return rows


def _print_rows(name, rows):
  for variant, r in rows.items():
    r = {"occupancy": np.nan, "wasted": np.nan, "steps_per_call": np.nan, **r}
    extra = (f"{r['updates']:>7} {r['pause_ms']:>9.1f} {r['transfer_ms']:>8.1f}"
             if "updates" in r else "")
    print(f"{name:8} {variant:14} {r['tokens']:>7} {r['seconds']:>8.3f} {r['tokens_per_s']:>9.1f} "
          f"{r['occupancy']:>9.2f} {r['wasted']:>6.2f} {r['steps_per_call']:>6.1f} {extra}")


def main(argv):
  del argv
  setups = _QUICK_SETUPS if _QUICK.value else _FULL_SETUPS
  headline = {"quick": _QUICK.value, "device": jax.devices()[0].platform,
              "steps_per_call": _DEFAULT_STEPS, "matmul_gflops": matmul_peak() / 1e9}
  print(f"{'preset':8} {'variant':14} {'tokens':>7} {'seconds':>8} {'tok/s':>9} "
        f"{'occupancy':>9} {'waste':>6} {'steps':>6} {'updates':>7} {'pause ms':>9} "
        f"{'xfer ms':>8}")
  rows = _bench_workload(_SEED.value, _WORKLOAD_REPEATS.value)
  _print_rows("workload", rows)
  headline.update({f"workload_{v}_tokens_per_s": r["tokens_per_s"] for v, r in rows.items()})
  for static in ("static_sampler", "static_shared"):
    headline[f"workload_pool_over_{static}"] = (rows["pool"]["tokens_per_s"]
                                                / rows[static]["tokens_per_s"])
  headline.update(workload_steps_per_round_trip=rows["pool"]["steps_per_call"],
                  workload_tokens_per_round_trip=rows["pool"]["round_trip_tokens"],
                  workload_token_agreement=min(rows["static_sampler"]["token_agreement"],
                                               rows["static_shared"]["token_agreement"]))
  for name, setup in setups.items():
    # The steps_per_call sweep runs on the tiny preset only: small's runs are slow.
    rows = _bench_preset(name, setup, _SEED.value, _REPEATS.value or (3 if _QUICK.value else 5),
                         sweep=name == "tiny")
    _print_rows(name, rows)
    tps = {v: r["tokens_per_s"] for v, r in rows.items()}
    for v in ("pool", "static", "nocache", *(f"pool_k{k}" for k in _swept() if name == "tiny")):
      headline[f"{name}_{v}_tokens_per_s"] = tps[v]
    headline[f"{name}_pool_over_static"] = tps["pool"] / tps["static"]
    headline[f"{name}_pool_over_nocache"] = tps["pool"] / tps["nocache"]
    headline[f"{name}_wasted_fraction"] = rows["pool"]["wasted"]
    headline[f"{name}_steps_per_round_trip"] = rows["pool"]["steps_per_call"]
    headline[f"{name}_retract_over_drain"] = tps["retract"] / tps["drain"]
    headline[f"{name}_keep_over_drain"] = tps["keep"] / tps["drain"]
    headline[f"{name}_retract_swap_pause_ms"] = rows["retract"]["pause_ms"]
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                    for k, v in headline.items()}))


if __name__ == "__main__":
  app.run(main)
