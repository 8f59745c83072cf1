r"""A fixed GRPO workload end to end through the library, against its FLOP floor.

  python -m benchmarks.grpo_step            # every variant, 10 steps each
  python -m benchmarks.grpo_step --quick    # sync_naive alone, 3 steps (the test)

The workload: a Qwen2-shaped model (vocab 256, d_model 128, 4
layers, 4 query / 2 KV heads, head_dim 32, MLP 512, q/k/v bias, tied embeddings,
float32, RoPE theta 1e6) with every weight matrix ~ N(0, 0.02), biases 0 and norm
scales 1, passed as the run's initial params (no warm start). Per RL step 16 prompts
of 16 token ids uniform in [3, 255], drawn fresh from a seeded stream; 4 samples per
prompt at temperature 1 with no top-k / top-p and no stop id, so every sample has
exactly 64 new tokens; reward the fraction of even completion ids; group-normalised
advantages, eps 0.2, Adam 1e-4, no KL term (but in the _kl variant), one optimizer
step per RL step. All 64
samples of a step decode together (64 generator slots). Everything else is the
library's default (1024 tokens per micro-batch, so [8, 11, 80] batches; 8 decode
steps per host round trip), and the run is `rl.entry.run`, as a user's would be;
held-out evaluation (one prompt) runs only before the first and after the last step.
On the CPU, the synchronous variants give the generator and the trainer every core
(they take turns), the overlapping ones half each (`config.CPUConfig`).

Variants (`--variants`): η = `staleness.max_staleness`, the weight-update mode,
`ppo.prox_logp` and `ppo.kl_beta`:

  sync_naive          η = 0, drain, behav       the synchronous baseline, naive PPO
  sync_decoupled      η = 0, drain, recompute   decoupled PPO (proximal recompute)
  sync_decoupled_kl   η = 0, drain, recompute,  and a KL penalty to the initial params in
                      kl_beta 0.04              the loss (k3): a reference forward per step
  overlap_naive       η = 1, drain, behav       one-step overlap of generation and training
  overlap_decoupled   η = 1, drain, recompute
  overlap_loglinear   η = 1, drain, loglinear   AReaL's proximal estimate, no recompute

Timing. A step runs from the end of one update to the end of the next: the ends of
the trainer's "train" spans (`async_rl.timeline`). The first `WARMUP` steps (which
compile) are left out and the figures are medians over the remaining steps (so
`--steps` >= WARMUP + 8 for 8 timed steps). Per step: "gen s" is the
time the generator was busy (decoding, prefilling, swapping weights) within the
step, "train s" the trainer's train span (packing, the transfer, the reference
forward with a KL penalty, the recompute where decoupled, the update), "wait s" how long the trainer waited for its batch, and
"decode steps" the generator's device decode steps (a sample's first token comes from
its prefill, so 63 would decode one step's samples if they all started together).

FLOP floor. With N the matmul params (`models.flops.matmul_params`) and L H E the
layers x query heads x head dim, a forward at position p costs 2 N + 4 L H E (p + 1)
FLOPs and a forward and backward 6 N + 12 L H E (p + 1) (`models.flops.train_flops`).
One RL step needs, over the 64 sequences of positions p = 0 .. 79 (16 prompt + 64
new tokens):

  floor FLOPs = F_fwd (generation) + [F_fwd (proximal recompute, decoupled only)]
                + [F_fwd (reference forward, KL penalty only)]
                + 3 F_fwd (train forward and backward),
  F_fwd = sum over the 64 x 80 tokens of 2 N + 4 L H E (p + 1),

(the generation term counts what the pool computes: it prefills a prompt once for its
group and feeds back 63 of the new tokens, 4,288 token forwards instead of 5,120),
and floor_s = floor FLOPs / the best float32 1024^3 matmul FLOP/s measured in this
run (`train_step.matmul_peak`, before each variant and after the last), so
floor_ratio = s/step / floor_s. "gen ratio" and "train ratio" divide each
part's seconds by its own floor (F_fwd; the rest), to show which part is far off.

Prints a table, then, as the last line, one JSON object: `sec_per_step`, `floor_s`,
`floor_ratio` of sync_naive, `matmul_gflops`, and `variants` with each variant's
figures and its sanity counts (completion lengths generated, mean rewards).
"""

