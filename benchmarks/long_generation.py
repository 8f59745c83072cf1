r"""Generation cost against the configured length: the decode step, the pool, a long tail.

  python -m benchmarks.long_generation     # a few minutes on a 2-core CPU

The `tiny` preset, float32, blocks of --block_size tokens. Three measurements, side by
side in one run:

  * step: the same decode step (--slots slots each holding --live tokens) on a dense
    cache of T = 128, 1024, 4096 and 16384 positions per slot (`models.decode`: every
    step attends over all T, masked) and on a paged cache (`generation.paged.decode`)
    whose tables have T / --block_size columns and whose pool holds what the live
    tokens need plus one block per slot to grow into, read as the builder's
    `paged.Decoding` chooses for those tables. ms per step (one token for each slot),
    KV bytes allocated.
  * pool: the same short requests (--pool_samples samples in groups of 8, 16-token
    prompts, 32 new tokens each, no stop id) through the public `GeneratorPool` on an
    engine of as many slots at each `max_target_length` T, with one KV budget for all:
    the blocks of one sequence of the longest T. Seconds per generated token (the
    fastest of --repeats runs after one that compiles), KV bytes allocated.
  * long tail: --tail_samples requests whose `max_new_tokens` are lognormal with a
    median of a tenth of --tail_cap and the 99th percentile at it (capped there),
    16-token prompts, no stop id, more samples than slots (as a rollout keeps a pool
    fed), at one KV budget of --tail_sequences sequences of the cap. The paged engine
    shares it among --tail_slots slots; the dense cache's layout, a whole sequence
    reserved for every slot, holds --tail_sequences slots in it (the same engine with
    its default budget). Tokens per second (one timed run after `Engine.warmup`), the
    most slots that decoded at once, preemptions, KV bytes.

A float32 1024^3 matmul measured in the same run tells how loaded the machine was.
Prints tables, then, as the last line, one JSON object.
"""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from async_rl import cpu, models
from async_rl.config import model_preset
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams, blocks, paged
from async_rl.models.attention import kernels_for
from benchmarks.common.peak import matmul_peak
from benchmarks.common.timer import timed

_LENGTHS = flags.DEFINE_list("lengths", ["128", "1024", "4096", "16384"],
                             "Cache lengths T (positions per slot).")
_SLOTS = flags.DEFINE_integer("slots", 16, "Decode slots of the step benchmark.")
_LIVE = flags.DEFINE_integer("live", 48, "Tokens each slot holds when the steps run.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Tokens per block of the paged cache.")
_STEPS = flags.DEFINE_integer("steps", 20, "Decode steps per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per variant (the fastest counts).")
_POOL_SAMPLES = flags.DEFINE_integer("pool_samples", 64, "Samples of the pool benchmark.")
_TAIL_SAMPLES = flags.DEFINE_integer("tail_samples", 128, "Requests of the long tail.")
_TAIL_CAP = flags.DEFINE_integer("tail_cap", 4096, "Longest sequence of the long tail.")
_TAIL_SLOTS = flags.DEFINE_integer("tail_slots", 32, "Slots of the paged long-tail engine.")
_TAIL_SEQUENCES = flags.DEFINE_integer("tail_sequences", 4,
                                       "The long tail's KV budget, in sequences of the cap.")

_PROMPT, _NEW = 16, 32


def _nbytes(cache) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(cache))


def _time_steps(step, cache, steps, repeats):
  """Fastest of `repeats` runs of `steps` calls of `step(cache) -> (logits, cache)`, in
  seconds per call; the first call compiles and is not timed."""
  def run(cache):
    for _ in range(steps):
      logits, cache = step(cache)
    return logits, cache

  _, cache = step(cache)
  best = float("inf")
  for _ in range(repeats):
    jax.block_until_ready(cache)
    (_, cache), seconds = timed(functools.partial(run, cache))
    best = min(best, seconds / steps)
  return best


