"""The transformer: packing isolation, KV-cached decode == full forward, its layer loop
over a caller's KV layout == decode, presets, the weight matmul's backward pass, remat
and what it saves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl import models
from async_rl.config import ModelConfig, model_preset
from async_rl.models import flops, transformer
from conftest import two_layer_model


def _cfg(**kw):
  return two_layer_model(61, **kw)


# One program per length: run op by op, each of the forward's primitives compiles
# for every length the tests take.
_forward = jax.jit(models.forward, static_argnums=1)


def _full_logits(params, cfg, tokens_T):
  tokens = jnp.asarray(tokens_T)[None]
  T = tokens.shape[1]
  return _forward(params, cfg, tokens, jnp.arange(T)[None], jnp.ones_like(tokens))[0]


@pytest.mark.parametrize("kw", [{}, {"qk_norm": True, "qkv_bias": False},
                                {"tie_embeddings": True}])
def test_packed_segments_do_not_attend_across(kw):
  cfg = _cfg(**kw)
  params = models.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 61, 7), rng.integers(0, 61, 5)
  row = np.concatenate([a, b, np.zeros(4, int)])[None]
  positions = np.concatenate([np.arange(7), np.arange(5), np.zeros(4, int)])[None]
  segments = np.concatenate([np.full(7, 1), np.full(5, 2), np.zeros(4, int)])[None]
  packed = models.forward(params, cfg, row, positions, segments)[0]
  np.testing.assert_allclose(packed[:7], _full_logits(params, cfg, a), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[7:12], _full_logits(params, cfg, b), atol=1e-5, rtol=1e-5)


def test_kv_cached_decode_matches_full_forward():
  cfg = _cfg(qk_norm=True)
  params = models.init_params(cfg, jax.random.key(1))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 61, 5), rng.integers(0, 61, 3)]
  continuations = [rng.integers(0, 61, 6), rng.integers(0, 61, 6)]
  P = 8
  tokens_BP = np.zeros((2, P), np.int32)
  for i, p in enumerate(prompts):
    tokens_BP[i, :len(p)] = p
  lengths = np.array([len(p) for p in prompts])
  logits_BV, prompt_cache = models.prefill(params, cfg, tokens_BP, lengths)
  cache = models.init_cache(cfg, num_slots=2, max_len=16)
  # The prompts' K/V go to positions 0..P-1 of each layer's [S, K, T, E] cache.
  cache = jax.tree.map(lambda c, p: c.at[:, :, :P].set(p), cache, prompt_cache)
  for i, p in enumerate(prompts):
    np.testing.assert_allclose(logits_BV[i], _full_logits(params, cfg, p)[-1],
                               atol=1e-5, rtol=1e-5)
  positions = lengths.copy()
  for step in range(6):
    tokens_S = np.array([c[step] for c in continuations])
    logits_SV, cache = models.decode(params, cfg, cache, tokens_S, positions)
    for i in range(2):
      seq = np.concatenate([prompts[i], continuations[i][:step + 1]])
      np.testing.assert_allclose(logits_SV[i], _full_logits(params, cfg, seq)[-1],
                                 atol=1e-5, rtol=1e-5)
    positions = positions + 1


def _stacked(cache):
  """The per-layer cache as [L, S, K, T, E] arrays."""
  return {name: np.stack(cache[name]) for name in ("k", "v")}


def test_decode_past_cache_end_leaves_cache_untouched():
  cfg = _cfg()
  params = models.init_params(cfg, jax.random.key(2))
  cache = models.init_cache(cfg, num_slots=2, max_len=4)
  cache = jax.tree.map(lambda c: c + 1.0, cache)
  _, new = models.decode(params, cfg, cache, jnp.array([3, 4]), jnp.array([4, 2]))
  new, cache = _stacked(new), _stacked(cache)
  for name in ("k", "v"):
    np.testing.assert_array_equal(new[name][:, 0], cache[name][:, 0])
    # Slot 1 writes its row at position 2 in every layer and head, and nothing else
    # (a slot's cache is [L, K, T, E]).
    assert not np.allclose(new[name][:, 1, :, 2], cache[name][:, 1, :, 2])
    np.testing.assert_array_equal(np.delete(new[name][:, 1], 2, axis=2),
                                  np.delete(cache[name][:, 1], 2, axis=2))


def test_decode_layers_over_the_dense_cache_is_decode():
  cfg = _cfg()
  params = models.split_layers(models.init_params(cfg, jax.random.key(6)))
  rng = np.random.default_rng(6)
  cache = jax.tree.map(lambda c: jnp.asarray(rng.normal(size=c.shape), c.dtype),
                       models.init_cache(cfg, num_slots=3, max_len=8))
  tokens_S, positions_S = jnp.array([3, 4, 5]), jnp.array([5, 0, 8])
  slots_S, mask_ST = jnp.arange(3), jnp.arange(8)[None, :] <= positions_S[:, None]

  def attend(q, k, v, kv):
    k_SKTE = kv[0].at[slots_S, :, positions_S].set(k[:, 0], mode="drop")
    v_SKTE = kv[1].at[slots_S, :, positions_S].set(v[:, 0], mode="drop")
    return transformer._decode_attention(q, k_SKTE, v_SKTE, mask_ST), (k_SKTE, v_SKTE)

  logits_SV, layers = models.decode_layers(params, cfg, tuple(zip(cache["k"], cache["v"])),
                                           tokens_S, positions_S, attend)
  expected_SV, expected = models.decode(params, cfg, cache, tokens_S, positions_S)
  np.testing.assert_array_equal(logits_SV, expected_SV)
  for l, (k, v) in enumerate(layers):
    np.testing.assert_array_equal(k, expected["k"][l])
    np.testing.assert_array_equal(v, expected["v"][l])


def test_the_serving_layout_prefills_and_decodes_as_the_stacked_one():
  cfg = _cfg()
  params = models.init_params(cfg, jax.random.key(3))
  split = models.split_layers(params)
  assert isinstance(split["layers"], tuple) and len(split["layers"]) == cfg.n_layers
  np.testing.assert_array_equal(split["layers"][1]["q"], params["layers"]["q"][1])
  assert models.split_layers(split) is split
  tokens_BP, lengths = np.array([[5, 6, 7, 0], [8, 9, 10, 11]], np.int32), np.array([3, 4])
  results = []
  for p in (params, split):
    logits, prompt_cache = models.prefill(p, cfg, tokens_BP, lengths)
    cache = jax.tree.map(lambda c, pc: c.at[:, :, :4].set(pc),
                         models.init_cache(cfg, num_slots=2, max_len=8), prompt_cache)
    step_logits, cache = models.decode(p, cfg, cache, jnp.array([12, 13]), jnp.array(lengths))
    results.append((logits, step_logits, cache))
  jax.tree.map(np.testing.assert_array_equal, *results)


def test_presets_have_documented_sizes():
  assert 0.9e6 < model_preset("tiny").num_params() < 1.2e6
  assert 20e6 < model_preset("small").num_params() < 30e6
  assert abs(model_preset("qwen2.5-0.5b").num_params() - 494e6) < 1e6
  cfg = model_preset("tiny")
  shapes = jax.eval_shape(lambda k: models.init_params(cfg, k), jax.random.key(0))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params()


def _loss_grad(cfg):
  """jit(grad) of a weighted sum of a packed row's logits, with its compiled program."""
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, 61, (2, 12)))
  positions = jnp.asarray(np.tile(np.arange(12), (2, 1)))
  weights = jnp.asarray(rng.normal(size=(2, 12, 61)), jnp.float32)

  def loss(params):
    return (models.forward(params, cfg, tokens, positions, jnp.ones_like(tokens)) *
            weights).sum()

  params = models.init_params(cfg, jax.random.key(4))
  fn = jax.jit(jax.value_and_grad(loss))
  return fn(params), fn.lower(params).compile()


