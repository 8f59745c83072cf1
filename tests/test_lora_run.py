"""A warm-started LoRA run (the documented `--config.lora.rank=...` on a task with
reference completions) out of its workdir, through the one loader every binary uses:
served by the OpenAI-compatible endpoint, scored, and exported as the merged model and
as adapters with their base, which `peft` loads to the merged model's logits."""

import numpy as np
import pytest

from async_rl import models
from async_rl.models import lora
from async_rl.rl import entry, export, lora_base
from hf_test_utils import our_logits
from rl_test_utils import small_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The workdir of a LoRA run whose base is its own warm start, trained far enough (a
  large learning rate, a reward that differs within a group) that its adapters change
  the model."""
  workdir = tmp_path_factory.mktemp("lora_run")
  cfg = small_config(**{"lora.rank": 4, "sft.steps": 2, "sft.batch_size": 2, "num_steps": 2,
                        "optimizer.learning_rate": 0.05,
                        "rollout.reward_fn": "reward_fns_for_tests:length"})
  entry.run(cfg, str(workdir), progress=False, echo=lambda _: None)
  assert (workdir / lora_base.BASE_FILE).exists()
  return workdir


def test_one_loader_gives_the_adapters_of_the_checkpoint_on_the_run_s_warm_start(run):
  policy = export.load_policy(workdir=str(run))
  cfg = policy.cfg
  assert policy.source == {"workdir": str(run), "step": 2} and cfg.lora.rank == 4
  base, _ = lora_base.load_file(str(run / lora_base.BASE_FILE),
                                models.abstract_params(cfg.model))
  tokens = np.arange(3, 15)
  served = our_logits(cfg.model, policy.params, tokens)
  # The policy the trainer computes: the adapters attached to the warm-started base.
  trained = our_logits(cfg.model, lora.attach(base, policy.adapters, cfg.lora.scale), tokens)
  np.testing.assert_allclose(served, trained, atol=2e-5)
  assert np.abs(served - our_logits(cfg.model, base, tokens)).max() > 0.01  # adapters matter


def test_the_openai_endpoint_serves_a_warm_started_lora_run(run):
  httpx = pytest.importorskip("httpx", reason="the `agents` extra")
  from async_rl.agents import serve  # noqa: PLC0415
  with serve.serve(export.run_config(str(run)), workdir=str(run), port=0) as endpoint:
    r = httpx.post(f"{endpoint.url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": "12+34=", "max_tokens": 4, "temperature": 0})
  assert r.status_code == 200, r.text
  assert r.json()["usage"]["completion_tokens"] > 0


def test_a_warm_started_lora_run_is_scored(run):
  report = export.score(export.load_policy(workdir=str(run)), num_prompts=2, pass_k=1)
  assert report["num_prompts"] == 2 and report["reward_calls"] == 2 * (1 + 1)
  assert report["reward_failures"] == 0 and report["completion_len"] > 0


def test_peft_loads_the_adapters_onto_their_exported_base_as_our_merged_export(run, tmp_path):
  torch = pytest.importorskip("torch", reason="the export round trip needs CPU torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  for name, kind in (("merged", {}), ("adapter", {"adapter": True}), ("base", {"base": True})):
    export.export_hf(str(run), str(tmp_path / name), **kind)
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
      d, dtype=torch.float32).eval()
  tokens = torch.arange(3, 15)[None]
  with torch.no_grad():
    merged = load(tmp_path / "merged")(tokens).logits[0].numpy()
    base = load(tmp_path / "base")
    on_base = base(tokens).logits[0].numpy()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    peft_logits = adapted(tokens).logits[0].numpy()
  assert np.abs(merged - on_base).max() > 0.01  # the adapters matter
  np.testing.assert_allclose(peft_logits, merged, atol=1e-4)
  with pytest.raises(ValueError, match="not both at once"):
    export.export_hf(str(run), str(tmp_path / "x"), adapter=True, base=True)
