"""Hugging Face Qwen2/Qwen3 checkpoints: config, safetensors weights, and export.

One table (`_RULES`) maps each Hugging Face tensor to a leaf of our params tree and
says whether it is transposed; loading and saving both read it. Hugging Face linear
weights are [out, in]; ours are [in, ...] with heads split out, so a transposed
tensor is `w.T.reshape(ours)` on the way in and `w.reshape(hf[::-1]).T` on the way
out. Per-layer tensors are stacked on our leading L axis.

Needs the `hf` extra (safetensors, which reads bf16 into numpy via ml_dtypes).
"""

import dataclasses
import functools
import json
import os
import shutil
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from async_rl import sharding
from async_rl.models.config import ModelConfig
from async_rl.models.transformer import Params, init_params

_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DTYPES = ("float32", "bfloat16", "float16")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class _Rule:
  hf_name: str  # "{}" stands for the layer index.
  path: tuple[str, ...]  # Leaf of our params tree.
  hf_shape: Callable[[ModelConfig], tuple[int, ...]]
  transposed: bool


def _rules() -> tuple[_Rule, ...]:
  def layer(hf, ours, shape, transposed=False):
    return _Rule(f"model.layers.{{}}.{hf}", ("layers", ours), shape, transposed)

  return (
      _Rule("model.embed_tokens.weight", ("embed",), lambda c: (c.vocab_size, c.d_model), False),
      _Rule("model.norm.weight", ("final_norm",), lambda c: (c.d_model,), False),
      _Rule("lm_head.weight", ("lm_head",), lambda c: (c.vocab_size, c.d_model), True),
      layer("input_layernorm.weight", "attn_norm", lambda c: (c.d_model,)),
      layer("post_attention_layernorm.weight", "mlp_norm", lambda c: (c.d_model,)),
      layer("self_attn.q_proj.weight", "q", lambda c: (c.n_heads * c.head_dim, c.d_model), True),
      layer("self_attn.k_proj.weight", "k", lambda c: (c.n_kv_heads * c.head_dim, c.d_model),
            True),
      layer("self_attn.v_proj.weight", "v", lambda c: (c.n_kv_heads * c.head_dim, c.d_model),
            True),
      layer("self_attn.o_proj.weight", "o", lambda c: (c.d_model, c.n_heads * c.head_dim), True),
      layer("self_attn.q_proj.bias", "q_bias", lambda c: (c.n_heads * c.head_dim,)),
      layer("self_attn.k_proj.bias", "k_bias", lambda c: (c.n_kv_heads * c.head_dim,)),
      layer("self_attn.v_proj.bias", "v_bias", lambda c: (c.n_kv_heads * c.head_dim,)),
      layer("self_attn.q_norm.weight", "q_norm", lambda c: (c.head_dim,)),
      layer("self_attn.k_norm.weight", "k_norm", lambda c: (c.head_dim,)),
      layer("mlp.gate_proj.weight", "gate", lambda c: (c.d_ff, c.d_model), True),
      layer("mlp.up_proj.weight", "up", lambda c: (c.d_ff, c.d_model), True),
      layer("mlp.down_proj.weight", "down", lambda c: (c.d_model, c.d_ff), True),
  )


_RULES = _rules()


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _abstract_params(cfg: ModelConfig):
  return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def _active_rules(abstract) -> list[_Rule]:
  """The rules whose leaf exists for this config (biases, q/k norms, untied head)."""
  active = []
  for rule in _RULES:
    try:
      _get(abstract, rule.path)
    except KeyError:
      continue
    active.append(rule)
  return active


def _rope_theta(config_json: dict) -> float:
  rope = config_json.get("rope_parameters") or {}
  if config_json.get("rope_scaling") or rope.get("rope_type", "default") != "default":
    raise ValueError(f"config.json: rope scaling is not supported, got "
                     f"{config_json.get('rope_scaling') or rope}")
  return float(rope.get("rope_theta", config_json.get("rope_theta", 10000.0)))


