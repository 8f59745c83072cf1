r"""One prepared check of async_rl on a GPU: the kernels' numerics, decode and training
against the hardware's limits, memory against the plan, a real run, sync vs async.

  python -m benchmarks.gpu_check --out=/tmp/gpu_check          # on a GPU: under 8 minutes
  python -m benchmarks.gpu_check --fast --out=/tmp/gpu_check   # micro shapes, any backend
  benchmarks/gpu_check_device.sh                               # on a lent machine (docs/gpu.md)

Every section but the real run uses the first device. On a CPU backend the fast mode
is chosen whatever the flags say: micro shapes (`configs/micro.py`, the tiny preset's
heads, short rows and contexts) and the Pallas kernels in interpret mode, so that the
same code runs in CI. Each section is timed and guarded: one that raises is recorded
with its error and the next one runs; one that would start after its share of
`--budget_s` is skipped and says so. Sections, in order:

  env        jax, jaxlib and plugin versions, the devices and their memory.
  kernels    the Pallas paged decode kernel (`paged.pallas_attention`) and the flash
             kernel (`attention.flash_gpu`, forward and gradient) against float32
             references (matmuls at full precision) at the 1.5B and 7B head shapes
             (`config.MODEL_PRESETS`): max |delta| with float32 and bfloat16 inputs,
             and whether it is within one bfloat16 step (2^-7) of the reference's
             largest magnitude.
  training   tokens/s of the 1.5B train step (random weights, the config's dtypes and
             remat) on micro-batches of `batching.max_tokens_per_mb` (16k) tokens, and
             MFU: model FLOPs (`models.flops.train_flops`) per second over a bfloat16
             matmul peak measured in the same run (`benchmarks.common.peak`).
  decode     tokens/s of the 1.5B shape (random bfloat16 weights) through
             `generation.Engine.generate_chunk` at 64 and 256 slots whose contexts hold
             8k tokens each (written straight into the block tables: nothing is
             prefilled), and the fraction of the HBM roofline: bytes of the weights
             plus the live KV read per step, over the step time, against a copy
             bandwidth measured in the same run.
  sync_async the real run's shortened config run in process twice at a frozen policy
             (learning rate 0), generation and training sharing the device:
             synchronous (max_staleness 0, drain) and asynchronous (max_staleness 2,
             retract); trained tokens/s of each (`benchmarks.common.run_stats`) and
             their ratio.
  real_run   a few RL steps of the 1.5B config (`CONFIG_1_5B`, shortened completions,
             learning) through `launch.train` in a subprocess: step time, trained and
             generated tokens/s. With several local devices the run splits them: the
             trainer on the first half (FSDP), one generator replica on each of the
             others.
  memory     the device's peak bytes in use after training and after each decode
             width, against `benchmarks.memory`'s prediction for the same shapes
             (compiled for the host's CPU as that benchmark does, an upper bound, on a
             thread that starts with the check). The peak counts from the start of the
             process, so a phase whose peak is not above the peak at its start is
             reported as masked.

Prints as it goes; the last line is one JSON object: `fast`, `backend`, `device_kind`,
`wall_s`, `sections` (per section: `status` "ok", "error" or "skipped", `seconds`,
`error`, and its figures) and `goals` (each measured figure beside its target).
Writes that object to OUT/gpu_check.json; the runs' workdirs and the compilation cache
they share live in a temporary folder, removed at the end.
"""

import os

# Device memory grows as it is used instead of three quarters of it being taken at
# start: the real run's process (which inherits this) needs its share while this one
# holds what it used.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ast  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from async_rl import loss, models, sharding, train_step  # noqa: E402
from async_rl.batching import PackedBatch  # noqa: E402
from async_rl.cli import from_dict  # noqa: E402
from async_rl.config import MODEL_PRESETS, MeshConfig, model_preset  # noqa: E402
from async_rl.generation import Engine, SamplingParams, SlotSampling, paged  # noqa: E402
from async_rl.models import attention, flops  # noqa: E402
from async_rl.models.memory import GIB  # noqa: E402
from async_rl.rl import entry  # noqa: E402
from async_rl.rl.audit import step_lines  # noqa: E402
from benchmarks.common import run_stats  # noqa: E402
from benchmarks.common.peak import copy_bandwidth, matmul_peak  # noqa: E402