import dataclasses
import json
import tempfile
from typing import Optional

import jax
import numpy as np
from absl import app, flags, logging

from async_rl import cpu, models, timeline
from async_rl.config import (CPUConfig, EvalConfig, ExperimentConfig, GenerationConfig,
                             ModelConfig, OptimizerConfig, PPOConfig, StalenessConfig, TaskConfig)
from async_rl.models import flops
from async_rl.rl import entry
from benchmarks.common.run_stats import measured_config
from benchmarks.train_step import matmul_peak

# --quick (sync_naive alone, 3 steps) and --seed (params, prompts and sampling) are
# the flags benchmarks/train_step.py defines.
_STEPS = flags.DEFINE_integer("steps", None, "RL steps per variant (default 10; quick 3).")
_VARIANTS = flags.DEFINE_list("variants", None, "Which variants, in order (default: all; "
                              "quick: sync_naive).")

WARMUP = 2
PROMPTS, PROMPT_LEN, GROUP, NEW_TOKENS = 16, 16, 4, 64
SEQUENCES = PROMPTS * GROUP
MODEL = ModelConfig(
    vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512,
    qkv_bias=True, tie_embeddings=True, rope_theta=1e6, dtype="float32",
    param_dtype="float32", max_seq_len=PROMPT_LEN + NEW_TOKENS)
INIT_STD = 0.02
FIRST_ID = 3  # Prompt ids are uniform in [FIRST_ID, vocab).

VARIANTS = {  # name: (max_staleness, update_mode, ppo.prox_logp, ppo.kl_beta)
    "sync_naive": (0, "drain", "behav", 0.0),
    "sync_decoupled": (0, "drain", "recompute", 0.0),
    "sync_decoupled_kl": (0, "drain", "recompute", 0.04),
    "overlap_naive": (1, "drain", "behav", 0.0),
    "overlap_decoupled": (1, "drain", "recompute", 0.0),
    "overlap_loglinear": (1, "drain", "loglinear", 0.0),
}
QUICK_VARIANTS = ("sync_naive",)
HEADLINE = "sync_naive"


def even_fraction(completion: str, reference) -> float:
  """The reward: the share of the completion's token ids that are even."""
  del reference
  ids = completion.split()
  return sum(int(i) % 2 == 0 for i in ids) / len(ids) if ids else 0.0


class IdTokenizer:
  """Token ids as decimal words; no stop id, so every sample runs to max_new_tokens."""
  stop_ids = ()

  def __init__(self, vocab_size: int = MODEL.vocab_size):
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]:
    return [int(i) for i in text.split()]

  def decode(self, ids) -> str:
    return " ".join(str(int(i)) for i in ids)


@dataclasses.dataclass(frozen=True)
class RandomPrompt:
  id: str
  tokens: tuple[int, ...]


class RandomPrompts:
  """An endless stream of random prompts of `prompt_len` ids in [FIRST_ID, vocab_size);
  prompt i is drawn from (seed, i) alone."""

  def __init__(self, seed: int, index: int = 0, split: str = "train", *,
               vocab_size: int = MODEL.vocab_size, prompt_len: int = PROMPT_LEN):
    self.seed, self.index, self.split = seed, index, split
    self.vocab_size, self.prompt_len = vocab_size, prompt_len

  def __iter__(self):
    return self

  def __next__(self) -> RandomPrompt:
    rng = np.random.default_rng([self.seed, self.index])
    tokens = rng.integers(FIRST_ID, self.vocab_size, self.prompt_len)
    prompt = RandomPrompt(f"{self.split}/{self.seed}/{self.index}", tuple(map(int, tokens)))
    self.index += 1
    return prompt

  def state(self) -> dict[str, int]:
    return {"seed": self.seed, "index": self.index}


