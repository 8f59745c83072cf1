"""Generation engine and sampling: parity with the full forward and the policy module,
truncated sampling, reproducibility, bounded compilation."""

import jax
import numpy as np
import pytest

from async_rl import cpu, models, policy
from async_rl.generation import (Engine, GeneratorPool, Request, SamplingParams, SlotSampling,
                                 noise, prefill_buckets, sample, sampling as sampling_lib)
from conftest import compiles, two_layer_model

CFG = two_layer_model(61)
T = 32


@pytest.fixture(scope="module")
def params():
  return jax.jit(models.init_params, static_argnums=0)(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def engine(params):
  engine = Engine(CFG, max_concurrent_decodes=3, max_prefill_length=16, max_target_length=T,
                  steps_per_call=8)
  engine.warmup(params)
  return engine


def _logp(s):
  """The behaviour log-probs of a sample's generated tokens."""
  return s.logp_T[s.prompt_len:]


def _prompts(seed, count, max_len=16):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CFG.vocab_size, rng.integers(1, max_len + 1)).tolist()
          for _ in range(count)]


def _run(engine, params, requests, **pool_kw):
  with GeneratorPool(engine, params, **pool_kw) as pool:
    futures = [pool.submit(r) for r in requests]
    return [f.result(timeout=60) for f in futures]


# References run on sequences padded to the cache length, so they compile once.
_forward = jax.jit(models.forward, static_argnums=1)
_logp_and_entropy = jax.jit(policy.logp_and_entropy, static_argnums=1,
                            static_argnames="temperature")


def _padded(seq):
  tokens_T = np.zeros(T, np.int32)
  tokens_T[:len(seq)] = seq
  return tokens_T[None], np.arange(T)[None], (np.arange(T) < len(seq))[None].astype(np.int32)


def _full_logits(params, seq):
  return np.asarray(_forward(params, CFG, *_padded(seq)))[0, :len(seq)]


def _recompute_logp(params, prompt, tokens, temperature, top_k=0, top_p=1.0):
  """The policy's log-probs of `tokens` after `prompt`, on the support of the given
  truncation (none by default)."""
  seq = np.concatenate([prompt, tokens])
  truncation = {} if (top_k, top_p) == (0, 1.0) else {
      "top_k_BT": np.full((1, T), top_k, np.int32), "top_p_BT": np.full((1, T), top_p, np.float32)}
  logp_1T, _ = _logp_and_entropy(params, CFG, *_padded(seq), temperature=temperature,
                                 **truncation)
  return np.asarray(logp_1T)[0, len(prompt):len(seq)]


def test_prefill_buckets_are_powers_of_two_capped():
  assert prefill_buckets(48) == (16, 32, 48)
  assert prefill_buckets(32) == (16, 32)
  assert prefill_buckets(64) == (16, 32, 64)
  assert prefill_buckets(10) == (10,)


def _prefill_one(engine, params, prompt, sampling):
  padded, length = engine.pad_tokens(prompt)
  return engine.prefill(params=params, padded_tokens=padded, true_length=length,
                        sampling=sampling)


def test_prefill_many_equals_prefill_one_by_one(engine, params):
  # Eleven prompts of one bucket: a batched call for eight, then three one by one.
  prompts = _prompts(11, 11)
  samplings = [SlotSampling.create(SamplingParams(temperature=0.9), 5, i) for i in range(11)]
  refs = engine.prefill_many(params=params, prompts=prompts, samplings=samplings)
  assert len({id(prefix) for prefix, _ in refs}) == 4
  assert [row for _, row in refs] == list(range(8)) + [0, 0, 0]
  for prompt, sampling, (got, row) in zip(prompts, samplings, refs):
    want, _ = _prefill_one(engine, params, prompt, sampling)
    assert int(got.lengths_B[row]) == int(got.starts_B[row]) == len(prompt)
    assert int(got.tokens_B[row]) == int(want.tokens_B[0])
    np.testing.assert_allclose(got.logits_BV[row], want.logits_BV[0], atol=1e-5)
    np.testing.assert_allclose(np.stack(got.cache["k"])[:, row], np.stack(want.cache["k"])[:, 0],
                               atol=1e-5)