# The 1.5B experiment, as `launch.train --config=` takes it ("path" or "path:variant").
CONFIG_1_5B = "configs/qwen2_5.py:1.5b"
MICRO_CONFIG = "configs/micro.py"

_OUT = flags.DEFINE_string("out", None, "Folder for gpu_check.json (default: a new "
                           "temporary one).")
_FAST = flags.DEFINE_bool("fast", False, "Micro shapes and interpreted kernels (always on "
                          "a CPU backend).")
_BUDGET = flags.DEFINE_integer("budget_s", 450, "Seconds for the whole check: a section that "
                               "would start past its share is skipped.")
_SECTIONS = flags.DEFINE_list("sections", None, "Run only these sections (default: all).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment the run's subprocess inherits, before anything below changes ours.
_ENV = dict(os.environ)
# One bfloat16 step at 1: a kernel within this times the reference's largest magnitude
# is within bfloat16 rounding of it.
BF16_EPS = 2.0 ** -7
GOALS = {"decode_roofline_fraction": 0.6, "train_mfu": 0.4, "memory_ratio": 1.1,
         "async_over_sync": 1.3}


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What each section runs, full size on a GPU or micro in the fast mode."""
  fast: bool
  kernel_slots: int
  kernel_context: int
  kernel_rows: int
  decode_slots: tuple
  decode_context: int
  decode_chunks: int
  train_steps: int
  run_steps: int
  sync_steps: int
  run_overrides: tuple
  # The share of the budget (seconds) each section needs to start.
  needs: dict


FULL = Shapes(
    fast=False, kernel_slots=64, kernel_context=8192, kernel_rows=4096,
    decode_slots=(64, 256), decode_context=8192, decode_chunks=8, train_steps=3, run_steps=3,
    sync_steps=4,
    run_overrides=("batch_groups=4", "generation.group_size=4", "generation.max_new_tokens=256",
                   "generation.num_slots=16", "generation.kv_blocks=0",
                   "staleness.max_concurrent=8", "eval.num_prompts=8", "eval.pass_k=1"),
    needs={"env": 5, "kernels": 60, "training": 60, "decode": 90, "memory": 5,
           "real_run": 90, "sync_async": 120})
FAST = Shapes(
    fast=True, kernel_slots=3, kernel_context=40, kernel_rows=64,
    decode_slots=(4,), decode_context=48, decode_chunks=2, train_steps=2, run_steps=2,
    sync_steps=2,
    run_overrides=("eval.num_prompts=1", "eval.pass_k=1", "checkpoint.every_steps=2"),
    needs={name: 0 for name in ("env", "kernels", "training", "decode", "memory", "real_run",
                                "sync_async")})
# The head shapes the kernels are checked at (`config.MODEL_PRESETS`).
HEAD_PRESETS = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}
FAST_HEAD_PRESETS = {"tiny": "tiny"}


def load_config(spec: str):
  """The ConfigDict of `spec`, "path.py" or "path.py:variant", relative to the repository."""
  path, _, variant = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("gpu_check_config",
                                                       os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def experiment(shapes: Shapes, overrides=()):
  """The 1.5B experiment (the micro one in the fast mode), with `overrides`
  ("a.b=value", a Python literal or else a string, as `--config.a.b=value` reads)."""
  c = load_config(MICRO_CONFIG if shapes.fast else CONFIG_1_5B)
  for item in overrides:
    key, _, value = item.partition("=")
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    with contextlib.suppress(ValueError, SyntaxError):
      value = ast.literal_eval(value)
    node[leaf] = value
  return from_dict(c)


def peak_bytes():
  """The first device's peak bytes in use since the process started; None where the
  backend keeps no count."""
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def say(text: str) -> None:
  print(text, flush=True)


# --- env ------------------------------------------------------------------------------

_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "chex", "numpy")


def env_section(shapes: Shapes, ctx: dict) -> dict:
  del shapes, ctx
  versions = {}
  for name in _PACKAGES:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      versions[name] = importlib.metadata.version(name)
  devices = jax.devices()
  stats = devices[0].memory_stats() or {}
  out = dict(python=sys.version.split()[0], versions=versions, backend=jax.default_backend(),
             devices=len(devices), device_kind=devices[0].device_kind,
             platform=devices[0].platform, bytes_limit=stats.get("bytes_limit"),
             bytes_in_use=stats.get("bytes_in_use"))
  say(f"  jax {jax.__version__} on {len(devices)} x {devices[0].device_kind}; "
      f"{json.dumps(versions)}")
  return out


# --- kernels --------------------------------------------------------------------------

def paged_reference(q_SHE, k_KNZE, v_KNZE, tables_SM, lengths_S):
  """Decode attention of each slot to its first `lengths_S[s]` positions, in float32:
  the slot's blocks gathered into one dense row, masked, softmax."""
  S, H, E = q_SHE.shape
  K = k_KNZE.shape[0]
  rows = lambda x_KNZE: jnp.moveaxis(x_KNZE[:, tables_SM], 0, 1).reshape(S, K, -1, E)
  k_SKTE, v_SKTE = rows(k_KNZE), rows(v_KNZE)
  q_SKQE = q_SHE.reshape(S, K, H // K, E)
  scores = jnp.einsum("skqe,skte->skqt", q_SKQE, k_SKTE) * E ** -0.5
  seen_ST = jnp.arange(k_SKTE.shape[2])[None, :] < lengths_S[:, None]
  scores = jnp.where(seen_ST[:, None, None], scores, -jnp.inf)
  out = jnp.einsum("skqt,skte->skqe", jax.nn.softmax(scores, axis=-1), v_SKTE)
  return out.reshape(S, H, E)


def flash_reference(q_BTHE, k_BTKE, v_BTKE, segment_ids_BT):
  """Causal attention within segments, dense, in float32."""
  B, T, H, E = q_BTHE.shape
  Q = H // k_BTKE.shape[2]
  k_BTHE, v_BTHE = (jnp.repeat(x, Q, axis=2) for x in (k_BTKE, v_BTKE))
  scores = jnp.einsum("bqhe,bkhe->bhqk", q_BTHE, k_BTHE) * E ** -0.5
  same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  mask = same & (segment_ids_BT[:, :, None] > 0) & jnp.tril(jnp.ones((T, T), bool))
  scores = jnp.where(mask[:, None], scores, -1e30)
  return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, axis=-1), v_BTHE)