class RandomTokenTask:
  """The workload's task (`tasks.protocol.Task`): random prompts, the even-id reward."""
  reward_fn = staticmethod(even_fraction)
  workflow = None

  def __init__(self, seed: int, *, vocab_size: int = MODEL.vocab_size,
               prompt_len: int = PROMPT_LEN):
    self.seed, self.tokenizer = seed, IdTokenizer(vocab_size)
    self._shape = dict(vocab_size=vocab_size, prompt_len=prompt_len)

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0) -> RandomPrompts:
    seed = self.seed + 1000 * (worker_index + 1)  # The held-out set takes seed + 0.
    return RandomPrompts(seed, state["index"] if state else 0, **self._shape)

  def heldout(self, n: int) -> list[RandomPrompt]:
    prompts = RandomPrompts(self.seed, split="heldout", **self._shape)
    return [next(prompts) for _ in range(n)]

  @staticmethod
  def reference(prompt: RandomPrompt) -> None:
    del prompt


def make_task(cfg: TaskConfig) -> RandomTokenTask:
  """The task factory (`task.name="benchmarks.grpo_step:make_task"`); its seed is
  `task.options["seed"]`, and `vocab_size` and `prompt_len` may be given there too
  (default: the workload's)."""
  return RandomTokenTask(**cfg.options)


def init_params(cfg: ModelConfig, seed: int):
  """Weight matrices ~ N(0, INIT_STD), biases 0, norm scales 1, as host arrays (numpy's
  generator: jax.random would compile for every shape, seconds each on a CPU)."""
  abstract = models.abstract_params(cfg)
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    name = path[-1].key
    if name.endswith("norm"):
      return np.ones(x.shape, x.dtype)
    if name.endswith("bias"):
      return np.zeros(x.shape, x.dtype)
    return rng.normal(0.0, INIT_STD, x.shape).astype(x.dtype)

  return jax.tree.map_with_path(leaf, abstract)


def experiment(name: str, steps: int, seed: int) -> ExperimentConfig:
  eta, mode, prox, kl_beta = VARIANTS[name]
  threads = cpu.cores() if eta == 0 else 0  # Taking turns, each side may use every core.
  cfg = ExperimentConfig(
      seed=seed, batch_groups=PROMPTS,
      task=TaskConfig(name="benchmarks.grpo_step:make_task", options={"seed": seed}),
      cpu=CPUConfig(decode_threads=threads, grad_threads=threads), model=MODEL,
      optimizer=OptimizerConfig(learning_rate=1e-4),
      ppo=PPOConfig(prox_logp=prox, num_minibatches=1, eps_clip=0.2, kl_beta=kl_beta),
      generation=GenerationConfig(max_prompt_len=PROMPT_LEN, max_new_tokens=NEW_TOKENS,
                                  group_size=GROUP, temperature=1.0, top_k=0, top_p=1.0,
                                  num_slots=SEQUENCES, update_mode=mode),
      staleness=StalenessConfig(max_staleness=eta), eval=EvalConfig(num_prompts=1, pass_k=1))
  return measured_config(cfg, steps)


def step_flops(cfg: ModelConfig, ppo: PPOConfig) -> tuple[float, float]:
  """The floor FLOPs of one RL step's generation and of its training (module docstring)."""
  positions = np.tile(np.arange(PROMPT_LEN + NEW_TOKENS), SEQUENCES)
  forward = flops.train_flops(cfg, positions) / 3
  return forward, forward * (3 + (ppo.prox_logp == "recompute") + (ppo.kl_beta > 0))


def step_figures(summary: dict) -> dict[str, np.ndarray]:
  """Per timed step (after WARMUP): its wall time and where it went."""
  spans, history = summary["timeline"], summary["history"]
  train = [s for s in spans if s.lane == "trainer" and s.name == "train"]
  if len(train) != len(history) or len(train) <= WARMUP:
    raise RuntimeError(f"{len(train)} train spans for {len(history)} steps; need more than "
                       f"{WARMUP}")
  ends = np.array([s.end for s in train])
  windows = list(zip(ends[WARMUP - 1:-1], ends[WARMUP:]))
  return {
      "step_s": np.diff(ends)[WARMUP - 1:],
      "gen_s": np.array([timeline.busy_fraction(spans, "generator", a, b) * (b - a)
                         for a, b in windows]),
      "train_s": np.array([s.end - s.start for s in train[WARMUP:]]),
      "wait_s": np.array([m["time_wait_s"] for m in history[WARMUP:]]),
      "decode_steps": np.diff([m["workers"]["0"]["pool"]["decode_steps"]
                              for m in history])[WARMUP - 1:],
  }


