"""Qwen2.5-7B shapes, bf16, sized for reasoning RL (8k new tokens) on eight GPUs.

  python -m launch.train --config=configs/qwen2_5_7b.py --workdir=/tmp/q7

Mesh: `data=1, fsdp=-1, tensor=1`, so the trainer's params, AdamW state and gradients
are sharded over every device (fsdp=1 on one GPU, fsdp=8 on eight). Other 8-GPU
layouts: `--config.mesh.fsdp=4 --config.mesh.tensor=2`, or `--config.mesh.data=2
--config.mesh.fsdp=4`. The generator engines (rollout and evaluation) are not on the
mesh: each holds a full copy of the params and its KV cache on the first device.

Expected memory (`async_rl.models.memory.describe(cfg)`; 7,615,616,512 params; whole
model, before sharding; activations not counted):

  params: 14.19 GiB       (bf16)
  optimizer: 28.37 GiB    (AdamW moments, bf16 like the params)
  gradients: 28.37 GiB    (float32)
  kv_cache: 7.00 GiB      (per engine: 2 * 28 L * 8192 N * 16 Z * 4 K * 128 E * 2 bytes)
  trainer: 70.93 GiB      (/ fsdp per device)
  generator: 21.19 GiB    (per engine, all on the first device)

The KV budget. A token's keys and values take 2 * 28 L * 4 K * 128 E * 2 bytes = 56
KiB, so the 8,192 blocks of 16 tokens (131,072 tokens: the 64 slots at a mean of 2,048
tokens, or 15 sequences of the full 8,448) take 7.00 GiB per engine, where every slot
at full length would take 28.88 GiB. On eight 80 GB GPUs (74.5 GiB each) the first
device holds an eighth of the trainer and both engines, 8.87 + 2 x 21.19, about 51.2
GiB, which leaves 23.3 GiB for the train step's temporaries there. Samples beyond the
budget wait, preempted, and resume where they stopped (`generation.pool`).

The compiled train step needs more than `trainer`, most of it gradient buffers (a
float32 accumulator, one micro-batch's gradients, their cast): `python -m
benchmarks.memory --config=configs/qwen2_5_7b.py --tokens=2048,4096,8192` reads it from
XLA's memory analysis (BENCHMARKS.md, "Memory", has the figures). One device does not
hold it beside both engines; on eight GPUs (fsdp=8) the params, moments and gradient
buffers shard eight ways and the rows of a micro-batch one per device.

What runs today: as it stands, this config trains the 7B-shaped model from random
weights on the arithmetic task (character tokenizer). From a local checkpoint on
GSM8K/MATH-style JSONL files (docs/training.md, "Training a Qwen model from a local checkpoint"):

  python -m launch.train --config=configs/qwen2_5_7b.py --workdir=/tmp/q7 \
      --config.hf_model_dir=/models/Qwen2.5-7B-Instruct --config.task.name=math \
      --config.rollout.reward_fn=math --config.task.math.train_path=/data/gsm8k/train.jsonl \
      --config.task.math.heldout_path=/data/gsm8k/test.jsonl
  python -m launch.export_hf --workdir=/tmp/q7 --out=/tmp/q7_hf

The architecture then comes from the directory's config.json. The group settings
are those for GSM8K; the lengths (256 prompt + 8,192 new tokens) leave room for long
chains of thought.
"""

from async_rl.cli import config_dict
from async_rl.config import MODEL_PRESETS


def get_config():
  c = config_dict()
  c.batch_groups = 32
  c.num_steps = 200
  c.model.update(MODEL_PRESETS["qwen2.5-7b"])
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
  c.generation.num_slots = 64
  c.generation.update_mode = "retract"
  c.generation.kv_blocks = 8192
  c.generation.kv_block_size = 16
  c.staleness.max_staleness = 4
  c.staleness.max_concurrent = 64
  c.eval.num_prompts = 200
  c.checkpoint.every_steps = 50
  return c
