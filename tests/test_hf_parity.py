"""Hugging Face checkpoints: logit parity with `transformers` for Qwen2 (untied and tied),
Qwen3 and Llama (tied, and untied with Llama 3's rope scaling), export round trip, greedy
generation parity, and loader errors."""

import copy
import dataclasses
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the HF parity tests need CPU torch")
transformers = pytest.importorskip("transformers", reason="the HF parity tests need transformers")
pytest.importorskip("safetensors", reason="the HF loader needs safetensors")

from async_rl import models  # noqa: E402
from async_rl.config import ModelConfig  # noqa: E402
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams  # noqa: E402
from async_rl.models import hf, hf_config  # noqa: E402
from hf_test_utils import COMMON, load_hf, our_logits, torch_logits, torch_model  # noqa: E402

# float32 reference vs float32 ours: differences are summation-order rounding, ~1e-6.
TOL = 1e-4
T = 12
VARIANTS = {
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_theta=5000.0),
    "qwen2_tied": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True,
                                                   rope_theta=1e6),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, rope_theta=2e4),
    "llama_tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True,
                                                   rope_theta=1e5),
    # With head_dim 16 and base 1e4 the wavelengths 2 pi 1e4^(i/8) straddle both of llama3's
    # bounds (32 / 4 and 32 / 1): kept, blended and divided frequencies all occur.
    "llama3_rope": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=dict(
        rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32)),
}
LLAMA3 = dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
              rope_high_freq_factor=4.0, rope_original_max_len=32)


def _tokens(seed=0, n=T):
  return np.random.default_rng(seed).integers(0, COMMON["vocab_size"], n).tolist()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
  model = torch_model(VARIANTS[request.param]())
  model_dir = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(model_dir)
  return request.param, model, model_dir


def test_config_from_hf_reads_the_fields(saved):
  name, _, model_dir = saved
  with open(os.path.join(model_dir, "config.json")) as f:
    cfg = ModelConfig(**hf_config.config_from_hf(json.load(f)))
  assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
          cfg.d_ff) == (128, 64, 2, 4, 2, 96)
  assert cfg.rms_eps == 1e-5
  assert cfg.rope_theta == {"qwen2": 5000.0, "qwen2_tied": 1e6, "qwen3": 2e4,
                            "llama_tied": 1e5, "llama3_rope": 1e4}[name]
  assert cfg.head_dim == (32 if name == "qwen3" else 16)
  assert cfg.qk_norm == (name == "qwen3") and cfg.qkv_bias == name.startswith("qwen2")
  assert cfg.tie_embeddings == name.endswith("_tied")
  assert cfg.param_dtype == "float32"
  rope = {f: getattr(cfg, f) for f in LLAMA3}
  assert rope == (LLAMA3 if name == "llama3_rope" else dict(
      rope, rope_scaling="none")), rope


def test_logits_match_transformers(saved):
  _, model, model_dir = saved
  cfg, params = load_hf(model_dir)
  tokens = _tokens()
  want = torch_logits(model, tokens)
  diff = np.abs(our_logits(cfg, params, tokens) - want).max()
  assert diff <= TOL, diff
  if cfg.rope_scaling != "none":  # the scaling is exercised: without it the logits move
    plain = dataclasses.replace(cfg, rope_scaling="none")
    assert np.abs(our_logits(plain, params, tokens) - want).max() > 100 * TOL


def test_sharded_load_matches(saved):
  _, model, model_dir = saved
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp",
                                                                          "tensor"))
  cfg, params = load_hf(model_dir, mesh=mesh)
  assert params["layers"]["q"].sharding.mesh == mesh
  tokens = _tokens(1)
  diff = np.abs(our_logits(cfg, params, tokens) - torch_logits(model, tokens)).max()
  assert diff <= TOL, diff


