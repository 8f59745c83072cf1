"""Memory per device of the accelerator configs at reasoning lengths, read from the compiler.

  python -m benchmarks.memory      # 1.5B and 7B at 8k / 16k / 32k, and the 7B engine on
                                   # 1 / 2 / 4 / 8 devices; compile only, minutes
  python -m benchmarks.memory --configs=qwen2_5:1.5b --lengths=32k --tp=   # one row
  python -m benchmarks.memory --configs=qwen2_5:7b,qwen2_5:7b+lora16 --lengths=8k --tp=
                                   # full fine-tuning against LoRA of rank 16
  python -m benchmarks.memory --config=configs/micro.py --tokens=80,160   # per micro-batch

Nothing is allocated: params and KV pools are counted from their abstract shapes and
shardings, and every program is lowered from abstract shapes and compiled for the
host's CPU (8 fake devices, `--xla_force_host_platform_device_count`, for the
multi-device ones), its `memory_analysis()` read; values are per device.

Per device, for each config (a shipped `NAME:VARIANT`) and generation length:
  generator  one engine (`generation.Engine`, as `build.make_engine` builds it for an
             accelerator): its params in the serving layout and its KV pool
             (`generation.kv_blocks` blocks); and its transient, the larger of a prefill
             of one sequence of the full length (a preempted or retracted sample's, with
             the prefix it returns) and one decode chunk with the whole KV budget in
             flight (attention over `paged.bucket(kv_blocks)` blocks).
  trainer    the train state (params and AdamW moments, sharded by `sharding.PARAM_RULES`
             over the config's mesh on D devices); and the train step's temporaries for
             one micro-batch of one row per device of max(`batching.max_tokens_per_mb`,
             the sequence length) tokens, the longest row `batching.pack_dynamic` builds.
  device 0   the default placement (`placement.trainer_devices=-1`): the trainer on all D
             devices and both engines' pools (rollout and evaluation, each with its own
             params and KV pool) on the first device, every transient counted at once:
             trainer + its temporaries + 2 x (generator + its transient). It fits one
             80 GB device when at most 74.5 GiB, one 24 GB device at 22.35 GiB.
  LoRA       a config with `lora.rank` > 0 (`qwen2_5:1.5b_lora`): the train state is the
             frozen base and the adapters' float32 state; device 0 adds the base the
             engine merges each published adapter into (`generation.adapted`).

D is 1 for the 1.5B and 8 for the 7B, the devices `configs/qwen2_5.py` sizes them for (1
for other configs).
Lengths: 8k is each config as shipped (256 prompt + 8,192 new tokens); 4k takes 256
prompt and 4,096 new tokens; 16k and 32k
take 1,024 prompt tokens and 15,360 / 31,744 new ones, slots and KV budget as shipped,
or a config's variant `VARIANT_LENGTH` where it has one (`qwen2_5:1.5b_32k`, 64 slots).

16-bit accounting. XLA:CPU computes 16-bit data in float32: a bfloat16 compile holds
float32 copies of the weights, of the KV pools in the decode loop and of the stacks
remat saves, buffers a backend with native bfloat16 never holds (one decode chunk of
the 1.5B at 32k: 27 GiB of temporaries as bfloat16, 1.8 GiB as float32). So params
and KV pools are counted at the configs' 16-bit dtypes from their shapes, and each
program is compiled once, in the 16-bit stand-in that overcounts it least: the
engine's programs in float32, which widens nothing but counts each 16-bit temporary
at 4 bytes (float16 would widen every layer's weights at once, the programs being
unrolled); the train step in float16, which keeps its buffers 16-bit but widens the
weights of the layer its dots read (float32 would double every saved activation).
The train state is that compile's arguments (params, AdamW moments and the
micro-batch). Each transient is thus an upper bound.
On CPU the programs run the CPU kernels, `attention.chunked` (long rows) and
`cpu.paged_decode.ragged_attention`, where a GPU runs the Pallas flash and paged
kernels; the attention temporaries of both grow linearly in the row.

Tensor parallelism (`--tp`): the `--tp_config` engine at 8k on k devices, params split
over heads and MLP width (`sharding.param_shardings` on a `tensor` = k mesh), KV pools
over kv heads (`sharding.kv_pool_sharding`), with each figure's ratio to k = 1. An axis
that k does not divide stays whole (`sharding.PARAM_RULES`). Beside the counts from
shapes, `decode_args_f32` is what the compiler places on each device as the decode
chunk's arguments (params, pools and the slots' state, at float32's 4 bytes).

Last line: JSON with, per config and length, `device0_gib`, `fits_80gb` and `fits_24gb`, the
generator's and the trainer's parts, and `tp_gib` / `tp_ratio` per k.

Per micro-batch (`--tokens`, with `--config` and `--saves`): the train step of
`--config` alone, one device, one micro-batch ([1, R, T]) of R rows of T tokens, T the
config's longest sequence (`generation.max_prompt_len + max_new_tokens`) and R = tokens
/ T, for each micro-batch size in --tokens; each row holds one sequence filling it.
The model is the config's (dtype, remat and what it saves; --saves overrides
`model.remat_saves`) and so is the loss with its proximal log-probs
(`ppo.prox_logp`). Printed per size: XLA's `memory_analysis()` (arguments, outputs,
aliased, temporaries, in GiB), model FLOPs (`models.flops.train_flops`), executed
matmul FLOPs and their ratio, and XLA's raw `cost_analysis()["flops"]`.

Counting method. `cost_analysis()` counts a loop body once: the scans over layers
(28 trips), over micro-batches and over log-prob chunks read as one trip each, which
is why its figure lies far below the model FLOPs. Executed FLOPs are therefore
counted by `models.flops.executed_matmul_flops`, a walk over the optimised HLO that
multiplies each loop body by its known trip count (dots only, as model FLOPs count
only matmuls); rows longer than `attention.LONG_ROW` run `attention.chunked`, whose
loops have traced trip counts, so their FLOPs are not counted. The walk is checked
against a closed form of what this implementation executes on rows that one sequence
fills, where nothing is padding and the model FLOPs are exactly known:

  per token  6 N; plus 2 (N - D V - L D F - L S) when remat recomputes the layers'
             forward pass (all of it but the MLP's down projection, whose output
             the backward pass does not need, and S, the matmuls whose outputs
             `model.remat_saves` keeps: `models.config.REMAT_SAVES`); plus 2 D V,
             the LM head's logits scored again in the backward pass, whose
             gradient `policy` writes in closed form from them;
  attention  per row and layer 4 H E C^2 n (n + 1) / 2 forward (`blockwise`: query
             block i of n scores the (i + 1) C keys before it), times 3 for forward
             and backward, plus 1 under remat.

The check passes when the two agree to 0.1%. For a bf16 config the step is also
compiled in float16 (`temp_16bit`). Its last line: JSON with `temp_gib` (micro-batch
tokens -> GiB of temporaries), `temp_gib_16bit`, `flops_ratio` (executed / model FLOPs
at the largest size) and the breakdown.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from async_rl import sharding  # noqa: E402
from async_rl.cli import from_dict  # noqa: E402
from async_rl.config import MeshConfig  # noqa: E402
from async_rl.compiled_memory import (compile_train_step, generator, trainer,  # noqa: E402
                                      with_dtype)
from async_rl.models import attention, flops  # noqa: E402
from async_rl.models.memory import GIB  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["qwen2_5:1.5b", "qwen2_5:7b"],
                             "Shipped configs (NAME:VARIANT) of the per-device table.")
_LENGTHS = flags.DEFINE_list("lengths", ["8k", "16k", "32k"], "Generation lengths.")
_TP = flags.DEFINE_list("tp", ["1", "2", "4", "8"], "Devices of the tensor-parallel engine.")
_TP_CONFIG = flags.DEFINE_string("tp_config", "qwen2_5:7b", "Config of the --tp table.")
_CONFIG = config_flags.DEFINE_config_file("config", "configs/qwen2_5.py",
                                          "The experiment whose train step --tokens compiles.")
_TOKENS = flags.DEFINE_list("tokens", [], "Tokens per micro-batch (multiples of the row "
                            "length): the per micro-batch table of --config instead.")
_SAVES = flags.DEFINE_list("saves", None, "model.remat_saves to compile with, e.g. "
                           "mlp_gate,qkv (default: the config's; 'none' for none).")

# Prompt and new tokens of each length; None: the config as shipped.
LENGTHS = {"4k": (256, 4096), "8k": None, "16k": (1024, 15360), "32k": (1024, 31744)}
TRAINER_DEVICES = {"qwen2_5:1.5b": 1, "qwen2_5:7b": 8}
DEVICE_GIB = 80e9 / GIB
SMALL_DEVICE_GIB = 24e9 / GIB  # what `1.5b_lora` is sized for


def experiment(name: str, length: str):
  """The shipped config `name` (`NAME[:VARIANT][+loraR]`) at `length` (`LENGTHS`): its
  variant `VARIANT_LENGTH` if it has one; with `+loraR`, LoRA adapters of rank R."""
  name, _, rank = name.partition("+lora")
  module_name, _, variant = name.partition(":")
  module = importlib.import_module(f"async_rl.configs.{module_name}")
  if f"{variant}_{length}" in getattr(module, "VARIANTS", ()):
    c = module.get_config(f"{variant}_{length}")
  else:
    c = module.get_config(*[variant] if variant else [])
    if LENGTHS[length] is not None:
      c.generation.max_prompt_len, c.generation.max_new_tokens = LENGTHS[length]
  if rank:
    c.lora.rank = int(rank)
  g = c.generation
  c.model.max_seq_len = max(c.model.max_seq_len, g.max_prompt_len + g.max_new_tokens)
  c.batching.max_tokens_per_mb = max(c.batching.max_tokens_per_mb, c.model.max_seq_len)
  return from_dict(c)


@functools.cache
def generator_of(name: str, length: str, k: int) -> dict:
  """`generator` of config `name` at `length` on the first `k` devices, once each."""
  gen = generator(experiment(name, length), jax.devices()[:k])
  return dict(gen, transient=max(gen["prefill"], gen["decode"]),
              total=gen["params"] + gen["kv"] + max(gen["prefill"], gen["decode"]))


def per_device(name: str, length: str) -> dict:
  """`name` at `length`: generator, trainer and device 0 (module docstring), in GiB."""
  cfg = experiment(name, length)
  D = TRAINER_DEVICES.get(name.partition("+lora")[0], 1)
  if len(jax.devices()) < D:
    raise ValueError(f"{name} needs {D} devices; XLA_FLAGS gives {len(jax.devices())}")
  gen = generator_of(name, length, 1)
  train = trainer(cfg, jax.devices()[:D])
  device0 = train["state"] + train["temp"] + 2 * gen["total"]
  if cfg.lora.enabled:  # the base the engine merges each published adapter into
    device0 += gen["params"]
  return dict(length=cfg.generation.max_length, slots=cfg.generation.num_slots,
              trainer_devices=D, generator=gen, trainer=train, device0=device0,
              fits_80gb=device0 <= DEVICE_GIB, fits_24gb=device0 <= SMALL_DEVICE_GIB)


def tensor_parallel(name: str, ks) -> dict:
  """`name`'s engine at 8k on k devices for each k: per-device GiB and the ratio to the
  fewest."""
  out = {k: dict(generator_of(name, "8k", k)) for k in ks}
  one = out[min(ks)]
  for r in out.values():
    r["ratio"] = {key: r[key] / one[key]
                  for key in ("params", "kv", "transient", "total", "decode_args_f32")}
  return out


def print_per_device(results):
  print(f"\n{'config':<14}{'length':>7}{'D':>3}{'gen params':>11}{'KV':>7}{'prefill':>9}"
        f"{'decode':>8}{'train state':>12}{'train temp':>11}{'device 0':>10}  fits 80 GB")
  for (name, length), r in results.items():
    g, t = r["generator"], r["trainer"]
    print(f"{name:<14}{length:>7}{r['trainer_devices']:>3}{g['params']:>11.2f}{g['kv']:>7.2f}"
          f"{g['prefill']:>9.2f}{g['decode']:>8.2f}{t['state']:>12.2f}"
          f"{t['temp']:>11.2f}{r['device0']:>10.2f}  {'yes' if r['fits_80gb'] else 'NO'}"
          f"{' (24 GB: yes)' if r['fits_24gb'] else ''}")
  print("GiB per device. prefill: temporaries + the prefix of one full-length sequence; "
        "decode: one chunk's temporaries, the KV budget in flight; device 0: train state + "
        "temp + 2 x (params + KV + the larger transient).")


def print_tensor_parallel(name, tp):
  print(f"\n{name} engine at 8k, per device (GiB; ratio to k = {min(tp)})")
  print(f"{'k':>3}{'params':>9}{'KV':>8}{'prefill':>9}{'decode':>8}{'total':>9}{'ratio':>8}"
        f"{'1/k':>7}")
  for k, r in tp.items():
    print(f"{k:>3}{r['params']:>9.2f}{r['kv']:>8.2f}{r['prefill']:>9.2f}{r['decode']:>8.2f}"
          f"{r['total']:>9.2f}{r['ratio']['total']:>8.3f}{1 / k:>7.3f}")


def implementation_flops(model_cfg, rows, row_len) -> dict:
  """What this implementation executes on rows one sequence fills (module docstring)."""
  m = model_cfg
  N, head = flops.matmul_params(m), m.d_model * m.vocab_size
  tokens = rows * row_len
  n = attention.num_blocks(row_len)
  C = row_len // n
  attn_fwd = m.n_layers * rows * 4 * m.n_heads * m.head_dim * C * C * n * (n + 1) / 2
  D, F, E = m.d_model, m.d_ff, m.head_dim
  kept = {"qkv": D * (m.n_heads + 2 * m.n_kv_heads) * E, "residual": m.n_heads * E * D,
          "mlp_gate": D * F, "mlp_up": D * F}  # the matmul each saved value spares
  recomputed = 2 * m.n_layers * tokens * (
      (N - head) / m.n_layers - D * F - sum(kept[s] for s in m.remat_saves)) + attn_fwd
  return dict(weights=6 * N * tokens, remat=recomputed * m.remat,
              head_recompute=2 * head * tokens, attention=3 * attn_fwd)


def measure(cfg, tokens):
  model_cfg = cfg.model
  row_len = cfg.generation.max_prompt_len + cfg.generation.max_new_tokens
  if tokens % row_len:
    raise ValueError(f"--tokens {tokens} is not a multiple of the row length {row_len}")
  rows = tokens // row_len
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  compiled = compile_train_step(cfg, mesh, rows, row_len)
  mem = compiled.memory_analysis()
  executed = (flops.executed_matmul_flops(compiled.as_text())
              if row_len <= attention.LONG_ROW else None)
  expected = implementation_flops(model_cfg, rows, row_len)
  model = flops.train_flops(model_cfg, np.tile(np.arange(row_len), rows))
  return dict(
      rows=rows, row_len=row_len,
      arguments_gib=mem.argument_size_in_bytes / GIB, outputs_gib=mem.output_size_in_bytes / GIB,
      aliased_gib=mem.alias_size_in_bytes / GIB, temp_gib=mem.temp_size_in_bytes / GIB,
      model_flops=model, executed_flops=executed, expected_flops=sum(expected.values()),
      breakdown={k: v / model for k, v in expected.items()},
      xla_cost_analysis_flops=compiled.cost_analysis()["flops"])


def micro_batch_table(cfg):
  """The per micro-batch table of `--config` (module docstring)."""
  if _SAVES.value is not None:
    saves = tuple(s for s in _SAVES.value if s != "none")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat_saves=saves))
  m = cfg.model
  print(f"jax {jax.__version__} on {jax.default_backend()}; {m.n_layers} layers, d_model "
        f"{m.d_model}, vocab {m.vocab_size}, {m.dtype}, remat={m.remat}, remat_saves="
        f"{m.remat_saves}; one device")
  results = {int(t): measure(cfg, int(t)) for t in _TOKENS.value}
  as_16bit = "bfloat16" in (m.dtype, m.param_dtype)
  if as_16bit:
    f16 = dataclasses.replace(cfg, model=with_dtype(m, "float16"))
    for t, r in results.items():
      r["temp_16bit_gib"] = measure(f16, t)["temp_gib"]
  nan = float("nan")
  print(f"\n{'tokens':>7}{'R x T':>11}{'args GiB':>10}{'out GiB':>9}{'alias GiB':>10}"
        f"{'temp GiB':>10}{'temp_16bit':>11}{'model TFLOP':>12}{'exec TFLOP':>11}"
        f"{'exec/model':>11}{'walk/closed form':>17}{'XLA raw TFLOP':>14}")
  for t, r in results.items():
    executed = r["executed_flops"] or nan
    print(f"{t:>7}{r['rows']:>5} x {r['row_len']:<5}{r['arguments_gib']:>9.2f}"
          f"{r['outputs_gib']:>9.2f}{r['aliased_gib']:>10.2f}{r['temp_gib']:>10.2f}"
          f"{r.get('temp_16bit_gib', nan):>11.2f}"
          f"{r['model_flops'] / 1e12:>12.2f}{executed / 1e12:>11.2f}"
          f"{executed / r['model_flops']:>11.3f}{executed / r['expected_flops']:>17.4f}"
          f"{r['xla_cost_analysis_flops'] / 1e12:>14.3f}")
  largest, smallest = results[max(results)], results[min(results)]
  summary = dict(temp_gib={t: round(r["temp_gib"], 6) for t, r in results.items()},
                 temp_growth=largest["temp_gib"] / smallest["temp_gib"])
  if as_16bit:
    summary.update(temp_gib_16bit={t: round(r["temp_16bit_gib"], 6) for t, r in results.items()},
                   temp_growth_16bit=largest["temp_16bit_gib"] / smallest["temp_16bit_gib"])
  if largest["executed_flops"] is not None:
    parts = ", ".join(f"{k} {v:.3f}" for k, v in largest["breakdown"].items())
    print(f"\nAt {max(results)} tokens, executed / model FLOPs by closed form: {parts}.")
    check = max(abs(r["executed_flops"] / r["expected_flops"] - 1) for r in results.values())
    print(f"Counting check (HLO walk vs closed form): worst {check:.2e} "
          f"({'ok' if check < 1e-3 else 'FAILED'}).")
    summary.update(flops_ratio=largest["executed_flops"] / largest["model_flops"],
                   flops_breakdown={k: round(v, 4) for k, v in largest["breakdown"].items()},
                   count_check=check)
  else:
    print(f"\nRows of {largest['row_len']} tokens run `attention.chunked`: executed FLOPs not "
          "counted.")
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))


def main(argv):
  del argv
  if _TOKENS.value:
    return micro_batch_table(from_dict(_CONFIG.value))
  print(f"jax {jax.__version__}, compiled for {jax.default_backend()} "
        f"({len(jax.devices())} devices); nothing allocated")
  results = {}
  for name in _CONFIGS.value:
    for length in _LENGTHS.value:
      results[name, length] = per_device(name, length)
      print(f"  {name} {length}: device 0 {results[name, length]['device0']:.2f} GiB", flush=True)
  if results:
    print_per_device(results)
  tp = tensor_parallel(_TP_CONFIG.value, [int(k) for k in _TP.value]) if _TP.value else {}
  if tp:
    print_tensor_parallel(_TP_CONFIG.value, tp)
  r2 = lambda x: round(x, 2)
  summary = dict(
      device0_gib={f"{n}/{l}": r2(r["device0"]) for (n, l), r in results.items()},
      fits_80gb={f"{n}/{l}": r["fits_80gb"] for (n, l), r in results.items()},
      fits_24gb={f"{n}/{l}": r["fits_24gb"] for (n, l), r in results.items()},
      generator_gib={f"{n}/{l}": {k: r2(v) for k, v in r["generator"].items()}
                     for (n, l), r in results.items()},
      trainer_gib={f"{n}/{l}": {k: r2(v) for k, v in r["trainer"].items()}
                   for (n, l), r in results.items()},
      tp_gib={k: {key: r2(r[key]) for key in ("params", "kv", "prefill", "decode", "total",
                                              "decode_args_f32")}
              for k, r in tp.items()},
      tp_ratio={k: {key: round(v, 3) for key, v in r["ratio"].items()} for k, r in tp.items()})
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
