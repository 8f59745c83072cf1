"""Train-step throughput, FLOP utilisation and dynamic vs fixed micro-batching.

  python -m benchmarks.train_step --quick   # about 2 minutes on a 2-core CPU
  python -m benchmarks.train_step           # about 6 minutes on a 2-core CPU

Prints a table, then, as the last line, one JSON object with the headline figures.
Everything runs on one device (a 1-device mesh from `sharding.make_mesh`).

Sequence lengths are lognormal (median 160, sigma 1, rounded and clipped to
[16, 1024], seeded); prompts are 8..64 tokens, at most half the sequence.

Part 1 times `train_step.jit_train_step` for the `tiny` and `small` presets (vocab
256, max_seq_len 1024) on such sequences packed by `batching.pack_dynamic` into a
fixed number of well-filled rows of 1024 tokens, one row per micro-batch. Part 2 packs one set of sequences
two ways and times the same train step on both:

  * dynamic: `pack_dynamic` (FFD under a token budget) with R rows per micro-batch
    and budget = the longest sequence rounded up to 8, so a micro-batch is at most
    [R, T_max];
  * fixed: M = n / R equal-count micro-batches, one sequence per row, every row
    padded to the longest sequence of the batch (`batching.pack` with singleton
    groups): each micro-batch is exactly [R, T_max].

Both therefore have the same largest micro-batch shape, hence the same peak
activation memory; the dynamic one fills its rows with several sequences and so
runs fewer micro-batches. AReaL reports about +30% for dynamic micro-batching, but
against a baseline that packs each equal-count micro-batch without padding; the
padded baseline here wastes more, so expect a larger ratio.

Counting. "Trained tokens" are the valid (non-padding, segment id > 0) tokens:
prompt and completion tokens both run forward and backward. With the model's
matmul parameters

  N = L * (D*(H + 2K)*E + H*E*D + 3*D*F) + D*V

(q/k/v/o projections, SwiGLU MLP, LM head; the embedding lookup, norms and biases
do no matmul and are left out), the model FLOPs of one train step are

  sum over valid tokens of  6*N + 12*L*H*E*(p + 1)

where p is the token's position in its sequence, so p + 1 is the causal context it
attends to (QK^T and PV, 2*H*E*(p + 1) FLOPs each per layer forward; backward costs
twice the forward). "MFU" is model FLOP/s over the best float32 matmul FLOP/s
(2mnk/t) measured by this script in the same run, before and after the benchmarks.
"HFU" uses the FLOPs the dense implementation executes instead: every slot of every
micro-batch that has a loss token (empty micro-batches are skipped by `lax.cond`),
and full T x T attention scores per row whatever its segments, i.e. per micro-batch
[R, T]: 6*N*R*T + 12*L*H*E*R*T^2. So packing several sequences into a row costs
attention over the whole row, which works against the dynamic scheme here.

The proximal-policy recompute (`jit_recompute_logp`, forward only) that precedes
each update is not in the train-step figures; it is timed separately with
2*N + 4*L*H*E*(p + 1) FLOPs per valid token.

Padding fraction is 1 - valid tokens / slots of the executed micro-batches. Times
are medians over timed calls after a warm-up (compile) call, each call blocked on;
calls that are compared (recompute and step; dynamic and fixed) alternate.
"""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from async_rl import batching, loss, models, sharding, train_step
from async_rl.config import MeshConfig, OptimizerConfig
from async_rl.trajectory import Trajectory

_QUICK = flags.DEFINE_bool("quick", False, "Reduced run (< ~4 minutes on a 2-core CPU).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of lengths, tokens and params.")
_MATMUL = flags.DEFINE_integer("matmul_size", 1024, "m = n = k of the peak matmul.")

VOCAB = 256
MAX_SEQ_LEN = 1024
ROW_LEN = 1024
LENGTH_MEDIAN, LENGTH_SIGMA, MIN_LEN = 160, 1.0, 16

