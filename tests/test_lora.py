"""LoRA adapters (`models.lora`): the adapted model against the merged one, the trainer
training the adapters alone on a frozen base that is also its reference, and the
generator proving which published adapter produced its tokens."""

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import models, policy, sharding
from async_rl.cli import from_dict
from async_rl.config import LoraConfig
from async_rl.configs import qwen2_5, tiny
from async_rl.generation import GeneratorPool, Request, SamplingParams
from async_rl.models import lora
from async_rl.models.memory import GIB, describe, estimate_memory
from async_rl.rl import build, lora_base
from async_rl.rl.checkpoint import Checkpointer, Meta
from async_rl.rl.errors import NoUsableCheckpointError
from async_rl.rl.lora_base import LoraBase
from async_rl.trajectory import Group, Trajectory

from conftest import two_layer_model
from rl_test_utils import checkpoint_meta, small_config

CFG = two_layer_model(64, qk_norm=True)
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down"))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _random_adapters(cfg, lora_cfg, key):
  """Adapters whose B is not zero, so that they change the model."""
  adapters = lora.init_adapters(cfg, lora_cfg, key)
  return jax.tree_util.tree_map_with_path(
      lambda path, w: (0.1 * jax.random.normal(jax.random.fold_in(key, len(str(path))), w.shape)
                       if str(path[-1].key).endswith("_lora_b") else w), adapters)


_forward = jax.jit(models.forward, static_argnums=1)
_prefill = jax.jit(models.prefill, static_argnums=1)
_decode = jax.jit(models.decode, static_argnums=1)


def test_adapters_shapes_and_a_new_adapter_leaves_the_model_as_it_was():
  base = models.init_params(CFG, jax.random.key(0))
  adapters = lora.init_adapters(CFG, LORA, jax.random.key(1))
  layers = adapters["layers"]
  assert sorted(layers) == sorted(f"{t}_lora_{ab}" for t in LORA.targets for ab in "ab")
  assert layers["q_lora_a"].shape == (2, 32, 4) and layers["q_lora_b"].shape == (2, 4, 4, 8)
  assert layers["o_lora_a"].shape == (2, 4, 8, 4) and layers["o_lora_b"].shape == (2, 4, 32)
  assert layers["down_lora_a"].shape == (2, 64, 4) and layers["down_lora_b"].shape == (2, 4, 32)
  assert all(w.dtype == jnp.float32 for w in jax.tree.leaves(adapters))
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)
  pos, seg = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)
  np.testing.assert_array_equal(
      _forward(lora.attach(base, adapters, LORA.scale), CFG, tokens, pos, seg),
      _forward(base, CFG, tokens, pos, seg))


def test_the_adapted_model_is_the_merged_one_in_training_prefill_and_decode():
  cfg = CFG
  base = models.init_params(cfg, jax.random.key(0))
  every = LoraConfig(rank=3, alpha=6.0)
  adapters = _random_adapters(cfg, every, jax.random.key(1))
  adapted, merged = lora.attach(base, adapters, every.scale), lora.merge(base, adapters, every.scale)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)
  pos, seg = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)
  want = _forward(merged, cfg, tokens, pos, seg)
  assert float(jnp.abs(want - _forward(base, cfg, tokens, pos, seg)).max()) > 0.1
  np.testing.assert_allclose(_forward(adapted, cfg, tokens, pos, seg), want, atol=2e-5)
  lengths = jnp.array([8, 5])
  logits, _ = _prefill(models.split_layers(adapted), cfg, tokens, lengths)
  np.testing.assert_allclose(logits, want[jnp.arange(2), lengths - 1], atol=2e-5)
  cache, split = models.init_cache(cfg, 2, 8), models.split_layers(adapted)
  for t in range(8):
    logits, cache = _decode(split, cfg, cache, tokens[:, t], jnp.full((2,), t))
  np.testing.assert_allclose(logits, want[:, -1], atol=2e-5)


def _groups():
  rng = np.random.default_rng(0)
  trajs = [Trajectory.from_completion(rng.integers(3, 32, 4), rng.integers(3, 32, c),
                                      rng.normal(-2.5, 0.5, c), np.zeros(c, np.int32), "stop",
                                      reward=r) for c, r in zip((2, 3, 4, 5), (1.0, 0.0, 0.5, 0.25))]
  return [Group("g0", trajs[:2]), Group("g1", trajs[2:])]