def _delta(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))


def _paged_case(preset: str, dtype, shapes: Shapes, interpret: bool) -> dict:
  m = model_preset(preset)
  S, Z = shapes.kernel_slots, 16
  M = -(-shapes.kernel_context // Z)
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (S, m.n_heads, m.head_dim), jnp.float32)
  k, v = (jax.random.normal(key, (m.n_kv_heads, S * M, Z, m.head_dim), jnp.float32)
          for key in keys[1:])
  tables = jnp.asarray(rng.permutation(S * M).reshape(S, M).astype(np.int32))
  lengths = jnp.asarray(rng.integers(1, shapes.kernel_context + 1, S).astype(np.int32))
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  got = jax.jit(lambda *a: paged.pallas_attention(*a, blocks=M, interpret=interpret))(
      q, k, v, tables, lengths)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(paged_reference)(*(x.astype(jnp.float32) for x in (q, k, v)), tables, lengths)
  delta, scale = _delta(got, want)
  return dict(max_abs_delta=delta, ref_max_abs=scale, ok=delta <= BF16_EPS * scale)


def _flash_case(preset: str, dtype, shapes: Shapes, interpret: bool) -> dict:
  m = model_preset(preset)
  T = shapes.kernel_rows
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (1, T, m.n_heads, m.head_dim), jnp.float32).astype(dtype)
  k, v = (jax.random.normal(key, (1, T, m.n_kv_heads, m.head_dim), jnp.float32).astype(dtype)
          for key in keys[1:3])
  # Three sequences and some padding: the kernel must not attend across them.
  cuts = [0, T // 4, T // 2 + 3, T - T // 8, T]
  seg = np.zeros((1, T), np.int32)
  for i in range(3):
    seg[0, cuts[i]:cuts[i + 1]] = i + 1
  seg = jnp.asarray(seg)
  # Padding rows are left to the implementation: nothing flows back from them, and only
  # rows of a sequence are compared.
  real = np.asarray(seg[0] > 0)
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32) * real[None, :, None, None]

  def value_and_grads(fn, q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return out, vjp(cotangent.astype(out.dtype))

  kernel = lambda q, k, v, s: attention.flash_gpu(q, k, v, s, interpret=interpret)
  got, got_grads = jax.jit(lambda *a: value_and_grads(kernel, *a))(q, k, v)
  with jax.default_matmul_precision("highest"):
    want, want_grads = jax.jit(lambda *a: value_and_grads(flash_reference, *a))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
  delta, scale = _delta(np.asarray(got, np.float32)[:, real], np.asarray(want)[:, real])
  grads = {}
  for name, g, w in zip("qkv", got_grads, want_grads):
    d, s = _delta(np.asarray(g, np.float32)[:, real], np.asarray(w)[:, real])
    grads[f"d{name}"] = dict(max_abs_delta=d, ref_max_abs=s, ok=d <= BF16_EPS * s)
  return dict(forward=dict(max_abs_delta=delta, ref_max_abs=scale, ok=delta <= BF16_EPS * scale),
              **grads)


def kernels_section(shapes: Shapes, ctx: dict) -> dict:
  del ctx
  interpret = jax.default_backend() != "gpu"
  out = {"interpret": interpret}
  for name, preset in (FAST_HEAD_PRESETS if shapes.fast else HEAD_PRESETS).items():
    m = MODEL_PRESETS[preset]
    for dtype in (jnp.float32, jnp.bfloat16):
      key = f"{name}_{jnp.dtype(dtype).name}"
      out[f"paged_{key}"] = _paged_case(preset, dtype, shapes, interpret)
      out[f"flash_{key}"] = _flash_case(preset, dtype, shapes, interpret)
      say(f"  {key} (H={m['n_heads']}, K={m['n_kv_heads']}, E={m['head_dim']}): paged "
          f"{out[f'paged_{key}']['max_abs_delta']:.2e}, flash forward "
          f"{out[f'flash_{key}']['forward']['max_abs_delta']:.2e}, dq "
          f"{out[f'flash_{key}']['dq']['max_abs_delta']:.2e}")
  checks = [c["ok"] for k, c in out.items() if k.startswith("paged_")] + [
      g["ok"] for k, c in out.items() if k.startswith("flash_") for g in c.values()]
  out["all_within_bf16_rounding"] = all(checks)
  return out


# --- training -------------------------------------------------------------------------

def train_batch(model_cfg, tokens: int, prox_mode: str, seed: int = 0):
  """One micro-batch ([1, 1, tokens]) of two sequences filling the row, and its proximal
  log-probs (None where the step estimates them)."""
  rng = np.random.default_rng(seed)
  half = tokens // 2
  positions = np.concatenate([np.arange(half), np.arange(tokens - half)])[None, None]
  segments = np.concatenate([np.full(half, 1), np.full(tokens - half, 2)])[None, None]
  shape = (1, 1, tokens)
  mask = np.ones(shape, np.float32)
  batch = PackedBatch(
      tokens=rng.integers(1, model_cfg.vocab_size, shape).astype(np.int32),
      positions=positions.astype(np.int32), segment_ids=segments.astype(np.int32),
      loss_mask=mask, behav_logp=np.full(shape, -1.0, np.float32),
      advantages=rng.normal(size=shape).astype(np.float32),
      versions=np.zeros(shape, np.int32) if prox_mode == "loglinear" else None)
  return batch, None if prox_mode == "loglinear" else np.full(shape, -1.0, np.float32)


def training_section(shapes: Shapes, ctx: dict) -> dict:
  del ctx
  peak_before = peak_bytes()
  cfg = experiment(shapes)
  tokens = cfg.batching.max_tokens_per_mb
  if jax.default_backend() == "gpu":
    peak, peak_dtype = matmul_peak(8192, reps=10, dtype=jnp.bfloat16), "bfloat16"
  else:
    peak, peak_dtype = matmul_peak(), "float32"
  say(f"  {peak_dtype} matmul peak {peak / 1e12:.1f} TFLOP/s")
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  tx = train_step.make_optimizer(cfg.optimizer)
  state, shardings = train_step.create_train_state(cfg.model, tx, mesh, jax.random.key(0))
  step = train_step.jit_train_step(mesh, shardings, model_cfg=cfg.model,
                                   loss_fn=loss.from_config(cfg.ppo),
                                   temperature=cfg.generation.logp_temperature)
  batch, prox = train_batch(cfg.model, tokens, cfg.ppo.prox_logp)
  start = time.perf_counter()
  state, metrics = step(state, batch, prox)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(shapes.train_steps):
    start = time.perf_counter()
    state, metrics = step(state, batch, prox)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  model_flops = flops.train_flops(cfg.model, batch.positions[batch.segment_ids > 0])
  out = dict(tokens_per_micro_batch=tokens, compile_s=compile_s, step_s=step_s,
             tokens_per_s=tokens / step_s, model_tflops_per_step=model_flops / 1e12,
             matmul_peak_tflops=peak / 1e12, peak_dtype=peak_dtype,
             mfu=model_flops / step_s / peak, peak_bytes=peak_bytes(), peak_before=peak_before)
  say(f"  {tokens} tokens/step in {step_s:.3f} s: {out['tokens_per_s']:.0f} tokens/s, "
      f"MFU {out['mfu']:.3f}")
  del state
  return out


# --- decode ---------------------------------------------------------------------------

def decode_engine(model_cfg, slots: int, context: int, steps: int):
  """An engine of `slots` slots whose tables hold `context` tokens and `steps` more each,
  with a pool of exactly those blocks."""
  Z = 16
  T = context + steps + 1
  M = -(-T // Z)
  return Engine(model_cfg, max_concurrent_decodes=slots, max_prefill_length=min(16, T - 1),
                max_target_length=T, steps_per_call=8, kv_blocks=slots * M, kv_block_size=Z)


def decode_width(model_cfg, params, slots: int, shapes: Shapes) -> dict:
  """Decode chunks of `slots` slots each `decode_context` tokens in, timed after the first
  (which compiles); every chunk's tokens are read back, as the pool reads them."""
  peak_before = peak_bytes()
  context, chunks = shapes.decode_context, shapes.decode_chunks
  engine = decode_engine(model_cfg, slots, context, (chunks + 1) * 8)
  served = engine.load_params(params)
  state = engine.init_decode_state()
  tables = np.arange(slots * engine.max_blocks, dtype=np.int32).reshape(slots, -1)
  sampling = SlotSampling.create(SamplingParams(temperature=1.0,
                                                max_new_tokens=engine.max_target_length),
                                 seed=0, index=0)
  state = state.replace(
      tokens_S=jnp.ones(slots, jnp.int32), positions_S=jnp.full(slots, context, jnp.int32),
      end_S=jnp.full(slots, engine.max_target_length, jnp.int32),
      sampling_S=jax.tree.map(lambda x: jnp.asarray(np.stack([x] * slots)), sampling))
  start = time.perf_counter()
  state, result = engine.generate_chunk(served, state, tables)
  np.asarray(result.count_S)
  compile_s = time.perf_counter() - start
  made, start = 0, time.perf_counter()
  for _ in range(chunks):
    state, result = engine.generate_chunk(served, state, tables)
    made += int(np.asarray(result.count_S).sum())
  seconds = time.perf_counter() - start
  steps = made / slots
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(served))
  # Live KV read per step: every slot's keys and values up to its position, mid-window.
  per_token = (2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim
               * jnp.dtype(model_cfg.dtype).itemsize)
  live = context + 8 + steps / 2
  step_bytes = weight_bytes + slots * live * per_token
  out = dict(slots=slots, context=context, compile_s=compile_s, steps=steps,
             tokens_per_s=made / seconds, step_ms=seconds / steps * 1e3,
             weight_gb=weight_bytes / 1e9, kv_read_gb_per_step=slots * live * per_token / 1e9,
             bytes_per_s=step_bytes * steps / seconds, peak_bytes=peak_bytes(),
             peak_before=peak_before)
  del state, served
  return out


def decode_model(shapes: Shapes):
  """The experiment's model in bfloat16, weights and activations."""
  return dataclasses.replace(experiment(shapes).model, dtype="bfloat16", param_dtype="bfloat16")


def decode_section(shapes: Shapes, ctx: dict) -> dict:
  del ctx
  model_cfg = decode_model(shapes)
  bandwidth = copy_bandwidth(1 << 31 if not shapes.fast else 1 << 24)
  say(f"  copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)")
  params = models.init_params(model_cfg, jax.random.key(0))
  out = dict(copy_bandwidth_tb_s=bandwidth / 1e12)
  for slots in shapes.decode_slots:
    row = decode_width(model_cfg, params, slots, shapes)
    row["roofline_fraction"] = row["bytes_per_s"] / bandwidth
    out[f"slots_{slots}"] = row
    say(f"  {slots} slots at {shapes.decode_context}: {row['tokens_per_s']:.0f} tokens/s, "
        f"{row['step_ms']:.2f} ms/step, {row['roofline_fraction']:.2f} of the roofline")
  return out


# --- memory ---------------------------------------------------------------------------

def predict_memory(shapes: Shapes) -> dict:
  """`async_rl.compiled_memory`'s prediction for training's and each decode width's
  shapes, compiled for the host's CPU as `benchmarks/memory.py` compiles them: per phase,
  its total in bytes and its parts in GiB."""
  from async_rl import compiled_memory as memory
  cpu = jax.devices("cpu")[:1]
  train = memory.trainer(experiment(shapes), cpu)
  out = {"training": ((train["state"] + train["temp"]) * GIB, train)}
  model_cfg = decode_model(shapes)
  for slots in shapes.decode_slots:
    engine = decode_engine(model_cfg, slots, shapes.decode_context,
                           (shapes.decode_chunks + 1) * 8)
    gen = memory.generator(decode_experiment(model_cfg, engine, shapes), cpu)
    out[f"decode_{slots}"] = ((gen["params"] + gen["kv"] + gen["decode"]) * GIB, gen)
  return out


def memory_section(shapes: Shapes, ctx: dict) -> dict:
  """The peaks training and decode recorded, against `predict_memory`, which has been
  compiling on the host's CPU since the check started."""
  del shapes
  thread, predicted = ctx["prediction"]
  thread.join(timeout=max(1.0, ctx["left"]()))
  if thread.is_alive():
    raise TimeoutError("benchmarks.memory's prediction did not finish within the budget")
  if "error" in predicted:
    raise predicted["error"]
  results = ctx["results"]
  measured = {}
  if results.get("training", {}).get("status") == "ok":
    measured["training"] = results["training"]
  if results.get("decode", {}).get("status") == "ok":
    measured.update((f"decode_{row['slots']}", row) for name, row in results["decode"].items()
                    if name.startswith("slots_"))
  out = {}
  for name, (total, parts) in predicted["phases"].items():
    if name in measured:
      out[name] = _compare(measured[name]["peak_bytes"], total, measured[name]["peak_before"],
                           parts)
      say(f"  {name}: measured {out[name]['measured_gib']} GiB, predicted "
          f"{out[name]['predicted_gib']:.2f} GiB"
          f"{' (masked by an earlier peak)' if out[name]['masked'] else ''}")
  return out


def decode_experiment(model_cfg, engine: Engine, shapes: Shapes):
  """An experiment whose generator is `engine`'s shape, for `benchmarks.memory`."""
  c = load_config(MICRO_CONFIG if shapes.fast else CONFIG_1_5B)
  c.model.update(dataclasses.asdict(model_cfg))
  c.generation.update(num_slots=engine.max_concurrent_decodes, max_prompt_len=16,
                      max_new_tokens=engine.max_target_length - 16,
                      kv_blocks=engine.num_blocks, kv_block_size=engine.block_size)
  c.model.max_seq_len = max(c.model.max_seq_len, engine.max_target_length)
  c.batching.max_tokens_per_mb = max(c.batching.max_tokens_per_mb, engine.max_target_length)
  return from_dict(c)


def _compare(measured, predicted_bytes, before, parts) -> dict:
  gib = 2 ** 30
  return dict(measured_gib=None if measured is None else round(measured / gib, 3),
              predicted_gib=predicted_bytes / gib,
              ratio=None if measured is None else measured / predicted_bytes,
              masked=measured is not None and measured <= (before or 0),
              predicted_parts_gib={k: round(v, 3) for k, v in parts.items()
                                   if isinstance(v, float)})


# --- real run -------------------------------------------------------------------------

def real_run_section(shapes: Shapes, ctx: dict) -> dict:
  workdir = os.path.join(ctx["work"], "real_run")
  shutil.rmtree(workdir, ignore_errors=True)
  config = MICRO_CONFIG if shapes.fast else CONFIG_1_5B
  command = [sys.executable, "-m", "launch.train", f"--config={config}",
             f"--workdir={workdir}", f"--config.num_steps={shapes.run_steps}",
             *(f"--config.{o}" for o in shapes.run_overrides)]
  devices = jax.local_device_count()
  if devices > 1:  # the trainer on half, one generator replica on each of the others
    command += [f"--config.placement.trainer_devices={devices // 2}", "--config.mesh.fsdp=-1"]
  say("  " + " ".join(command[1:]))
  start = time.perf_counter()
  env = dict(_ENV, JAX_COMPILATION_CACHE_DIR=ctx["cache"],
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=max(60, ctx["left"]()))
  wall = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"launch.train exited {proc.returncode}: {proc.stderr[-2000:]}")
  steps = step_lines(workdir)
  timed = steps[1:] or steps
  step_s = [m["time_wait_s"] + m["time_pack_s"] + m["time_train_s"] + m["time_publish_s"]
            for m in timed]
  generated = (timed[-1]["rollout"]["generated_tokens"]
               - (steps[0]["rollout"]["generated_tokens"] if len(steps) > 1 else 0))
  out = dict(config=config, devices=devices, steps=len(steps), wall_s=wall,
             step_s=float(np.median(step_s)),
             trained_tokens_per_s=sum(m["trained_tokens"] for m in timed)
             / sum(m["time_train_s"] for m in timed),
             generated_tokens_per_s=generated / sum(step_s),
             rewards=[m["reward_mean"] for m in steps if "reward_mean" in m])
  say(f"  {len(steps)} steps, median {out['step_s']:.2f} s/step, "
      f"{out['trained_tokens_per_s']:.0f} trained tokens/s, "
      f"{out['generated_tokens_per_s']:.0f} generated tokens/s")
  return out


