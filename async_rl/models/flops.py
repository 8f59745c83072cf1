"""FLOP counts of the decoder: the model FLOPs that MFU divides, and the packer's cost.

N counts the matmul params: q/k/v/o projections, the SwiGLU MLP and the LM head
(D V; the embedding lookup, norms and biases do no matmul). Per trained token at
position p of its sequence, a train step needs

  6 N + 12 L H E (p + 1)

FLOPs: 2 N forward and 4 N backward for the weights, and per layer 2 H E (p + 1)
each for Q K^T and P V over the p + 1 causal keys, forward, and twice that backward.
These are model FLOPs: what the math needs, not what an implementation executes
(padding, masked attention blocks, recomputation under remat).
"""

import numpy as np

from async_rl.models.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
  """N: params that take part in a matmul per token."""
  D, F, H, K, E, L, V = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                         cfg.n_layers, cfg.vocab_size)
  return L * (D * (H + 2 * K) * E + H * E * D + 3 * D * F) + D * V


def train_flops(cfg: ModelConfig, positions) -> float:
  """Model FLOPs of a forward and backward over tokens at `positions` (valid tokens only)."""
  positions = np.asarray(positions)
  LHE = cfg.n_layers * cfg.n_heads * cfg.head_dim
  return 6.0 * matmul_params(cfg) * positions.size + 12.0 * LHE * float((positions + 1).sum())


def attention_break_even_len(cfg: ModelConfig) -> float:
  """Row length at which a row's causal attention costs as many FLOPs as its matmuls.

  Over a row of T tokens causal attention averages about T / 2 keys per token, so
  12 L H E T / 2 = 6 N at T = N / (L H E). `batching.pack_dynamic` weighs a row of
  length T by 1 + T / this.
  """
  return matmul_params(cfg) / (cfg.n_layers * cfg.n_heads * cfg.head_dim)