# Per run size: {preset: rows of ROW_LEN tokens} for part 1; part 2 sequence count n,
# rows per micro-batch R (so fixed M = n / R); timed steps per measurement.
QUICK = dict(rows={"tiny": 4, "small": 2}, ffd_n=16, ffd_rows=2, steps=2)
FULL = dict(rows={"tiny": 8, "small": 4}, ffd_n=48, ffd_rows=4, steps=4)


def lognormal_lengths(rng, n):
  lengths = rng.lognormal(np.log(LENGTH_MEDIAN), LENGTH_SIGMA, n)
  return np.clip(np.round(lengths), MIN_LEN, MAX_SEQ_LEN).astype(int)


def make_sequences(rng, lengths):
  """Random single-turn trajectories of `lengths` tokens and their advantages."""
  trajs = []
  for n in lengths:
    prompt_len = int(min(rng.integers(8, 65), n // 2))
    tokens = rng.integers(0, VOCAB, n)
    c = n - prompt_len
    trajs.append(Trajectory.from_completion(
        tokens[:prompt_len], tokens[prompt_len:], rng.normal(-3.0, 0.3, c),
        np.zeros(c, np.int32), "stop"))
  return trajs, rng.normal(size=len(trajs))


def sequences_for_rows(rng, rows):
  """Long-tailed sequences that FFD packs into `rows` rows of ROW_LEN tokens.

  Draws are kept while they still fit; filling stops after 8 draws in a row do not.
  """
  lengths, misses = [], 0
  while misses < 8:
    n = int(lognormal_lengths(rng, 1)[0])
    fits = len(batching.ffd_allocate(lengths + [n], ROW_LEN)) <= rows
    lengths, misses = (lengths + [n], 0) if fits else (lengths, misses + 1)
  return make_sequences(rng, lengths)


def matmul_params(cfg: models.ModelConfig) -> int:
  D, F, H, K, E, L, V = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads,
                         cfg.head_dim, cfg.n_layers, cfg.vocab_size)
  return L * (D * (H + 2 * K) * E + H * E * D + 3 * D * F) + D * V


def flop_counts(cfg: models.ModelConfig, batch: batching.PackedBatch):
  """Valid tokens, executed micro-batches and their slots, and the FLOP counts."""
  N = matmul_params(cfg)
  LHE = cfg.n_layers * cfg.n_heads * cfg.head_dim
  valid = batch.segment_ids > 0
  tokens = int(valid.sum())
  ctx = float((batch.positions + 1)[valid].sum())
  _, R, T = batch.tokens.shape
  mbs = int((batch.loss_mask.sum(axis=(1, 2)) > 0).sum())
  slots = mbs * R * T
  return dict(tokens=tokens, mbs=mbs, slots=slots,
              model=6 * N * tokens + 12 * LHE * ctx, forward=2 * N * tokens + 4 * LHE * ctx,
              executed=6 * N * slots + 12 * LHE * mbs * R * T * T)


def median_times(fns, steps):
  """Median wall time of each `fn()`, after one warm-up call each.

  The timed calls go round-robin, so a load change on a shared machine hits every
  measurement alike and ratios between them stay fair.
  """
  for fn in fns:
    jax.block_until_ready(fn())
  times = [[] for _ in fns]
  for _ in range(steps):
    for fn, ts in zip(fns, times):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - start)
  return [float(np.median(ts)) for ts in times]


def matmul_peak(size, reps=10):
  """Best float32 FLOP/s of a jitted [size, size] @ [size, size]."""
  a, b = (jax.random.normal(k, (size, size), jnp.float32)
          for k in jax.random.split(jax.random.key(0), 2))
  f = jax.jit(jnp.matmul)
  jax.block_until_ready(f(a, b))
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(f(a, b))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


