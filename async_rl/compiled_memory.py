"""Memory per device of a run's generator engine and train step, read from the compiler.

`generator` and `trainer` give, per device and in GiB, what one engine and the train
step hold, transients included, for a config's real shapes on given devices. Nothing
is allocated: params and KV pools are counted from their abstract shapes and
shardings, and each program is lowered from abstract shapes and compiled, its
`memory_analysis()` read. XLA:CPU computes 16-bit data in float32, so a 16-bit program
compiled there holds float32 copies that a backend with native 16-bit types never
holds. So params and pools are counted at the config's dtypes, and each program is
compiled in the stand-in that overcounts it least: the engine's programs in float32,
which widens nothing but counts each 16-bit temporary at 4 bytes; the train step in
float16, which keeps its buffers 16-bit but widens the weights of the layer its dots
read. Each transient is thus an upper bound.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from async_rl import cpu, loss, models, sharding, train_step
from async_rl.batching import PackedBatch
from async_rl.generation import Engine, paged
from async_rl.models.memory import GIB


def with_dtype(model_cfg, dtype: str):
  """`model_cfg` computing and keeping its params in `dtype`."""
  return dataclasses.replace(model_cfg, dtype=dtype, param_dtype=dtype)


def _gib_per_device(tree, dtype) -> float:
  """GiB on one device of the sharded abstract arrays of `tree`, each element `dtype`."""
  elements = sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(tree))
  return elements * jnp.dtype(dtype).itemsize / GIB


def _engine_on(cfg, devices, model_cfg):
  """`cfg`'s generator engine on `devices` (tensor parallel over several), with
  `model_cfg`, and its params' abstract serving layout."""
  g, k = cfg.generation, len(devices)
  mesh = Mesh(np.array(devices).reshape(1, 1, k), sharding.AXES)
  stacked = models.abstract_params(model_cfg)
  engine = Engine(model_cfg, max_concurrent_decodes=g.num_slots,
                  max_prefill_length=g.max_length - 1, max_target_length=g.max_length,
                  steps_per_call=g.steps_per_call, kv_blocks=g.kv_blocks,
                  kv_block_size=g.kv_block_size, mesh=mesh,
                  param_sharding=sharding.param_shardings(stacked, mesh) if k > 1 else None,
                  decoding=cpu.PagedDecoding())
  return engine, engine.abstract_params(stacked)


def generator(cfg, devices) -> dict:
  """`cfg`'s generator engine on `devices` (tensor parallel over several), per device in
  GiB: `params` and `kv` (its pools) in the config's dtypes; from the float32 compile
  (module docstring), `prefill` (the temporaries and the prefix of one sequence of
  `generation.max_length`), `decode` (one chunk's temporaries, the whole KV budget in
  flight) and `decode_args_f32` (the decode chunk's arguments)."""
  engine, params = _engine_on(cfg, devices, with_dtype(cfg.model, "float32"))
  pools = engine.abstract_decode_state().cache
  g = cfg.generation
  blocks = paged.bucket(g.kv_cache_blocks, g.num_slots * g.sequence_blocks)
  prefill = engine.lower_prefill(params, g.max_length).compile().memory_analysis()
  decode = engine.lower_generate_chunk(params, paged.Reads("ragged", blocks)).compile(
  ).memory_analysis()
  return dict(params=_gib_per_device(params, cfg.model.param_dtype),
              kv=_gib_per_device((pools.k, pools.v), cfg.model.dtype),
              prefill=(prefill.temp_size_in_bytes + prefill.output_size_in_bytes) / GIB,
              decode=decode.temp_size_in_bytes / GIB,
              decode_args_f32=decode.argument_size_in_bytes / GIB)


def trainer(cfg, devices) -> dict:
  """`cfg`'s train state (`state`: params, AdamW moments and the micro-batch) and the
  train step's temporaries (`temp`) per device, in GiB, on `cfg.mesh` over `devices`,
  from the float16 compile (module docstring) of one micro-batch of one row per device
  of `row_len` tokens, `batching.max_tokens_per_mb` rounded up to a multiple of 8."""
  mesh = sharding.make_mesh(cfg.mesh, devices)
  row_len = -(-cfg.batching.max_tokens_per_mb // 8) * 8
  rows = mesh.shape["data"] * mesh.shape["fsdp"]
  f16 = dataclasses.replace(cfg, model=with_dtype(cfg.model, "float16"))
  mem = compile_train_step(f16, mesh, rows, row_len).memory_analysis()
  # The float16 compile counts a LoRA run's float32 adapters and moments at their size.
  return dict(state=mem.argument_size_in_bytes / GIB, temp=mem.temp_size_in_bytes / GIB,
              row_len=row_len)


def compile_train_step(cfg, mesh, rows, row_len):
  """The train step of `cfg` on `mesh`, compiled for one micro-batch of `rows` rows of
  `row_len` tokens."""
  tx = train_step.make_optimizer(cfg.optimizer)
  state = _abstract_state(cfg.model, tx, mesh, cfg.lora)
  step = train_step.jit_train_step(mesh, train_step.train_state_shardings(state, mesh),
                                   model_cfg=cfg.model, loss_fn=loss.from_config(cfg.ppo),
                                   temperature=cfg.generation.logp_temperature)
  return step.lower(state, *_abstract_batch(rows, row_len, cfg.ppo.prox_logp)).compile()


def _abstract_state(model_cfg, tx, mesh, lora_cfg):
  """The train state's shapes, as `train_step.create_train_state` builds it (nothing
  allocated): with `lora_cfg` on, the frozen base and the adapters' state."""
  return jax.eval_shape(lambda key: train_step.create_train_state(
      model_cfg, tx, mesh, key, lora_cfg=lora_cfg)[0], jax.random.key(0))


def _abstract_batch(rows, row_len, prox_mode):
  """One micro-batch and its proximal log-probs, as the trainer passes them in `prox_mode`."""
  shape = (1, rows, row_len)
  i32, f32 = (lambda: jax.ShapeDtypeStruct(shape, jnp.int32),
              lambda: jax.ShapeDtypeStruct(shape, jnp.float32))
  loglinear = prox_mode == "loglinear"  # estimated inside the step from the versions
  batch = PackedBatch(tokens=i32(), positions=i32(), segment_ids=i32(), loss_mask=f32(),
                      behav_logp=f32(), advantages=f32(), versions=i32() if loglinear else None)
  return batch, None if loglinear else f32()
