"""Train-step throughput and FLOP utilisation; dynamic vs fixed micro-batching.

  python -m benchmarks.train_step --quick   # about 2 minutes on a 2-core CPU
  python -m benchmarks.train_step           # about 5 minutes on a 2-core CPU

Prints tables, then, as the last line, one JSON object with the headline figures.
Everything runs on one device (a 1-device mesh from `sharding.make_mesh`).

Part 1 times `train_step.jit_train_step` for the `tiny` and `small` presets (vocab
256, max_seq_len 1024) on long-tailed sequences: lognormal lengths (median 160,
sigma 1, rounded and clipped to [16, 1024], seeded), prompts 8..64 tokens and at most
half the sequence, drawn until they hold the part's token count. They are packed as
the trainer packs them: `batching.pack_dynamic` with 1024 tokens per micro-batch, the
default row buckets and the model's `attention_break_even_len`, so the batch is
[M, R, T] with T chosen for the batch. The proximal-policy recompute
(`jit_recompute_logp`, forward only) is timed separately.

Part 2 packs one set of sequences two ways and times the same train step on both:

  * dynamic: `pack_dynamic` with a budget of R_fixed x T_max tokens per micro-batch
    (T_max the longest sequence rounded up to 8);
  * fixed: M = n / R_fixed equal-count micro-batches, one sequence per row, every row
    padded to the longest sequence (`batching.pack` with singleton groups), so each
    micro-batch is [R_fixed, T_max].

Both hold at most R_fixed x T_max tokens per micro-batch, hence the same peak
activation memory; the dynamic one fills rows with several sequences where that is
cheaper and runs fewer micro-batches. AReaL reports about +30% for dynamic
micro-batching against a baseline that packs without padding; the padded baseline
here wastes more, so expect a larger ratio.

Part 3 is the fixed GRPO workload (`benchmarks/grpo_step.py`): a Qwen2-shaped model
(vocab 256, d_model 128, 4 layers, 4 query / 2 KV heads, head_dim 32, MLP 512, q/k/v
bias, tied embeddings, float32, RoPE theta 1e6), 64 sequences of 16 prompt + 64 completion
tokens, packed as its trainer packs them (1024 tokens per micro-batch, rows of 80:
[8, 11, 80]), naive PPO (so no proximal recompute), the fused step on one thread.
Its FLOP floor is the model FLOPs at the matmul peak.

Counting. Model FLOPs (`models.flops.train_flops`) are those of the valid tokens:
6 N + 12 L H E (p + 1) per token at position p, N the matmul params. "MFU" is model
FLOP/s over the best float32 1024^3 matmul FLOP/s measured in the same run. "HFU"
counts executed matmul FLOPs instead, read from the compiled step
(`models.flops.executed_matmul_flops`: the HLO's dots with loop trip counts) and
scaled by the share of micro-batches that hold a token (the step skips the others):
padding slots, the attention blocks `attention.blockwise` computes (the diagonal
blocks in full) and any recomputation count there. The walk counts a conditional as
its costliest branch, so attention counts with its widest key window: an upper
bound where a micro-batch holds only short sequences.

Times are medians of calls after a warm-up (compile) call, each call blocked on; the
calls compared in one part take turns with a 1024^3 matmul, so each call's FLOP rate
is taken against the peak of its own round ("floor ratio" of part 3: median over
rounds of step time x peak / model FLOPs). The table's peak is the best of all rounds.
"""

import functools
import json

import jax
import numpy as np
from absl import app, flags

from async_rl import batching, loss, sharding, train_step
from async_rl.config import BatchingConfig, MeshConfig, ModelConfig, OptimizerConfig, model_preset
from async_rl.models import flops
from benchmarks.common.peak import matmul_peak
from benchmarks.common.timer import timed
from async_rl.trajectory import Trajectory

_QUICK = flags.DEFINE_bool("quick", False, "Reduced run (about 2 minutes on a 2-core CPU).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of lengths, tokens and params.")

VOCAB = 256
MAX_SEQ_LEN = 1024
MB_TOKENS = 1024
LENGTH_MEDIAN, LENGTH_SIGMA, MIN_LEN = 160, 1.0, 16
MATMUL = 1024
WORKLOAD_MODEL = ModelConfig(
    vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512,
    qkv_bias=True, tie_embeddings=True, rope_theta=1e6, max_seq_len=MAX_SEQ_LEN)