# --- sync vs async --------------------------------------------------------------------

def sync_async_section(shapes: Shapes, ctx: dict) -> dict:
  base = experiment(shapes, shapes.run_overrides)
  base = dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer,
                                                                 learning_rate=0.0))
  out = {}
  for name, eta, mode in (("sync", 0, "drain"), ("async", 2, "retract")):
    cfg = dataclasses.replace(
        run_stats.measured_config(base, shapes.sync_steps),
        staleness=dataclasses.replace(base.staleness, max_staleness=eta),
        generation=dataclasses.replace(base.generation, update_mode=mode))
    workdir = os.path.join(ctx["work"], f"sync_async_{name}")
    shutil.rmtree(workdir, ignore_errors=True)
    summary = entry.run(cfg, workdir, echo=lambda _: None, progress=False)
    row = run_stats.measure(cfg, summary)
    out[name] = {k: row[k] for k in ("wall_s", "steps", "trained_tokens_per_s",
                                     "generated_tokens_per_s", "generator_idle",
                                     "trainer_idle", "staleness_mean")}
    say(f"  {name} (η={eta}, {mode}): {row['trained_tokens_per_s']:.0f} trained tokens/s, "
        f"{row['generated_tokens_per_s']:.0f} generated tokens/s")
  out["async_over_sync"] = (out["async"]["trained_tokens_per_s"]
                            / out["sync"]["trained_tokens_per_s"])
  return out


