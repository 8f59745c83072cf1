"""Model hyper-parameters and the size presets."""

import dataclasses

import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16", "float16")

# Per layer and token, what `model.remat_saves` may keep from the forward pass (the
# rest is recomputed in the backward pass), and the matmul that keeping it saves
# recomputing: the rotated q, k and v (D (H + 2K) E elements; their projection), the
# residual stream between attention and MLP (D; the output projection), and the MLP's
# gate and up projections (F each; their matmuls).
REMAT_SAVES = ("qkv", "residual", "mlp_gate", "mlp_up")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Qwen2-family decoder.

  `dtype` is the compute dtype, `param_dtype` the storage dtype of the params.
  `qk_norm` adds the per-head q/k RMSNorm of Qwen3. `remat` recomputes each layer's
  activations in the backward pass instead of storing them, except those named in
  `remat_saves` (`REMAT_SAVES`): memory traded for the FLOPs of recomputing them
  (`python -m benchmarks.memory --saves=...` prints both from the compiler).
  """
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 512
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  qkv_bias: bool = True
  qk_norm: bool = False
  tie_embeddings: bool = False
  max_seq_len: int = 512
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  remat_saves: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "remat_saves", tuple(self.remat_saves))
    unknown = set(self.remat_saves) - set(REMAT_SAVES)
    if unknown:
      raise ValueError(f"model.remat_saves: unknown {sorted(unknown)}; known: "
                       f"{sorted(REMAT_SAVES)}")
    if self.remat_saves and not self.remat:
      raise ValueError(f"model.remat_saves={self.remat_saves} needs model.remat=True")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of "
                       f"model.n_kv_heads ({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim must be even for rotary embeddings, got {self.head_dim}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
    if self.rope_theta <= 0 or self.rms_eps <= 0:
      raise ValueError("model.rope_theta and model.rms_eps must be > 0")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def num_params(self) -> int:
    D, F, H, K, E, V = (self.d_model, self.d_ff, self.n_heads, self.n_kv_heads,
                        self.head_dim, self.vocab_size)
    per_layer = 2 * D * H * E + 2 * D * K * E + 3 * D * F + 2 * D
    per_layer += (H + 2 * K) * E if self.qkv_bias else 0
    per_layer += 2 * E if self.qk_norm else 0
    return self.n_layers * per_layer + V * D * (1 if self.tie_embeddings else 2) + D


_QWEN = dict(rope_theta=1e6, qkv_bias=True, max_seq_len=32768, dtype="bfloat16",
             param_dtype="bfloat16", remat=True)

PRESETS = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512),
    "small": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, d_ff=1408),
    "qwen2.5-0.5b": dict(_QWEN, vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                         n_kv_heads=2, head_dim=64, d_ff=4864, tie_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN, vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                         n_kv_heads=2, head_dim=128, d_ff=8960, tie_embeddings=True),
    "qwen2.5-7b": dict(_QWEN, vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                       n_kv_heads=4, head_dim=128, d_ff=18944, tie_embeddings=False),
}


def preset(name: str, **overrides) -> ModelConfig:
  """The named size preset, with field overrides (for example `vocab_size`)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return ModelConfig(**{**PRESETS[name], **overrides})