WORKLOAD_SEQS, WORKLOAD_PROMPT, WORKLOAD_COMPLETION = 64, 16, 64

# Per run size: {preset: tokens} for part 1; part 2 sequence count n and rows per
# fixed micro-batch R; timed calls per measurement.
QUICK = dict(tokens={"tiny": 4096, "small": 2048}, ffd_n=16, ffd_rows=2, steps=3)
FULL = dict(tokens={"tiny": 8192, "small": 4096}, ffd_n=48, ffd_rows=4, steps=6)


def lognormal_lengths(rng, n):
  lengths = rng.lognormal(np.log(LENGTH_MEDIAN), LENGTH_SIGMA, n)
  return np.clip(np.round(lengths), MIN_LEN, MAX_SEQ_LEN).astype(int)


def make_sequences(rng, lengths, prompt_lens=None):
  """Random single-turn trajectories of `lengths` tokens and their advantages."""
  trajs, adv_N = [], []
  for i, n in enumerate(lengths):
    prompt_len = int(min(rng.integers(8, 65), n // 2)) if prompt_lens is None else prompt_lens[i]
    tokens = rng.integers(3, VOCAB, n)
    c = n - prompt_len
    trajs.append(Trajectory.from_completion(
        tokens[:prompt_len], tokens[prompt_len:], rng.normal(-3.0, 0.3, c),
        np.zeros(c, np.int32), "stop"))
    adv_N.append(rng.normal())
  return trajs, np.array(adv_N)


def sequences_of(rng, tokens):
  """Long-tailed sequences drawn until they hold at least `tokens` tokens."""
  lengths = []
  while sum(lengths) < tokens:
    lengths.append(int(lognormal_lengths(rng, 1)[0]))
  return make_sequences(rng, lengths)


def workload_sequences(rng):
  n = WORKLOAD_PROMPT + WORKLOAD_COMPLETION
  return make_sequences(rng, [n] * WORKLOAD_SEQS, [WORKLOAD_PROMPT] * WORKLOAD_SEQS)


def pack(cfg, trajs, adv_N, mb_tokens=MB_TOKENS, longest=None):
  """As the trainer packs on one device (`longest`: the longest sequence the run can
  produce, which adds its row length to the buckets)."""
  return batching.pack_dynamic(trajs, adv_N, max_tokens_per_mb=mb_tokens, num_shards=1,
                               row_buckets=batching.default_row_buckets(mb_tokens,
                                                                        longest=longest),
                               attention_len=flops.attention_break_even_len(cfg))


def workload_pack(trajs, adv_N):
  """The GRPO workload as its trainer packs it: the default budget and rows of the
  80-token sequences."""
  return pack(WORKLOAD_MODEL, trajs, adv_N, longest=WORKLOAD_PROMPT + WORKLOAD_COMPLETION,
              mb_tokens=BatchingConfig().max_tokens_per_mb)


def timed_rounds(fns, steps):
  """Per-call wall times of each `fn()` and the matmul peak of each round.

  One warm-up call each, then `steps` rounds in which a peak measurement and every
  fn take turns, so a load change on a shared machine hits all of them alike.
  """
  for fn in fns:
    jax.block_until_ready(fn())
  times, peaks = [[] for _ in fns], []
  for _ in range(steps):
    peaks.append(matmul_peak(reps=3))
    for fn, ts in zip(fns, times):
      ts.append(timed(fn)[1])
  return np.array(times), np.array(peaks)


class Bench:
  """A 1-device train state and the jitted step and recompute for one model."""

  def __init__(self, cfg: ModelConfig, seed: int):
    self.cfg = cfg
    self.mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    tx = train_step.make_optimizer(OptimizerConfig())
    self.state, shardings = train_step.create_train_state(cfg, tx, self.mesh,
                                                          jax.random.key(seed))
    self.step = train_step.jit_train_step(
        self.mesh, shardings, model_cfg=cfg, loss_fn=loss.make_loss("decoupled_ppo", eps_clip=0.2))
    self.recompute = train_step.jit_recompute_logp(self.mesh, shardings.params,
                                                   model_cfg=cfg)
    self.batch_sh = train_step.batch_shardings(self.mesh)

  def prepare(self, batch: batching.PackedBatch, recompute=True):
    """`batch` on the device and its proximal log-probs (the behaviour's: naive PPO)."""
    batch = jax.device_put(batch, self.batch_sh)
    return batch, (self.recompute(self.state.params, batch) if recompute else batch.behav_logp)

  def train(self, batch_and_prox):
    self.state, self.metrics = self.step(self.state, *batch_and_prox)
    return self.state, self.metrics

  def executed_flops(self, batch_and_prox) -> float:
    """Executed matmul FLOPs of one step on `batch_and_prox` (module docstring)."""
    hlo = self.step.lower(self.state, *batch_and_prox).compile().as_text()
    real = np.asarray(batch_and_prox[0].loss_mask).sum(axis=(1, 2)) > 0
    return flops.executed_matmul_flops(hlo) * real.mean()

  def check_trained(self):
    if int(self.metrics["skipped"]):
      raise RuntimeError("the last train step was skipped as non-finite")


def counts(cfg, batch):
  valid = np.asarray(batch.segment_ids) > 0
  tokens = int(valid.sum())
  slots = int((np.asarray(batch.loss_mask).sum(axis=(1, 2)) > 0).sum()) * np.prod(
      batch.tokens.shape[1:])
  positions = np.asarray(batch.positions)[valid]
  forward = flops.train_flops(cfg, positions) / 3
  return dict(tokens=tokens, padding=1 - tokens / slots, model=flops.train_flops(cfg, positions),
              forward=forward, shape="x".join(map(str, batch.tokens.shape)))


def bench_preset(name, tokens, steps, rng, seed):
  cfg = model_preset(name, vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN)
  bench = Bench(cfg, seed)
  host = pack(cfg, *sequences_of(rng, tokens))
  batch = bench.prepare(host)
  c = counts(cfg, host)
  (recompute_t, step_t), peaks = timed_rounds(
      [lambda: bench.recompute(bench.state.params, batch[0]), lambda: bench.train(batch)],
      steps)
  bench.check_trained()
  executed = bench.executed_flops(batch)
  step_s, recompute_s = float(np.median(step_t)), float(np.median(recompute_t))
  return dict(c, params_matmul=flops.matmul_params(cfg), step_s=step_s,
              tokens_per_s=c["tokens"] / step_s, peak=float(peaks.max()),
              mfu=float(np.median(c["model"] / step_t / peaks)),
              hfu=float(np.median(executed / step_t / peaks)),
              model_flops=c["model"] / step_s, recompute_tokens_per_s=c["tokens"] / recompute_s,
              recompute_mfu=float(np.median(c["forward"] / recompute_t / peaks)))


def bench_ffd(n, rows, steps, rng, seed):
  if n % rows:
    raise ValueError(f"ffd sequence count {n} must be a multiple of rows per mb {rows}")
  cfg = model_preset("tiny", vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN)
  seqs, adv_N = make_sequences(rng, lognormal_lengths(rng, n))
  longest = max(len(s) for s in seqs)
  batches = {
      "dynamic": pack(cfg, seqs, adv_N, mb_tokens=rows * (-(-longest // 8) * 8)),
      "fixed": batching.pack(seqs, adv_N, [[i] for i in range(n)], rows_per_mb=rows,
                             row_len=longest),
  }
  bench = Bench(cfg, seed)
  on_device = {name: bench.prepare(batch) for name, batch in batches.items()}
  times, peaks = timed_rounds(
      [functools.partial(bench.train, b) for b in on_device.values()], steps)
  bench.check_trained()
  out = {}
  for (name, batch), step_t in zip(batches.items(), times):
    c = counts(cfg, batch)
    step_s = float(np.median(step_t))
    out[name] = dict(c, executed_mb=int((batch.loss_mask.sum(axis=(1, 2)) > 0).sum()),
                     step_s=step_s, tokens_per_s=c["tokens"] / step_s,
                     mfu=float(np.median(c["model"] / step_t / peaks)))
  return out


def bench_workload(steps, seed):
  rng = np.random.default_rng(seed)
  bench = Bench(WORKLOAD_MODEL, seed)
  host = workload_pack(*workload_sequences(rng))
  batch = bench.prepare(host, recompute=False)
  c = counts(WORKLOAD_MODEL, host)
  (step_t,), peaks = timed_rounds([lambda: bench.train(batch)], steps)
  bench.check_trained()
  floor_t = c["model"] / peaks
  return dict(c, step_s=float(np.median(step_t)), floor_s=float(np.median(floor_t)),
              floor_ratio=float(np.median(step_t / floor_t)),
              executed_over_model=bench.executed_flops(batch) / c["model"])


def main(argv):
  del argv
  size = QUICK if _QUICK.value else FULL
  rng = np.random.default_rng(_SEED.value)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), {'quick' if _QUICK.value else 'full'} run")
  results = {name: bench_preset(name, tokens, size["steps"], rng, _SEED.value)
             for name, tokens in size["tokens"].items()}
  ffd = bench_ffd(size["ffd_n"], size["ffd_rows"], size["steps"], rng, _SEED.value)
  work = bench_workload(2 * size["steps"], _SEED.value)
  peak = max(r["peak"] for r in results.values())

  print(f"\nfloat32 matmul {MATMUL}^3 peak: {peak / 1e9:.1f} GFLOP/s (best round); MFU and "
        "HFU take each call against its own round's peak\n")
  print(f"{'preset':<7}{'N_matmul':>10}{'batch MxRxT':>13}{'valid tok':>10}{'pad':>6}"
        f"{'step s':>8}{'tok/s':>9}{'GFLOP/s':>9}{'MFU':>7}{'HFU':>7}"
        f"{'recomp tok/s':>13}{'recomp MFU':>11}")
  for name, r in results.items():
    print(f"{name:<7}{r['params_matmul'] / 1e6:>9.2f}M{r['shape']:>13}{r['tokens']:>10}"
          f"{r['padding']:>6.1%}{r['step_s']:>8.3f}{r['tokens_per_s']:>9.0f}"
          f"{r['model_flops'] / 1e9:>9.2f}{r['mfu']:>7.1%}{r['hfu']:>7.1%}"
          f"{r['recompute_tokens_per_s']:>13.0f}{r['recompute_mfu']:>11.1%}")
  print("MFU: model FLOP/s (6N + causal attention, valid tokens) / matmul peak; HFU: "
        "executed matmul FLOP/s (compiled step) / matmul peak.")

  ratio = ffd["dynamic"]["tokens_per_s"] / ffd["fixed"]["tokens_per_s"]
  print(f"\ntiny, {size['ffd_n']} lognormal sequences, at most {size['ffd_rows']} x the "
        "longest tokens per micro-batch both ways")
  print(f"{'packing':<9}{'batch MxRxT':>13}{'run mb':>7}{'valid tok':>10}{'pad':>7}"
        f"{'step s':>8}{'tok/s':>9}{'MFU':>7}")
  for name, r in ffd.items():
    print(f"{name:<9}{r['shape']:>13}{r['executed_mb']:>7}{r['tokens']:>10}"
          f"{r['padding']:>7.1%}{r['step_s']:>8.3f}{r['tokens_per_s']:>9.0f}{r['mfu']:>7.1%}")
  print(f"dynamic / fixed trained tokens/s: {ratio:.2f}x (AReaL reports about 1.3x against "
        "an unpadded equal-count baseline)")

  print(f"\nGRPO workload train step ({WORKLOAD_SEQS} x {WORKLOAD_PROMPT}+"
        f"{WORKLOAD_COMPLETION} tokens, naive PPO): batch {work['shape']}, padding "
        f"{work['padding']:.1%}, {work['step_s']:.3f} s; FLOP floor {work['floor_s']:.3f} s "
        f"({work['model'] / 1e9:.1f} GFLOP); step / floor {work['floor_ratio']:.2f}x; "
        f"executed / model matmul FLOPs {work['executed_over_model']:.2f}\n")

  headline = {"quick": _QUICK.value, "matmul_peak_flops": peak}
  for name, r in results.items():
    headline.update({f"{name}_tokens_per_s": r["tokens_per_s"],
                     f"{name}_model_flops_per_s": r["model_flops"],
                     f"{name}_mfu_vs_matmul": r["mfu"], f"{name}_hfu_vs_matmul": r["hfu"],
                     f"{name}_padding_fraction": r["padding"],
                     f"{name}_recompute_tokens_per_s": r["recompute_tokens_per_s"]})
  headline.update({"ffd_tokens_per_s": ffd["dynamic"]["tokens_per_s"],
                   "fixed_tokens_per_s": ffd["fixed"]["tokens_per_s"],
                   "ffd_padding_fraction": ffd["dynamic"]["padding"],
                   "fixed_padding_fraction": ffd["fixed"]["padding"],
                   "ffd_vs_fixed_ratio": ratio,
                   "workload_step_s": work["step_s"], "workload_floor_s": work["floor_s"],
                   "workload_floor_ratio": work["floor_ratio"]})
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                    for k, v in headline.items()}))


if __name__ == "__main__":
  app.run(main)