class Bench:
  """A 1-device train state and the jitted step and recompute for one model."""

  def __init__(self, cfg: models.ModelConfig, seed: int):
    self.cfg = cfg
    self.mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    tx = train_step.make_optimizer(OptimizerConfig())
    self.state = train_step.create_train_state(cfg, tx, self.mesh, jax.random.key(seed))
    shardings = train_step.train_state_shardings(jax.eval_shape(lambda: self.state),
                                                 self.mesh)
    self.step = train_step.jit_train_step(
        self.mesh, shardings, model_cfg=cfg,
        loss_fn=loss.make_loss("decoupled_ppo", eps_clip=0.2))
    self.recompute = train_step.jit_recompute_logp(self.mesh, shardings.params,
                                                   model_cfg=cfg)
    self.batch_sh = train_step.batch_shardings(self.mesh)

  def prepare(self, batch: batching.PackedBatch):
    """`batch` on the device and its proximal log-probs."""
    batch = jax.device_put(batch, self.batch_sh)
    return batch, self.recompute(self.state.params, batch)

  def train(self, batch_and_prox):
    self.state, self.metrics = self.step(self.state, *batch_and_prox)
    return self.state, self.metrics

  def check_trained(self):
    if int(self.metrics["skipped"]):
      raise RuntimeError("the last train step was skipped as non-finite")


def bench_preset(name, rows, steps, rng, seed):
  cfg = models.preset(name, vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN)
  batch = batching.pack_dynamic(
      *sequences_for_rows(rng, rows), max_tokens_per_mb=ROW_LEN, rows_per_mb=1,
      row_buckets=batching.default_row_buckets(ROW_LEN))
  counts = flop_counts(cfg, batch)
  bench = Bench(cfg, seed)
  on_device = bench.prepare(batch)
  recompute_s, step_s = median_times(
      [lambda: bench.recompute(bench.state.params, on_device[0]),
       lambda: bench.train(on_device)], steps)
  bench.check_trained()
  return dict(
      shape="x".join(map(str, batch.tokens.shape)), params_matmul=matmul_params(cfg),
      tokens=counts["tokens"], padding=1 - counts["tokens"] / counts["slots"],
      step_s=step_s, tokens_per_s=counts["tokens"] / step_s,
      model_flops=counts["model"] / step_s, executed_flops=counts["executed"] / step_s,
      recompute_tokens_per_s=counts["tokens"] / recompute_s,
      recompute_flops=counts["forward"] / recompute_s)


