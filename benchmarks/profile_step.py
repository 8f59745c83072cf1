"""Where the train step's time goes: a profiler trace of it, summed by layer part and op kind.

  python -m benchmarks.profile_step                        # tiny, small, workload
  python -m benchmarks.profile_step --models=small --trace_dir=/tmp/trace

For each model, the batch `benchmarks/train_step.py` times (part 1 for tiny and
small, part 3 for the GRPO workload) is compiled and run once, then --steps calls
are traced with `jax.profiler` (the trace lands in --trace_dir, readable by
TensorBoard's profile plugin or Perfetto). Every op event on XLA's CPU worker threads
is attributed, through the op_name metadata of the optimised HLO, to

  * a part of the model: the named scopes `qkv` (q/k/v projections and rotary
    embedding), `attention`, `out_proj`, `mlp` (with its norm), `logp` (final norm,
    LM head, softmax), or `other` (embedding, the first norm, loss, optimizer, loops);
  * a kind: `matmul` (dots), `layout` (transposes and copies between layouts),
    `buffers` (dynamic slices and updates, broadcasts: loop bookkeeping) or
    `elementwise` (everything else, reductions included).

Printed per model: ms per step by part and kind (summed over the worker threads), the
share of the step's wall time the worker threads were busy, and the costliest ops.
Last line: JSON of the same per-model tables.
"""

import collections
import glob
import json
import os
import re
import tempfile
import time

import jax
import numpy as np
from absl import app, flags
from jax.profiler import ProfileData

from async_rl.config import model_preset
from benchmarks import train_step as bench

_MODELS = flags.DEFINE_list("models", ["tiny", "small", "workload"],
                            "Presets of benchmarks/train_step.py part 1, or `workload`.")
_STEPS = flags.DEFINE_integer("steps", 3, "Traced calls per model.")
_TRACE_DIR = flags.DEFINE_string("trace_dir", None, "Where traces go (default: a temp dir).")

PARTS = ("qkv", "attention", "out_proj", "mlp", "logp")
KINDS = ("matmul", "layout", "buffers", "elementwise")
_NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool", "while", "cond", "call")


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, bool]]:
  """HLO instruction name -> (its op_name metadata, whether it is or fuses a dot).

  An op whose own metadata names no part (XLA:CPU's dot fusions often have none)
  takes the first op_name inside its computation that names one, else that of its
  first operand that names one.
  """
  fused_dot, inner, current = set(), collections.defaultdict(list), None
  for line in hlo_text.splitlines():
    header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
    if header:
      current = header.group(1)
      continue
    if " dot(" in line and current:
      fused_dot.add(current)
    op_name = re.search(r'op_name="([^"]*)"', line)
    if op_name and current:
      inner[current].append(op_name.group(1))
  def named(comp):
    names = inner.get(comp, [])
    return next((n for n in names if _part(n) != "other"), names[0] if names else "")
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
    if m:
      op_name = re.search(r'op_name="([^"]*)"', m.group(2))
      calls = re.search(r"calls=%([\w.\-]+)", m.group(2))
      callee = calls.group(1) if calls else None
      own = op_name.group(1) if op_name else ""
      if _part(own) == "other" and callee:
        own = named(callee) or own
      if _part(own) == "other":  # an op XLA made up: its operands' part
        operands = re.findall(r"%([\w.\-]+)", m.group(2).split("),")[0])
        own = next((out[o][0] for o in operands if o in out and _part(out[o][0]) != "other"),
                   own)
      out[m.group(1)] = (own, " dot(" in m.group(2) or callee in fused_dot)
  return out


def _part(op_name: str) -> str:
  return next((p for p in PARTS if re.search(rf"\b{p}\b", op_name)), "other")