def test_insert_samples_draws_as_prefill_does_and_touches_only_its_slots(params):
  engine = Engine(CFG, max_concurrent_decodes=8, max_prefill_length=16, max_target_length=T)
  prompts = _prompts(10, 4)
  sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=4)
  samplings = [SlotSampling.create(sp, 4, i) for i in range(3)]
  ((prefix, _), *_) = engine.prefill_many(params=params, prompts=prompts,
                                         samplings=samplings + samplings[:1])
  rows, slots, blocks = [2, 0, 2], [5, 1, 6], [[9, 4], [3, 12], [0, 7]]
  state, first = engine.insert_samples(prefix, engine.init_decode_state(), rows, slots,
                                       samplings, blocks, [0, 0, 0])
  for i, (row, slot, sampling) in enumerate(zip(rows, slots, samplings)):
    alone, draw = _prefill_one(engine, params, prompts[row], sampling)
    assert first.tokens_S[i] == draw.tokens_S[0] == state.tokens_S[slot]
    np.testing.assert_allclose(first.logp_S[i], draw.logp_S[0], atol=1e-5)
    np.testing.assert_allclose(_stacked(state.cache)["k"][:, slot, :, :16],
                               np.stack(alone.cache["k"])[:, 0], atol=1e-5)
    assert state.positions_S[slot] == len(prompts[row])
    assert state.end_S[slot] == len(prompts[row]) + 5
  others = [0, 2, 3, 4, 7]
  past_tables = engine.max_blocks * engine.block_size
  assert all(state.positions_S[s] == past_tables and state.end_S[s] == 0 for s in others)
  assert not np.any(_stacked(state.cache)["k"][:, others])
  unused = sorted(set(range(engine.num_blocks)) - {b for bs in blocks for b in bs})
  assert not np.any(np.stack(state.cache.k)[:, :, unused])


def _stacked(cache):
  """The per-layer paged cache as [L, S, K, M Z, E] arrays: each slot's blocks in table
  order, zeros where its table has no block."""
  Z = cache.block_size
  tables_SM = np.asarray(cache.tables_SM)

  def dense(pools):
    pages_LKNZE = np.concatenate([np.stack(pools), np.zeros_like(np.stack(pools)[:, :, :1])],
                                 axis=2)
    L, K, _, _, E = pages_LKNZE.shape
    S, M = tables_SM.shape
    return pages_LKNZE[:, :, tables_SM].transpose(0, 2, 1, 3, 4, 5).reshape(L, S, K, M * Z, E)

  return {"k": dense(cache.k), "v": dense(cache.v)}


def test_extend_continues_a_slot_as_a_prefill_of_the_whole_sequence(engine, params):
  seq = [3, 1, 4, 1, 5, *range(20, 28)]  # 13 tokens; the slot holds the first 6
  sampling = SlotSampling.create(SamplingParams(temperature=1.0, max_new_tokens=6, seed=2), 2, 0)
  head, _ = _prefill_one(engine, params, seq[:6], sampling)
  state = engine.insert(head, engine.init_decode_state(), 1, [3, 0])
  before = _stacked(state.cache)
  # The cache holds positions 0..5; the slot's last token (seq[6]) and the rest are fed.
  state, first = engine.extend(params, state, 1, seq[6:], 6, sampling, [3, 0])
  alone, draw = _prefill_one(engine, params, seq, sampling)
  assert first.tokens_S[0] == draw.tokens_S[0] == state.tokens_S[1]
  np.testing.assert_allclose(first.logp_S[0], draw.logp_S[0], atol=1e-5)
  got, alone = _stacked(state.cache), {name: np.stack(alone.cache[name]) for name in "kv"}
  for name in ("k", "v"):
    np.testing.assert_allclose(got[name][:, 1, :, :len(seq)], alone[name][:, 0, :, :len(seq)],
                               atol=1e-5)
    np.testing.assert_array_equal(got[name][:, 1, :, len(seq):], before[name][:, 1, :, len(seq):])
    assert not np.any(got[name][:, [0, 2]])
  assert state.positions_S[1] == first.positions_S[0] == len(seq)
  assert state.end_S[1] == len(seq) + 6
  with pytest.raises(ValueError, match="no room"):
    engine.extend(params, state, 1, list(range(16)), T - 16, sampling, [3, 0])


