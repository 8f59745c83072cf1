"""Hugging Face Qwen2/Qwen3/Llama checkpoints: safetensors weights in, and export.

One table (`_RULES`) maps each Hugging Face tensor to a leaf of our params tree and
says whether it is transposed; loading and saving both read it. Hugging Face linear
weights are [out, in]; ours are [in, ...] with heads split out, so a transposed
tensor is `w.T.reshape(ours)` on the way in and `w.reshape(hf[::-1]).T` on the way
out. Per-layer tensors are stacked on our leading L axis.

Needs the `hf` extra (safetensors, which reads bf16 into numpy via ml_dtypes).
"""

import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Optional

import jax
import numpy as np

from async_rl.models.hf_config import config_to_hf
from async_rl.models.transformer import Params, abstract_params

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class _Rule:
  hf_name: str  # "{}" stands for the layer index.
  path: tuple[str, ...]  # Leaf of our params tree.
  hf_shape: Callable[[Any], tuple[int, ...]]  # of the model config
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


def tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
  """The Hugging Face tensors a checkpoint of model config `cfg` holds, with their shapes
  (no `lm_head.weight` when the embeddings are tied)."""
  return {rule.hf_name.format(i): rule.hf_shape(cfg)
          for rule in _active_rules(abstract_params(cfg))
          for i in (range(cfg.n_layers) if "{}" in rule.hf_name else [None])}


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


def _host_leaf(rule: _Rule, cfg, leaf, read) -> np.ndarray:
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


def load_hf(model_dir: str, cfg, *, shardings=None) -> Params:
  """Reads the weights of a Hugging Face Qwen2/Qwen3/Llama directory.

  `cfg` is the model's `config.ModelConfig`, its architecture that of the directory's
  `config.json` (`hf_config.read_config`). Each leaf is assembled on the host and put
  straight onto its sharding in `shardings` (a tree like the params', e.g.
  `sharding.param_shardings`; None: the default device), so no device ever holds
  more than its shards. Missing, unexpected and mis-shaped tensors raise ValueError
  naming the tensor.
  """
  abstract = abstract_params(cfg)
  rules = _active_rules(abstract)
  where = _tensor_files(model_dir)

  expected = set(tensor_shapes(cfg))
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

  if shardings is None:
    shardings = jax.tree.map(lambda _: None, abstract)
  read = _Reader(where)
  flat = {}
  for rule in rules:
    host = _host_leaf(rule, cfg, _get(abstract, rule.path), read)
    target = _get(shardings, rule.path)
    flat[rule.path] = jax.device_put(host) if target is None else jax.device_put(host, target)
  params = jax.tree_util.tree_map_with_path(
      lambda path, _: flat[tuple(k.key for k in path)], abstract)
  return params


def write_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
  """Writes `tensors` to the safetensors file `path`, readable as the umask allows."""
  from safetensors.numpy import save_file
  save_file(tensors, path, metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)  # safetensors writes 0600; a model is shared like its config


def save_hf(cfg, params: Params, out_dir: str, *,
            tokenizer_dir: Optional[str] = None) -> None:
  """Writes `config.json` and `model.safetensors` that `transformers` loads, plus the
  tokenizer and generation files found in `tokenizer_dir`, if given."""
  hf_config = config_to_hf(cfg)
  tensors: dict[str, Any] = {}
  for rule in _active_rules(abstract_params(cfg)):
    leaf = np.asarray(jax.device_get(_get(params, rule.path)))
    layers = list(enumerate(leaf)) if "{}" in rule.hf_name else [(None, leaf)]
    for i, w in layers:
      hf_shape = rule.hf_shape(cfg)
      w = w.reshape(hf_shape[::-1]).T if rule.transposed else w.reshape(hf_shape)
      tensors[rule.hf_name.format(i)] = np.ascontiguousarray(w)
  os.makedirs(out_dir, exist_ok=True)
  write_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  if tokenizer_dir is not None:
    for name in _TOKENIZER_FILES:
      if os.path.exists(os.path.join(tokenizer_dir, name)):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
