r"""SmolLM2-135M's shapes end to end: decode, the train step and the GRPO workload, each
against its FLOP floor at the matmul peak of the same run and against transformers (and,
given its virtualenv, TRL) doing the same work in the same run.

  python -m benchmarks.real_model                      # about 40 minutes on a 2-core CPU
  python -m benchmarks.real_model --trl_python=/tmp/trl_venv/bin/python   # and TRL
  python -m benchmarks.real_model --quick              # 2 layers, vocab 4096 (the test)

(`benchmarks/peers/trl_grpo.py` says how to make TRL's virtualenv.)

The model: SmolLM2-135M's shapes (the `smollm2-135m` preset, a Llama: vocab 49152,
d_model 576, 30 layers, 9 query / 3 KV heads, head_dim 64, MLP 1536, no q/k/v bias, tied
embeddings, RoPE theta 1e5, RMS eps 1e-5), float32, weight matrices ~ N(0, 0.02) and
norm scales 1: a stand-in with random weights, since speed does not depend on them.
transformers runs a `LlamaForCausalLM` of the same config (its own init, at the same
std). --quick keeps the shapes but 2 layers and a vocab of 4096.

Parts (`--parts`), each comparison taking turns with the other side and with a 1024^3
float32 matmul, `--rounds` times, its best round reported (others' load on a shared
machine only adds time):

  decode: S prompts of 40 random ids, 64 new tokens each at temperature 1 with no stop
    id, S = 1, 8, 32 (--quick: 1, 8): the library's `GeneratorPool` on the engine the
    builder makes for a synchronous run (every core decodes, `cpu.decode_threads`),
    against transformers' `generate` (KV cache, sampling, torch on every core). Tokens/s
    is S x 64 over the wall time from the requests to the last token, prefill included;
    the floor is the FLOPs of P + 63 token forwards per sequence at the peak.
  train: the GRPO workload's training batch (8 groups of 4 sequences of 40 + 64 tokens,
    naive PPO, advantages from random rewards) through the builder's trainer
    (`rl.build.make_trainer`: packing, the transfer, the update: `Trainer.train`),
    against transformers on the same 32 x 104 tokens: a forward with logits at the
    completion positions only (as TRL's `logits_to_keep`), log-probs, the entropy (no
    gradient), the clipped PPO loss, backward and an AdamW step. MFU is the model
    FLOPs (6 N + 12 L H E (p + 1) per token, `models.flops.train_flops`) per second
    over the peak.
  grpo: the GRPO workload through the builder (`rl.entry.run`, in a process of its own):
    per RL step 8 prompts of 40 random ids, 4 samples each, exactly 64 new tokens,
    reward the share of even ids (`benchmarks/grpo_step.py`'s task), group-normalised
    advantages, naive PPO (η = 0, drain), AdamW 1e-4, every core to the generator and
    the trainer in turn; `--steps` steps, the first 2 untimed, medians of the rest (gen
    s, train s as `benchmarks/grpo_step.py` splits a step). Its floor: the FLOPs of each
    prompt's forward once (for its group), 63 token forwards per sample, and the train
    forward and backward, at the peak. With --trl_python, TRL 1.16's `GRPOTrainer` on the
    same workload (`benchmarks/peers/trl_grpo.py --workload=real_model`), after the
    library's runs.
  overlap: the grpo workload with η = 1 (the library's asynchronous mode): the samples
    of step v + 1 are generated while step v trains, the generator and the trainer on
    half the cores each (the defaults of `cpu`), naive PPO as above.
  first_step: seconds from starting a process that runs the grpo workload to the end of
    its first RL step, with an empty compilation cache (cold: a fresh
    `JAX_COMPILATION_CACHE_DIR`) and again with the cache that run filled (warm: the grpo
    part's run), and each process's peak RSS.

Prints tables, then, as the last line, one JSON object.
"""

import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags, logging

from async_rl import cpu, sharding
from async_rl.config import (CPUConfig, EvalConfig, ExperimentConfig, GenerationConfig,
                             MeshConfig, ModelConfig, OptimizerConfig, PPOConfig,
                             StalenessConfig, TaskConfig, model_preset)
from async_rl.generation import GeneratorPool, Request, SamplingParams
from async_rl.models import flops
from async_rl.rl import build, entry
from async_rl.trajectory import Group, Trajectory
from benchmarks import grpo_step
from benchmarks.common.peak import matmul_peak
from benchmarks.common.run_stats import measured_config