def test_the_trainer_trains_the_adapters_alone_and_the_base_is_the_reference():
  # On CPU threads (`cpu.threaded_steps`); the checkpoint test below trains one step of
  # the one-program `train_step.jit_steps`.
  cfg = small_config(**{"cpu.grad_threads": 2, "lora.rank": 4, "ppo.kl_beta": 0.1,
                        "optimizer.learning_rate": 1e-2})
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  trainer = build.make_trainer(cfg, mesh)
  state = trainer.state
  # The base is what its pointer (here the seed) names, which every generator loads.
  base = jax.device_get(LoraBase(cfg).load())
  for got, want in zip(jax.tree.leaves(state.base), jax.tree.leaves(base)):
    np.testing.assert_array_equal(got, want)
  assert state.ref_params is None and state.lora_scale == cfg.lora.scale
  adapter_shapes = {w.shape for w in jax.tree.leaves(state.params)}
  # Adam's moments and counts: every array leaf mirrors an adapter or is a scalar.
  assert {w.shape for w in jax.tree.leaves(state.opt_state) if w.ndim} == adapter_shapes
  recorded = []
  steps = trainer.steps
  trainer.steps = dataclasses.replace(
      steps, recompute=lambda params, batch: recorded.append(params) or steps.recompute(
          params, batch))
  metrics = trainer.train(_groups())
  assert metrics["skipped"] == 0 and metrics["applied_updates"] == 1
  # The reference is the base with the adapters zeroed: the base's own model.
  reference, proximal = recorded
  assert all(not np.any(w) for k, w in reference["layers"].items() if "_lora_" in k)
  assert reference["embed"] is state.base["embed"]
  assert 0.0 <= metrics["kl"] < 1e-8  # the adapters start at zero: the policy is the base
  for got, want in zip(jax.tree.leaves(jax.device_get(trainer.state.base)), jax.tree.leaves(base)):
    np.testing.assert_array_equal(got, want)
  b_after = jax.device_get(trainer.state.params["layers"]["q_lora_b"])
  assert np.abs(b_after).max() > 0  # B moved off zero
  # What is published, in process and across processes: the adapters alone.
  published = jax.device_get(trainer.device_params())
  assert jax.tree.structure(published) == jax.tree.structure(lora.abstract_adapters(
      cfg.model, cfg.lora))
  host = trainer.host_params()
  assert sum(x.nbytes for x in jax.tree.leaves(host)) == 4 * lora.num_params(cfg.model,
                                                                             cfg.lora)


def test_the_lora_section_is_validated_and_set_from_the_command_line():
  assert from_dict({"lora": {"rank": 16}}).lora.scale == 2.0
  with pytest.raises(ValueError, match=r"lora\.targets must be one of"):
    from_dict({"lora": {"rank": 4, "targets": ("q", "embed")}})
  with pytest.raises(ValueError, match=r"lora\.rank must be >= 0"):
    LoraConfig(rank=-1)


_logp = jax.jit(policy.logp_and_entropy, static_argnums=1, static_argnames="temperature")


def _max_logp_error(params, model_cfg, samples, width=48):
  """The largest |behaviour - recomputed| log-prob of the samples' policy tokens under
  `params`."""
  worst = 0.0
  for s in samples:
    tokens_T = np.zeros(width, np.int32)
    tokens_T[:len(s)] = s.tokens_T
    segments_T = (np.arange(width) < len(s)).astype(np.int32)
    logp_1T, _ = _logp(params, model_cfg, tokens_T[None], np.arange(width)[None],
                       segments_T[None], temperature=1.0)
    mask = s.loss_mask_T != 0
    worst = max(worst, float(np.abs(np.asarray(logp_1T)[0, :len(s)][mask] - s.logp_T[mask]).max()))
  return worst


def test_the_generator_samples_with_the_published_adapter_and_reports_its_version():
  """Only adapters reach the generator; its tokens carry the version they were published
  at, and their log-probs are those of that adapter on the base, not of a stale one or of
  the base alone."""
  cfg = small_config(**{"lora.rank": 4})
  base = LoraBase(cfg).load()  # the trainer's own (test above), and the generator's
  adapters = {v: _random_adapters(cfg.model, cfg.lora, jax.random.key(v)) for v in (1, 2)}
  engine = build.make_engine(cfg, base=base)
  requests = lambda tag: [Request(f"{tag}{i}", [1 + i, 2, 3, 4], n=2,
                                  sampling=SamplingParams(max_new_tokens=10, seed=i))
                          for i in range(3)]
  samples = {}
  with GeneratorPool(engine, adapters[1], version=1) as pool:
    samples[1] = [s for f in [pool.submit(r) for r in requests("a")] for s in f.result(60)]
    pool.update_weights(adapters[2], 2, "retract").result(60)
    assert pool.version == 2
    samples[2] = [s for f in [pool.submit(r) for r in requests("b")] for s in f.result(60)]
  rounding = policy.LOGP_ROUNDING["float32"]
  for v, drawn in samples.items():
    for s in drawn:
      assert set(s.versions_T[s.loss_mask_T != 0]) == {v}
    error = {name: _max_logp_error(params, cfg.model, drawn) for name, params in (
        ("published", lora.attach(base, adapters[v], cfg.lora.scale)),
        ("stale", lora.attach(base, adapters[3 - v], cfg.lora.scale)),
        ("missing", base))}
    assert error["published"] < rounding, error
    assert min(error["stale"], error["missing"]) > 100 * rounding, error


