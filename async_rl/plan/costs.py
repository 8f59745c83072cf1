"""Time and memory of each part of an RL step, from a model's shapes and a `Hardware` row.

Every figure comes from bytes moved and FLOPs done, at the rates of `plan.hardware` and
the efficiencies its `Efficiency` states (each from a published measurement):

  decode step   a roofline (`sim.DecodeCost`): the larger of the reads,
                step_overhead_s + (weights + live keys and values) / (hbm_bw
                decode_read), and the compute, 2 N FLOPs per slot at the matmul
                efficiency and 4 L H E per cached key at the attention efficiency. The
                keys and values are read through the paged layout: each slot's last
                block is read whole, on average (Z - 1) / 2 tokens more. Under tensor
                parallelism each of t devices reads 1/t of both (keys and values split
                over at most K devices), its matmuls are 1/t as large, and the step adds
                two all-reduces of the activations per layer over NVLink.
  prefill       2 N FLOPs per token at the matmul efficiency of the engine's 1/t share
                of the model, plus the causal attention over the prompt (4 L H E per
                key, half the prompt's keys on average) at the attention efficiency.
  train         `models.flops.train_flops` per token, split into its matmul part (6 N,
                at the matmul efficiency) and its attention part (12 L H E per key, at
                the attention efficiency), plus one forward when the proximal policy's
                log-probs are recomputed (decoupled PPO: a third more of each), plus one
                gradient reduce-scatter and one parameter all-gather per step over the
                trainer's slowest link.
  publish       the bf16 weights once over the link between trainer and generators.
  swap          a synchronous placement that releases its generator's memory while it
                trains moves the trainer's state to the host and back once a step, over
                the host link.

A token's keys in training are its position plus one, averaged over every token of the
batch: (E[T^2] + E[T]) / (2 E[T]) over sequences of T tokens, so long sequences weigh
as their tokens do. N is `models.flops.matmul_params`; sizes of memory use the counts of
`models.memory.estimate_memory`.
"""

import dataclasses
import math
import types

import numpy as np

from async_rl.config import GenerationConfig, LoraConfig, ModelConfig
from async_rl.models import flops, memory
from async_rl.plan.hardware import Hardware
from async_rl.sim import DecodeCost


@dataclasses.dataclass(frozen=True)
class MeasuredCosts:
  """What one side of a placement costs on the cores it was measured on, in seconds
  (`plan.host.measure`); they replace the roofline's in `search.sim_config`.

  Attributes:
    decode_base: a decode step's fixed cost, whatever its active slots.
    decode_per_slot: what each active slot adds to a decode step.
    prefill_per_token: a prompt token's prefill.
    train_per_token: a training step's time per token it holds (prompts and outputs).
    source: what was measured, and where.
  """
  decode_base: float
  decode_per_slot: float
  prefill_per_token: float
  train_per_token: float
  source: str

  @property
  def decode(self) -> DecodeCost:
    return DecodeCost(base=self.decode_base, per_slot=self.decode_per_slot)


def _itemsize(dtype: str) -> int:
  return np.dtype({"bfloat16": "float16"}.get(dtype, dtype)).itemsize


def weight_bytes(model: ModelConfig) -> float:
  """Bytes a decode step reads for the weights: the matmul params in the compute dtype."""
  return flops.matmul_params(model) * _itemsize(model.dtype)


def kv_bytes_per_token(model: ModelConfig) -> int:
  """Bytes of keys and values one cached token holds: 2 L K E in the compute dtype."""
  return 2 * model.n_layers * model.n_kv_heads * model.head_dim * _itemsize(model.dtype)


def matmul_eff(hw: Hardware, params_per_device: float) -> float:
  """The fraction of peak a device's GEMMs reach when it holds `params_per_device` of
  the model's matmul params: log-linear in them through the two points of
  `hw.efficiency.matmul` (larger GEMMs have more arithmetic per byte), within
  [0.1, 1]."""
  (n0, e0), (n1, e1) = hw.efficiency.matmul
  eff = e0 + (e1 - e0) * math.log(params_per_device / n0) / math.log(n1 / n0)
  return min(1.0, max(0.1, eff))


