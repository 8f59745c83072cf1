"""What recording a run's schedule costs, and whether a sample decodes alike beside others.

  python -m benchmarks.replay --quick   # a few minutes on a 2-core CPU
  python -m benchmarks.replay

Prints tables, then, as the last line, one JSON object with the headline figures.

Part 1, recording overhead. For the micro and tiny configs (their models and batches:
B groups of G samples, prompts of `max_prompt_len` / 2 tokens, completions of uniform
length in [1, `max_new_tokens`], versions spread over the η + 1 a batch may hold,
seeded), it times what a recording run adds to each step, `schedule.write_batch` of the
batch into a temporary directory (arrays, digest, file), against the step itself,
`Trainer.train` of a trainer the builder makes (`build.make_trainer`: packing,
proximal recompute, update), calls and a float32 1024³ matmul peak taking turns.
Overhead: median record time / median step time. Recording costs per token, a step
per token and parameter, so the smallest model is the worst case. Then a recording
run of the micro config (`entry.run`, its η and update mode): the median
`time_record_s` of its step lines against the median time between two of them (the
loop's whole step: waiting for groups, training, publishing, logging, checkpointing).

Part 2, decode independence. One request of n samples (temperature 1, a fixed seed)
is decoded alone and among other requests (other prompts and lengths, another pool
seed) by an engine of one slot group and one of two (`cpu.SlotGroupEngine`, as the
builder makes on a CPU with 4 or more cores); it counts the samples whose tokens and
whose behaviour log-probs differ in any bit, and the largest log-prob difference.
Log-probs that differ in their last bits are why a replay re-executes the trainer
on the recorded tokens rather than regenerating them (`rl.replay`).
"""

import dataclasses
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from async_rl import cpu, models, sharding
from async_rl.cli import from_dict
from async_rl.config import ModelConfig
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.rl import build, entry, schedule
from async_rl.trajectory import Group, Trajectory
# Also defines --quick (fewer rounds and samples here) and --seed (of the batches and prompts).
from benchmarks.train_step import matmul_peak

ROOT = Path(__file__).parents[1]
DECODE_MODEL = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=32, d_ff=512, max_seq_len=256)