def run_variant(name: str, steps: int, seed: int) -> dict:
  cfg = experiment(name, steps, seed)
  with tempfile.TemporaryDirectory(prefix=f"grpo_step_{name}_") as workdir:
    summary = entry.run(cfg, workdir, init_params=init_params(cfg.model, seed),
                        task=make_task(cfg.task), echo=lambda _: None, progress=False)
  per_step = step_figures(summary)
  history = summary["history"]
  generated = summary["server"]["length_hist"]["generated"]
  return {
      **{k: float(np.median(v)) for k, v in per_step.items()},
      "timed_steps": len(per_step["step_s"]),
      **dict(zip(("gen_flops", "train_flops"), step_flops(cfg.model, cfg.ppo))),
      "staleness_max": max(m["staleness_max"] for m in history),
      "skipped_steps": history[-1]["skipped_steps"],
      "trained_tokens": sorted({m["trained_tokens"] for m in history}),
      "completion_lengths": {str(n): c for n, c in enumerate(generated) if c},
      "reward_mean": [min(m["reward_mean"] for m in history),
                      max(m["reward_mean"] for m in history)],
  }


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  steps = _STEPS.value or (3 if flags.FLAGS.quick else 10)
  names = _VARIANTS.value or list(QUICK_VARIANTS if flags.FLAGS.quick else VARIANTS)
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown or HEADLINE not in names:
    raise app.UsageError(f"--variants must include {HEADLINE} and name only "
                         f"{sorted(VARIANTS)}; got {names}")
  if steps <= WARMUP:
    raise app.UsageError(f"--steps must exceed the {WARMUP} warm-up steps")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{steps} steps per variant, the first {WARMUP} untimed", flush=True)
  peaks, results = [matmul_peak()], {}
  for name in names:
    results[name] = run_variant(name, steps, flags.FLAGS.seed)
    peaks.append(matmul_peak())
    results[name]["matmul_gflops_after"] = peaks[-1] / 1e9
    print(f"{name}: {results[name]['step_s']:.3f} s/step", flush=True)
  peak = max(peaks)
  for r in results.values():
    r["floor_s"] = (r["gen_flops"] + r["train_flops"]) / peak
    r["floor_ratio"] = r["step_s"] / r["floor_s"]
    r["gen_floor_ratio"] = r["gen_s"] * peak / r["gen_flops"]
    r["train_floor_ratio"] = r["train_s"] * peak / r["train_flops"]
  _print_table(results, peak, peaks)
  head = results[HEADLINE]
  print(json.dumps({
      "quick": flags.FLAGS.quick, "steps": steps, "warmup": WARMUP,
      "sec_per_step": _round(head["step_s"]), "floor_s": _round(head["floor_s"]),
      "floor_ratio": _round(head["floor_ratio"]), "matmul_gflops": _round(peak / 1e9),
      "variants": {n: {k: _round(v) for k, v in r.items()} for n, r in results.items()}}))


def _round(v):
  return round(v, 4) if isinstance(v, float) else v


def _print_table(results, peak, peaks):
  print(f"\nfloat32 1024^3 matmul: best {peak / 1e9:.1f} GFLOP/s of "
        f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)} (before each variant and after the "
        f"last); the floor divides by the best\n")
  cols = [("step_s", "s/step", ".3f"), ("gen_s", "gen s", ".3f"), ("train_s", "train s", ".3f"),
          ("wait_s", "wait s", ".3f"), ("decode_steps", "dec steps", ".0f"),
          ("floor_s", "floor s", ".3f"),
          ("floor_ratio", "ratio", ".2f"), ("gen_floor_ratio", "gen ratio", ".2f"),
          ("train_floor_ratio", "train ratio", ".2f"), ("staleness_max", "stale max", "d")]
  print(f"{'variant':20}" + "".join(f"{h:>12}" for _, h, _ in cols))
  for name, r in results.items():
    print(f"{name:20}" + "".join(format(r[k], fmt).rjust(12) for k, _, fmt in cols))
  print(f"\nmedians over {next(iter(results.values()))['timed_steps']} steps; floor: model "
        f"FLOPs of generation, recompute (decoupled), reference forward (KL) and train at the "
        f"best matmul rate; gen and train ratios: each part's seconds over its own floor\n")


if __name__ == "__main__":
  app.run(main)
