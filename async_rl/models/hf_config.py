"""Hugging Face Qwen2/Qwen3 `config.json` <-> the fields of our `config.ModelConfig`.

No weights and no JAX work (`models/hf.py` has the weights), so that the builder can
read a checkpoint's architecture before anything is compiled.
"""

import json
import os
from typing import Optional


_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DTYPES = ("float32", "bfloat16", "float16")


def _rope_theta(config_json: dict) -> float:
  rope = config_json.get("rope_parameters") or {}
  if config_json.get("rope_scaling") or rope.get("rope_type", "default") != "default":
    raise ValueError(f"config.json: rope scaling is not supported, got "
                     f"{config_json.get('rope_scaling') or rope}")
  return float(rope.get("rope_theta", config_json.get("rope_theta", 10000.0)))


def config_from_hf(config_json: dict, *, dtype: Optional[str] = None) -> dict:
  """The `config.ModelConfig` fields of a Hugging Face Qwen2/Qwen3 `config.json` dict.

  `dtype` sets both compute and storage dtypes; by default the checkpoint's own
  (`dtype`, or `torch_dtype` in older files), else float32.
  """
  archs = config_json.get("architectures") or []
  if len(archs) != 1 or archs[0] not in _ARCHITECTURES:
    raise ValueError(f"config.json: architectures {archs} is not supported; "
                     f"expected one of {_ARCHITECTURES}")
  qwen3 = archs[0] == "Qwen3ForCausalLM"
  if config_json.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act must be 'silu', got {config_json['hidden_act']!r}")
  if config_json.get("use_sliding_window"):
    raise ValueError("config.json: use_sliding_window is not supported")
  dtype = dtype or config_json.get("dtype") or config_json.get("torch_dtype") or "float32"
  if dtype not in _DTYPES:
    raise ValueError(f"config.json: dtype must be one of {_DTYPES}, got {dtype!r}")
  d_model, n_heads = config_json["hidden_size"], config_json["num_attention_heads"]
  return dict(
      vocab_size=config_json["vocab_size"],
      d_model=d_model,
      n_layers=config_json["num_hidden_layers"],
      n_heads=n_heads,
      n_kv_heads=config_json.get("num_key_value_heads", n_heads),
      head_dim=config_json.get("head_dim") or d_model // n_heads,
      d_ff=config_json["intermediate_size"],
      rope_theta=_rope_theta(config_json),
      rms_eps=float(config_json["rms_norm_eps"]),
      qkv_bias=bool(config_json.get("attention_bias", False)) if qwen3 else True,
      qk_norm=qwen3,
      tie_embeddings=bool(config_json.get("tie_word_embeddings", False)),
      max_seq_len=config_json.get("max_position_embeddings", 32768),
      dtype=dtype,
      param_dtype=dtype,
  )


def read_config(model_dir: str, *, dtype: Optional[str] = None) -> dict:
  """`config_from_hf` of the `config.json` in `model_dir`."""
  with open(os.path.join(model_dir, "config.json")) as f:
    return config_from_hf(json.load(f), dtype=dtype)


def config_to_hf(cfg) -> dict:
  """The `config.json` dict that `transformers` reads back as the same model."""
  if cfg.qk_norm:
    arch, extra = "Qwen3ForCausalLM", {"model_type": "qwen3", "attention_bias": cfg.qkv_bias}
  elif cfg.qkv_bias:
    arch, extra = "Qwen2ForCausalLM", {"model_type": "qwen2"}
  else:
    raise ValueError("model: no Hugging Face architecture has neither qkv_bias (Qwen2) nor "
                     "qk_norm (Qwen3)")
  return dict(
      extra,
      architectures=[arch],
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim,
      hidden_act="silu",
      max_position_embeddings=cfg.max_seq_len,
      rms_norm_eps=cfg.rms_eps,
      rope_theta=cfg.rope_theta,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
      tie_word_embeddings=cfg.tie_embeddings,
      use_sliding_window=False,
      dtype=cfg.param_dtype,
      torch_dtype=cfg.param_dtype,
  )
