"""Run in a subprocess with 8 fake CPU devices: a tensor-parallel engine's compiled
memory per device (`compiled_memory.generator`) on k = 1 and 4 devices, and the train
step's (`compiled_memory.trainer`: one row of 4,096 tokens per device) on 1 and on 8
devices (fsdp).

The model is small, bfloat16, with 8 heads, 8 kv heads and an MLP width that every k
divides, and a KV budget of 4 sequences of 4,096 tokens, which outweighs its params.
Prints the figures (GiB) as JSON.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
from async_rl import compiled_memory as memory  # noqa: E402
from rl_test_utils import small_config  # noqa: E402

OVERRIDES = {
    "model.d_model": 256, "model.n_layers": 2, "model.n_heads": 8, "model.n_kv_heads": 8,
    "model.head_dim": 32, "model.d_ff": 1024, "model.vocab_size": 512,
    "model.max_seq_len": 4096, "model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
    "generation.max_prompt_len": 32, "generation.max_new_tokens": 4064,
    "generation.num_slots": 8, "generation.kv_blocks": 1024, "generation.kv_block_size": 16,
    "batching.max_tokens_per_mb": 4096,
}


def main():
  cfg = small_config(**OVERRIDES)
  print(json.dumps({"engine": {k: memory.generator(cfg, jax.devices()[:k]) for k in (1, 4)},
                    "trainer": {D: memory.trainer(cfg, jax.devices()[:D]) for D in (1, 8)}}))


if __name__ == "__main__":
  main()
