"""Hugging Face Qwen2/Qwen3/Llama `config.json` <-> the fields of our `config.ModelConfig`.

No weights and no JAX work (`models/hf.py` has the weights), so that the builder can
read a checkpoint's architecture before anything is compiled. The three differ in the
attention's extras: Qwen2 biases q, k and v, Qwen3 normalises q and k per head (and may
bias them), Llama does neither. The rotary embedding is plain or scaled as Llama 3.1/3.2
scale it ("llama3"); any other scaling is refused naming the field.
"""

import json
import os
from typing import Optional

_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "llama3")


def _rope(config_json: dict) -> dict:
  """The rope fields of `config.ModelConfig`: transformers 5 writes `rope_parameters`
  (base included), older files `rope_scaling` beside a top-level `rope_theta`."""
  key = "rope_parameters" if config_json.get("rope_parameters") else "rope_scaling"
  rope = config_json.get(key) or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in _ROPE_TYPES:
    raise ValueError(f"config.json: {key}.rope_type {kind!r} is not supported; expected one "
                     f"of {_ROPE_TYPES}")
  partial = rope.get("partial_rotary_factor", config_json.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise ValueError(f"config.json: partial_rotary_factor must be 1.0, got {partial}")
  fields = dict(rope_theta=float(rope.get("rope_theta", config_json.get("rope_theta", 10000.0))))
  if kind == "llama3":
    fields.update(
        rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
        rope_low_freq_factor=float(rope["low_freq_factor"]),
        rope_high_freq_factor=float(rope["high_freq_factor"]),
        rope_original_max_len=int(rope.get("original_max_position_embeddings",
                                           config_json["max_position_embeddings"])))
  return fields


def config_from_hf(config_json: dict, *, dtype: Optional[str] = None) -> dict:
  """The `config.ModelConfig` fields of a Hugging Face Qwen2/Qwen3/Llama `config.json` dict.

  `dtype` sets both compute and storage dtypes; by default the checkpoint's own
  (`dtype`, or `torch_dtype` in older files), else float32.
  """
  archs = config_json.get("architectures") or []
  if len(archs) != 1 or archs[0] not in _ARCHITECTURES:
    raise ValueError(f"config.json: architectures {archs} is not supported; "
                     f"expected one of {_ARCHITECTURES}")
  arch = archs[0]
  if config_json.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act must be 'silu', got {config_json['hidden_act']!r}")
  if config_json.get("use_sliding_window"):
    raise ValueError("config.json: use_sliding_window is not supported")
  if arch == "LlamaForCausalLM":
    for name in ("attention_bias", "mlp_bias"):  # Llama's attention bias covers o_proj too
      if config_json.get(name):
        raise ValueError(f"config.json: {name}=true is not supported for LlamaForCausalLM")
  dtype = dtype or config_json.get("dtype") or config_json.get("torch_dtype") or "float32"
  if dtype not in _DTYPES:
    raise ValueError(f"config.json: dtype must be one of {_DTYPES}, got {dtype!r}")
  d_model, n_heads = config_json["hidden_size"], config_json["num_attention_heads"]
  qkv_bias = {"Qwen2ForCausalLM": True, "LlamaForCausalLM": False,
              "Qwen3ForCausalLM": bool(config_json.get("attention_bias", False))}[arch]
  return dict(
      _rope(config_json),
      vocab_size=config_json["vocab_size"],
      d_model=d_model,
      n_layers=config_json["num_hidden_layers"],
      n_heads=n_heads,
      n_kv_heads=config_json.get("num_key_value_heads") or n_heads,
      head_dim=config_json.get("head_dim") or d_model // n_heads,
      d_ff=config_json["intermediate_size"],
      rms_eps=float(config_json["rms_norm_eps"]),
      qkv_bias=qkv_bias,
      qk_norm=arch == "Qwen3ForCausalLM",
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
  """The `config.json` dict that `transformers` reads back as the same model: Qwen3 with
  `qk_norm`, else Qwen2 with `qkv_bias`, else Llama."""
  if cfg.qk_norm:
    arch, extra = "Qwen3ForCausalLM", {"model_type": "qwen3", "attention_bias": cfg.qkv_bias,
                                       "use_sliding_window": False}
  elif cfg.qkv_bias:
    arch, extra = "Qwen2ForCausalLM", {"model_type": "qwen2", "use_sliding_window": False}
  else:
    arch, extra = "LlamaForCausalLM", {"model_type": "llama", "attention_bias": False,
                                       "mlp_bias": False}
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling == "llama3":
    rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
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
      rope_parameters=rope,
      tie_word_embeddings=cfg.tie_embeddings,
      dtype=cfg.param_dtype,
      torch_dtype=cfg.param_dtype,
  )
