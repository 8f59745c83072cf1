r"""The GRPO workload (`benchmarks/grpo_step.py`) through Hugging Face TRL's `GRPOTrainer`, on CPU.

  python -m venv /tmp/trl_venv
  /tmp/trl_venv/bin/pip install torch==2.13.0 trl==1.16.0   # pinned torch: the CPU build
  /tmp/trl_venv/bin/python benchmarks/peers/trl_grpo.py [--steps 10] [--seed 0] [--threads N]
  /tmp/trl_venv/bin/python benchmarks/peers/trl_grpo.py --workload=real_model

`--workload=real_model` runs `benchmarks/real_model.py`'s workload instead (which starts
this script itself when given `--trl_python`): a Llama model of SmolLM2-135M's shapes
(vocab 49152, hidden 576, 30 layers, 9 query / 3 KV heads, head_dim 64, MLP 1536, no
bias, tied embeddings, RoPE theta 1e5, RMS eps 1e-5) with weights ~ N(0, 0.02), per RL
step 8 prompts of 40 ids uniform in [3, 49151], otherwise as below; it also reports the
seconds each step spent in `generate` (TRL's `_generate`), the rest being training.

A peer baseline, for a side-by-side comparison with the library's synchronous run,
`python -m benchmarks.grpo_step --variants=sync_naive`, whose docstring fixes the
workload; it runs in its own virtualenv (TRL and torch, not the project's JAX). The
same workload: a Qwen2 model (vocab 256, hidden 128, 4 layers, 4 query / 2 KV heads,
head_dim 32, MLP 512, q/k/v bias, tied embeddings, float32, RoPE theta 1e6) with
weight matrices ~ N(0, 0.02), biases 0 and norm scales 1 (transformers' own init at
initializer_range 0.02 and no padding_idx; checked); per RL step 16 prompts of 16 ids
uniform in [3, 255] (the same prompts as the library's stream for the seed), 4
samples each at temperature 1, no top-k / top-p, exactly 64 new tokens (the only
stop id is one the model cannot emit); reward the fraction of even completion ids;
group-normalised advantages, eps 0.2, AdamW at 1e-4 (constant, no warmup, no weight
decay, global-norm clip 1, as the library's defaults), no KL term, one optimizer step
per RL step: all 64 completions generate together and make one batch, so the
PPO ratio is taken against the behaviour policy (naive PPO, as sync_naive).
float32 throughout, no gradient checkpointing (TRL turns it on by default), no vLLM.
Beyond the workload, and not to be turned off: TRL takes the per-token entropy in the
loss forward (a logged metric), and `generate` prefills each of the 64 sequences (the
library prefills a prompt once for its group).

Measures the wall time of an RL step, from the end of one optimizer update to the end
of the next (`on_step_end`), median and min over the steps after the first WARMUP,
and the float32 1024^3 matmul rate with torch before and after training. Prints a
summary, then, as the last line, one JSON object.
"""

import argparse
import collections
import json
import os
import tempfile
import time

import numpy as np
import torch
import transformers
import trl
from datasets import Dataset

from peer_workload import (GROUP, INIT_STD, NEW_TOKENS, PROMPT_LEN, PROMPTS, REAL_PROMPT_LEN,
                           REAL_PROMPTS, REAL_VOCAB, VOCAB, WARMUP, even_fraction, make_tokenizer,
                           prompt_ids)

# workload: (prompts per step, prompt length, vocab)
WORKLOADS = {"grpo_step": (PROMPTS, PROMPT_LEN, VOCAB),
             "real_model": (REAL_PROMPTS, REAL_PROMPT_LEN, REAL_VOCAB)}


