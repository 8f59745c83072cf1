"""Memory and FLOPs of the train step, read from the compiler for the real shapes.

  python -m benchmarks.memory          # configs/qwen2_5_1_5b.py; about 3 minutes on CPU
  python -m benchmarks.memory --saves=none     # the same with remat saving nothing
  python -m benchmarks.memory --config=configs/micro.py --tokens=80,160   # seconds

Compiles `train_step.jit_train_step` of --config from abstract shapes on the CPU
(nothing is allocated): one micro-batch ([1, R, T]) of R rows of T tokens, T the
config's longest sequence (`generation.max_prompt_len + max_new_tokens`, the row
length `batching.pack_dynamic` picks for full-length sequences) and R = tokens / T,
for each micro-batch size in --tokens. Each row holds one sequence filling it. The
model is the config's (dtype, remat and what it saves; --saves overrides
`model.remat_saves`) and so is the loss with its proximal log-probs
(`ppo.prox_logp`); one micro-batch is one PPO update, whatever `ppo.num_minibatches`
says. The mesh is one device.

Printed per size: XLA's `memory_analysis()` (arguments, outputs, aliased, temporaries,
in GiB), model FLOPs (`models.flops.train_flops`), executed matmul FLOPs and their
ratio, and XLA's raw `cost_analysis()["flops"].

Counting method. `cost_analysis()` counts a loop body once: the scans over layers
(28 trips), over micro-batches and over log-prob chunks read as one trip each, which
is why its figure lies far below the model FLOPs. Executed FLOPs are therefore
counted by `models.flops.executed_matmul_flops`, a walk over the optimised HLO that
multiplies each loop body by its known trip count (dots only, as model FLOPs count
only matmuls). The walk is checked against a closed form of what this
implementation executes on rows that one sequence fills, where nothing is padding
and the model FLOPs are exactly known:

  per token  6 N; plus 2 (N - D V - L D F - L S) when remat recomputes the layers'
             forward pass (all of it but the MLP's down projection, whose output
             the backward pass does not need, and S, the matmuls whose outputs
             `model.remat_saves` keeps: `models.config.REMAT_SAVES`); plus 2 D V
             when log-probs are chunked (each chunk's LM head is recomputed in the
             backward pass);
  attention  per row and layer 4 H E C^2 n (n + 1) / 2 forward (`blockwise`: query
             block i of n scores the (i + 1) C keys before it), times 3 for forward
             and backward, plus 1 under remat.

The check passes when the two agree to 0.1%; the remaining gap between executed and
model FLOPs is then the recomputation and the attention blocks' upper triangles,
which the printout splits out. The GPU path (`attention.flash_gpu`) is not compiled
here (no GPU): its attention tiles skip the same upper blocks at 128 tokens.

16-bit accounting. XLA:CPU widens bf16 data movement to float32 (its
`float-normalization-bf16` pass): the scans over layers then slice a float32 copy of
every layer's bf16 weights (4.9 GiB for the 1.5B model) and of every bf16 stack the
backward pass reads (remat's saved values: float32 copies next to the bf16 stacks),
buffers a backend with native bf16 never holds. float16 has the same two bytes and
XLA:CPU keeps it 16-bit, so for a bf16 config the step is also compiled with
`dtype` and `param_dtype` float16 (the same program otherwise, the same FLOPs): its
temporaries, `temp_16bit` in the table, are what the compiler needs with 16-bit
buffers kept 16-bit, the estimate for a GPU; `temp` is the bf16 CPU compile's.
(Disabling the pass instead fails: XLA:CPU's dot emitter then meets bf16 dots it
cannot emit.)

Last line: JSON with `temp_gib` (micro-batch tokens -> GiB of temporaries of the
config's compile), `temp_gib_16bit` (the float16 compile's, for a bf16 config),
`flops_ratio` (executed / model FLOPs at the largest size) and the breakdown.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from async_rl import loss, sharding, train_step
from async_rl.batching import PackedBatch
from async_rl.config import MeshConfig, from_dict
from async_rl.models import attention, flops
from async_rl.models.memory import GIB
from async_rl.policy import chunk_len

_CONFIG = config_flags.DEFINE_config_file("config", "configs/qwen2_5_1_5b.py",
                                          "The experiment whose train step is compiled.")
_TOKENS = flags.DEFINE_list("tokens", ["4096", "8192", "16384"],
                            "Tokens per micro-batch (multiples of the row length).")
_SAVES = flags.DEFINE_list("saves", None, "model.remat_saves to compile with, e.g. "
                           "mlp_gate,qkv (default: the config's; 'none' for none).")


def abstract_state(model_cfg, tx, mesh):
  """The train state's shapes, as `train_step.create_train_state` builds it (nothing allocated)."""
  return jax.eval_shape(lambda key: train_step.create_train_state(model_cfg, tx, mesh, key)[0],
                        jax.random.key(0))


def abstract_batch(rows, row_len, prox_mode):
  """One micro-batch and its proximal log-probs, as the trainer passes them in `prox_mode`."""
  shape = (1, rows, row_len)
  i32, f32 = (lambda: jax.ShapeDtypeStruct(shape, jnp.int32),
              lambda: jax.ShapeDtypeStruct(shape, jnp.float32))
  loglinear = prox_mode == "loglinear"  # estimated inside the step from the versions
  batch = PackedBatch(tokens=i32(), positions=i32(), segment_ids=i32(), loss_mask=f32(),
                      behav_logp=f32(), advantages=f32(), versions=i32() if loglinear else None)
  return batch, None if loglinear else f32()