def test_greedy_pool_equals_argmax_of_full_reforward(engine, params):
  prompts = _prompts(1, 5)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
  results = _run(engine, params, [Request(i, p, sampling=greedy) for i, p in enumerate(prompts)])
  for prompt, (s,) in zip(prompts, results):
    assert s.finish_reason == "length" and len(s.completion_C) == 12
    seq = list(prompt)
    for token, logp in zip(s.completion_C, _logp(s)):
      logits_TV = _full_logits(params, seq)
      assert token == int(np.argmax(logits_TV[-1]))
      # Greedy records the log-prob at temperature 1.
      np.testing.assert_allclose(logp, jax.nn.log_softmax(logits_TV[-1])[token], atol=1e-4)
      seq.append(int(token))


@pytest.mark.parametrize("top_k,top_p,truncated_logp", [
    (0, 1.0, True), (3, 1.0, True), (0, 0.6, True), (5, 0.8, True), (5, 0.8, False)])
def test_behaviour_logp_equals_policy_recomputation(engine, params, top_k, top_p,
                                                    truncated_logp):
  prompts = _prompts(2, 4)
  sp = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=3,
                      truncated_logp=truncated_logp)
  results = _run(engine, params, [Request(i, p, n=2, sampling=sp) for i, p in enumerate(prompts)])
  for prompt, samples in zip(prompts, results):
    for s in samples:
      # The sample records the truncation its log-probs are under, and the policy
      # scores the tokens on that truncation's support: the two agree to rounding.
      assert (s.top_k, s.top_p) == ((top_k, top_p) if truncated_logp else (0, 1.0))
      np.testing.assert_allclose(
          _logp(s), _recompute_logp(params, prompt, s.completion_C, 0.7, s.top_k, s.top_p),
          atol=1e-4)
      if s.truncated:  # Renormalised over the support: above the full softmax's.
        assert np.all(_logp(s) >= _recompute_logp(params, prompt, s.completion_C, 0.7) - 1e-6)
      seq = np.concatenate([prompt, s.completion_C])
      logits_TV = _full_logits(params, seq)[len(prompt) - 1:-1]
      probs_TV = np.asarray(jax.nn.softmax(logits_TV / 0.7))
      for t, token in enumerate(s.completion_C):
        rank = int(np.sum(probs_TV[t] > probs_TV[t, token]))
        assert rank < (top_k or CFG.vocab_size)
        sorted_V = np.sort(probs_TV[t])[::-1]
        # The nucleus is taken within the top-k, renormalised.
        assert sorted_V[:rank].sum() / sorted_V[:top_k or None].sum() < top_p + 1e-5


def test_sample_truncation_and_greedy():
  logits_V = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
  S = 2000
  positions_S = np.arange(S)

  def draw(temperature, top_k, top_p):
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    sampling_S = jax.tree.map(lambda x: np.broadcast_to(x, (S,) + x.shape),
                              SlotSampling.create(sp, seed=7, index=0))
    tokens_S, logp_S = sample(np.broadcast_to(logits_V, (S, 4)), sampling_S, positions_S)
    return np.asarray(tokens_S), np.asarray(logp_S)

  tokens, logp = draw(1.0, 0, 1.0)
  np.testing.assert_allclose(np.bincount(tokens, minlength=4) / S, [0.5, 0.3, 0.15, 0.05],
                             atol=0.04)
  np.testing.assert_allclose(logp, logits_V[tokens], atol=1e-6)
  assert set(draw(1.0, 2, 1.0)[0]) == {0, 1}
  assert set(draw(1.0, 0, 0.7)[0]) == {0, 1}
  assert set(draw(1.0, 0, 0.8)[0]) == {0, 1}
  assert set(draw(1.0, 0, 0.81)[0]) == {0, 1, 2}
  assert set(draw(1.0, 3, 0.1)[0]) == {0}
  tokens, logp = draw(0.0, 0, 1.0)
  assert set(tokens) == {0}
  np.testing.assert_allclose(logp, logits_V[0], atol=1e-6)


