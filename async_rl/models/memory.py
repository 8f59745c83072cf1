"""Memory use of a run estimated from its shapes (`estimate_memory`, the numbers the
accelerator configs quote); `async_rl.compiled_memory` reads it per device from the
compiler.

`estimate_memory` counts what lives for a whole run, in bytes, for the model as a whole
(not per device):

  params        N params in `model.param_dtype`.
  optimizer     AdamW's two moments; optax keeps them in the params' dtype.
  gradients     one gradient tree in float32 (`train_step` accumulates micro-batches
                in float32 before the update).
  kv_cache      one engine's paged KV cache: 2 (k and v) * L * N * Z * K * E in
                `model.dtype`, N = `generation.kv_blocks` blocks of Z =
                `generation.kv_block_size` tokens (with kv_blocks 0, every one of the
                `generation.num_slots` slots at `generation.max_length`).

Its "trainer" = params + optimizer + gradients, sharded over the mesh by
`sharding.PARAM_RULES`; its "generator" = params + kv_cache, one full copy per engine
(the in-process placement runs two: rollout and evaluation).

With LoRA (`lora.rank` > 0) the params are the frozen base, and `adapters` (float32)
are what trains: optimizer and gradients are theirs, in float32, and `trainer` adds
them to the base. Each engine serves the base with the adapters merged in, and the
engine they share holds the base beside it once more (`generator_base`).

This is what lives between steps. During a step the compiled train step holds more:
besides the float32 accumulator counted here, one micro-batch's gradients and their
cast to the params' dtype, and the activations of a micro-batch (they scale with
`batching.max_tokens_per_mb`; under `model.remat` the layer inputs and what
`model.remat_saves` keeps).
"""

import jax.numpy as jnp

from async_rl.models import lora

GIB = 2**30


def estimate_memory(cfg) -> dict[str, int]:
  """Bytes of params, optimizer, gradients, kv_cache, and the trainer/generator sums of
  an experiment (`config.ExperimentConfig`: its `model` and `generation`)."""
  m, g = cfg.model, cfg.generation
  n = m.num_params()
  param_bytes = jnp.dtype(m.param_dtype).itemsize
  out = dict(
      params=n * param_bytes,
      optimizer=2 * n * param_bytes,
      gradients=n * 4,
      kv_cache=2 * m.n_layers * g.kv_cache_blocks * g.kv_block_size * m.n_kv_heads
      * m.head_dim * jnp.dtype(m.dtype).itemsize,
  )
  if cfg.lora.enabled:
    a = lora.num_params(m, cfg.lora)
    out.update(adapters=4 * a, optimizer=2 * 4 * a, gradients=4 * a)
  out["trainer"] = out["params"] + out.get("adapters", 0) + out["optimizer"] + out["gradients"]
  out["generator"] = out["params"] + out["kv_cache"]
  if cfg.lora.enabled:
    out["generator_base"] = out["params"]
  return out


def describe(cfg) -> str:
  """`estimate_memory(cfg)` as one line per entry, in GiB (what config docstrings quote)."""
  return "\n".join(f"{k}: {v / GIB:.2f} GiB" for k, v in estimate_memory(cfg).items())
