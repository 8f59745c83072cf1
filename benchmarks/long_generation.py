r"""Decode cost against the configured cache length: the dense KV cache and the paged one.

  python -m benchmarks.long_generation     # about a minute on a 2-core CPU

The same decode step (the `tiny` preset, float32, --slots slots each holding --live
tokens) runs on a dense cache of T = 128, 1024, 4096 and 16384 positions per slot
(`models.decode`: every step attends over all T, masked) and on a paged cache
(`generation.paged.decode`) whose tables have T / --block_size columns and whose pool
holds what the live tokens need plus one block per slot to grow into. The paged step
reads the bucket of table columns the live tokens need (`paged.bucket`), so neither
its time nor its memory should follow T.

Each variant is jitted with its cache donated, warmed up, then timed over --steps
steps, --repeats times; the fastest run counts (others' load on a shared machine only
adds time). Reported: ms per decode step (one token for each slot), KV bytes allocated,
and each path's time at the longest T over its time at the shortest. A float32 1024^3
matmul measured in the same run tells how loaded the machine was. Prints a table, then,
as the last line, one JSON object.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from async_rl import models
from async_rl.config import model_preset
from async_rl.generation import paged

_LENGTHS = flags.DEFINE_list("lengths", ["128", "1024", "4096", "16384"],
                             "Cache lengths T (positions per slot).")
_SLOTS = flags.DEFINE_integer("slots", 16, "Decode slots.")
_LIVE = flags.DEFINE_integer("live", 48, "Tokens each slot holds when the steps run.")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Tokens per block of the paged cache.")
_STEPS = flags.DEFINE_integer("steps", 20, "Decode steps per timed run.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per variant.")


def _matmul_gflops(size=1024, reps=10):
  """Best float32 GFLOP/s of a jitted [size, size] @ [size, size]."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  f = jax.jit(jnp.matmul)
  times = []
  for _ in range(reps + 1):  # The first call compiles.
    start = time.perf_counter()
    jax.block_until_ready(f(a, a))
    times.append(time.perf_counter() - start)
  return 2 * size ** 3 / min(times[1:]) / 1e9


def _nbytes(cache) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(cache))


def _time_steps(step, cache, steps, repeats):
  """Fastest of `repeats` runs of `steps` calls of `step(cache) -> (logits, cache)`, in
  seconds per call; the first call compiles and is not timed."""
  _, cache = step(cache)
  best = float("inf")
  for _ in range(repeats):
    jax.block_until_ready(cache)
    start = time.perf_counter()
    for _ in range(steps):
      logits, cache = step(cache)
    jax.block_until_ready(logits)
    best = min(best, (time.perf_counter() - start) / steps)
  return best


def _dense(params, cfg, T, tokens_S, positions_S):
  cache = models.init_cache(cfg, tokens_S.shape[0], T)
  step = jax.jit(lambda cache: models.decode(params, cfg, cache, tokens_S, positions_S),
                 donate_argnums=0)
  return _nbytes(cache), _time_steps(step, cache, _STEPS.value, _REPEATS.value)


def _paged(params, cfg, T, tokens_S, positions_S):
  S, C, live = tokens_S.shape[0], _BLOCK.value, _LIVE.value
  need = -(-(live + 1) // C)
  allocator = paged.BlockAllocator(S * (need + 1), C)
  M = T // C
  tables_SM = np.stack([allocator.table(allocator.allocate(need), M)
                        for _ in range(S)])
  cache = paged.init_cache(cfg, num_slots=S, num_blocks=allocator.num_blocks, block_size=C,
                           max_blocks=M).replace(tables_SM=jnp.asarray(tables_SM))
  blocks = paged.bucket(need, M)
  step = jax.jit(lambda cache: paged.decode(params, cfg, cache, tokens_S, positions_S,
                                            blocks=blocks), donate_argnums=0)
  return _nbytes(cache), _time_steps(step, cache, _STEPS.value, _REPEATS.value)


def main(argv):
  del argv
  cfg = model_preset("tiny")
  params = models.split_layers(models.init_params(cfg, jax.random.key(0)))
  S = _SLOTS.value
  tokens_S = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, S), jnp.int32)
  # Every step writes the token after the live ones and attends to all of them.
  positions_S = jnp.full(S, _LIVE.value, jnp.int32)
  headline = {"device": jax.devices()[0].platform, "slots": S, "live_tokens": _LIVE.value,
              "block_size": _BLOCK.value, "matmul_gflops": _matmul_gflops()}
  lengths = [int(t) for t in _LENGTHS.value]
  print(f"{'T':>6} {'path':6} {'ms/step':>8} {'KV MiB':>8}")
  for T in lengths:
    for name, run in (("dense", _dense), ("paged", _paged)):
      nbytes, seconds = run(params, cfg, T, tokens_S, positions_S)
      print(f"{T:>6} {name:6} {seconds * 1e3:>8.3f} {nbytes / 2 ** 20:>8.2f}")
      headline[f"{name}_{T}_ms_per_step"] = seconds * 1e3
      headline[f"{name}_{T}_kv_mib"] = nbytes / 2 ** 20
  for name in ("dense", "paged"):
    headline[f"{name}_{lengths[-1]}_over_{lengths[0]}"] = (
        headline[f"{name}_{lengths[-1]}_ms_per_step"] / headline[f"{name}_{lengths[0]}_ms_per_step"])
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in headline.items()}))


if __name__ == "__main__":
  app.run(main)