def test_argmax_is_the_first_index_of_the_maximum():
  x = np.array([[1., 3., 3., 2.], [-np.inf, -np.inf, 0., -np.inf], [5., 5., 5., 5.],
                [np.nan, 1., 2., 0.]], np.float32)
  np.testing.assert_array_equal(sampling_lib.argmax(x), [1, 2, 0, 3])  # NaN: the last
  rng = np.random.default_rng(0)
  x = rng.integers(0, 5, (64, 256)).astype(np.float32)  # many ties
  np.testing.assert_array_equal(sampling_lib.argmax(x), np.argmax(x, axis=-1))


def test_sample_draws_what_jax_random_categorical_draws():
  # The contract of the module docstring: the key fold_in(fold_in(key(s), i), p), and
  # the token jax.random.categorical draws with it from the (truncated) logits.
  S, V = 64, 256
  logits_SV = 3 * jax.random.normal(jax.random.key(0), (S, V))
  sp = [SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8))]
  sampling_S = jax.tree.map(lambda *x: np.stack(x),
                            *[SlotSampling.create(sp[i % 3], 11, i) for i in range(S)])
  positions_S = np.arange(S) + 3
  tokens_S, _ = sample(logits_SV, sampling_S, positions_S)
  for i in range(S):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(11), i), positions_S[i])
    scaled_V = logits_SV[i] / sp[i % 3].temperature
    keep_V = policy.support(scaled_V, sp[i % 3].top_k, sp[i % 3].top_p)
    truncated_V = np.where(keep_V, scaled_V, -np.inf)
    assert tokens_S[i] == jax.random.categorical(key, truncated_V)


@pytest.mark.parametrize("V", [256, 61, 1])
def test_noise_is_jax_random_gumbel_of_the_samples_key(V):
  # The written-out threefry must draw jax's noise bit for bit, so that the tokens are
  # those jax.random.categorical draws with the key of the module docstring.
  rng = np.random.default_rng(V)
  seed_S = np.concatenate([[0, 2**32 - 1], rng.integers(0, 2**32, 14)]).astype(np.uint32)
  index_S = np.concatenate([[2**32 - 1, 0], rng.integers(0, 2**32, 14)]).astype(np.uint32)
  positions_S = rng.integers(0, 4096, 16).astype(np.int32)
  got_SV = jax.jit(noise.gumbel, static_argnums=3)(seed_S, index_S, positions_S, V)
  for s in range(16):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_S[s]), index_S[s]),
                             positions_S[s])
    np.testing.assert_array_equal(got_SV[s], jax.random.gumbel(key, (V,), np.float32))


def test_fixed_seed_reproduces_samples_whatever_the_batching(engine, params):
  target = Request("target", _prompts(3, 1)[0], n=3,
                   sampling=SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, seed=11))
  alone = _run(engine, params, [target])[0]
  others = [Request(i, p, n=2, sampling=SamplingParams(max_new_tokens=i + 3))
            for i, p in enumerate(_prompts(4, 4))]
  crowded = _run(engine, params, others[:3] + [target] + others[3:], seed=99)[3]
  for a, b in zip(alone, crowded):
    np.testing.assert_array_equal(a.completion_C, b.completion_C)
    np.testing.assert_allclose(_logp(a), _logp(b), atol=1e-5)
  assert not np.array_equal(alone[0].completion_C, alone[1].completion_C)


def _varied_requests():
  """Stops, length limits, top-k/top-p and greedy, with more samples than slots, so
  samples start and end at every offset within a chunk."""
  rng = np.random.default_rng(8)
  return [Request(i, p, n=2, sampling=SamplingParams(
      temperature=float(rng.choice([0.0, 0.8, 1.0])), top_k=int(rng.choice([0, 4])),
      top_p=float(rng.choice([0.7, 1.0])), max_new_tokens=int(rng.integers(1, 24)),
      stop_token_ids=[int(rng.integers(CFG.vocab_size))], seed=i))
          for i, p in enumerate(_prompts(9, 6))]


def _assert_same_samples(a_results, b_results):
  for a_samples, b_samples in zip(a_results, b_results, strict=True):
    for a, b in zip(a_samples, b_samples, strict=True):
      assert a.finish_reason == b.finish_reason
      np.testing.assert_array_equal(a.tokens_T, b.tokens_T)
      np.testing.assert_allclose(a.logp_T, b.logp_T, atol=1e-5)