# In this order: the goals' figures first; the two runs share compiled programs through
# the cache, the later one reading them; memory compares the peaks that training and
# decode recorded with a prediction compiled meanwhile, so it comes last.
SECTIONS = {"env": env_section, "kernels": kernels_section, "training": training_section,
            "decode": decode_section, "sync_async": sync_async_section,
            "real_run": real_run_section, "memory": memory_section}


def goals(results: dict) -> dict:
  """Each goal's measured figure (None where its section did not run) and target."""
  def get(section, *keys):
    r = results.get(section, {})
    if r.get("status") != "ok":
      return None
    for k in keys:
      r = r.get(k) if isinstance(r, dict) else None
    return r
  widths = [k for k in results.get("decode", {}) if k.startswith("slots_")]
  roofline = [get("decode", w, "roofline_fraction") for w in widths]
  ratios = [r["ratio"] for r in (results.get("memory") or {}).values()
            if isinstance(r, dict) and r.get("ratio") is not None and not r["masked"]]
  figures = {
      "decode_roofline_fraction": min(roofline) if roofline and None not in roofline else None,
      "train_mfu": get("training", "mfu"),
      "kernels_within_bf16_rounding": get("kernels", "all_within_bf16_rounding"),
      "memory_ratio": max(ratios, key=lambda r: abs(r - 1)) if ratios else None,
      "async_over_sync": get("sync_async", "async_over_sync")}
  out = {}
  for name, value in figures.items():
    if name == "kernels_within_bf16_rounding":
      out[name] = dict(value=value, met=value)
    elif name == "memory_ratio":
      out[name] = dict(value=value, target=f"within {GOALS[name] - 1:.0%}",
                       met=None if value is None else abs(value - 1) <= GOALS[name] - 1)
    else:
      out[name] = dict(value=value, target=GOALS[name],
                       met=None if value is None else value >= GOALS[name])
  return out


