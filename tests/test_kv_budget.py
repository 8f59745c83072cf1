"""The generator at a KV budget: preempted samples resume to the tokens, log-probs and
versions of an unpreempted run; a long-tailed mix at a small budget finishes every
sample; blocks all come back; held slots and weight updates work under preemption;
decoding reads (and compiles for) the live table bucket only; the policy's choices
on the host."""

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import jax
import numpy as np
import pytest

from async_rl import cpu, models, policy
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams, SlotSampling, paged
from async_rl.generation.blocks import SlotBlocks
from async_rl.generation.host_batch import HostBatch, Job
from async_rl.generation.kv_policy import KVPolicy
from conftest import compiles, two_layer_model, wait_until

CFG = two_layer_model(61)
T, Z, SLOTS = 64, 4, 4
M = T // Z
_init = jax.jit(models.init_params, static_argnums=0)
_logp_and_entropy = jax.jit(policy.logp_and_entropy, static_argnums=1,
                            static_argnames="temperature")


@pytest.fixture(scope="module")
def params():
  return _init(CFG, jax.random.key(0))


def _engine(kv_blocks, groups=1, steps_per_call=8):
  engine = Engine(CFG, max_concurrent_decodes=SLOTS // groups, max_prefill_length=T - 1,
                  max_target_length=T, steps_per_call=steps_per_call, kv_blocks=kv_blocks,
                  kv_block_size=Z)
  return engine if groups == 1 else cpu.SlotGroupEngine(engine, groups)


def _requests(seed, count, max_new=(4, 48), n=3):
  rng = np.random.default_rng(seed)
  return [Request(i, rng.integers(0, 61, rng.integers(1, 17)).tolist(), n=n,
                  sampling=SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(*max_new)),
                                          stop_token_ids=[60], seed=i))
          for i in range(count)]


def _run(engine, params, requests, timeout=120):
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(r) for r in requests]
    results = [f.result(timeout=timeout) for f in futures]
    return results, pool.metrics()