def implementation_flops(model_cfg, rows, row_len) -> dict:
  """What this implementation executes on rows one sequence fills (module docstring)."""
  m = model_cfg
  N, head = flops.matmul_params(m), m.d_model * m.vocab_size
  tokens = rows * row_len
  chunked = chunk_len(rows, row_len, m.vocab_size) < row_len
  n = attention.num_blocks(row_len)
  C = row_len // n
  attn_fwd = m.n_layers * rows * 4 * m.n_heads * m.head_dim * C * C * n * (n + 1) / 2
  D, F, E = m.d_model, m.d_ff, m.head_dim
  kept = {"qkv": D * (m.n_heads + 2 * m.n_kv_heads) * E, "residual": m.n_heads * E * D,
          "mlp_gate": D * F, "mlp_up": D * F}  # the matmul each saved value spares
  recomputed = 2 * m.n_layers * tokens * (
      (N - head) / m.n_layers - D * F - sum(kept[s] for s in m.remat_saves)) + attn_fwd
  return dict(weights=6 * N * tokens, remat=recomputed * m.remat,
              head_recompute=2 * head * tokens * chunked, attention=3 * attn_fwd)


def measure(cfg, tokens):
  model_cfg = cfg.model
  row_len = cfg.generation.max_prompt_len + cfg.generation.max_new_tokens
  if tokens % row_len:
    raise ValueError(f"--tokens {tokens} is not a multiple of the row length {row_len}")
  rows = tokens // row_len
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  tx = train_step.make_optimizer(cfg.optimizer)
  state = abstract_state(model_cfg, tx, mesh)
  step = train_step.jit_train_step(mesh, train_step.train_state_shardings(state, mesh),
                                   model_cfg=model_cfg, loss_fn=loss.from_config(cfg.ppo),
                                   temperature=cfg.generation.logp_temperature)
  compiled = step.lower(state, *abstract_batch(rows, row_len, cfg.ppo.prox_logp)).compile()
  mem = compiled.memory_analysis()
  executed = flops.executed_matmul_flops(compiled.as_text())
  expected = implementation_flops(model_cfg, rows, row_len)
  model = flops.train_flops(model_cfg, np.tile(np.arange(row_len), rows))
  return dict(
      rows=rows, row_len=row_len,
      arguments_gib=mem.argument_size_in_bytes / GIB, outputs_gib=mem.output_size_in_bytes / GIB,
      aliased_gib=mem.alias_size_in_bytes / GIB, temp_gib=mem.temp_size_in_bytes / GIB,
      model_flops=model, executed_flops=executed, expected_flops=sum(expected.values()),
      breakdown={k: v / model for k, v in expected.items()},
      xla_cost_analysis_flops=compiled.cost_analysis()["flops"])


def main(argv):
  del argv
  cfg = from_dict(_CONFIG.value)
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
    f16 = dataclasses.replace(cfg, model=dataclasses.replace(m, dtype="float16",
                                                             param_dtype="float16"))
    for t, r in results.items():
      r["temp_16bit_gib"] = measure(f16, t)["temp_gib"]
  print(f"\n{'tokens':>7}{'R x T':>11}{'args GiB':>10}{'out GiB':>9}{'alias GiB':>10}"
        f"{'temp GiB':>10}{'temp_16bit':>11}{'model TFLOP':>12}{'exec TFLOP':>11}"
        f"{'exec/model':>11}{'walk/closed form':>17}{'XLA raw TFLOP':>14}")
  for t, r in results.items():
    print(f"{t:>7}{r['rows']:>5} x {r['row_len']:<5}{r['arguments_gib']:>9.2f}"
          f"{r['outputs_gib']:>9.2f}{r['aliased_gib']:>10.2f}{r['temp_gib']:>10.2f}"
          f"{r.get('temp_16bit_gib', float('nan')):>11.2f}"
          f"{r['model_flops'] / 1e12:>12.2f}{r['executed_flops'] / 1e12:>11.2f}"
          f"{r['executed_flops'] / r['model_flops']:>11.3f}"
          f"{r['executed_flops'] / r['expected_flops']:>17.4f}"
          f"{r['xla_cost_analysis_flops'] / 1e12:>14.3f}")
  largest = results[max(results)]
  parts = ", ".join(f"{k} {v:.3f}" for k, v in largest["breakdown"].items())
  print(f"\nAt {max(results)} tokens, executed / model FLOPs by closed form: {parts}.")
  check = max(abs(r["executed_flops"] / r["expected_flops"] - 1) for r in results.values())
  print(f"Counting check (HLO walk vs closed form): worst {check:.2e} "
        f"({'ok' if check < 1e-3 else 'FAILED'}).")
  smallest = results[min(results)]
  summary = dict(
      temp_gib={t: round(r["temp_gib"], 6) for t, r in results.items()},
      temp_growth=largest["temp_gib"] / smallest["temp_gib"],
      **(dict(temp_gib_16bit={t: round(r["temp_16bit_gib"], 6) for t, r in results.items()},
              temp_growth_16bit=largest["temp_16bit_gib"] / smallest["temp_16bit_gib"])
         if as_16bit else {}),
      flops_ratio=largest["executed_flops"] / largest["model_flops"],
      flops_breakdown={k: round(v, 4) for k, v in largest["breakdown"].items()},
      count_check=check)
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
  app.run(main)