def test_samples_do_not_depend_on_steps_per_call(engine, params):
  requests = _varied_requests()
  chunked = _run(engine, params, requests)
  for steps in (1, 3):
    other = Engine(CFG, max_concurrent_decodes=3, max_prefill_length=16, max_target_length=T,
                   steps_per_call=steps)
    _assert_same_samples(chunked, _run(other, params, requests))
  reasons = {s.finish_reason for samples in chunked for s in samples}
  assert reasons == {"stop", "length"}


def _grouped(slots, groups):
  """`slots` slots in `groups` slot groups, each decoded from its own thread."""
  return cpu.SlotGroupEngine(Engine(CFG, max_concurrent_decodes=slots // groups,
                                    max_prefill_length=16, max_target_length=T), groups)


def test_samples_do_not_depend_on_slot_groups(engine, params):
  # The same requests on 4 slots in 1, 2 and 4 groups, each decoded from its own thread.
  requests = _varied_requests()
  expected = _run(engine, params, requests)
  for groups in (1, 2, 4):
    _assert_same_samples(expected, _run(_grouped(4, groups), params, requests))


def test_slot_groups_interleave_the_slots(params):
  engine = _grouped(6, 3)
  state = engine.init_decode_state()
  assert len(state) == 3 and all(s.tokens_S.shape == (2,) for s in state)
  assert engine.max_concurrent_decodes == 6
  prefix, _ = engine.prefill(params=params, padded_tokens=np.zeros(16, np.int32),
                             true_length=3, sampling=SlotSampling.create(SamplingParams(), 0, 0))
  sampling = SlotSampling.create(SamplingParams(), 0, 0)
  # Slot s is slot s // 3 of group s % 3: slots 2 and 3 are group 2's first, group 0's
  # second (at the prompt's length); the other slots stay idle.
  state, first = engine.insert_samples(prefix, state, [0, 0], [2, 3], [sampling] * 2,
                                       [[0], [0]], [0, 0])
  assert [np.asarray(s.positions_S).tolist() for s in state] == [[T, 3], [T, T], [3, T]]
  assert np.asarray(first.positions_S)[:2].tolist() == [3, 3]


@pytest.mark.parametrize("groups", [1, 3])
def test_no_recompilation_after_warmup(params, groups):
  # A fresh engine, so that only its own warmup has compiled anything.
  engine = (Engine(CFG, max_concurrent_decodes=3, max_prefill_length=16, max_target_length=T)
            if groups == 1 else _grouped(3, groups))
  with compiles() as warmup_compiles:
    engine.warmup(params)
  # prefill and insert per bucket; prefill_many's batch, insert_samples (for one and
  # for a batch of prompts) and extend per prompt bucket; generate_chunk per table
  # bucket; the draws of insert_samples (one, a batch), generate and init_decode_state
  # once; with slot groups, the joins of generate's and generate_chunk's results and
  # insert_samples' gather.
  buckets = (2 * len(engine.prefill_buckets) + 4 * len(engine.prompt_buckets)
             + len(engine.decode_buckets))
  assert len(warmup_compiles) <= buckets + 4 + 3 * (groups > 1)
  new_params = jax.tree.map(lambda x: x * 1.01, params)
  rng = np.random.default_rng(5)
  requests = [Request(i, p, n=int(rng.integers(1, 4)),
                      sampling=SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])),
                                              top_k=int(rng.integers(0, 5)),
                                              top_p=float(rng.choice([0.5, 1.0])),
                                              max_new_tokens=int(rng.integers(1, 30)),
                                              stop_token_ids=[int(rng.integers(61))]))
              for i, p in enumerate(_prompts(6, 12))]
  with compiles() as after_warmup:
    with GeneratorPool(engine, params) as pool:
      futures = [pool.submit(r) for r in requests]
      pool.update_weights(new_params, 1, "retract").result(timeout=60)
      pool.update_weights(params, 2, "keep").result(timeout=60)
      pool.abort(5)
      for f in futures:
        f.result(timeout=60)
  assert after_warmup == []