def _assert_same_samples(a_results, b_results):
  for a_samples, b_samples in zip(a_results, b_results, strict=True):
    for a, b in zip(a_samples, b_samples, strict=True):
      assert a.finish_reason == b.finish_reason
      np.testing.assert_array_equal(a.tokens_T, b.tokens_T)
      np.testing.assert_array_equal(a.versions_T, b.versions_T)
      # The resumed token comes from a prefill of the whole sequence rather than from
      # the decode step: the same math, in another summation order.
      np.testing.assert_allclose(a.logp_T, b.logp_T, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_preempted_samples_resume_to_the_unpreempted_samples(params, groups):
  requests = _requests(0, 6)
  # Every slot at full length: nothing is ever preempted.
  reference, full = _run(_engine(0, groups), params, requests)
  assert full["preemptions"] == 0 and full["kv_blocks_free"] == SLOTS * M
  # One and a quarter sequences' worth of blocks per pool.
  tight, small = _run(_engine(M + M // 4, groups), params, requests)
  assert small["preemptions"] > 0 and small["resumed_samples"] == small["preemptions"]
  assert small["peak_kv_blocks_used"] <= groups * (M + M // 4)
  _assert_same_samples(reference, tight)
  assert {s.finish_reason for samples in tight for s in samples} == {"stop", "length"}


def test_a_long_tailed_mix_at_a_small_budget_finishes_every_sample(params):
  rng = np.random.default_rng(1)
  # Completion budgets with a median near a tenth of the longest and a tail to it.
  budgets = rng.permutation(np.concatenate([rng.integers(2, 9, 20), [16, 24, 32], [48, 48]]))
  requests = [Request(i, rng.integers(0, 60, 16).tolist(),
                      sampling=SamplingParams(max_new_tokens=int(b), seed=i))
              for i, b in enumerate(budgets)]
  engine = _engine(M + 2)
  start = time.monotonic()
  results, metrics = _run(engine, params, requests, timeout=300)
  assert time.monotonic() - start < 300
  for (s,), b in zip(results, budgets):
    assert s.finish_reason == "length" and len(s.completion_C) == b
  assert metrics["preemptions"] > 0 and metrics["preempted_samples"] == 0
  assert metrics["kv_blocks_used"] == 0 and metrics["kv_blocks_free"] == M + 2
  # Nothing lost and nothing drawn twice: a resumed sample goes on from its last token.
  assert metrics["generated_tokens"] == budgets.sum()


def test_blocks_all_come_back_after_aborts_releases_and_shutdown(params):
  engine = _engine(M + 4)
  hold = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(30, 61)),
                        seed=5)
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(r) for r in _requests(2, 5, max_new=(40, 48))]
    # Request 0 is running, the others wait or are preempted when these aborts land.
    wait_until(lambda: pool.metrics()["generated_tokens"] > 3, timeout=60)
    pool.abort(0)
    pool.abort(3)
    results = [f.result(timeout=120) for f in futures]
    assert any(0 < len(s.completion_C) for s in results[0])
    assert "aborted" in {s.finish_reason for s in results[0] + results[3]}
    (h,) = pool.submit(Request("held", [1, 2, 3], sampling=hold,
                               hold_slot=True)).result(timeout=120)
    assert h.finish_reason == "stop", "the test needs a sample that stops on a stop id"
    metrics = pool.metrics()
    assert metrics["held_slots"] == 1 and 0 < metrics["kv_blocks_used"] <= M
    pool.release(h.metadata["slot"])
    wait_until(lambda: pool.metrics()["kv_blocks_used"] == 0, timeout=60)
    assert pool.metrics()["kv_blocks_free"] == M + 4
    # Work running at shutdown is aborted, and its blocks freed.
    before = pool.metrics()["generated_tokens"]
    pending = [pool.submit(r) for r in _requests(3, 3, max_new=(40, 48))]
    wait_until(lambda: pool.metrics()["generated_tokens"] > before + 3, timeout=60)
  assert any(s.finish_reason == "aborted" and len(s.completion_C)
             for f in pending for s in f.result(timeout=1))
  assert pool.metrics()["kv_blocks_used"] == 0 and pool.metrics()["preempted_samples"] == 0


def _recompute_logp(p, sample):
  seq = np.concatenate([sample.prompt_P, sample.completion_C])
  tokens_T = np.zeros(T, np.int32)
  tokens_T[:len(seq)] = seq
  segments_T = (np.arange(T) < len(seq)).astype(np.int32)
  logp_1T, _ = _logp_and_entropy(p, CFG, tokens_T[None], np.arange(T)[None], segments_T[None],
                                 temperature=1.0)
  return np.asarray(logp_1T)[0, len(sample.prompt_P):len(seq)]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_of_updates_holds_and_aborts_at_a_small_budget(params, seed):
  """Submissions, aborts, held slots continued or released, and retract updates at
  random moments under preemption: every request resolves exactly once, every token's
  log-prob is its version's params' (retract recomputes the cache), and every block
  comes back."""
  rng = random.Random(seed)
  versions = [params] + [_init(CFG, jax.random.key(10 + v)) for v in range(1, 4)]
  hold = dict(temperature=1.0, stop_token_ids=tuple(range(40, 61)))
  engine = _engine(M + M // 2, steps_per_call=4)
  done, held = [], []
  with GeneratorPool(engine, params) as pool:
    version = 0
    for i in range(24):
      kind = rng.random()
      if kind < 0.1 and version < 3:
        version += 1
        pool.update_weights(versions[version], version, "retract")
      elif kind < 0.25 and held:
        handle, tokens = held.pop(rng.randrange(len(held)))
        if rng.random() < 0.5:
          pool.release(handle)
        else:
          done.append(pool.extend(handle, Request(f"x{i}", [*tokens, 7], sampling=SamplingParams(
              max_new_tokens=rng.randint(1, 20), seed=i, **hold))))
      else:
        prompt = [rng.randrange(61) for _ in range(rng.randint(1, 16))]
        future = pool.submit(Request(i, prompt, n=rng.randint(1, 3), hold_slot=rng.random() < 0.3,
                                     sampling=SamplingParams(max_new_tokens=rng.randint(1, 48),
                                                             seed=i, **hold)))
        done.append(future)
        if rng.random() < 0.15:
          pool.abort(i)
      if rng.random() < 0.5 and done[-1:] and done[-1].done():
        for s in done[-1].result() or []:
          if "slot" in s.metadata:
            held.append((s.metadata["slot"], s.tokens_T.tolist()))
      time.sleep(rng.random() * 0.01)
    results = [f.result(timeout=120) for f in done]
    for handle, _ in held:
      pool.release(handle)
    for samples in results:
      for s in samples or []:
        if "slot" in s.metadata:
          pool.release(s.metadata["slot"])
    wait_until(lambda: not (pool.metrics()["kv_blocks_used"] or pool.metrics()["held_slots"]),
               timeout=60)
    metrics = pool.metrics()
  assert metrics["preempted_samples"] == 0 and metrics["active_slots"] == 0
  assert metrics["kv_blocks_free"] == M + M // 2
  for samples in results:
    for s in samples or []:
      gen = s.versions_T[s.prompt_len:]
      assert np.all(np.diff(gen) >= 0)
      assert len(s.completion_C) == len(gen) == len(s.logp_T[s.prompt_len:])
      for v in np.unique(gen):
        mine = gen == v
        np.testing.assert_allclose(s.logp_T[s.prompt_len:][mine],
                                   _recompute_logp(versions[v], s)[mine], atol=1e-4)


def test_decode_reads_the_live_blocks_and_compiles_once_per_size(params):
  engine = Engine(CFG, max_concurrent_decodes=SLOTS, max_prefill_length=16,
                  max_target_length=1024, kv_block_size=16)
  assert engine.max_blocks == 64 and engine.decode_buckets[-1] == paged.Reads("columns", 64)
  chunk_fn, sizes = engine._generate_chunk_fn, []

  def spy(*args, reads):
    sizes.append(reads)
    return chunk_fn(*args, reads=reads)

  engine._generate_chunk_fn = spy
  # 16-token prompts and 32 new tokens: at most 48 positions, 3 blocks a slot.
  requests = [Request(i, list(range(1, 17)), n=2, sampling=SamplingParams(max_new_tokens=32))
              for i in range(4)]
  with compiles("generate_chunk") as programs:
    _run(engine, params, requests)
    # Never more than the live blocks: 3 columns a slot (bucket 4), or 3 blocks of each of
    # the SLOTS slots laid end to end.
    limit = {"columns": 4, "ragged": paged.bucket(3 * SLOTS, 64 * SLOTS)}
    assert all(r.blocks <= limit[r.layout] for r in sizes), sizes
    assert len(programs) == len(set(sizes)) < len(engine.decode_buckets)
    # A second chunk of a size already compiled does not compile again.
    live = np.where(np.arange(64)[None] < 3, 7, engine.num_blocks).repeat(SLOTS, axis=0)
    state = engine.init_decode_state()
    state, _ = engine.generate_chunk(engine.load_params(params), state, live)
    assert sizes[-1] in sizes[:-1] and len(programs) == len(set(sizes))


def test_a_budget_below_one_sequence_is_rejected():
  with pytest.raises(ValueError, match=r"kv_blocks \(15\) must hold one sequence of "
                                       r"max_target_length \(64 tokens: 16 blocks of 4\)"):
    _engine(M - 1)
  with pytest.raises(ValueError, match="kv_block_size"):
    Engine(CFG, max_concurrent_decodes=1, max_prefill_length=4, max_target_length=8,
           kv_block_size=0)


def test_a_tensor_parallel_engine_splits_its_pools_over_kv_heads_and_samples_the_same():
  check = Path(__file__).with_name("kv_tensor_check.py")
  env = dict(os.environ, PYTHONPATH=str(check.parent.parent))
  out = subprocess.run([sys.executable, str(check)], env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  # [K, N, Z, E]: kv heads over `tensor`.
  assert result["pool_spec"] == ["tensor", "None", "None", "None"]
  assert result["pool_devices"] == 2
  assert result["preemptions"] > 0 and result["tokens_equal"]
  # Each device sums its own heads' attention, and the output projection adds the two
  # halves: float32 rounding.
  assert result["logp_max_diff"] < 1e-4


def test_the_kv_policy_reserves_growth_grows_the_oldest_and_preempts_the_newest():
  # One pool of 6 blocks of 4 tokens; a 3-token prompt, up to 12 new tokens, chunks of
  # 4 steps.
  batch = HostBatch(3, 16, lambda job: None,
                    SlotBlocks([0, 0, 0], num_blocks=6, block_size=4, max_blocks=4))
  kv = KVPolicy(batch, steps=4)
  request = Request(0, [1, 2, 3], n=3, sampling=SamplingParams(max_new_tokens=12))
  job = Job(request, np.array(request.prompt, np.int32), 0, Future(), [None] * 3, 3)
  started = []
  # A sample takes the blocks of its prompt and one chunk (2), and leaves those the
  # running ones grow into in the chunk after (1 each): the third does not fit.
  while (placed := kv.place_queued(job)) is not None:
    slot, _ = placed
    started.append(batch.start(slot, job, len(started), SlotSampling.create(
        request.sampling, 0, len(started)), version=0))
  assert len(started) == 2 and batch.blocks.num_free == 2
  for s in started:
    s.position += 4
  assert kv.grow() is None and batch.blocks.num_free == 0
  for s in started:
    s.position += 4
  # The pool is short for the oldest: the newest is preempted for it, and waits.
  pool = kv.grow()
  assert pool == 0 and [len(batch.blocks_of(i)) for i in (0, 1)] == [3, 3]
  assert kv.make_room(pool) == "preempted"
  assert batch.preempted == [started[1]] and started[1].preempted
  assert kv.grow() is None and len(batch.blocks_of(0)) == 4 and batch.blocks.num_free == 2
