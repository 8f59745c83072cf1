"""Qwen2.5 shapes, bf16, sized for reasoning RL (8k new tokens) on one or eight GPUs.

  python -m launch.train --config=configs/qwen2_5.py --workdir=/tmp/q15        # 1.5b
  python -m launch.train --config=configs/qwen2_5.py:7b --workdir=/tmp/q7
  python -m launch.train --config=configs/qwen2_5.py:1.5b_32k --workdir=/tmp/q15_32k
  python -m launch.train --config=configs/qwen2_5.py:1.5b_lora --workdir=/tmp/q15_lora

(installed: `--config=qwen2_5:7b`). Variants, after the colon:

  1.5b      Qwen2.5-1.5B, the default: 128 slots, 24,576 KV blocks; one or eight GPUs.
  7b        Qwen2.5-7B: 64 slots, 8,192 KV blocks; eight GPUs.
  1.5b_32k  the 1.5B at AReaL's reasoning length: 1,024 prompt + 31,744 new tokens, 64
            slots, the same KV budget (12 sequences of the full 32,768, or the slots at a
            mean of 6,144), micro-batches of 32,768 tokens.
  1.5b_lora the 1.5B on one 24 GB GPU: LoRA adapters of rank 16 on every projection
            (`lora`), the base frozen; 256 prompt + 4,096 new tokens, 32 slots, 2,048 KV
            blocks per engine (7 sequences of the full 4,352, or the slots at a mean of
            1,024), micro-batches of 4,352 tokens, learning rate 1e-5.

Mesh: `data=1, fsdp=-1, tensor=1`, so the trainer's params, AdamW state and gradients
are sharded over every device (fsdp=1 on one GPU, fsdp=8 on eight). Other 8-GPU
layouts: `--config.mesh.fsdp=4 --config.mesh.tensor=2`, or `--config.mesh.data=2
--config.mesh.fsdp=4`. The generator engines (rollout and evaluation) are not on the
mesh: each holds a full copy of the params and its KV cache on the first device.

Expected memory (`async_rl.models.memory.describe(cfg)`; whole model, before sharding;
activations not counted).

1.5b (1,543,714,304 params):

  params: 2.88 GiB        (bf16)
  optimizer: 5.75 GiB     (AdamW moments, bf16 like the params)
  gradients: 5.75 GiB     (float32)
  kv_cache: 10.50 GiB     (per engine: 2 * 28 L * 24576 N * 16 Z * 2 K * 128 E * 2 bytes)
  trainer: 14.38 GiB      (/ fsdp per device)
  generator: 13.38 GiB    (per engine, all on the first device)

A token's keys and values take 2 * 28 L * 2 K * 128 E * 2 bytes = 28 KiB, so the
24,576 blocks of 16 tokens (393,216 tokens: the 128 slots at a mean of 3,072 tokens, or
46 sequences of the full 8,448) take 10.50 GiB per engine, where every slot at full
length would take 28.88 GiB. On one 80 GB GPU (74.5 GiB) the trainer and both engines
take 14.38 + 2 x 13.38, about 41.1 GiB, which leaves 33.4 GiB for the train step's
temporaries.

7b (7,615,616,512 params):

  params: 14.19 GiB       (bf16)
  optimizer: 28.37 GiB    (AdamW moments, bf16 like the params)
  gradients: 28.37 GiB    (float32)
  kv_cache: 7.00 GiB      (per engine: 2 * 28 L * 8192 N * 16 Z * 4 K * 128 E * 2 bytes)
  trainer: 70.93 GiB      (/ fsdp per device)
  generator: 21.19 GiB    (per engine, all on the first device)

A token's keys and values take 2 * 28 L * 4 K * 128 E * 2 bytes = 56 KiB, so the 8,192
blocks of 16 tokens (131,072 tokens: the 64 slots at a mean of 2,048 tokens, or 15
sequences of the full 8,448) take 7.00 GiB per engine, where every slot at full length
would take 28.88 GiB. On eight 80 GB GPUs (74.5 GiB each) the first device holds an
eighth of the trainer and both engines, 8.87 + 2 x 21.19, about 51.2 GiB, which leaves
23.3 GiB for the train step's temporaries there.

1.5b_lora (1,543,714,304 params, 18,464,768 in the adapters):

  params: 2.88 GiB        (bf16, frozen)
  optimizer: 0.14 GiB     (AdamW moments of the adapters, float32)
  gradients: 0.07 GiB     (of the adapters, float32)
  kv_cache: 0.88 GiB      (per engine: 2 * 28 L * 2048 N * 16 Z * 2 K * 128 E * 2 bytes)
  adapters: 0.07 GiB      (float32)
  trainer: 3.15 GiB       (the base and the adapters' state)
  generator: 3.75 GiB     (per engine: the base with the adapters merged in, and its KV)
  generator_base: 2.88 GiB (the base the engines merge into, once)

On one 24 GB GPU (22.35 GiB) the trainer, both engines and the base they share take
3.15 + 2 x 3.75 + 2.88, about 13.5 GiB, which leaves 8.8 GiB for the train step's and
the engines' temporaries (`python -m benchmarks.memory --configs=qwen2_5:1.5b_lora
--lengths=4k --tp=` compiles them).

Samples beyond the KV budget wait, preempted, and resume where they stopped
(`generation.pool`). The compiled train step needs more than `trainer`, most of it
gradient buffers (a float32 accumulator, one micro-batch's gradients, their cast):
`python -m benchmarks.memory` reads it, and the engines' transients, per device from
XLA's memory analysis at 8k, 16k and 32k (BENCHMARKS.md, "Memory", has the figures).
The 7B's does not fit one device beside both engines; on eight GPUs (fsdp=8) the
params, moments and gradient buffers shard eight ways and the rows of a micro-batch
one per device.

What runs today: as it stands, this config trains a Qwen2.5-shaped model from random
weights on the arithmetic task (character tokenizer); `benchmarks/gpu_check.py` runs
a few such steps of the 1.5B on one GPU. From a local checkpoint on GSM8K/MATH-style JSONL
files (docs/training.md, "Training a Qwen model from a local checkpoint"):

  python -m launch.train --config=configs/qwen2_5.py --workdir=/tmp/q15 \
      --config.hf_model_dir=/models/Qwen2.5-1.5B-Instruct --config.task.name=math \
      --config.rollout.reward_fn=math --config.task.math.train_path=/data/gsm8k/train.jsonl \
      --config.task.math.heldout_path=/data/gsm8k/test.jsonl
  python -m launch.export_hf --workdir=/tmp/q15 --out=/tmp/q15_hf

The architecture then comes from the directory's config.json. The group settings
are those for GSM8K; the lengths (256 prompt + 8,192 new tokens) leave room for long
chains of thought.
"""

