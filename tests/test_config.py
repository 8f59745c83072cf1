"""Typed config: strict conversion, validation messages that name the field."""

import importlib.util
from pathlib import Path

import pytest

from async_rl import cli, config as config_lib, generation
from async_rl.cli import from_dict
from async_rl.config import ExperimentConfig, MeshConfig
from async_rl.rl import build

CONFIGS = sorted(p for p in (Path(__file__).parents[1] / "configs").glob("*.py")
                 if p.stem != "__init__")


def _module(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_file_and_variant_converts(path):
  module = _module(path)
  for variant in (None, *getattr(module, "VARIANTS", ())):
    cfg = from_dict(module.get_config(*[variant] if variant else []))
    assert isinstance(cfg, ExperimentConfig)
    assert cli.to_dict(cfg)["model"]["vocab_size"] == cfg.model.vocab_size
    build.check(cfg)


def test_conversion_types_and_defaults():
  cfg = from_dict({"ppo": {"eps_clip": 1, "c_clip": None}, "batching": {
      "max_tokens_per_mb": 512, "row_buckets": [128, 512]}})
  assert cfg.ppo.eps_clip == 1.0 and isinstance(cfg.ppo.eps_clip, float)
  assert cfg.batching.row_buckets == (128, 512)
  assert cfg.generation == config_lib.GenerationConfig()


@pytest.mark.parametrize("values, field", [
    ({"ppo": {"eps": 0.2}}, "ppo.eps"),
    ({"bogus": 1}, "bogus"),
    ({"ppo": {"eps_clip": -0.1}}, "ppo.eps_clip"),
    ({"ppo": {"c_clip": 0.5}}, "ppo.c_clip"),
    ({"ppo": {"loss": "ppo2"}}, "ppo.loss"),
    ({"ppo": {"loss": "naive_ppo"}}, "ppo.loss"),
    ({"ppo": {"behav_imp_weight_cap": 5.0}}, "ppo.behav_imp_weight_cap"),
    ({"ppo": {"prox_logp": "fresh"}}, "ppo.prox_logp"),
    ({"ppo": {"rejection_upper": 1.0}}, "ppo.rejection_upper"),
    ({"ppo": {"rejection_action": "clamp", "rejection_metric": "kl_k1"}},
     "ppo.rejection_metric"),
    ({"staleness": {"max_staleness": -1}}, "staleness.max_staleness"),
    ({"staleness": {"admit_stale": True}}, "staleness.admit_stale"),
    ({"staleness": {"on_stale": "mask"}}, "staleness.on_stale must be one of"),
    ({"run": {"warn_after_s": 30.0, "stall_timeout_s": 20.0}}, "run.stall_timeout_s"),
    ({"run": {"max_worker_restarts": -1}}, "run.max_worker_restarts"),
    ({"rollout": {"reward_timeout_s": 600.0}}, "rollout.reward_timeout_s must be below"),
    ({"batching": {"max_tokens_per_mb": 64}}, "batching.max_tokens_per_mb"),
    ({"batching": {"reuse_slack": -0.5}}, "batching.reuse_slack"),
    ({"batching": {"reuse_slack": float("nan")}}, "batching.reuse_slack"),
    ({"generation": {"top_p": 0.0}}, "generation.top_p"),
    ({"cpu": {"decode_threads": -1}}, "cpu.decode_threads"),
    ({"cpu": {"grad_threads": -1}}, "cpu.grad_threads"),
    ({"generation": {"update_mode": "swap"}}, "generation.update_mode"),
    ({"generation": {"kv_blocks": 11}}, "generation.kv_blocks must be 0"),
    ({"generation": {"kv_block_size": 0}}, "generation.kv_block_size"),
    ({"advantage": {"std_level": "prompt"}}, "advantage.std_level"),
    ({"model": {"n_heads": 4, "n_kv_heads": 3}}, "model.n_kv_heads"),
    ({"model": {"max_seq_len": 100}}, "model.max_seq_len"),
    ({"model": {"rope_scaling": "yarn"}}, "model.rope_scaling must be one of"),
    ({"model": {"rope_scaling": "llama3", "rope_high_freq_factor": 1.0}},
     "model.rope_high_freq_factor must exceed model.rope_low_freq_factor"),
    ({"model": {"rope_scaling": "llama3", "rope_scaling_factor": 0.0}},
     "model.rope_scaling_factor must be > 0"),
    ({"model": {"rope_scaling": "llama3", "rope_original_max_len": 0}},
     "model.rope_original_max_len"),
    ({"generation": {"max_prompt_len": 8}, "batching": {"max_tokens_per_mb": 256}},
     "generation.max_prompt_len"),
    ({"sft": {"steps": 10}, "generation": {"max_prompt_len": 20, "max_new_tokens": 20},
      "batching": {"max_tokens_per_mb": 64}}, "batching.max_tokens_per_mb"),
    ({"optimizer": {"learning_rate": "fast"}}, "optimizer.learning_rate"),
    ({"optimizer": {"learning_rate": -1e-4}}, "optimizer.learning_rate must be >= 0"),
    ({"num_steps": True}, "num_steps"),
    ({"task": {"max_turns": 0}}, "task.max_turns"),
    ({"task": {"options": {"path": {1, 2}}}}, "task.options"),
    ({"rollout": {"reward_style": "openrlhf"}}, "rollout.reward_style must be one of"),
    ({"rollout": {"reward_fn": "a:f,b:g", "reward_weights": [1.0]}},
     "rollout.reward_weights must give one weight per function of rollout.reward_fn"),
    ({"rollout": {"reward_weights": [1.0]}}, "rollout.reward_weights must give one weight"),
    ({"rollout": {"reward_fn": "a:f", "reward_weights": [float("nan")]}},
     "rollout.reward_weights must be finite"),
    ({"rollout": {"reward_fn": "a:f,,b:g"}}, "rollout.reward_fn must be names separated"),
    ({"eval": {"correct_threshold": float("nan")}}, "eval.correct_threshold must be finite"),
    ({"task": {"data": {"tokenizer": "sentencepiece"}}}, "task.data.tokenizer must be one of"),
    ({"task": {"data": {"answer_key": "prompt"}}}, "task.data.prompt_key must differ"),
    ({"task": {"data": {"completion_key": ""}}}, "task.data.completion_key must name a column"),
    ({"task": {"data": {"heldout_fraction": 1.0}}}, "task.data.heldout_fraction"),
    ({"task": {"data": {"chat_template_kwargs": {"x": float("inf")}}}},
     "task.data.chat_template_kwargs must hold plain data"),
])
def test_invalid_values_name_the_field(values, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    build.check(from_dict(values))


def test_task_options_are_free_form_plain_data_and_round_trip():
  options = {"train": "a.jsonl", "sizes": [1, 2], "nested": {"k": None}}
  cd = cli.config_dict()
  cd.task.options = options
  cfg = from_dict(cd)
  assert cfg.task.options == options
  assert cli.to_dict(cfg)["task"]["options"] == options
  assert from_dict({}).task.options == {} and from_dict({}).rollout.reward_fn is None


def test_reward_lists_and_chat_template_variables_convert():
  cd = cli.config_dict()
  cd.rollout.update(reward_fn="a:f,b:g", reward_weights=(1, 0.5), reward_style="trl")
  cd.task.data.chat_template_kwargs = {"enable_thinking": False}
  cfg = from_dict(cd)
  assert cfg.rollout.reward_weights == (1.0, 0.5) and cfg.rollout.reward_style == "trl"
  assert cfg.task.data.chat_template_kwargs == {"enable_thinking": False}
  assert (cfg.eval.correct_threshold, cfg.eval.correct_fn) == (1.0, None)


def test_mesh_axes_must_multiply_to_device_count():
  assert MeshConfig(data=2, fsdp=-1, tensor=2).axis_sizes(8) == {"data": 2, "fsdp": 2,
                                                                 "tensor": 2}
  with pytest.raises(ValueError, match="mesh"):
    MeshConfig(data=3, fsdp=1, tensor=1).axis_sizes(8)
  with pytest.raises(ValueError, match="mesh.fsdp"):
    MeshConfig(data=3, fsdp=-1, tensor=1).axis_sizes(8)
  with pytest.raises(ValueError, match="at most one axis"):
    MeshConfig(data=-1, fsdp=-1)


def test_the_pools_update_modes_are_the_configs():
  # The generator pool (which imports nothing from the config) keeps its own tuple.
  assert generation.UPDATE_MODES == config_lib.UPDATE_MODES