def run_check(shapes: Shapes, work_dir: str, budget_s: float, only=None) -> dict:
  """Runs the sections (`only` those named, if given) with their workdirs and compilation
  cache under `work_dir`; the summary the last line prints."""
  start = time.perf_counter()
  left = lambda: budget_s - (time.perf_counter() - start)
  results = {}
  # The runs compile the same programs: the later ones read them from disk (from a
  # cache the environment names, if it names one).
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(work_dir, "jax_cache")
  ctx = dict(work=work_dir, cache=cache, results=results, left=left)
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if only is None or "memory" in only:
    # On the host's CPU while the device works; a daemon, so that a prediction still
    # compiling when the budget runs out does not hold the exit.
    predicted = {}
    def predict():
      try:
        predicted["phases"] = predict_memory(shapes)
      except Exception as e:  # noqa: BLE001 -- raised again by the memory section
        predicted["error"] = e
    thread = threading.Thread(target=predict, name="predict_memory", daemon=True)
    thread.start()
    ctx["prediction"] = (thread, predicted)
  for name, section in SECTIONS.items():
    if only is not None and name not in only:
      continue
    if left() < shapes.needs[name]:
      results[name] = dict(status="skipped", seconds=0.0, error=None,
                           reason=f"{left():.0f} s left of the budget, {shapes.needs[name]} needed")
      say(f"[{name}] skipped: {results[name]['reason']}")
      continue
    say(f"[{name}]")
    t0 = time.perf_counter()
    try:
      figures = section(shapes, ctx)
      results[name] = dict(status="ok", error=None, **figures)
    except Exception as e:  # noqa: BLE001 -- recorded; the next section runs
      traceback.print_exc()
      results[name] = dict(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    except KeyboardInterrupt:  # SIGINT, from a time limit: what ran is still reported
      results[name] = dict(status="error", error="interrupted")
    results[name]["seconds"] = time.perf_counter() - t0
    say(f"[{name}] {results[name]['status']} in {results[name]['seconds']:.1f} s")
    if results[name]["error"] == "interrupted":
      break
  device = jax.devices()[0]
  return dict(fast=shapes.fast, backend=jax.default_backend(), device_kind=device.device_kind,
              jax=jax.__version__, wall_s=time.perf_counter() - start, sections=results,
              goals=goals(results))


def _plain(x):
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if isinstance(x, (np.floating, float)):
    return round(float(x), 6)
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.bool_):
    return bool(x)
  return x


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  fast = _FAST.value or jax.default_backend() == "cpu"
  out_dir = _OUT.value or tempfile.mkdtemp(prefix="gpu_check_")
  os.makedirs(out_dir, exist_ok=True)
  shapes = FAST if fast else FULL
  say(f"gpu_check: {'fast' if fast else 'full'} mode on {jax.default_backend()}, "
      f"budget {_BUDGET.value} s, summary to {out_dir}")
  # Checkpoints of the 1.5B runs are gigabytes: they stay out of --out.
  with tempfile.TemporaryDirectory(prefix="gpu_check_work_") as work_dir:
    summary = _plain(run_check(shapes, work_dir, _BUDGET.value, _SECTIONS.value))
  with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps(summary), flush=True)
  if any(t.name == "predict_memory" and t.is_alive() for t in threading.enumerate()):
    # A compile still running on that thread cannot be stopped, and the interpreter's
    # exit would abort inside it: leave without one, everything written.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
  app.run(main)