def bench_ffd(n, rows_per_mb, steps, rng, seed):
  if n % rows_per_mb:
    raise ValueError(f"ffd sequence count {n} must be a multiple of rows per mb {rows_per_mb}")
  cfg = models.preset("tiny", vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN)
  seqs, adv_N = make_sequences(rng, lognormal_lengths(rng, n))
  longest = -(-max(len(s) for s in seqs) // 8) * 8
  batches = {
      "dynamic": batching.pack_dynamic(
          seqs, adv_N, max_tokens_per_mb=longest, rows_per_mb=rows_per_mb,
          row_buckets=batching.default_row_buckets(longest)),
      "fixed": batching.pack(seqs, adv_N, [[i] for i in range(n)], rows_per_mb=rows_per_mb,
                             row_len=max(len(s) for s in seqs)),
  }
  bench = Bench(cfg, seed)
  on_device = {name: bench.prepare(batch) for name, batch in batches.items()}
  times = median_times([functools.partial(bench.train, b) for b in on_device.values()], steps)
  bench.check_trained()
  out = {}
  for (name, batch), step_s in zip(batches.items(), times):
    counts = flop_counts(cfg, batch)
    out[name] = dict(shape="x".join(map(str, batch.tokens.shape)), tokens=counts["tokens"],
                     executed_mb=counts["mbs"], padding=1 - counts["tokens"] / counts["slots"],
                     step_s=step_s, tokens_per_s=counts["tokens"] / step_s,
                     model_flops=counts["model"] / step_s)
  return out


def main(argv):
  del argv
  size = QUICK if _QUICK.value else FULL
  rng = np.random.default_rng(_SEED.value)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), {'quick' if _QUICK.value else 'full'} run")
  peak_before = matmul_peak(_MATMUL.value)
  results = {name: bench_preset(name, rows, size["steps"], rng, _SEED.value)
             for name, rows in size["rows"].items()}
  ffd = bench_ffd(size["ffd_n"], size["ffd_rows"], size["steps"], rng, _SEED.value)
  # Measured before and after: on a shared machine the better one is nearer the peak.
  peak = max(peak_before, matmul_peak(_MATMUL.value))

  n = _MATMUL.value
  print(f"\nfloat32 matmul {n}x{n}x{n} peak: {peak / 1e9:.1f} GFLOP/s (best of 10 before "
        "and 10 after the benchmarks)\n")
  print(f"{'preset':<7}{'N_matmul':>10}{'batch MxRxT':>13}{'valid tok':>10}{'pad':>6}"
        f"{'step s':>8}{'tok/s':>9}{'GFLOP/s':>9}{'MFU':>7}{'HFU':>7}"
        f"{'recomp tok/s':>13}{'recomp MFU':>11}")
  for name, r in results.items():
    print(f"{name:<7}{r['params_matmul'] / 1e6:>9.2f}M{r['shape']:>13}{r['tokens']:>10}"
          f"{r['padding']:>6.1%}{r['step_s']:>8.2f}{r['tokens_per_s']:>9.0f}"
          f"{r['model_flops'] / 1e9:>9.2f}{r['model_flops'] / peak:>7.1%}"
          f"{r['executed_flops'] / peak:>7.1%}{r['recompute_tokens_per_s']:>13.0f}"
          f"{r['recompute_flops'] / peak:>11.1%}")
  print("MFU: model FLOP/s (6N + causal attention, valid tokens) / matmul peak; HFU: "
        "executed FLOP/s (all slots, dense T x T attention) / matmul peak.")

  ratio = ffd["dynamic"]["tokens_per_s"] / ffd["fixed"]["tokens_per_s"]
  print(f"\ntiny, {size['ffd_n']} lognormal sequences, {size['ffd_rows']} rows per "
        "micro-batch (same largest micro-batch shape both ways)")
  print(f"{'packing':<9}{'batch MxRxT':>13}{'run mb':>7}{'valid tok':>10}{'pad':>7}"
        f"{'step s':>8}{'tok/s':>9}{'MFU':>7}")
  for name, r in ffd.items():
    print(f"{name:<9}{r['shape']:>13}{r['executed_mb']:>7}{r['tokens']:>10}"
          f"{r['padding']:>7.1%}{r['step_s']:>8.2f}{r['tokens_per_s']:>9.0f}"
          f"{r['model_flops'] / peak:>7.1%}")
  print(f"dynamic / fixed trained tokens/s: {ratio:.2f}x (AReaL reports about 1.3x against "
        "an unpadded equal-count baseline)\n")

  headline = {"quick": _QUICK.value, "matmul_peak_flops": peak}
  for name, r in results.items():
    headline.update({f"{name}_tokens_per_s": r["tokens_per_s"],
                     f"{name}_model_flops_per_s": r["model_flops"],
                     f"{name}_mfu_vs_matmul": r["model_flops"] / peak,
                     f"{name}_padding_fraction": r["padding"],
                     f"{name}_recompute_tokens_per_s": r["recompute_tokens_per_s"]})
  headline.update({"ffd_tokens_per_s": ffd["dynamic"]["tokens_per_s"],
                   "fixed_tokens_per_s": ffd["fixed"]["tokens_per_s"],
                   "ffd_padding_fraction": ffd["dynamic"]["padding"],
                   "fixed_padding_fraction": ffd["fixed"]["padding"],
                   "ffd_vs_fixed_ratio": ratio})
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                    for k, v in headline.items()}))


if __name__ == "__main__":
  app.run(main)