def _decoding():
  """How the builder's engine reads the paged cache on this device: the CPU's own
  `cpu.PagedDecoding`, else the core's for its kernels."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return cpu.PagedDecoding()
  return paged.for_kernels(kernels_for([device]))


def _dense_step(params, cfg, T, tokens_S, positions_S):
  cache = models.init_cache(cfg, tokens_S.shape[0], T)
  step = jax.jit(lambda cache: models.decode(params, cfg, cache, tokens_S, positions_S),
                 donate_argnums=0)
  return _nbytes(cache), _time_steps(step, cache, _STEPS.value, _REPEATS.value)


def _paged_step(params, cfg, T, tokens_S, positions_S):
  S, Z, live = tokens_S.shape[0], _BLOCK.value, _LIVE.value
  need = -(-(live + 1) // Z)
  allocator = blocks.BlockAllocator(S * (need + 1), Z)
  M = T // Z
  tables_SM = np.stack([allocator.table(allocator.allocate(need), M)
                        for _ in range(S)])
  cache = paged.init_cache(cfg, num_slots=S, num_blocks=allocator.num_blocks, block_size=Z,
                           max_blocks=M).replace(tables_SM=jnp.asarray(tables_SM))
  decoding = _decoding()
  reads = decoding.reads(tables_SM, allocator.num_blocks, Z)
  step = jax.jit(lambda cache: paged.decode(params, cfg, cache, tokens_S, positions_S,
                                            reads=reads, decoding=decoding), donate_argnums=0)
  return _nbytes(cache), _time_steps(step, cache, _STEPS.value, _REPEATS.value)


def _run_pool(engine, params, requests, repeats, compile_run=True):
  """(fastest seconds of `repeats` timed runs, after one that compiles unless
  `compile_run` is False; metrics and samples of the last run)."""
  best = float("inf")
  for run in range(not compile_run, repeats + 1):
    with GeneratorPool(engine, params) as pool:
      start = time.perf_counter()
      futures = [pool.submit(r) for r in requests]
      samples = [s for f in futures for s in f.result()]
      seconds = time.perf_counter() - start
      metrics = pool.metrics()
    if run:
      best = min(best, seconds)
  assert all(s.finish_reason == "length" for s in samples)
  return best, metrics, samples


def _pool_scaling(params, cfg, lengths, out):
  """The same short requests at each T, one KV budget for all of them."""
  S, Z = _POOL_SAMPLES.value, _BLOCK.value
  rng = np.random.default_rng(1)
  requests = [Request(i, rng.integers(0, cfg.vocab_size, _PROMPT).tolist(), n=8,
                      sampling=SamplingParams(max_new_tokens=_NEW, seed=i))
              for i in range(S // 8)]
  budget = -(-max(lengths) // Z)
  print(f"\npool: {S} samples of {_PROMPT} + {_NEW} tokens, {budget} blocks of {Z}")
  print(f"{'T':>6} {'us/token':>9} {'KV MiB':>8} {'dense KV MiB':>13}")
  reference = None
  for T in lengths:
    engine = Engine(cfg, max_concurrent_decodes=S, max_prefill_length=_PROMPT,
                    max_target_length=T, kv_blocks=budget, kv_block_size=Z,
                    decoding=_decoding())
    seconds, metrics, samples = _run_pool(engine, params, requests, _REPEATS.value)
    tokens = [s.completion_C.tolist() for s in samples]
    reference = reference or tokens
    assert tokens == reference, "the tokens must not depend on T"
    per_token = seconds / metrics["generated_tokens"]
    dense = 2 * cfg.n_layers * S * T * cfg.n_kv_heads * cfg.head_dim * 4
    print(f"{T:>6} {per_token * 1e6:>9.1f} {engine.kv_cache_bytes / 2**20:>8.2f} "
          f"{dense / 2**20:>13.2f}")
    out[f"pool_{T}_us_per_token"] = per_token * 1e6
    out[f"pool_{T}_kv_mib"] = engine.kv_cache_bytes / 2 ** 20
    out[f"pool_{T}_dense_kv_mib"] = dense / 2 ** 20
  out[f"pool_{lengths[-1]}_over_{lengths[0]}"] = (out[f"pool_{lengths[-1]}_us_per_token"]
                                                 / out[f"pool_{lengths[0]}_us_per_token"])


def _long_tail(params, cfg, out):
  """A long-tailed mix at a fixed KV budget: paged, and a whole sequence per slot."""
  cap, Z = _TAIL_CAP.value, _BLOCK.value
  rng = np.random.default_rng(2)
  most = cap - _PROMPT
  # Median a tenth of the longest; the 99th percentile (z = 2.326) at it.
  budgets = np.minimum(np.ceil(rng.lognormal(np.log(most / 10), np.log(10) / 2.326,
                                             _TAIL_SAMPLES.value)), most).astype(int)
  requests = [Request(i, rng.integers(0, cfg.vocab_size, _PROMPT).tolist(),
                      sampling=SamplingParams(max_new_tokens=int(b), seed=i))
              for i, b in enumerate(budgets)]
  M, slots, sequences = -(-cap // Z), _TAIL_SLOTS.value, _TAIL_SEQUENCES.value
  variants = {
      "paged": Engine(cfg, max_concurrent_decodes=slots, max_prefill_length=_PROMPT,
                      max_target_length=cap, kv_blocks=sequences * M, kv_block_size=Z,
                      decoding=_decoding()),
      "reserved": Engine(cfg, max_concurrent_decodes=sequences, max_prefill_length=_PROMPT,
                         max_target_length=cap, kv_block_size=Z, decoding=_decoding()),
  }
  assert variants["paged"].kv_cache_bytes == variants["reserved"].kv_cache_bytes
  print(f"\nlong tail: {len(budgets)} samples, new tokens median {np.median(budgets):.0f}, "
        f"p99 {np.percentile(budgets, 99):.0f}, max {budgets.max()} (cap {cap})")
  print(f"{'engine':10} {'slots':>5} {'tok/s':>8} {'peak slots':>10} {'preempted':>9} "
        f"{'KV MiB':>8}")
  out["tail_new_tokens"] = {"median": float(np.median(budgets)),
                            "p99": float(np.percentile(budgets, 99)), "max": int(budgets.max()),
                            "total": int(budgets.sum())}
  reference = None
  for name, engine in variants.items():
    # These runs are long: one, after compiling every program the pool may call.
    engine.warmup(params)
    seconds, metrics, samples = _run_pool(engine, params, requests, 1, compile_run=False)
    tokens = [s.completion_C.tolist() for s in samples]
    reference = reference or tokens
    assert tokens == reference, "every engine draws the same tokens"
    row = {"slots": engine.max_concurrent_decodes,
           "tokens_per_s": metrics["generated_tokens"] / seconds,
           "peak_active_slots": metrics["peak_active_slots"],
           "preemptions": metrics["preemptions"],
           "kv_mib": engine.kv_cache_bytes / 2 ** 20}
    print(f"{name:10} {row['slots']:>5} {row['tokens_per_s']:>8.0f} "
          f"{row['peak_active_slots']:>10} {row['preemptions']:>9} {row['kv_mib']:>8.1f}")
    out[f"tail_{name}"] = row
  out["tail_paged_over_reserved"] = (out["tail_paged"]["tokens_per_s"]
                                     / out["tail_reserved"]["tokens_per_s"])


def main(argv):
  del argv
  cfg = model_preset("tiny")
  params = models.init_params(cfg, jax.random.key(0))
  layers = models.split_layers(params)
  S = _SLOTS.value
  tokens_S = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, S), jnp.int32)
  # Every step writes the token after the live ones and attends to all of them.
  positions_S = jnp.full(S, _LIVE.value, jnp.int32)
  out = {"device": jax.devices()[0].platform, "slots": S, "live_tokens": _LIVE.value,
         "block_size": _BLOCK.value, "matmul_gflops": matmul_peak() / 1e9}
  lengths = [int(t) for t in _LENGTHS.value]
  print(f"step: {S} slots of {_LIVE.value} live tokens")
  print(f"{'T':>6} {'path':6} {'ms/step':>8} {'KV MiB':>8}")
  for T in lengths:
    for name, run in (("dense", _dense_step), ("paged", _paged_step)):
      nbytes, seconds = run(layers, cfg, T, tokens_S, positions_S)
      print(f"{T:>6} {name:6} {seconds * 1e3:>8.3f} {nbytes / 2 ** 20:>8.2f}")
      out[f"{name}_{T}_ms_per_step"] = seconds * 1e3
      out[f"{name}_{T}_kv_mib"] = nbytes / 2 ** 20
  for name in ("dense", "paged"):
    out[f"{name}_{lengths[-1]}_over_{lengths[0]}"] = (
        out[f"{name}_{lengths[-1]}_ms_per_step"] / out[f"{name}_{lengths[0]}_ms_per_step"])
  _pool_scaling(params, cfg, lengths, out)
  _long_tail(params, cfg, out)
  out["matmul_gflops_after"] = matmul_peak() / 1e9
  rounded = lambda v: round(v, 4) if isinstance(v, float) else v
  print(json.dumps({k: ({kk: rounded(vv) for kk, vv in v.items()} if isinstance(v, dict)
                        else rounded(v)) for k, v in out.items()}))


if __name__ == "__main__":
  app.run(main)
