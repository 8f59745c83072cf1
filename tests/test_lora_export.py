"""A LoRA run's export: the merged model as `transformers` loads it, and the adapters
alone in PEFT's layout, loaded by `peft` onto the base, both computing the adapted
model's logits, for a Qwen2 and a Llama base."""

import functools

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch", reason="the export round trip needs CPU torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from async_rl import sharding, train_step  # noqa: E402
from async_rl.models import hf, lora  # noqa: E402
from async_rl.rl import build, workdir as workdir_lib  # noqa: E402
from async_rl.rl.checkpoint import Checkpointer, Meta  # noqa: E402
from async_rl.rl.export import export_hf  # noqa: E402
from hf_test_utils import COMMON, our_logits, torch_logits, torch_model  # noqa: E402
from rl_test_utils import small_config  # noqa: E402


@functools.partial(jax.jit, static_argnums=(0, 1))
def _random_adapters(model_cfg, lora_cfg, key):
  adapters = lora.init_adapters(model_cfg, lora_cfg, key)
  return jax.tree.map(lambda w: w + 0.05 * jax.random.normal(key, w.shape), adapters)


@pytest.mark.parametrize("architecture", ["Qwen2", "Llama"])
def test_the_merged_model_and_the_peft_adapter_compute_the_adapted_model(tmp_path,
                                                                         architecture):
  base_dir, workdir = tmp_path / "base", tmp_path / "run"
  base_model = torch_model(getattr(transformers, f"{architecture}Config")(**COMMON))
  base_model.save_pretrained(base_dir)
  cfg = build.resolve(small_config(**{
      "hf_model_dir": str(base_dir), "lora.rank": 4, "lora.alpha": 8.0,
      "lora.targets": ("q", "k", "o", "gate", "down"), "model.max_seq_len": 64}))
  base = hf.load_hf(str(base_dir), cfg.model)
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = train_step.create_train_state(cfg.model, optax.sgd(1.0), mesh, jax.random.key(0),
                                           params=base, lora_cfg=cfg.lora)
  adapters = _random_adapters(cfg.model, cfg.lora, jax.random.key(1))
  workdir.mkdir()
  workdir_lib.write_config(str(workdir), cfg)
  checkpointer = Checkpointer(str(workdir / "checkpoints"), keep=1)
  checkpointer.save(1, state.replace(step=state.step + 1, params=adapters),
                    Meta(1, lora_base={"hf_model_dir": cfg.hf_model_dir}), wait=True)
  checkpointer.close()
  tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], 12)
  want = our_logits(cfg.model, lora.attach(base, adapters, cfg.lora.scale), tokens)
  assert np.abs(want - our_logits(cfg.model, base, tokens)).max() > 0.05  # adapters matter

  export_hf(str(workdir), str(tmp_path / "merged"))
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                             dtype=torch.float32).eval()
  np.testing.assert_allclose(torch_logits(merged, tokens), want, atol=1e-4)

  export_hf(str(workdir), str(tmp_path / "adapter"), adapter=True)
  on_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
  adapted = peft.PeftModel.from_pretrained(on_base, tmp_path / "adapter").eval()
  np.testing.assert_allclose(torch_logits(adapted, tokens), want, atol=1e-4)
  with pytest.raises(ValueError, match="trained no adapters"):
    plain = tmp_path / "plain"
    plain.mkdir()
    workdir_lib.write_config(str(plain), small_config())
    export_hf(str(plain), str(tmp_path / "x"), adapter=True)