# --quick and --seed are benchmarks/train_step.py's flags and --steps grpo_step.py's,
# which grpo_step imports.
_PARTS = flags.DEFINE_list("parts", ["decode", "train", "grpo", "overlap", "first_step"],
                           "Which parts, of decode, train, grpo, overlap, first_step.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Turns of each side-by-side comparison.")
_TRL_PYTHON = flags.DEFINE_string("trl_python", None, "A Python with TRL 1.16 "
                                  "(benchmarks/peers/trl_grpo.py): runs its GRPOTrainer too.")

ROOT = Path(__file__).parents[1]
PROMPTS, PROMPT_LEN, GROUP, NEW_TOKENS = 8, 40, 4, 64
SEQUENCES = PROMPTS * GROUP
MODEL = model_preset("smollm2-135m", dtype="float32", param_dtype="float32")
QUICK_MODEL = dataclasses.replace(MODEL, n_layers=2, vocab_size=4096)
PARTS = ("decode", "train", "grpo", "overlap", "first_step")


def model_cfg(quick: bool) -> ModelConfig:
  return QUICK_MODEL if quick else MODEL


def experiment(cfg: ModelConfig, *, steps: int, seed: int, num_slots: int = SEQUENCES,
               eta: int = 0) -> ExperimentConfig:
  """The GRPO workload's run, naive PPO: synchronous (η = 0) with every core to each side
  in turn, or overlapping (η = 1) with half each."""
  cores = cpu.cores() if eta == 0 else 0
  return measured_config(ExperimentConfig(
      seed=seed, batch_groups=PROMPTS, model=cfg,
      task=TaskConfig(name="benchmarks.grpo_step:make_task",
                      options={"seed": seed, "vocab_size": cfg.vocab_size,
                               "prompt_len": PROMPT_LEN}),
      cpu=CPUConfig(decode_threads=cores, grad_threads=cores),
      optimizer=OptimizerConfig(learning_rate=1e-4),
      ppo=PPOConfig(prox_logp="behav", num_minibatches=1, eps_clip=0.2),
      generation=GenerationConfig(max_prompt_len=PROMPT_LEN, max_new_tokens=NEW_TOKENS,
                                  group_size=GROUP, temperature=1.0, top_k=0, top_p=1.0,
                                  num_slots=num_slots, update_mode="drain"),
      staleness=StalenessConfig(max_staleness=eta), eval=EvalConfig(num_prompts=1, pass_k=1)),
      steps)


def forward_flops(cfg: ModelConfig, lengths) -> float:
  """FLOPs of one forward of every position of sequences of `lengths` tokens."""
  return flops.train_flops(cfg, np.concatenate([np.arange(n) for n in lengths])) / 3


def gen_flops(cfg: ModelConfig) -> float:
  """The least FLOPs of a step's generation: each prompt's forward once for its group,
  then 63 token forwards per sample (the 64th token needs none)."""
  prompts = np.tile(np.arange(PROMPT_LEN), PROMPTS)
  samples = np.tile(np.arange(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS - 1), SEQUENCES)
  return flops.train_flops(cfg, np.concatenate([prompts, samples])) / 3


def _torch_model(cfg: ModelConfig, seed: int):
  import torch
  import transformers
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, attention_bias=False,
      rms_norm_eps=cfg.rms_eps, tie_word_embeddings=True, initializer_range=grpo_step.INIT_STD,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
      max_position_embeddings=cfg.max_seq_len, bos_token_id=None, eos_token_id=None,
      pad_token_id=None, dtype="float32")
  return transformers.LlamaForCausalLM(config).float()


def _best_of_rounds(fns: dict, rounds: int, peaks: list) -> dict:
  """Each fn's fastest of `rounds` calls, taking turns with each other and the peak."""
  seconds = {k: [] for k in fns}
  for _ in range(rounds):
    peaks.append(matmul_peak())
    for k, fn in fns.items():
      start = time.perf_counter()
      fn()
      seconds[k].append(time.perf_counter() - start)
  return {k: min(v) for k, v in seconds.items()}


