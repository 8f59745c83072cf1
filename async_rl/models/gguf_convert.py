"""A GGUF file (llama.cpp's format) written out as a Hugging Face directory.

`convert` reads the file with llama.cpp's own `gguf` library and writes `config.json`,
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json` (with the chat template)
and `generation_config.json`: what `hf_config`, `hf.load_hf` and `HFTokenizer` read
from any Hugging Face directory, and what `transformers` loads. `models.pretrained`
caches the result by the file's digest, so a file is converted once.

Weights: every tensor is dequantized to float32 (`gguf.quants.dequantize`), so the
directory holds exactly the values llama.cpp computes with. llama.cpp's converter
permutes the rows of each q and k projection, per head, from the half-split rotary
layout of Hugging Face checkpoints to interleaved pairs (its rope kernels rotate
adjacent elements); the inverse permutation restores the half-split layout that
`transformer.rope` and `transformers` use.

Tokenizer: a byte-level BPE (`tokenizer.ggml.model` "gpt2") built with the `tokenizers`
library from `tokenizer.ggml.tokens`, `merges` and `token_type` (control tokens become
special added tokens, user-defined ones plain added tokens: both match whole in text).
The pre-tokenizer follows `tokenizer.ggml.pre` as llama.cpp reads it:

  gpt-2   GPT-2's split: contractions, letters, numbers, other symbols, whitespace.
  smollm  each digit split off first, then GPT-2's split. This is llama.cpp's rule for
          "smollm" (shared with starcoder and refact), and the original SmolLM2
          tokenizer's (a `Digits(individual_digits=True)` step before its byte-level
          one), the tokenization the model was trained on. `transformers` (5.x) builds
          a GGUF byte-level tokenizer with GPT-2's split alone, whatever the file's
          `pre` says. For SmolLM2 the two agree on most text, since no token of its
          vocabulary has a digit beside anything else, but not where two or more
          whitespace characters precede a digit: "x\\n\\n1" is `x`, `\\n\\n`, `1` here and
          in llama.cpp, `x`, `\\n`, `\\n`, `1` in transformers' load of the file. This
          module follows llama.cpp and the original tokenizer; a directory written
          here carries the rule in its `tokenizer.json`, so `transformers` loading the
          directory (or an export of a run) tokenizes as we do.

Other architectures than "llama", other tokenizer models and pre-tokenizers, and
rope scaling (`llama.rope.scaling.type`, a `rope_freqs` tensor) are refused naming the
field. Needs the `hf` extra (`gguf`, `safetensors`, `tokenizers`).
"""

import json
import os
from typing import Any

import numpy as np

from async_rl.config import ModelConfig
from async_rl.models import hf, hf_config

_ARCH = "llama"
# GGUF tensor name -> Hugging Face name; "{}" stands for the layer index.
_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
_PRE_TOKENIZERS = ("gpt-2", "smollm")
# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL, _USER_DEFINED = 3, 4


def read_metadata(reader) -> dict[str, Any]:
  """The key-value metadata of a `gguf.GGUFReader` as Python values."""
  return {key: field.contents() for key, field in reader.fields.items()
          if not key.startswith("GGUF.")}


def _f32(value) -> float:
  # GGUF stores floats in float32: 1e-5 reads back as 9.999999747378752e-06.
  return float(str(np.float32(value)))