def test_export_round_trips_through_transformers(saved, tmp_path):
  _, _, model_dir = saved
  cfg, params = load_hf(model_dir)
  # Fresh random params, so the export cannot pass by echoing the source files.
  params = jax.tree.map(lambda a, b: a + 0.1 * b, params,
                        models.init_params(cfg, jax.random.key(7)))
  with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": 3}, f)
  hf.save_hf(cfg, params, str(tmp_path), tokenizer_dir=model_dir)
  assert os.path.exists(tmp_path / "generation_config.json")
  # Readable by others as the config beside it is (the umask's say, not 0600).
  modes = {n: os.stat(tmp_path / n).st_mode & 0o777 for n in ("model.safetensors", "config.json")}
  assert modes["model.safetensors"] == modes["config.json"], modes
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                               dtype=torch.float32).eval()
  tokens = _tokens(2)
  diff = np.abs(our_logits(cfg, params, tokens) - torch_logits(reloaded, tokens)).max()
  assert diff <= TOL, diff
  cfg2, params2 = load_hf(str(tmp_path))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_greedy_generation_matches_transformers(saved):
  _, model, model_dir = saved
  cfg, params = load_hf(model_dir)
  prompt, n_new = _tokens(3, 7), 16
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  with torch.no_grad():
    ref = model.generate(torch.tensor(prompt)[None], do_sample=False, max_new_tokens=n_new,
                         min_new_tokens=n_new)[0, len(prompt):].numpy()
  engine = Engine(cfg, max_concurrent_decodes=1, max_prefill_length=16, max_target_length=32)
  with GeneratorPool(engine, params) as pool:
    (sample,) = pool.submit(Request(0, prompt, sampling=SamplingParams(
        temperature=0.0, max_new_tokens=n_new))).result(timeout=120)
  np.testing.assert_array_equal(sample.completion_C, ref)


def test_bfloat16_checkpoint_loads(saved, tmp_path):
  _, model, _ = saved
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(tmp_path))
  cfg, params = load_hf(str(tmp_path))
  assert cfg.param_dtype == "bfloat16" and params["embed"].dtype == jax.numpy.bfloat16
  ref = model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
  np.testing.assert_array_equal(np.asarray(params["embed"], np.float32), ref)
  cfg32, params32 = load_hf(str(tmp_path), dtype="float32")
  assert params32["layers"]["q"].dtype == np.float32


def test_unknown_architecture_is_named():
  with pytest.raises(ValueError, match="MistralForCausalLM"):
    hf_config.config_from_hf({"architectures": ["MistralForCausalLM"]})


@pytest.mark.parametrize("edit, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "rope_parameters.rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_scaling.rope_type 'linear' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported for LlamaForCausalLM"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor must be 1.0"),
])
def test_unsupported_llama_fields_are_named(edit, message):
  config_json = transformers.LlamaConfig(**COMMON).to_dict()
  config_json.update({"architectures": ["LlamaForCausalLM"], "rope_parameters": None, **edit})
  with pytest.raises(ValueError, match=message):
    hf_config.config_from_hf(config_json)


def test_llama3_scaling_of_an_older_config_reads_the_same():
  """Files written before transformers 5 keep the scaling in `rope_scaling` and the base
  beside it."""
  config_json = transformers.LlamaConfig(**COMMON).to_dict()
  config_json.update(architectures=["LlamaForCausalLM"], rope_parameters=None, rope_theta=5e5,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32})
  cfg = ModelConfig(**hf_config.config_from_hf(config_json))
  assert cfg.rope_theta == 5e5 and {f: getattr(cfg, f) for f in LLAMA3} == LLAMA3


def _copy_with(model_dir, out_dir, edit):
  from safetensors.numpy import load_file, save_file
  tensors = load_file(os.path.join(model_dir, "model.safetensors"))
  edit(tensors)
  os.makedirs(out_dir)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"))
  with open(os.path.join(model_dir, "config.json")) as f, \
      open(os.path.join(out_dir, "config.json"), "w") as g:
    g.write(f.read())
  return out_dir


def test_missing_unexpected_and_misshaped_tensors_are_named(saved, tmp_path):
  _, _, model_dir = saved
  name = "model.layers.1.mlp.up_proj.weight"
  cases = {
      "missing": (lambda t: t.pop(name), f"missing tensor '{name}'"),
      "unexpected": (lambda t: t.update(extra=np.zeros(2, np.float32)),
                     "unexpected tensor 'extra'"),
      "misshaped": (lambda t: t.update({name: t[name][:, :-1]}),
                    rf"tensor '{name}' has shape \(96, 63\), expected \(96, 64\)"),
  }
  for case, (edit, message) in cases.items():
    with pytest.raises(ValueError, match=message):
      load_hf(_copy_with(model_dir, str(tmp_path / case), edit))


def test_sharded_index_is_followed(saved, tmp_path):
  _, model, model_dir = saved
  model.save_pretrained(str(tmp_path), max_shard_size="20KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  cfg, params = load_hf(str(tmp_path))
  tokens = _tokens(4)
  diff = np.abs(our_logits(cfg, params, tokens) - torch_logits(model, tokens)).max()
  assert diff <= TOL, diff