def decode_part(cfg: ModelConfig, slots, rounds: int, seed: int, peaks: list) -> dict:
  """Tokens/s of the library's pool and of transformers' `generate` at each S."""
  import torch
  import transformers
  torch.set_num_threads(cpu.cores())
  hf = _torch_model(cfg, seed).eval()
  params = grpo_step.init_params(cfg, seed)
  rng = np.random.default_rng(seed)
  out = {}
  for S in slots:
    prompts = rng.integers(grpo_step.FIRST_ID, cfg.vocab_size, (S, PROMPT_LEN))
    engine = build.make_engine(experiment(cfg, steps=3, seed=seed, num_slots=S))
    gen_cfg = transformers.GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
        eos_token_id=None, pad_token_id=0)
    with GeneratorPool(engine, params, seed=seed) as pool:
      def ours():
        futures = [pool.submit(Request(i, p.tolist(), sampling=SamplingParams(
            max_new_tokens=NEW_TOKENS, seed=i))) for i, p in enumerate(prompts)]
        samples = [s for f in futures for s in f.result()]
        assert all(len(s.completion_C) == NEW_TOKENS for s in samples)

      def theirs():
        with torch.inference_mode():
          ids = hf.generate(torch.tensor(prompts), attention_mask=torch.ones(
              prompts.shape, dtype=torch.long), generation_config=gen_cfg)
        assert ids.shape == (S, PROMPT_LEN + NEW_TOKENS)

      ours(), theirs()  # compiles, warms up
      best = _best_of_rounds({"ours": ours, "transformers": theirs}, rounds, peaks)
    out[str(S)] = {
        "tokens_per_s": S * NEW_TOKENS / best["ours"],
        "hf_tokens_per_s": S * NEW_TOKENS / best["transformers"],
        "ratio": best["transformers"] / best["ours"],
        "flops": forward_flops(cfg, [PROMPT_LEN + NEW_TOKENS - 1] * S),
        "seconds": best["ours"], "hf_seconds": best["transformers"]}
    print(f"decode S={S}: {out[str(S)]['tokens_per_s']:.1f} tokens/s, transformers "
          f"{out[str(S)]['hf_tokens_per_s']:.1f}", flush=True)
  del hf, params
  gc.collect()
  return out


def _groups(cfg: ModelConfig, seed: int) -> list[Group]:
  """The workload's training batch: 8 groups of 4 samples with random rewards."""
  rng = np.random.default_rng(seed)
  groups = []
  for g in range(PROMPTS):
    prompt = rng.integers(grpo_step.FIRST_ID, cfg.vocab_size, PROMPT_LEN)
    groups.append(Group(g, tuple(Trajectory.from_completion(
        prompt, rng.integers(0, cfg.vocab_size, NEW_TOKENS), rng.normal(-10.0, 1.0, NEW_TOKENS),
        np.zeros(NEW_TOKENS, np.int32), "length", reward=float(rng.random()))
        for _ in range(GROUP))))
  return groups


def train_part(cfg: ModelConfig, rounds: int, seed: int, peaks: list) -> dict:
  """Seconds per train step of the builder's trainer and of transformers."""
  import torch
  torch.set_num_threads(cpu.cores())
  run_cfg = build.resolve(experiment(cfg, steps=3, seed=seed))
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  trainer = build.make_trainer(run_cfg, mesh, grpo_step.init_params(cfg, seed))
  groups = _groups(cfg, seed)
  shapes = []

  def ours():
    metrics = trainer.train(groups)
    assert not metrics["skipped"] and metrics["trained_tokens"] == SEQUENCES * NEW_TOKENS
    shapes.append(metrics["packed_tokens"])

  hf = _torch_model(cfg, seed).train()
  opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.0)
  tokens = torch.tensor(np.array([t.tokens_T for g in groups for t in g.trajectories]))
  adv = torch.tensor(np.random.default_rng(seed).normal(size=(SEQUENCES, 1)), dtype=torch.float32)

  def theirs():
    logits = hf(input_ids=tokens, logits_to_keep=NEW_TOKENS + 1).logits[:, :-1]
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, tokens[:, PROMPT_LEN:, None])[..., 0]
    with torch.no_grad():
      entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
    ratio = torch.exp(logp - logp.detach())
    loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert torch.isfinite(loss) and torch.isfinite(entropy)

  ours(), theirs()  # compiles, warms up
  best = _best_of_rounds({"ours": ours, "transformers": theirs}, rounds, peaks)
  positions = np.tile(np.arange(PROMPT_LEN + NEW_TOKENS), SEQUENCES)
  out = {"seconds": best["ours"], "hf_seconds": best["transformers"],
         "ratio": best["transformers"] / best["ours"],
         "tokens_per_s": len(positions) / best["ours"],
         "hf_tokens_per_s": len(positions) / best["transformers"],
         "flops": flops.train_flops(cfg, positions), "packed_tokens": shapes[-1],
         "grad_threads": build.grad_threads(run_cfg, mesh)}
  print(f"train: {out['seconds']:.2f} s/step, transformers {out['hf_seconds']:.2f}", flush=True)
  del trainer, hf, opt
  gc.collect()
  return out