def config_fields(meta: dict[str, Any], tensor_names) -> dict:
  """The `config.ModelConfig` fields of a GGUF file's metadata and tensor names."""
  arch = meta.get("general.architecture")
  if arch != _ARCH:
    raise ValueError(f"GGUF general.architecture {arch!r} is not supported; expected {_ARCH!r}")

  def get(key, default=None):
    value = meta.get(f"{_ARCH}.{key}", default)
    if value is None:
      raise ValueError(f"GGUF metadata has no {_ARCH}.{key}")
    return value

  if get("expert_count", 0):
    raise ValueError(f"GGUF {_ARCH}.expert_count: mixture-of-experts models are not supported")
  scaling = get("rope.scaling.type", "none")
  if scaling != "none":
    raise ValueError(f"GGUF {_ARCH}.rope.scaling.type {scaling!r} is not supported")
  if "rope_freqs.weight" in tensor_names:
    raise ValueError("GGUF tensor 'rope_freqs.weight' (rotary frequency factors, as Llama 3.1+ "
                     "files store their rope scaling) is not supported: convert the model's "
                     "Hugging Face directory instead, whose config.json names the scaling")
  d_model, n_heads = get("embedding_length"), get("attention.head_count")
  head_dim = get("attention.key_length", d_model // n_heads)
  rotary = get("rope.dimension_count", head_dim)
  if rotary != head_dim:
    raise ValueError(f"GGUF {_ARCH}.rope.dimension_count {rotary} must equal the head "
                     f"dimension {head_dim} (partial rotary embeddings are not supported)")
  return dict(
      vocab_size=get("vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))),
      d_model=d_model,
      n_layers=get("block_count"),
      n_heads=n_heads,
      n_kv_heads=get("attention.head_count_kv", n_heads),
      head_dim=head_dim,
      d_ff=get("feed_forward_length"),
      rope_theta=_f32(get("rope.freq_base", 10000.0)),
      rms_eps=_f32(get("attention.layer_norm_rms_epsilon")),
      qkv_bias=False,
      qk_norm=False,
      tie_embeddings="output.weight" not in tensor_names,
      max_seq_len=get("context_length"),
  )


def _unpermute(w, n_heads: int):
  """The inverse of llama.cpp's rotary row permutation of a q or k projection [H*E, D]."""
  E = w.shape[0] // n_heads
  # llama.cpp took each head's rows [2, E/2, D] to [E/2, 2, D]; swap them back.
  return w.reshape(n_heads, E // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """The Hugging Face tensors (float32) of a GGUF file's tensors: dequantized, with the q
  and k rows put back in the half-split rotary layout.

  Raises:
    ValueError: a tensor the model has no place for, a missing one, or a wrong shape,
      naming the GGUF tensor.
  """
  from gguf.quants import dequantize  # noqa: PLC0415 (the hf extra)
  shapes = hf.tensor_shapes(cfg)
  names = {}  # GGUF name -> Hugging Face name, for the tensors this config has
  for gguf_name, hf_name in _TENSORS.items():
    for i in range(cfg.n_layers) if "{}" in gguf_name else [None]:
      if hf_name.format(i) in shapes:
        names[gguf_name.format(i)] = hf_name.format(i)
  missing = sorted(set(names) - {t.name for t in reader.tensors})
  if missing:
    raise ValueError(f"GGUF file has no tensor {missing[0]!r}"
                     + (f" ({len(missing) - 1} more are missing)" if len(missing) > 1 else ""))
  out = {}
  for tensor in reader.tensors:
    name = names.get(tensor.name)
    if name is None:
      raise ValueError(f"GGUF tensor {tensor.name!r} ({tensor.tensor_type.name}) has no place "
                       f"in a {_ARCH} model of the file's metadata")
    w = dequantize(tensor.data, tensor.tensor_type)
    if tuple(w.shape) != shapes[name]:
      raise ValueError(f"GGUF tensor {tensor.name!r} has shape {tuple(w.shape)}, expected "
                       f"{shapes[name]} from the file's metadata")
    if name.endswith("q_proj.weight"):
      w = _unpermute(w, cfg.n_heads)
    elif name.endswith("k_proj.weight"):
      w = _unpermute(w, cfg.n_kv_heads)
    out[name] = np.ascontiguousarray(w, np.float32)
  return out


def tokenizer_json(meta: dict[str, Any]) -> str:
  """The `tokenizer.json` of a GGUF file's byte-level BPE vocabulary (see the module's
  docstring for the pre-tokenizer)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
  model = meta.get("tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"GGUF tokenizer.ggml.model {model!r} is not supported; expected 'gpt2' "
                     "(a byte-level BPE)")
  pre = meta.get("tokenizer.ggml.pre", "gpt-2")
  if pre not in _PRE_TOKENIZERS:
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; expected one of "
                     f"{_PRE_TOKENIZERS}")
  tokens = meta["tokenizer.ggml.tokens"]
  vocab = {}
  for i, token in enumerate(tokens):
    if vocab.setdefault(token, i) != i:
      raise ValueError(f"GGUF tokenizer.ggml.tokens: {token!r} is both id {vocab[token]} and {i}")
  merges = []
  for merge in meta.get("tokenizer.ggml.merges", ()):
    pair = tuple(merge.split(" "))
    if len(pair) != 2:
      raise ValueError(f"GGUF tokenizer.ggml.merges: {merge!r} is not two tokens")
    merges.append(pair)
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level])
                       if pre == "smollm" else byte_level)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
  if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
    raise ValueError(f"GGUF tokenizer: {len(tokens)} tokens became a vocabulary of "
                     f"{tok.get_vocab_size(with_added_tokens=True)}")
  return tok.to_str(pretty=False)


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
  ids = {}
  for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                    ("unk", "unknown_token_id"), ("pad", "padding_token_id")):
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is not None:
      if not 0 <= value < len(meta["tokenizer.ggml.tokens"]):
        raise ValueError(f"GGUF tokenizer.ggml.{key} {value} is not a token id")
      ids[name] = int(value)
  if "eos" not in ids:
    raise ValueError("GGUF metadata has no tokenizer.ggml.eos_token_id")
  return ids


def tokenizer_config(meta: dict[str, Any], max_len: int) -> dict:
  """`tokenizer_config.json`: the special tokens' text, the chat template, and whether
  BOS/EOS are added to encoded text (`tokenizer.ggml.add_bos_token`, `add_eos_token`)."""
  tokens = meta["tokenizer.ggml.tokens"]
  config = {f"{name}_token": tokens[i] for name, i in _special_ids(meta).items()}
  template = meta.get("tokenizer.chat_template")
  if template:
    config["chat_template"] = template
  return dict(config, add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
              clean_up_tokenization_spaces=False, model_max_length=max_len,
              tokenizer_class="PreTrainedTokenizerFast")


def convert(gguf_path: str, out_dir: str) -> None:
  """Writes the Hugging Face directory of the GGUF file `gguf_path` into `out_dir`.

  Raises:
    ValueError: what the file holds is not supported, naming the metadata key or tensor.
  """
  import gguf  # noqa: PLC0415 (the hf extra)
  reader = gguf.GGUFReader(gguf_path)
  meta = read_metadata(reader)
  cfg = ModelConfig(**config_fields(meta, {t.name for t in reader.tensors}))
  ids = _special_ids(meta)
  files = {
      "tokenizer.json": tokenizer_json(meta),
      "tokenizer_config.json": tokenizer_config(meta, cfg.max_seq_len),
      "generation_config.json": {f"{name}_token_id": i for name, i in ids.items()
                                 if name != "unk"},
      "config.json": dict(hf_config.config_to_hf(cfg),
                          **{f"{name}_token_id": i for name, i in ids.items() if name != "unk"}),
  }
  tensors = hf_tensors(reader, cfg)
  os.makedirs(out_dir, exist_ok=True)
  hf.write_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
  for name, content in files.items():
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
      f.write(content if isinstance(content, str) else json.dumps(content, indent=2,
                                                                  ensure_ascii=False))