def test_a_warm_started_base_is_served_checkpoints_point_to_it_and_resume_is_exact(
    tmp_path, monkeypatch):
  """The quick start's `--config.lora.rank=16` passes the checks; a fresh run's warm start
  is its adapters' base, written to the workdir before the first step; a generator
  samples with the adapter on that base, not on the seed's init; a checkpoint holds the
  adapters, their optimizer state and the base's pointer, not the base; a resume reads
  the base back without warm-starting again and restores bit for bit; without the
  file it fails naming it."""
  quick_start = tiny.get_config()
  quick_start.lora.rank = 16
  build.check(from_dict(quick_start))
  cfg = small_config(**{"lora.rank": 4, "sft.steps": 2, "sft.batch_size": 2,
                        "optimizer.learning_rate": 1e-2, "cpu.grad_threads": 1})
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  task = build.task_of(cfg)
  trainer, checkpointer, _ = build.restored_trainer(cfg, str(tmp_path), mesh, task)
  path = tmp_path / lora_base.BASE_FILE
  base = LoraBase(cfg, str(tmp_path)).load()  # what every generator loads
  digest = lora_base.digest(base)
  assert trainer.base_pointer == {"warm_start": lora_base.BASE_FILE, "sha256": digest}
  assert lora_base.digest(trainer.state.base) == digest
  seeded = small_config(**{"lora.rank": 4})  # no warm start: the base is the seed's init
  assert LoraBase(seeded).pointer == {"seed": cfg.seed, "model": dataclasses.asdict(cfg.model)}
  seed_init = LoraBase(seeded).load()
  assert lora_base.digest(seed_init) != digest  # the warm start trained it

  adapters = _random_adapters(cfg.model, cfg.lora, jax.random.key(1))
  engine = build.make_engine(cfg, base=LoraBase(cfg, str(tmp_path)).load())
  with GeneratorPool(engine, adapters, version=1) as pool:
    drawn = [s for f in [pool.submit(Request(f"r{i}", [1 + i, 2, 3, 4], n=2, sampling=(
        SamplingParams(max_new_tokens=6, seed=i)))) for i in range(2)] for s in f.result(60)]
  error = {name: _max_logp_error(lora.attach(b, adapters, cfg.lora.scale), cfg.model, drawn)
           for name, b in (("warm", base), ("seed", seed_init))}
  rounding = policy.LOGP_ROUNDING["float32"]
  assert error["warm"] < rounding < error["seed"] / 100, error

  trainer.train(_groups())
  meta = Meta(1, skipped_steps=0, applied_updates=1, packed_shapes=trainer.packed_shapes,
              lora_base=trainer.base_pointer)
  checkpointer.save(1, trainer.state, meta, wait=True)
  checkpointer.close()
  assert checkpoint_meta(tmp_path).lora_base == trainer.base_pointer
  saved_fields = {key.split("'")[1] for key in json.loads(
      (tmp_path / "checkpoints" / "1" / "state" / "_METADATA").read_text())["tree_metadata"]}
  assert saved_fields == {"step", "params", "opt_state"}  # no base
  monkeypatch.setattr(build, "warm_start", lambda *a, **k: pytest.fail("warm-started again"))
  resumed, checkpointer, restored = build.restored_trainer(cfg, str(tmp_path), mesh, task)
  checkpointer.close()
  assert restored.step == 1 and resumed.version == 1
  assert resumed.base_pointer == trainer.base_pointer
  for field in ("step", "params", "opt_state", "base"):
    want, got = (jax.device_get(getattr(t.state, field)) for t in (trainer, resumed))
    assert jax.tree.structure(got) == jax.tree.structure(want), field
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(g, w, err_msg=field)

  path.rename(tmp_path / "elsewhere.npz")
  with pytest.raises(NoUsableCheckpointError, match=f"{re.escape(str(path))} is missing"):
    build.restored_trainer(cfg, str(tmp_path), mesh, task)
  lora_base.save_file(str(path), seed_init)  # a sound base file, of another run
  with pytest.raises(NoUsableCheckpointError, match=f"trained on a base of sha256 {digest}"):
    build.restored_trainer(cfg, str(tmp_path), mesh, task)