def classify(name: str, op_name: str, has_dot: bool) -> tuple[str, str]:
  part = _part(op_name)
  last = op_name.rsplit("/", 1)[-1]
  if has_dot:
    kind = "matmul"
  elif "transpose" in name or name.startswith("copy") or last in ("transpose", "copy"):
    kind = "layout"
  elif re.search(r"dynamic.(update.)?slice|broadcast", name + last):
    kind = "buffers"
  else:
    kind = "elementwise"
  return part, kind


def summarize(trace_dir: str, hlo_text: str, steps: int, wall_s: float) -> dict:
  ops = hlo_ops(hlo_text)
  path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
  table, per_op, busy = collections.Counter(), collections.Counter(), 0.0
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLAEigen"):
        continue
      for ev in line.events:
        if ev.name.startswith(_NOT_OPS):
          continue
        ms = ev.duration_ns / 1e6 / steps
        table[classify(ev.name, *ops.get(ev.name, ("", False)))] += ms
        per_op[ev.name] += ms
        busy += ms
  return dict(
      ms={f"{p}/{k}": round(table[(p, k)], 2) for p in PARTS + ("other",) for k in KINDS},
      busy_ms=busy, wall_ms=wall_s * 1e3 / steps,
      top=[(n, round(ms, 2), ops.get(n, ("",))[0][-70:]) for n, ms in per_op.most_common(12)])


def profile(model: str, steps: int, trace_dir: str, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  if model == "workload":  # naive PPO: the behaviour log-probs stand in for the proximal
    cfg, seqs, recompute = bench.WORKLOAD_MODEL, bench.workload_sequences(rng), False
  else:
    cfg = model_preset(model, vocab_size=bench.VOCAB, max_seq_len=bench.MAX_SEQ_LEN)
    seqs, recompute = bench.sequences_of(rng, bench.FULL["tokens"][model]), True
  b = bench.Bench(cfg, seed)
  host = bench.workload_pack(*seqs) if model == "workload" else bench.pack(cfg, *seqs)
  batch = b.prepare(host, recompute=recompute)
  jax.block_until_ready(b.train(batch))
  hlo = b.step.lower(b.state, *batch).compile().as_text()
  jax.profiler.start_trace(trace_dir)
  start = time.perf_counter()
  for _ in range(steps):
    jax.block_until_ready(b.train(batch))
  wall = time.perf_counter() - start
  jax.profiler.stop_trace()
  return dict(summarize(trace_dir, hlo, steps, wall),
              shape="x".join(map(str, batch[0].tokens.shape)))


def main(argv):
  del argv
  root = _TRACE_DIR.value or tempfile.mkdtemp(prefix="async_rl_profile_")
  print(f"jax {jax.__version__} on {jax.default_backend()}; traces in {root}")
  out = {}
  for model in _MODELS.value:
    # --seed is the flag benchmarks/train_step.py defines.
    r = profile(model, _STEPS.value, os.path.join(root, model), flags.FLAGS.seed)
    out[model] = r
    # XLA:CPU runs one worker thread per core.
    busy = r["busy_ms"] / (r["wall_ms"] * os.cpu_count())
    print(f"\n{model}: batch {r['shape']}, {r['wall_ms']:.0f} ms per step, worker threads "
          f"busy {busy:.0%} of it; op time per step in ms (summed over threads):")
    print(f"{'part':<11}" + "".join(f"{k:>12}" for k in KINDS) + f"{'total':>10}{'share':>8}")
    for part in PARTS + ("other",):
      row = [r["ms"][f"{part}/{k}"] for k in KINDS]
      print(f"{part:<11}" + "".join(f"{v:>12.1f}" for v in row)
            + f"{sum(row):>10.1f}{sum(row) / r['busy_ms']:>8.1%}")
    print("costliest ops: " + "; ".join(f"{n} {ms} ms ({op})" for n, ms, op in r["top"][:6]))
  print(json.dumps({m: {"shape": r["shape"], "wall_ms": round(r["wall_ms"], 1),
                        "busy_ms": round(r["busy_ms"], 1), "ms": r["ms"]}
                    for m, r in out.items()}))


if __name__ == "__main__":
  app.run(main)
