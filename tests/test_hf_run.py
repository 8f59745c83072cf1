"""A run from a Hugging Face directory on the math task."""

import jax
import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("math_verify")

from async_rl.models import ModelConfig, hf  # noqa: E402
from async_rl.param_server import ParameterServer  # noqa: E402
from async_rl.rl.trainer_loop import TrainerLoop  # noqa: E402
from hf_test_utils import (MATH_CORPUS, MATH_HELDOUT, MATH_TRAIN, write_jsonl,  # noqa: E402
                           write_model_dir)
from rl_test_utils import small_config  # noqa: E402

# The micro config with room for the chat-templated prompts (about 35 tokens).
MATH_RUN = {"task_kind": "math", "rollout.reward_fn": "math",
            "generation.max_prompt_len": 48, "model.max_seq_len": 64}


def _math_files(tmp_path):
  return (write_jsonl(tmp_path / "train.jsonl", MATH_TRAIN),
          write_jsonl(tmp_path / "heldout.jsonl", MATH_HELDOUT))


def test_trainer_and_generators_start_from_the_checkpoint(tmp_path):
  model_dir = tmp_path / "model"
  write_model_dir(model_dir, ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                         n_kv_heads=1, head_dim=16, d_ff=64),
                  corpus=MATH_CORPUS, seed=3)
  train, heldout = _math_files(tmp_path)
  cfg = small_config(**MATH_RUN, **{"hf_model_dir": str(model_dir), "math.train_path": train,
                                    "math.heldout_path": heldout})
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  loop = TrainerLoop(cfg, str(tmp_path / "run"), server, echo=lambda _: None, progress=False)
  try:
    _, expected = hf.load_hf(str(model_dir))
    trained = loop.trainer.state.params
    assert trained["layers"]["q"].sharding.mesh.axis_names == ("data", "fsdp", "tensor")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trained), expected)
    version, published = server.fetch(-1)  # what every generator pool starts from
    assert version == 0
    jax.tree.map(np.testing.assert_array_equal, published, expected)
  finally:
    server.close()
    loop.close()