def test_the_base_file_round_trips_and_a_damaged_one_is_an_error_naming_it(tmp_path):
  params = {"embed": np.arange(6, dtype=np.float32).reshape(2, 3),
            "layers": {"q": jnp.ones((2, 2), jnp.bfloat16)}}
  path = str(tmp_path / lora_base.BASE_FILE)
  digest = lora_base.save_file(path, params)
  abstract = jax.eval_shape(lambda: params)
  loaded, got = lora_base.load_file(path, abstract)
  assert got == digest == lora_base.digest(loaded) and os.listdir(tmp_path) == [
      lora_base.BASE_FILE]  # no temporary file left
  assert loaded["layers"]["q"].dtype == jnp.bfloat16
  for g, w in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(g, w)
  with pytest.raises(NoUsableCheckpointError, match="holds other params"):
    lora_base.load_file(path, {**abstract, "embed": jax.ShapeDtypeStruct((3, 2), jnp.float32)})
  data = bytearray(open(path, "rb").read())
  at = data.index(np.arange(6, dtype=np.float32)[1:].tobytes())  # inside "embed"'s bytes
  data[at] ^= 1
  open(path, "wb").write(bytes(data))
  with pytest.raises(NoUsableCheckpointError, match=re.escape(path)):
    lora_base.load_file(path, abstract)


def test_the_24gb_config_quotes_its_estimate_and_leaves_room_for_temporaries():
  cfg = from_dict(qwen2_5.get_config("1.5b_lora"))
  assert cfg.lora.rank == 16 and cfg.generation.max_new_tokens == 4096
  section = qwen2_5.__doc__.split("\n1.5b_lora (", 1)[1].split("\n\n")[1]
  quoted = dict(re.findall(r"^  (\w+): ([\d.]+ GiB)", section, re.MULTILINE))
  assert quoted == dict(line.split(": ") for line in describe(cfg).splitlines())
  m = estimate_memory(cfg)
  assert m["optimizer"] < m["params"] / 10  # the moments are the adapters'
  resident = m["trainer"] + 2 * m["generator"] + m["generator_base"]
  assert 24e9 - resident > 7 * GIB


def test_a_warm_started_run_is_loaded_as_its_adapters_merged_into_the_base_in_its_workdir(
    tmp_path):
  from async_rl.rl import export, workdir as workdir_lib  # noqa: PLC0415
  cfg = build.resolve(small_config(**{"lora.rank": 4, "sft.steps": 2}))
  # Not the seed's init, which a base read from elsewhere would be.
  base = jax.tree.map(lambda x: x + 1, LoraBase(small_config(**{"lora.rank": 4})).load())
  digest = lora_base.save_file(str(tmp_path / lora_base.BASE_FILE), base)
  adapters = _random_adapters(cfg.model, cfg.lora, jax.random.key(1))
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  state = build.make_trainer(cfg, mesh, base).state
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), keep=1)
  pointer = {"warm_start": lora_base.BASE_FILE, "sha256": digest}
  checkpointer.save(1, state.replace(step=state.step + 1, params=adapters),
                    Meta(1, lora_base=pointer), wait=True)
  checkpointer.close()
  workdir_lib.write_config(str(tmp_path), cfg)
  policy = export.load_policy(workdir=str(tmp_path))
  assert policy.source == {"workdir": str(tmp_path), "step": 1}
  want = jax.device_get(lora.merge(base, adapters, cfg.lora.scale))
  for got, w in zip(jax.tree.leaves(jax.device_get(policy.params)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(got, w)
  # Another run's sound base file is refused, naming the digest the checkpoint records.
  lora_base.save_file(str(tmp_path / lora_base.BASE_FILE), jax.tree.map(lambda x: x + 2, base))
  with pytest.raises(NoUsableCheckpointError, match=f"trained on a base of sha256 {digest}"):
    export.load_policy(workdir=str(tmp_path))


def test_an_adapted_engine_serves_the_base_it_was_given_and_keeps_no_reference_to_it():
  import gc  # noqa: PLC0415
  import weakref  # noqa: PLC0415
  cfg = small_config(**{"lora.rank": 4})
  engine = build.make_engine(cfg)
  adapters = _random_adapters(cfg.model, cfg.lora, jax.random.key(1))
  with pytest.raises(RuntimeError, match=r"needs its frozen base \(set_base\)"):
    engine.load_params(adapters)
  base = LoraBase(cfg).load()
  held = weakref.ref(base["embed"])
  engine.set_base(base)
  del base
  gc.collect()
  assert held() is None  # the engine holds its own copy, on its devices, only
  merged = jax.device_get(engine.load_params(adapters))
  want = jax.device_get(lora.merge(LoraBase(cfg).load(), adapters, cfg.lora.scale))
  np.testing.assert_array_equal(merged["embed"], want["embed"])