def run_child(quick: bool, steps: int, seed: int, eta: int) -> dict:
  """The GRPO workload in this process (started by `_grpo_process`): its step figures,
  when its first step ended (`time.time()`) and its peak RSS."""
  logging.set_verbosity(logging.WARNING)
  cfg = experiment(model_cfg(quick), steps=steps, seed=seed, eta=eta)
  with tempfile.TemporaryDirectory(prefix="real_model_") as workdir:
    summary = entry.run(cfg, workdir, init_params=grpo_step.init_params(cfg.model, seed),
                        task=grpo_step.make_task(cfg.task), echo=lambda _: None,
                        progress=False)
  train = [s for s in summary["timeline"] if s.lane == "trainer" and s.name == "train"]
  out = {"first_step_end": train[0].end,
         "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
         "completion_lengths": sorted({int(n) for n, c in enumerate(
             summary["server"]["length_hist"]["generated"]) if c})}
  if steps > grpo_step.WARMUP:
    out.update({k: float(np.median(v)) for k, v in grpo_step.step_figures(summary).items()})
  return out


def _grpo_process(quick: bool, steps: int, seed: int, cache_dir: str, eta: int = 0) -> dict:
  """`run_child` in a new Python process with `cache_dir` as its compilation cache; with
  the seconds from starting it to the end of its first step."""
  code = (f"import json; from benchmarks import real_model; "
          f"print(json.dumps(real_model.run_child({quick}, {steps}, {seed}, {eta})))")
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=cache_dir)
  start = time.time()
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True)
  if out.returncode:
    raise RuntimeError(f"the GRPO run failed:\n{out.stderr[-3000:]}")
  result = json.loads(out.stdout.strip().splitlines()[-1])
  result["to_first_step_s"] = result.pop("first_step_end") - start
  return result