def config_from_hf(config_json: dict, *, dtype: Optional[str] = None) -> ModelConfig:
  """Our `ModelConfig` for a Hugging Face Qwen2/Qwen3 `config.json` dict.

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
  return ModelConfig(
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


def read_config(model_dir: str, *, dtype: Optional[str] = None) -> ModelConfig:
  """`config_from_hf` of the `config.json` in `model_dir`."""
  with open(os.path.join(model_dir, "config.json")) as f:
    return config_from_hf(json.load(f), dtype=dtype)


def config_to_hf(cfg: ModelConfig) -> dict:
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


def _tensor_files(model_dir: str) -> dict[str, str]:
  """Tensor name -> safetensors file, from the index when there is one."""
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
  from safetensors import safe_open
  files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
  if not files:
    raise ValueError(f"{model_dir}: no *.safetensors files")
  where = {}
  for file in files:
    with safe_open(os.path.join(model_dir, file), framework="numpy") as f:
      for name in f.keys():
        if name in where:
          raise ValueError(f"{model_dir}: tensor {name!r} is in both {where[name]} and {file}")
        where[name] = os.path.join(model_dir, file)
  return where


class _Reader:
  """Reads named tensors, keeping each safetensors file open once."""

  def __init__(self, where: dict[str, str]):
    self._where, self._open = where, {}

  def __call__(self, name: str) -> np.ndarray:
    from safetensors import safe_open
    file = self._where[name]
    if file not in self._open:
      self._open[file] = safe_open(file, framework="numpy")
    return self._open[file].get_tensor(name)


def _host_leaf(rule: _Rule, cfg: ModelConfig, leaf, read) -> np.ndarray:
  names = ([rule.hf_name.format(i) for i in range(cfg.n_layers)] if "{}" in rule.hf_name
           else [rule.hf_name])
  shape = leaf.shape[1:] if "{}" in rule.hf_name else leaf.shape
  parts = []
  for name in names:
    w = read(name)
    if tuple(w.shape) != rule.hf_shape(cfg):
      raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, expected "
                       f"{rule.hf_shape(cfg)} from config.json")
    parts.append((w.T if rule.transposed else w).reshape(shape).astype(leaf.dtype))
  return np.stack(parts) if "{}" in rule.hf_name else parts[0]


def load_hf(model_dir: str, *, mesh: Optional[Mesh] = None,
            dtype: Optional[str] = None) -> tuple[ModelConfig, Params]:
  """Reads a Hugging Face Qwen2/Qwen3 directory into (config, params).

  Each leaf is assembled on the host and put straight onto its sharding from
  `sharding.param_shardings` (on `mesh`; the default device when None), so no
  device ever holds more than its shards. Missing, unexpected and mis-shaped
  tensors raise ValueError naming the tensor.
  """
  cfg = read_config(model_dir, dtype=dtype)
  abstract = _abstract_params(cfg)
  rules = _active_rules(abstract)
  where = _tensor_files(model_dir)

  expected = {rule.hf_name.format(i) for rule in rules for i in range(cfg.n_layers)}
  missing = sorted(expected - set(where))
  if missing:
    raise ValueError(f"{model_dir}: missing tensor {missing[0]!r}"
                     + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
  # Tied checkpoints may still store the head; it equals the embedding and is unused.
  ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
  unexpected = sorted(set(where) - expected - ignored)
  if unexpected:
    raise ValueError(f"{model_dir}: unexpected tensor {unexpected[0]!r}"
                     + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))

  shardings = (sharding.param_shardings(abstract, mesh) if mesh is not None
               else jax.tree.map(lambda _: None, abstract))
  read = _Reader(where)
  flat = {}
  for rule in rules:
    host = _host_leaf(rule, cfg, _get(abstract, rule.path), read)
    target = _get(shardings, rule.path)
    flat[rule.path] = jax.device_put(host) if target is None else jax.device_put(host, target)
  params = jax.tree_util.tree_map_with_path(
      lambda path, _: flat[tuple(k.key for k in path)], abstract)
  return cfg, params


def save_hf(cfg: ModelConfig, params: Params, out_dir: str, *,
            tokenizer_dir: Optional[str] = None) -> None:
  """Writes `config.json` and `model.safetensors` that `transformers` loads, plus the
  tokenizer and generation files found in `tokenizer_dir`, if given."""
  from safetensors.numpy import save_file
  hf_config = config_to_hf(cfg)
  tensors: dict[str, Any] = {}
  for rule in _active_rules(_abstract_params(cfg)):
    leaf = np.asarray(jax.device_get(_get(params, rule.path)))
    layers = list(enumerate(leaf)) if "{}" in rule.hf_name else [(None, leaf)]
    for i, w in layers:
      hf_shape = rule.hf_shape(cfg)
      w = w.reshape(hf_shape[::-1]).T if rule.transposed else w.reshape(hf_shape)
      tensors[rule.hf_name.format(i)] = np.ascontiguousarray(w)
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  if tokenizer_dir is not None:
    for name in _TOKENIZER_FILES:
      if os.path.exists(os.path.join(tokenizer_dir, name)):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