from async_rl.cli import config_dict
from async_rl.config import MODEL_PRESETS

VARIANTS = ("1.5b", "7b", "1.5b_32k", "1.5b_lora")


def get_config(variant="1.5b"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/qwen2_5.py has variants {VARIANTS}, got {variant!r}")
  size = variant.removesuffix("_32k").removesuffix("_lora")
  c = config_dict()
  c.batch_groups = 32
  c.num_steps = 200
  c.model.update(MODEL_PRESETS[f"qwen2.5-{size}"])
  c.model.max_seq_len = 256 + 8192
  c.optimizer.learning_rate = 1e-6
  c.optimizer.warmup_steps = 10
  c.optimizer.grad_clip = 1.0
  c.ppo.loss = "decoupled_ppo"
  c.ppo.rejection_upper = 5.0
  c.batching.max_tokens_per_mb = 16384
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  c.generation.max_prompt_len = 256
  c.generation.max_new_tokens = 8192
  c.generation.group_size = 8
  c.generation.temperature = 1.0
  c.generation.update_mode = "retract"
  c.generation.kv_block_size = 16
  c.staleness.max_staleness = 4
  c.staleness.max_concurrent = 64
  c.eval.num_prompts = 200
  c.checkpoint.every_steps = 50
  if size == "1.5b":
    # Keep the MLP's gate projection and the mid-layer residual through remat: memory
    # traded for recomputation (`benchmarks.memory --saves=...`).
    c.model.remat_saves = ("mlp_gate", "residual")
    c.generation.num_slots = 128
    c.generation.kv_blocks = 24576
  else:
    c.generation.num_slots = 64
    c.generation.kv_blocks = 8192
  if variant == "1.5b_32k":
    c.model.max_seq_len = 32768
    c.batching.max_tokens_per_mb = 32768
    c.generation.max_prompt_len = 1024
    c.generation.max_new_tokens = 31744
    c.generation.num_slots = 64
  if variant == "1.5b_lora":
    c.lora.rank = 16
    c.optimizer.learning_rate = 1e-5
    c.model.max_seq_len = 256 + 4096
    c.batching.max_tokens_per_mb = 256 + 4096
    c.generation.max_new_tokens = 4096
    c.generation.num_slots = 32
    c.generation.kv_blocks = 2048
  return c