def trl_part(python: str, steps: int, seed: int) -> dict:
  out = subprocess.run([python, "trl_grpo.py", "--workload=real_model", f"--steps={steps}",
                        f"--seed={seed}", f"--threads={cpu.cores()}"],
                       cwd=ROOT / "benchmarks" / "peers", capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"TRL's run failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  parts = _PARTS.value
  if set(parts) - set(PARTS):
    raise app.UsageError(f"--parts must name some of {PARTS}, got {parts}")
  quick, seed = flags.FLAGS.quick, flags.FLAGS.seed
  steps = flags.FLAGS.steps or (grpo_step.WARMUP + 1 if quick else 6)
  if steps <= grpo_step.WARMUP:
    raise app.UsageError(f"--steps must exceed the {grpo_step.WARMUP} warm-up steps")
  cfg = model_cfg(quick)
  load_before = os.getloadavg()
  print(f"jax {jax.__version__}, {cpu.cores()} cores, load {load_before[0]:.1f}; model "
        f"{cfg.n_layers} layers, vocab {cfg.vocab_size}, {cfg.num_params() / 1e6:.1f}M params",
        flush=True)
  peaks, result = [matmul_peak()], {}
  if "decode" in parts:
    result["decode"] = decode_part(cfg, (1, 8) if quick else (1, 8, 32), _ROUNDS.value, seed,
                                   peaks)
  if "train" in parts:
    result["train"] = train_part(cfg, _ROUNDS.value, seed, peaks)
  with tempfile.TemporaryDirectory(prefix="real_model_jax_cache_") as cache:
    if "first_step" in parts:
      result["first_step_cold"] = _grpo_process(quick, 1, seed, cache)
    if "grpo" in parts or "first_step" in parts:
      peaks.append(matmul_peak())
      result["grpo"] = _grpo_process(quick, steps, seed, cache)
    if "overlap" in parts:
      peaks.append(matmul_peak())
      result["overlap"] = _grpo_process(quick, steps, seed, cache, eta=1)
  if "grpo" in parts and _TRL_PYTHON.value:
    peaks.append(matmul_peak())
    result["trl"] = trl_part(_TRL_PYTHON.value, steps, seed)
  peaks.append(matmul_peak())
  peak = max(peaks)
  summary = figures(cfg, result, peak)
  summary.update(matmul_gflops=peak / 1e9, matmul_gflops_runs=[p / 1e9 for p in peaks],
                 load=[load_before[0], os.getloadavg()[0]], quick=quick, steps=steps,
                 layers=cfg.n_layers, vocab=cfg.vocab_size)
  print_tables(summary)
  print(json.dumps(_rounded(summary)))


def figures(cfg: ModelConfig, result: dict, peak: float) -> dict:
  """The parts' figures against the peak: floors, MFU and the ratios of the goals."""
  out = dict(result)
  for row in out.get("decode", {}).values():
    row["floor_ratio"] = row["seconds"] * peak / row["flops"]
  if "train" in out:
    out["train"]["mfu"] = out["train"]["flops"] / out["train"]["seconds"] / peak
    out["train"]["hf_mfu"] = out["train"]["flops"] / out["train"]["hf_seconds"] / peak
  for name in ("grpo", "overlap"):
    if "step_s" not in out.get(name, {}):
      continue
    run = out[name]
    train = flops.train_flops(cfg, np.tile(np.arange(PROMPT_LEN + NEW_TOKENS), SEQUENCES))
    run.update(floor_s=(gen_flops(cfg) + train) / peak, train_mfu=train / run["train_s"] / peak)
    run["floor_ratio"] = run["step_s"] / run["floor_s"]
    if "trl" in out:
      run["vs_trl"] = run["step_s"] / out["trl"]["sec_per_step"]
  return out


def print_tables(s: dict) -> None:
  print(f"\nfloat32 1024^3 matmul: best {s['matmul_gflops']:.1f} GFLOP/s of "
        f"{', '.join(f'{p:.0f}' for p in s['matmul_gflops_runs'])}; load {s['load'][0]:.1f} "
        f"before, {s['load'][1]:.1f} after")
  if "decode" in s:
    print(f"\n{'decode':8}{'tokens/s':>10}{'hf tok/s':>10}{'vs hf':>8}{'floor x':>9}")
    for S, r in s["decode"].items():
      print(f"S={S:<6}{r['tokens_per_s']:>10.1f}{r['hf_tokens_per_s']:>10.1f}"
            f"{r['ratio']:>8.2f}{r['floor_ratio']:>9.2f}")
  if "train" in s:
    t = s["train"]
    print(f"\ntrain step: {t['seconds']:.2f} s ({t['tokens_per_s']:.0f} tokens/s, MFU "
          f"{t['mfu']:.0%}); transformers {t['hf_seconds']:.2f} s (MFU {t['hf_mfu']:.0%}); "
          f"{t['ratio']:.2f}x")
  for name, mode in (("grpo", "η = 0"), ("overlap", "η = 1")):
    if "step_s" not in s.get(name, {}):
      continue
    g = s[name]
    vs_trl = f"; {g['vs_trl']:.2f}x TRL's time" if "vs_trl" in g else ""
    print(f"\nGRPO step, {mode}: {g['step_s']:.2f} s (gen {g['gen_s']:.2f}, train "
          f"{g['train_s']:.2f}, train MFU {g['train_mfu']:.0%}), {g['floor_ratio']:.2f}x its "
          f"floor of {g['floor_s']:.2f} s{vs_trl}; peak RSS {g['peak_rss_gb']:.2f} GiB")
  if "trl" in s:
    r = s["trl"]
    print(f"TRL: {r['sec_per_step']:.2f} s (generate {r['gen_s']:.2f}, train {r['train_s']:.2f})")
  if "first_step_cold" in s:
    print(f"\nto the first RL step: {s['first_step_cold']['to_first_step_s']:.1f} s cold, "
          f"{s['grpo']['to_first_step_s']:.1f} s with the compilation cache warm; peak RSS "
          f"{s['first_step_cold']['peak_rss_gb']:.2f} GiB")


def _rounded(x):
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_rounded(v) for v in x]
  return round(x, 4) if isinstance(x, float) else x


if __name__ == "__main__":
  app.run(main)