def decode_cost(model: ModelConfig, hw: Hardware, *, tp: int, block_size: int) -> DecodeCost:
  """The decode step of an engine over `tp` devices with KV blocks of `block_size`."""
  e, n = hw.efficiency, flops.matmul_params(model)
  bw = hw.hbm_bw * e.decode_read
  kv = kv_bytes_per_token(model) / min(tp, model.n_kv_heads) / bw
  base = e.step_overhead_s + weight_bytes(model) / tp / bw
  per_slot = (block_size - 1) / 2 * kv
  if tp > 1:
    # Two all-reduces per layer (attention and MLP outputs), ring: 2 (t-1)/t of the bytes.
    base += 2 * model.n_layers * hw.link_latency_s
    per_slot += (2 * model.n_layers * 2 * (tp - 1) / tp * model.d_model
                 * _itemsize(model.dtype) / hw.nvlink_bw)
  peak = hw.peak_flops * tp
  return DecodeCost(base=base, per_slot=per_slot, per_token=kv,
                    compute_per_slot=2 * n / (peak * matmul_eff(hw, n / tp)),
                    compute_per_token=4 * _lhe(model) / (peak * e.attention))


def prefill_s_per_token(model: ModelConfig, hw: Hardware, prompt_tokens: float, *,
                        tp: int) -> float:
  """Seconds per prompt token of prefilling prompts of `prompt_tokens` on `tp` devices."""
  n, peak = flops.matmul_params(model), hw.peak_flops * tp
  attention = 4 * _lhe(model) * prompt_tokens / 2
  return 2 * n / (peak * matmul_eff(hw, n / tp)) + attention / (peak * hw.efficiency.attention)


def train_s_per_token(model: ModelConfig, hw: Hardware, keys_per_token: float, *,
                      recompute_logp: bool = True) -> float:
  """Seconds one device spends per trained token whose causal attention reads
  `keys_per_token` keys on average (the module's docstring)."""
  n = flops.matmul_params(model)
  matmuls = 6.0 * n
  attention = flops.train_flops(model, [keys_per_token - 1]) - matmuls
  s = (matmuls / matmul_eff(hw, n) + attention / hw.efficiency.attention) / hw.peak_flops
  if recompute_logp:  # a forward pass: a third of forward plus backward
    s += s / 3
  return s


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


def swap_s(model: ModelConfig, hw: Hardware, *, fsdp: int) -> float:
  """A synchronous step's moves over the host link when the generator's memory is
  released while the trainer runs: the trainer's state on each of its `fsdp` devices
  (params, AdamW moments and float32 gradients, `models.memory`'s counts) goes to the
  host for the generation and comes back to train. The generator's keys and values are
  dropped, and its weights come from the trainer as every publish does."""
  return 2 * _trainer_state(model) / fsdp / hw.host_link_bw


def memory_per_device(model: ModelConfig, *, kv_tokens: int, block_size: int, tp: int = 1,
                      fsdp: int = 1, train_tokens_per_mb: int = 0) -> dict:
  """Bytes per device of a generator engine over `tp` devices holding `kv_tokens` of KV,
  and of a trainer sharded over `fsdp` devices (`models.memory.estimate_memory`'s
  counts), plus the activations a micro-batch of `train_tokens_per_mb` keeps under remat:
  each layer's input, and one layer's working set (q, k, v, attention output, the
  MLP's three widths); the loss's logits are chunked (`policy`), so they are left out.
  Keys and values split over at most K devices (a larger `tp` replicates them)."""
  blocks = -(-kv_tokens // block_size)
  counts = _counts(model, blocks, block_size)
  kv_cache = counts["kv_cache"] if blocks else 0
  act_itemsize = _itemsize(model.dtype)
  width = model.n_layers * model.d_model + (
      (model.n_heads + 2 * model.n_kv_heads + model.n_heads) * model.head_dim
      + 3 * model.d_ff)
  activations = train_tokens_per_mb * width * act_itemsize
  return dict(generator=counts["params"] / tp + kv_cache / min(tp, model.n_kv_heads),
              trainer=counts["trainer"] / fsdp + activations)


def _trainer_state(model: ModelConfig) -> float:
  return _counts(model, 1, 2)["trainer"]  # The trainer's counts hold no KV cache.


def _counts(model: ModelConfig, blocks: int, block_size: int) -> dict:
  # One block is the shortest budget GenerationConfig takes (a sequence of one block).
  gen = GenerationConfig(kv_blocks=max(blocks, 1), kv_block_size=block_size,
                         max_prompt_len=1, max_new_tokens=block_size - 1)
  return memory.estimate_memory(types.SimpleNamespace(model=model, generation=gen,
                                                      lora=LoraConfig()))


def _lhe(model: ModelConfig) -> int:
  return model.n_layers * model.n_heads * model.head_dim
