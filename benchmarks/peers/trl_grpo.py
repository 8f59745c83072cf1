r"""The GRPO workload (`benchmarks/grpo_step.py`) through Hugging Face TRL's `GRPOTrainer`, on CPU.

  python -m venv /tmp/trl_venv
  /tmp/trl_venv/bin/pip install torch==2.13.0 trl==1.16.0   # pinned torch: the CPU build
  /tmp/trl_venv/bin/python benchmarks/peers/trl_grpo.py [--steps 10] [--seed 0] [--threads N]

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

from peer_workload import (GROUP, INIT_STD, NEW_TOKENS, PROMPT_LEN, PROMPTS, VOCAB, WARMUP,
                           even_fraction, make_tokenizer, prompt_ids)


def make_model(seed: int) -> transformers.Qwen2ForCausalLM:
  """The workload's model with transformers' init, checked against the workload's rules."""
  config = transformers.Qwen2Config(
      vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      max_position_embeddings=PROMPT_LEN + NEW_TOKENS, initializer_range=INIT_STD,
      pad_token_id=None, dtype="float32")  # No pad id: no zeroed, frozen embedding row.
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(config).float()
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
  flags = parser.parse_args()
  if flags.steps <= WARMUP:
    parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
  torch.set_num_threads(flags.threads)

  tokenizer = make_tokenizer()
  prompts = [" ".join(map(str, ids)) for ids in prompt_ids(flags.seed, PROMPTS * flags.steps)]
  assert tokenizer(prompts)["input_ids"] == prompt_ids(flags.seed, len(prompts))
  reward, clock = EvenFraction(), StepClock()
  with tempfile.TemporaryDirectory(prefix="trl_grpo_") as workdir:
    args = trl.GRPOConfig(
        output_dir=workdir, max_steps=flags.steps, seed=flags.seed, use_cpu=True, bf16=False,
        fp16=False, activation_checkpointing=False, per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=GROUP, max_completion_length=NEW_TOKENS, temperature=1.0, top_k=0,
        top_p=1.0, beta=0.0, epsilon=0.2, scale_rewards="group", learning_rate=1e-4,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        shuffle_dataset=False, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True)
    trainer = trl.GRPOTrainer(
        model=make_model(flags.seed), reward_funcs=reward, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[clock])
    peaks = [matmul_peak()]
    trainer.train()
    peaks.append(matmul_peak())

  step_s = np.diff(clock.ends)[WARMUP - 1:]
  peak = max(peaks)
  print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; {flags.steps} steps, the "
        f"first {WARMUP} untimed\nstep: median {np.median(step_s):.3f} s, min {step_s.min():.3f}"
        f" s over {len(step_s)} steps; float32 1024^3 matmul best {peak / 1e9:.1f} GFLOP/s of "
        f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)} (before and after)\ncompletion lengths "
        f"{dict(reward.lengths)}; mean reward per step {np.round(reward.means, 3).tolist()}")
  print(json.dumps({
      "system": "trl", "trl_version": trl.__version__,
      "transformers_version": transformers.__version__, "torch_version": torch.__version__,
      "threads": torch.get_num_threads(), "steps": flags.steps, "warmup": WARMUP,
      "timed_steps": len(step_s), "sec_per_step": round(float(np.median(step_s)), 4),
      "min_step_s": round(float(step_s.min()), 4),
      "step_s": [round(float(s), 4) for s in step_s], "matmul_gflops": round(peak / 1e9, 2),
      "matmul_gflops_runs": [round(p / 1e9, 2) for p in peaks],
      "completion_lengths": {str(n): c for n, c in sorted(reward.lengths.items())},
      "reward_mean": [round(min(reward.means), 4), round(max(reward.means), 4)]}))


if __name__ == "__main__":
  main()
