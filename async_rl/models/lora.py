"""Low-rank adapters (LoRA) on the projections of `models.transformer`'s model.

An adapter on projection W (q, k, v, o, gate, up or down; `config.LORA_TARGETS`) is a
pair A [*in, r], B [r, *out], stacked over layers like W, and the adapted projection
is x W + s (x A) B with s = alpha / r. A is drawn as PEFT draws it (uniform in
±1/sqrt(fan_in)) and B starts at zero, so a new adapter leaves the model as it was.
The adapters are float32 whatever the base's dtype: they are what the optimizer updates.

The adapters are a params-shaped pytree of their own, `{"layers": {"q_lora_a": ...,
"q_lora_b": ...}}`. `attach` puts them beside the base's weights in each layer's dict
(no copy of the base) with s folded into B, and the model adds the low-rank term where
a layer carries one; `merge` adds s A B into the weights themselves, for a generator or
an export that wants the plain model; `peft_tensors` and `peft_config` lay the adapters
out as Hugging Face's PEFT saves them.

The library is our own, not qwix (the LoRA of Tunix): qwix adapts Flax Linen/NNX
modules by intercepting their matmuls during model surgery, and this model is pure
functions over a dict of arrays, where an adapter is two more arrays in that dict.

There is no adapter dropout. A decoupled-PPO step compares the policy's log-probs with
those the generator recorded and with the proximal ones recomputed before the update;
dropout in the training forward alone would make the trained policy a different,
random one (the ratios would not start at 1 and the behaviour-vs-recomputed check
would fail for every token), while the generator samples the model without it.
"""

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from async_rl.config import LoraConfig, ModelConfig
from async_rl.models.transformer import Params, abstract_params

# Each target's input dims (after the leading L axis of its weight): the rest are its outputs.
N_IN = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def init_adapters(model_cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> Params:
  """New adapters for `lora.targets` of a `model_cfg` model; pure, so `jax.eval_shape`
  works. B is zero: the adapted model starts as the base."""
  weights = abstract_params(model_cfg)["layers"]
  layers = {}
  for name, key in zip(lora.targets, jax.random.split(key, len(lora.targets))):
    shape, n_in = weights[name].shape, N_IN[name]
    L, ins, outs = shape[0], shape[1:1 + n_in], shape[1 + n_in:]
    bound = math.prod(ins) ** -0.5
    layers[f"{name}_lora_a"] = jax.random.uniform(key, (L, *ins, lora.rank), jnp.float32,
                                                  -bound, bound)
    layers[f"{name}_lora_b"] = jnp.zeros((L, lora.rank, *outs), jnp.float32)
  return {"layers": layers}


def abstract_adapters(model_cfg: ModelConfig, lora: LoraConfig):
  """The adapters' shapes and dtypes, nothing allocated."""
  return jax.eval_shape(lambda key: init_adapters(model_cfg, lora, key), jax.random.key(0))


def num_params(model_cfg: ModelConfig, lora: LoraConfig) -> int:
  """The adapters' parameter count: r (in + out) per target and layer."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_adapters(model_cfg, lora)))


def targets(adapters: Params) -> list[str]:
  """The projections `adapters` adapt, in model order."""
  return [name for name in N_IN if f"{name}_lora_a" in adapters["layers"]]


def join(base: Params, adapters: Params) -> Params:
  """The base's tree with the adapters' entries in its layer dict, as they are: for
  trees of shardings or shapes, which `attach` gives arrays in."""
  return {**base, "layers": {**base["layers"], **adapters["layers"]}}


def attach(base: Params, adapters: Params, scale: float) -> Params:
  """Params for the model functions: the base's arrays (not copied) with each adapter's
  A and s B beside the weight it adapts. Differentiable in `adapters`."""
  layers = {name: w * scale if name.endswith("_lora_b") else w
            for name, w in adapters["layers"].items()}
  return join(base, {"layers": layers})


def zeros_like(adapters: Params) -> Params:
  """Adapters that add nothing: attached, the model is the base (the KL reference)."""
  return jax.tree.map(jnp.zeros_like, adapters)


def delta(adapters: Params, name: str, scale: float) -> jax.Array:
  """s A B of target `name`, shaped as its stacked weight [L, *in, *out], float32."""
  a, b = adapters["layers"][f"{name}_lora_a"], adapters["layers"][f"{name}_lora_b"]
  r = a.shape[-1]
  a_LIR = a.reshape(a.shape[0], -1, r)
  b_LRO = b.reshape(b.shape[0], r, -1)
  prod = jnp.einsum("lir,lro->lio", a_LIR, b_LRO, preferred_element_type=jnp.float32)
  return (scale * prod).reshape(*a.shape[:-1], *b.shape[2:])


def merge(base: Params, adapters: Params, scale: float) -> Params:
  """The base with s A B added into each adapted weight, in the weight's dtype: the plain
  model that the adapted one computes (to the rounding of that dtype). `base` may be in
  the stacked layout or the serving one (`models.split_layers`); `adapters` are stacked."""
  deltas = {name: delta(adapters, name, scale) for name in targets(adapters)}
  add = lambda w, d: (w.astype(jnp.float32) + d).astype(w.dtype)
  layers = base["layers"]
  if isinstance(layers, tuple):
    merged = tuple({**lp, **{name: add(lp[name], d[l]) for name, d in deltas.items()}}
                   for l, lp in enumerate(layers))
  else:
    merged = {**layers, **{name: add(layers[name], d) for name, d in deltas.items()}}
  return {**base, "layers": merged}


# Each target's module in a Hugging Face Qwen2 decoder layer, where PEFT puts its adapter.
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}


def peft_tensors(adapters: Params) -> dict[str, np.ndarray]:
  """The adapters as PEFT saves a LoRA of a Hugging Face causal LM (float32): for each
  layer and target, `lora_A.weight` [r, in] and `lora_B.weight` [out, r] (linear weights
  are [out, in] there; heads flatten head-major, as `models.hf` maps the weights)."""
  tensors = {}
  for name in targets(adapters):
    a = np.asarray(adapters["layers"][f"{name}_lora_a"], np.float32)
    b = np.asarray(adapters["layers"][f"{name}_lora_b"], np.float32)
    r = a.shape[-1]
    for l in range(a.shape[0]):
      module = f"base_model.model.model.layers.{l}.{HF_MODULES[name]}"
      tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a[l].reshape(-1, r).T)
      tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b[l].reshape(r, -1).T)
  return tensors


def peft_config(lora_cfg: LoraConfig, base_model: Optional[str] = None) -> dict[str, Any]:
  """PEFT's `adapter_config.json` for adapters of `lora_cfg` on `base_model` (a Hugging
  Face directory or hub id; None when the base was a random init)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank,
          "lora_alpha": lora_cfg.alpha, "lora_dropout": 0.0, "bias": "none",
          "target_modules": sorted(HF_MODULES[t].split(".")[1] for t in lora_cfg.targets),
          "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
          "base_model_name_or_path": base_model}