@pytest.mark.parametrize("saves", [(), ("mlp_gate",), ("qkv", "residual"),
                                   ("qkv", "residual", "mlp_gate", "mlp_up")])
def test_remat_and_what_it_saves_change_the_flops_not_the_values_or_gradients(saves):
  (value, grads), plain = _loss_grad(_cfg())
  (remat_value, remat_grads), remat = _loss_grad(_cfg(remat=True, remat_saves=saves))
  np.testing.assert_allclose(remat_value, value, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads)):
    np.testing.assert_allclose(r, g, rtol=1e-5, atol=1e-6)
  # Remat recomputes each layer's forward matmuls but the MLP's down projection; each
  # saved value spares its own matmul (models.config.REMAT_SAVES).
  c, tokens = _cfg(), 2 * 12
  D, F, L = c.d_model, c.d_ff, c.n_layers
  spared = {"qkv": D * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim,
            "residual": c.n_heads * c.head_dim * D, "mlp_gate": D * F, "mlp_up": D * F}
  per_layer = (flops.matmul_params(c) - D * c.vocab_size) // L - D * F
  attention = 2 * 2 * 2 * c.n_heads * c.head_dim * 12 * 12 * L  # QK^T and PV, 2 rows
  recomputed = flops.executed_matmul_flops(remat.as_text()) - flops.executed_matmul_flops(
      plain.as_text())
  assert recomputed == 2 * L * tokens * (per_layer - sum(spared[s] for s in saves)) + attention


def test_bad_model_config_names_field():
  with pytest.raises(ValueError, match="model.n_kv_heads"):
    ModelConfig(n_heads=4, n_kv_heads=3)
  with pytest.raises(ValueError, match="model.remat_saves: unknown"):
    ModelConfig(remat=True, remat_saves=("mlp",))
  with pytest.raises(ValueError, match="needs model.remat=True"):
    ModelConfig(remat_saves=("qkv",))
  with pytest.raises(ValueError, match="unknown model preset"):
    model_preset("huge")


@pytest.mark.parametrize("spec, shape_x, shape_w, n_in", [
    ("btd,dhe->bthe", (3, 5, 16), (16, 4, 8), 1),   # q projection: x narrower than y
    ("btf,fd->btd", (3, 5, 48), (48, 16), 1),       # MLP down: x wider than y
    ("bthe,hed->btd", (3, 5, 4, 8), (4, 8, 16), 2),  # o projection over heads
])
def test_linear_backward_equals_einsum_autodiff(spec, shape_x, shape_w, n_in):
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x, w = jax.random.normal(kx, shape_x), jax.random.normal(kw, shape_w)
  y, vjp = jax.vjp(lambda x, w: transformer._linear(x, w, n_in), x, w)
  y_ref, vjp_ref = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  g = jax.random.normal(kg, y.shape)
  for a, b in zip(vjp(g), vjp_ref(g)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