def make_model(workload: str, seed: int) -> transformers.PreTrainedModel:
  """The workload's model with transformers' init, checked against the workload's rules."""
  _, prompt_len, vocab = WORKLOADS[workload]
  # No pad id: no zeroed, frozen embedding row.
  common = dict(vocab_size=vocab, tie_word_embeddings=True, initializer_range=INIT_STD,
                max_position_embeddings=prompt_len + NEW_TOKENS, pad_token_id=None,
                dtype="float32")
  if workload == "real_model":
    config = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, attention_bias=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5}, **common)
    model_class = transformers.LlamaForCausalLM
  else:
    config = transformers.Qwen2Config(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    model_class = transformers.Qwen2ForCausalLM
  torch.manual_seed(seed)
  model = model_class(config).float()
  for name, p in model.named_parameters():
    if name.endswith("bias"):
      assert not p.any(), name
    elif "norm" in name:
      assert (p == 1).all(), name
    else:
      assert p.dtype == torch.float32 and abs(p.std().item() - INIT_STD) < 2e-3, name
  assert model.lm_head.weight is model.model.embed_tokens.weight
  return model


def matmul_peak(size=1024, reps=10) -> float:
  """Best float32 FLOP/s of a [size, size] @ [size, size] matmul over `reps` calls."""
  a = torch.randn(size, size)
  best = float("inf")
  for _ in range(reps + 1):  # The first call warms up.
    start = time.perf_counter()
    torch.mm(a, a)
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


class StepClock(transformers.TrainerCallback):
  """The end time of every optimizer step."""

  def __init__(self):
    self.ends = []

  def on_step_end(self, args, state, control, **kwargs):
    self.ends.append(time.perf_counter())


class GenerateClock:
  """Wraps a trainer's `_generate`, keeping the end time and seconds of every call."""

  def __init__(self, generate):
    self.generate, self.calls = generate, []

  def __call__(self, *args, **kwargs):
    start = time.perf_counter()
    out = self.generate(*args, **kwargs)
    self.calls.append((time.perf_counter(), time.perf_counter() - start))
    return out

  def per_step(self, ends) -> list[float]:
    """Seconds in `_generate` within each step (between consecutive `ends`)."""
    return [sum(s for end, s in self.calls if a < end <= b) for a, b in zip(ends, ends[1:])]


class EvenFraction:
  """The reward (the share of even completion ids), keeping the lengths and step means."""
  __name__ = "even_fraction"

  def __init__(self):
    self.lengths, self.means = collections.Counter(), []

  def __call__(self, prompts, completions, completion_ids, **kwargs):
    rewards = [even_fraction(ids) for ids in completion_ids]
    self.lengths.update(len(ids) for ids in completion_ids)
    self.means.append(float(np.mean(rewards)))
    return rewards


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10, help="RL steps, the first 2 untimed.")
  parser.add_argument("--seed", type=int, default=0, help="Seed of params, prompts, sampling.")
  parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads.")
  parser.add_argument("--workload", choices=sorted(WORKLOADS), default="grpo_step",
                      help="Whose workload: benchmarks/grpo_step.py's or real_model.py's.")
  flags = parser.parse_args()
  if flags.steps <= WARMUP:
    parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
  torch.set_num_threads(flags.threads)

  num_prompts, prompt_len, vocab = WORKLOADS[flags.workload]
  tokenizer = make_tokenizer(vocab)
  ids = prompt_ids(flags.seed, num_prompts * flags.steps, prompt_len, vocab)
  prompts = [" ".join(map(str, p)) for p in ids]
  assert tokenizer(prompts)["input_ids"] == ids
  reward, clock = EvenFraction(), StepClock()
  with tempfile.TemporaryDirectory(prefix="trl_grpo_") as workdir:
    args = trl.GRPOConfig(
        output_dir=workdir, max_steps=flags.steps, seed=flags.seed, use_cpu=True, bf16=False,
        fp16=False, activation_checkpointing=False,
        per_device_train_batch_size=num_prompts * GROUP, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=GROUP,
        max_completion_length=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
        epsilon=0.2, scale_rewards="group", learning_rate=1e-4, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, shuffle_dataset=False,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = trl.GRPOTrainer(
        model=make_model(flags.workload, flags.seed), reward_funcs=reward, args=args,
        processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[clock])
    trainer._generate = generate = GenerateClock(trainer._generate)
    peaks = [matmul_peak()]
    trainer.train()
    peaks.append(matmul_peak())

  step_s = np.diff(clock.ends)[WARMUP - 1:]
  gen_s = np.array(generate.per_step(clock.ends))[WARMUP - 1:]
  peak = max(peaks)
  print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; {flags.steps} steps of the "
        f"{flags.workload} workload, the first {WARMUP} untimed\nstep: median "
        f"{np.median(step_s):.3f} s (generate {np.median(gen_s):.3f} s), min {step_s.min():.3f}"
        f" s over {len(step_s)} steps; float32 1024^3 matmul best {peak / 1e9:.1f} GFLOP/s of "
        f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)} (before and after)\ncompletion lengths "
        f"{dict(reward.lengths)}; mean reward per step {np.round(reward.means, 3).tolist()}")
  print(json.dumps({
      "system": "trl", "workload": flags.workload, "trl_version": trl.__version__,
      "transformers_version": transformers.__version__, "torch_version": torch.__version__,
      "threads": torch.get_num_threads(), "steps": flags.steps, "warmup": WARMUP,
      "timed_steps": len(step_s), "sec_per_step": round(float(np.median(step_s)), 4),
      "min_step_s": round(float(step_s.min()), 4),
      "gen_s": round(float(np.median(gen_s)), 4),
      "train_s": round(float(np.median(step_s - gen_s)), 4),
      "step_s": [round(float(s), 4) for s in step_s], "matmul_gflops": round(peak / 1e9, 2),
      "matmul_gflops_runs": [round(p / 1e9, 2) for p in peaks],
      "completion_lengths": {str(n): c for n, c in sorted(reward.lengths.items())},
      "reward_mean": [round(min(reward.means), 4), round(max(reward.means), 4)]}))


if __name__ == "__main__":
  main()
