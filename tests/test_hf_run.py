"""A run from a Hugging Face directory on the math task, and its export back to one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("math_verify")

from async_rl.config import ModelConfig  # noqa: E402
from async_rl.models.hf_tokenizer import HFTokenizer  # noqa: E402
from async_rl.param_server import ParameterServer  # noqa: E402
from async_rl.rl import build  # noqa: E402
from async_rl.rl.checkpoint import restore_params  # noqa: E402
from async_rl.tasks.registry import make_task  # noqa: E402
from conftest import one_layer_model  # noqa: E402
from hf_test_utils import (COMMON, MATH_CORPUS, MATH_HELDOUT, MATH_TRAIN,  # noqa: E402
                           load_hf, our_logits, save_tokenizer, torch_logits, torch_model,
                           write_jsonl, write_model_dir)
from rl_test_utils import small_config  # noqa: E402

ROOT = Path(__file__).parents[1]
TOL = 1e-4  # float32 both sides, as in test_hf_parity.py.
# The micro config with room for the chat-templated prompts (about 35 tokens).
MATH_RUN = {"task.name": "math", "rollout.reward_fn": "math",
            "generation.max_prompt_len": 48, "model.max_seq_len": 64}


def _math_files(tmp_path):
  return (write_jsonl(tmp_path / "train.jsonl", MATH_TRAIN),
          write_jsonl(tmp_path / "heldout.jsonl", MATH_HELDOUT))


def test_trainer_and_generators_start_from_the_checkpoint(tmp_path):
  model_dir = tmp_path / "model"
  write_model_dir(model_dir, one_layer_model(64), corpus=MATH_CORPUS, seed=3)
  train, heldout = _math_files(tmp_path)
  cfg = build.resolve(small_config(**MATH_RUN, **{
      "hf_model_dir": str(model_dir), "task.math.train_path": train,
      "task.math.heldout_path": heldout}))
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  loop = build.train_loop(cfg, str(tmp_path / "run"), server, task=make_task(cfg.task),
                          echo=lambda _: None, progress=False)
  try:
    _, expected = load_hf(model_dir)
    trained = loop.trainer.state.params
    assert trained["layers"]["q"].sharding.mesh.axis_names == ("data", "fsdp", "tensor")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trained), expected)
    version, published = server.fetch(-1)  # what every generator pool starts from
    assert version == 0
    jax.tree.map(np.testing.assert_array_equal, published, expected)
  finally:
    server.close()
    loop.close()


def _run(*args):
  out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  return out.stdout


def test_train_from_hf_dir_on_math_then_export_loads_in_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model_dir, workdir, out_dir = tmp_path / "model", tmp_path / "run", tmp_path / "export"
  model_dir.mkdir()
  tok = save_tokenizer(model_dir, corpus=MATH_CORPUS)
  torch_model(transformers.Qwen2Config(**COMMON, rope_theta=5000.0,
                                       eos_token_id=tok.token_to_id("<|im_end|>"))
              ).save_pretrained(str(model_dir))
  train, heldout = _math_files(tmp_path)
  overrides = {**MATH_RUN, "num_steps": 2, "hf_model_dir": model_dir,
               "task.math.train_path": train, "task.math.heldout_path": heldout}
  out = _run("launch.train", "--config=configs/micro.py", f"--workdir={workdir}",
             *(f"--config.{k}={v}" for k, v in overrides.items()))
  assert "v=2 reward=" in out and "eval v=2" in out
  run = json.loads((workdir / "config.json").read_text())
  assert run["hf_model_dir"] == str(model_dir) and run["task"]["name"] == "math"
  assert (run["model"]["d_model"], run["model"]["n_layers"], run["model"]["vocab_size"]) == (
      COMMON["hidden_size"], COMMON["num_hidden_layers"], COMMON["vocab_size"])
  steps = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [s["step"] for s in steps if "eval" not in s] == [1, 2]
  assert all(s["trained_tokens"] > 0 for s in steps if "eval" not in s)

  assert "exported" in _run("launch.export_hf", f"--workdir={workdir}", f"--out={out_dir}")
  assert HFTokenizer(str(out_dir)).stop_ids == HFTokenizer(str(model_dir)).stop_ids
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir),
                                                               dtype=torch.float32).eval()
  model_cfg = ModelConfig(**run["model"])
  params = restore_params(str(workdir / "checkpoints"), model_cfg)
  tokens = HFTokenizer(str(out_dir)).encode_chat(MATH_HELDOUT[0]["question"])
  diff = np.abs(our_logits(model_cfg, params, tokens) - torch_logits(exported, tokens)).max()
  assert diff <= TOL, diff