def _config(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return build.resolve(from_dict(module.get_config()))


def _batch(cfg, rng):
  """A batch of the config's shape: B groups of G scored samples, versions 0..η."""
  g = cfg.generation
  eta = cfg.staleness.max_staleness
  groups = []
  for b in range(cfg.batch_groups):
    trajs = []
    for _ in range(g.group_size):
      C = int(rng.integers(1, g.max_new_tokens + 1))
      prompt = rng.integers(0, cfg.model.vocab_size, g.max_prompt_len // 2)
      trajs.append(Trajectory.from_completion(
          prompt, rng.integers(0, cfg.model.vocab_size, C),
          -rng.exponential(2.0, C).astype(np.float32), np.sort(rng.integers(0, eta + 1, C)),
          "stop", reward=float(rng.integers(0, 2))))
    groups.append(Group(b, tuple(trajs)))
  return groups


def bench_recording(name, rounds, rng):
  cfg = _config(name)
  trainer = build.make_trainer(cfg, sharding.make_mesh(cfg.mesh, jax.devices()[:1]))
  groups = _batch(cfg, rng)
  context = build.record_context(cfg, trainer.mesh)
  with tempfile.TemporaryDirectory() as directory:
    record = lambda: schedule.write_batch(directory, 1, groups, context=context)
    trainer.train(groups)  # the compile
    record()
    record_t, step_t, peaks = [], [], []
    for _ in range(rounds):
      peaks.append(matmul_peak(reps=3))
      t0 = time.perf_counter()
      record()
      t1 = time.perf_counter()
      trainer.train(groups)
      t2 = time.perf_counter()
      record_t.append(t1 - t0)
      step_t.append(t2 - t1)
    size = sum(p.stat().st_size for p in Path(directory).iterdir())
  tokens = sum(len(t) for g in groups for t in g.trajectories)
  record_s, step_s = float(np.median(record_t)), float(np.median(step_t))
  return dict(tokens=tokens, samples=cfg.batch_groups * cfg.generation.group_size,
              params=sum(x.size for x in jax.tree.leaves(trainer.state.params)),
              record_ms=record_s * 1e3, step_s=step_s, overhead=record_s / step_s,
              bytes=size, peak=float(max(peaks)))


def bench_run(name, steps):
  """A recording run of `steps` steps: its record time per step against its step time."""
  cfg = dataclasses.replace(_config(name), num_steps=steps)
  with tempfile.TemporaryDirectory() as workdir:
    entry.run(cfg, workdir, progress=False, echo=lambda _: None)
    rows = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
  lines = [line for line in map(json.loads, rows) if "loss" in line]
  record_s = float(np.median([line["time_record_s"] for line in lines]))
  step_s = float(np.median(np.diff([line["time"] for line in lines])))
  return dict(steps=len(lines), record_ms=record_s * 1e3, step_s=step_s,
              overhead=record_s / step_s)


def _decode(engine, params, requests, seed):
  with GeneratorPool(engine, params, seed=seed) as pool:
    futures = [pool.submit(r) for r in requests]
    return [f.result(timeout=600) for f in futures]


def bench_decode(groups, samples, rng):
  """One request decoded alone and among others by an engine of `groups` slot groups."""
  params = jax.jit(models.init_params, static_argnums=0)(DECODE_MODEL, jax.random.key(0))
  new = 64
  engine = Engine(DECODE_MODEL, max_concurrent_decodes=16 // groups, max_prefill_length=32,
                  max_target_length=32 + new, steps_per_call=8)
  engine = cpu.SlotGroupEngine(engine, groups) if groups > 1 else engine
  engine.warmup(params)
  prompts = [rng.integers(0, DECODE_MODEL.vocab_size, rng.integers(2, 31)).tolist()
             for _ in range(12)]
  target = Request("target", prompts[0], n=samples,
                   sampling=SamplingParams(temperature=1.0, max_new_tokens=new, seed=7))
  others = [Request(i, p, n=2, sampling=SamplingParams(max_new_tokens=3 + 5 * i, seed=100 + i))
            for i, p in enumerate(prompts[1:])]
  alone = _decode(engine, params, [target], seed=0)[0]
  crowded = _decode(engine, params, others[:5] + [target] + others[5:], seed=3)[5]
  same_tokens = [np.array_equal(a.tokens_T, b.tokens_T) for a, b in zip(alone, crowded)]
  logp_bits = [a.logp_T.tobytes() == b.logp_T.tobytes() for a, b in zip(alone, crowded)]
  largest = max((float(np.max(np.abs(a.logp_T - b.logp_T)))
                 for a, b, same in zip(alone, crowded, same_tokens) if same), default=0.0)
  return dict(samples=samples, tokens_differ=same_tokens.count(False),
              logp_bits_differ=logp_bits.count(False), logp_max_abs_diff=largest)


def main(argv):
  del argv
  quick = flags.FLAGS.quick
  rounds, samples = (3, 4) if quick else (8, 8)
  rng = np.random.default_rng(flags.FLAGS.seed)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), {'quick' if quick else 'full'} run")
  recording = {name: bench_recording(name, rounds, rng) for name in ("micro", "tiny")}
  run = bench_run("micro", 6 if quick else 12)
  decode = {groups: bench_decode(groups, samples, rng) for groups in (1, 2)}
  peak = max(r["peak"] for r in recording.values())

  print(f"\nfloat32 matmul 1024^3 peak: {peak / 1e9:.1f} GFLOP/s (best round)\n")
  print(f"{'config':<7}{'params':>9}{'samples':>8}{'tokens':>8}{'record ms':>10}"
        f"{'KiB':>7}{'step s':>8}{'overhead':>9}")
  for name, r in recording.items():
    print(f"{name:<7}{r['params']:>9}{r['samples']:>8}{r['tokens']:>8}"
          f"{r['record_ms']:>10.2f}{r['bytes'] / 1024:>7.0f}{r['step_s']:>8.3f}"
          f"{r['overhead']:>9.2%}")
  print(f"\nmicro run of {run['steps']} steps: record {run['record_ms']:.2f} ms per step, "
        f"step {run['step_s']:.3f} s, overhead {run['overhead']:.2%}")
  print("\nthe same request of temperature-1 samples, decoded alone and among 11 others")
  print(f"{'slot groups':<12}{'samples':>8}{'tokens differ':>14}{'log-probs differ':>17}"
        f"{'max |diff|':>11}")
  for groups, r in decode.items():
    print(f"{groups:<12}{r['samples']:>8}{r['tokens_differ']:>14}{r['logp_bits_differ']:>17}"
          f"{r['logp_max_abs_diff']:>11.2g}")
  headline = {"quick": quick, "matmul_peak_flops": peak}
  for name, r in recording.items():
    headline.update({f"{name}_record_ms": r["record_ms"], f"{name}_step_s": r["step_s"],
                     f"{name}_record_overhead": r["overhead"],
                     f"{name}_record_bytes": r["bytes"]})
  headline.update(micro_run_record_ms=run["record_ms"], micro_run_step_s=run["step_s"],
                  micro_run_record_overhead=run["overhead"])
  for groups, r in decode.items():
    headline.update({f"decode_{groups}_groups_tokens_differ": r["tokens_differ"],
                     f"decode_{groups}_groups_logp_bits_differ": r["logp_bits_differ"]})
  print(json.dumps(headline))


if __name__ == "__main__":
  app.run(main)
