"""Time and memory of each part of an RL step, from a model's shapes and a `Hardware` row.

Every figure comes from bytes moved and FLOPs done, at the rates of `plan.hardware`:

  decode step   a roofline: max(step_overhead_s + bytes read / (hbm_bw * decode_eff),
                FLOPs / (peak_flops * mfu)). The bytes are the weights, read once per
                step, and the live keys and values of every active slot, read through
                the paged layout (each slot's last block is read whole: on average
                (Z - 1) / 2 tokens more). The FLOPs are 2 N per token for the matmuls
                and 4 L H E per cached key for Q K^T and P V. Under tensor parallelism
                each of t devices reads 1/t of both and the step adds two all-reduces
                of the activations per layer over NVLink.
  prefill       FLOPs at `mfu`: 2 N per token plus the causal attention over the
                prompt (2 L H E per key, half the keys on average).
  train         FLOPs at `mfu`: `models.flops.train_flops` per token (forward and
                backward), plus one forward when the proximal policy's log-probs are
                recomputed (decoupled PPO), plus one gradient reduce-scatter and one
                parameter all-gather per step over the trainer's slowest link.
  publish       the bf16 weights once over the link between trainer and generators.

N is `models.flops.matmul_params`. Sizes of memory use the same counts as
`models.memory.estimate_memory`.
"""

import dataclasses
import types

import numpy as np

from async_rl.config import GenerationConfig, LoraConfig, ModelConfig
from async_rl.models import flops, memory
from async_rl.plan.hardware import Hardware


def _itemsize(dtype: str) -> int:
  return np.dtype({"bfloat16": "float16"}.get(dtype, dtype)).itemsize


def weight_bytes(model: ModelConfig) -> float:
  """Bytes a decode step reads for the weights: the matmul params in the compute dtype."""
  return flops.matmul_params(model) * _itemsize(model.dtype)


def kv_bytes_per_token(model: ModelConfig) -> int:
  """Bytes of keys and values one cached token holds: 2 L K E in the compute dtype."""
  return 2 * model.n_layers * model.n_kv_heads * model.head_dim * _itemsize(model.dtype)


@dataclasses.dataclass(frozen=True)
class DecodeCost:
  """A decode step's time as `SimConfig` takes it: reads and compute, linear in the
  active slots `a` and their live tokens `c`; the step takes the larger of
  `base + per_slot a + per_token c` and `compute_per_slot a + compute_per_token c`."""
  base: float
  per_slot: float
  per_token: float
  compute_per_slot: float
  compute_per_token: float

  def step_s(self, active: int, live_tokens: int) -> float:
    """The time of one step with `active` slots holding `live_tokens`."""
    return max(self.base + self.per_slot * active + self.per_token * live_tokens,
               self.compute_per_slot * active + self.compute_per_token * live_tokens)


def decode_cost(model: ModelConfig, hw: Hardware, *, tp: int = 1,
                block_size: int = 16) -> DecodeCost:
  """The decode step of an engine over `tp` devices with KV blocks of `block_size`."""
  bw = hw.hbm_bw * hw.decode_eff
  kv_split = min(tp, model.n_kv_heads)
  kv = kv_bytes_per_token(model) / kv_split
  base = hw.step_overhead_s + weight_bytes(model) / tp / bw
  per_slot = (block_size - 1) / 2 * kv / bw
  if tp > 1:
    # Two all-reduces per layer (attention and MLP outputs), ring: 2 (t-1)/t of the bytes.
    base += 2 * model.n_layers * hw.link_latency_s
    per_slot += (2 * model.n_layers * 2 * (tp - 1) / tp * model.d_model
                 * _itemsize(model.dtype) / hw.nvlink_bw)
  rate = hw.peak_flops * hw.mfu * tp
  return DecodeCost(base=base, per_slot=per_slot, per_token=kv / bw,
                    compute_per_slot=2 * flops.matmul_params(model) / rate,
                    compute_per_token=4 * _lhe(model) / rate)


def prefill_s_per_token(model: ModelConfig, hw: Hardware, prompt_tokens: float, *,
                        tp: int = 1) -> float:
  """Seconds per prompt token of prefilling prompts of `prompt_tokens` on `tp` devices."""
  per_token = 2 * flops.matmul_params(model) + 2 * _lhe(model) * prompt_tokens
  return per_token / (hw.peak_flops * hw.mfu * tp)


def train_s_per_token(model: ModelConfig, hw: Hardware, mean_length: float, *,
                      recompute_logp: bool = True) -> float:
  """Seconds one device spends per trained token, in sequences of `mean_length` tokens
  on average (a token's mean position over a sequence of T is (T - 1) / 2)."""
  position = (mean_length - 1) / 2
  per_token = flops.train_flops(model, [position])
  if recompute_logp:  # a forward pass: a third of forward plus backward
    per_token += per_token / 3
  return per_token / (hw.peak_flops * hw.mfu)


def train_sync_s(model: ModelConfig, hw: Hardware, devices: int, *,
                 crosses_nodes: bool) -> float:
  """A step's fixed cost on `devices` FSDP devices: the float32 gradients
  reduce-scattered and the params all-gathered once, ring over the slowest link."""
  if devices == 1:
    return 0.0
  link = hw.network_bw if crosses_nodes else hw.nvlink_bw
  n = model.num_params()
  moved = (4 + _itemsize(model.param_dtype)) * n * (devices - 1) / devices
  return moved / link


def publish_s(model: ModelConfig, hw: Hardware, *, crosses_nodes: bool) -> float:
  """Sending the weights once from the trainer to the generators (a pipelined
  broadcast costs about one copy, whatever the receivers)."""
  link = hw.network_bw if crosses_nodes else hw.nvlink_bw
  return model.num_params() * _itemsize(model.dtype) / link


def memory_per_device(model: ModelConfig, *, kv_tokens: int, block_size: int = 16,
                      tp: int = 1, fsdp: int = 1, train_tokens_per_mb: int = 0) -> dict:
  """Bytes per device of a generator engine over `tp` devices holding `kv_tokens` of KV,
  and of a trainer sharded over `fsdp` devices (`models.memory.estimate_memory`'s
  counts), plus the activations a micro-batch of `train_tokens_per_mb` keeps under remat:
  each layer's input, and one layer's working set (q, k, v, attention output, the
  MLP's three widths); the loss's logits are chunked (`policy`), so they are left out.
  Keys and values split over at most K devices (a larger `tp` replicates them)."""
  # One block is the shortest budget GenerationConfig takes (a sequence of one block).
  blocks = -(-kv_tokens // block_size)
  gen = GenerationConfig(kv_blocks=max(blocks, 1), kv_block_size=block_size,
                         max_prompt_len=1, max_new_tokens=block_size - 1)
  counts = memory.estimate_memory(types.SimpleNamespace(model=model, generation=gen,
                                                          lora=LoraConfig()))
  kv_cache = counts["kv_cache"] if blocks else 0
  act_itemsize = _itemsize(model.dtype)
  width = model.n_layers * model.d_model + (
      (model.n_heads + 2 * model.n_kv_heads + model.n_heads) * model.head_dim
      + 3 * model.d_ff)
  activations = train_tokens_per_mb * width * act_itemsize
  return dict(generator=counts["params"] / tp + kv_cache / min(tp, model.n_kv_heads),
              trainer=counts["trainer"] / fsdp + activations)


def _lhe(model: ModelConfig) -> int:
  return model.n_layers * model.n_heads * model.head_dim
