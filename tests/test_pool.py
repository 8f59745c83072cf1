"""GeneratorPool: pause/resume, weight-update modes, abort, concurrency, bad input."""

import random
import threading
import time

import jax
import numpy as np
import pytest

from async_rl import cpu, models, policy
from async_rl.generation import (FINISH_REASONS, Engine, GeneratorPool, Request,
                                 SamplingParams)
from async_rl.generation import scheduler
from conftest import two_layer_model, wait_until

CFG = two_layer_model(61)
T = 64
_init = jax.jit(models.init_params, static_argnums=0)
_logp_and_entropy = jax.jit(policy.logp_and_entropy, static_argnums=1,
                            static_argnames="temperature")


@pytest.fixture(scope="module")
def params():
  return _init(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def new_params():
  return _init(CFG, jax.random.key(1))


@pytest.fixture(scope="module", params=[1, 2], ids=lambda g: f"{g}_slot_groups")
def engine(params, request):
  # Every pool behaviour with the two slots in one group and in one group each.
  groups = request.param
  engine = Engine(CFG, max_concurrent_decodes=2 // groups, max_prefill_length=16,
                  max_target_length=T, steps_per_call=8)
  if groups > 1:
    engine = cpu.SlotGroupEngine(engine, groups)
  engine.warmup(params)
  return engine


def _logp(s):
  """The behaviour log-probs of a sample's generated tokens."""
  return s.logp_T[s.prompt_len:]


def _versions(s):
  """The versions of a sample's generated tokens."""
  return s.versions_T[s.prompt_len:]


def _recompute_logp(params, sample, temperature):
  seq = np.concatenate([sample.prompt_P, sample.completion_C])
  tokens_T = np.zeros(T, np.int32)
  tokens_T[:len(seq)] = seq
  segments_T = (np.arange(T) < len(seq)).astype(np.int32)
  logp_1T, _ = _logp_and_entropy(params, CFG, tokens_T[None], np.arange(T)[None],
                                 segments_T[None], temperature=temperature)
  return np.asarray(logp_1T)[0, len(sample.prompt_P):len(seq)]


def _long(request_id, n=1, seed=0, temperature=0.7):
  return Request(request_id, [1, 2, 3], n=n,
                 sampling=SamplingParams(temperature=temperature, max_new_tokens=T, seed=seed))


def _pause_mid_generation(pool):
  """Pauses the pool after its first chunk, with the samples still running, so the
  tests below really exercise an interruption however fast the machine: the second
  chunk is held back until the pause has been requested."""
  engine, generate_chunk = pool.engine, pool.engine.generate_chunk
  calls, reached = 0, threading.Event()

  def gated(*args):
    nonlocal calls
    calls += 1
    if calls == 2:
      reached.set()
      wait_until(lambda: pool._inbox.paused, interval=0.0005)
    return generate_chunk(*args)

  engine.generate_chunk = gated
  try:
    assert reached.wait(timeout=60)
    pool.pause()
  finally:
    del engine.generate_chunk  # The engine's own method again.
  assert pool.metrics()["active_slots"] > 0


def _tokens(results):
  return [[s.completion_C.tolist() for s in samples] for samples in results]


def test_pause_resume_loses_and_duplicates_nothing(engine, params):
  requests = [_long(i, n=2, seed=i) for i in range(3)]
  with GeneratorPool(engine, params) as pool:
    reference = [pool.submit(r).result(timeout=60) for r in requests]
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(r) for r in requests]
    _pause_mid_generation(pool)
    before = pool.metrics()["generated_tokens"]
    time.sleep(0.05)
    assert pool.metrics()["generated_tokens"] == before
    pool.resume()
    results = [f.result(timeout=60) for f in futures]
    assert pool.metrics()["time_paused_s"] >= 0.05
  assert _tokens(results) == _tokens(reference)


def test_stop_tokens_max_new_tokens_and_cache_bound(engine, params):
  with GeneratorPool(engine, params) as pool:
    stop = pool.submit(Request("stop", [5], n=4, sampling=SamplingParams(
        stop_token_ids=range(0, 61, 2), max_new_tokens=T))).result(timeout=60)
    short = pool.submit(Request("short", [5], sampling=SamplingParams(max_new_tokens=5)))
    full = pool.submit(Request("full", list(range(16)), sampling=SamplingParams(
        max_new_tokens=1000)))
    (short,), (full,) = short.result(timeout=60), full.result(timeout=60)
  for s in stop:
    assert s.finish_reason == "stop" and s.completion_C[-1] % 2 == 0
    assert np.all(s.completion_C[:-1] % 2 == 1)
  assert short.finish_reason == "length" and len(short.completion_C) == 5
  assert full.finish_reason == "length" and len(full.completion_C) == T - 16


def test_chunks_end_samples_on_device_and_count_the_waste(engine, params):
  with GeneratorPool(engine, params) as pool:
    pool.pause()  # Both samples start in the same chunk.
    short = pool.submit(Request("short", [5], sampling=SamplingParams(max_new_tokens=3)))
    long = pool.submit(Request("long", [6], sampling=SamplingParams(max_new_tokens=20)))
    pool.resume()
    (short,), (long,) = short.result(timeout=60), long.result(timeout=60)
    pool.shutdown()
    m = pool.metrics()
  assert len(short.completion_C) == 3 and len(long.completion_C) == 20
  # Prefill draws each first token; then chunks of 8, 8 and 3 steps (the loop exits
  # once no slot is live). "short" stops after 2 steps of the first chunk and idles
  # for its other 6; a slot with nothing left to do is idle, not wasted.
  assert m["decode_steps"] == 19 and m["wasted_slot_steps"] == 6
  assert m["slot_occupancy"] == pytest.approx((2 + 19) / (2 * 19))
  assert m["wasted_fraction"] == pytest.approx(6 / (2 * 19))
  assert m["decode_calls"] >= 3


def test_an_idle_pool_admits_a_burst_of_submissions_together(engine, params, monkeypatch):
  # Submissions 50 ms apart count as one burst under a 30 s quiet window, so both
  # samples start in one chunk (19 steps, as above) rather than "short" alone (2 steps
  # that end when it does, then "long"'s 19).
  monkeypatch.setattr(scheduler, "SETTLE_S", 30.0)
  monkeypatch.setattr(scheduler, "SETTLE_MAX_S", 30.0)
  with GeneratorPool(engine, params) as pool:
    short = pool.submit(Request("short", [5], sampling=SamplingParams(max_new_tokens=3)))
    time.sleep(0.05)
    start = time.monotonic()
    long = pool.submit(Request("long", [6], sampling=SamplingParams(max_new_tokens=20)))
    short.result(timeout=60), long.result(timeout=60)
    # The second filled both slots, so the pool did not wait out the window.
    assert time.monotonic() - start < 10.0
    assert pool.metrics()["decode_steps"] == 19


def test_an_idle_pool_waits_for_a_burst_at_most_settle_max_s(engine, params, monkeypatch):
  monkeypatch.setattr(scheduler, "SETTLE_S", 60.0)
  monkeypatch.setattr(scheduler, "SETTLE_MAX_S", 0.05)
  with GeneratorPool(engine, params) as pool:
    (sample,) = pool.submit(Request("alone", [5], sampling=SamplingParams(
        max_new_tokens=3))).result(timeout=30)
  assert len(sample.completion_C) == 3


def test_retract_recomputes_kv_under_new_params(engine, params, new_params):
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(_long(i, seed=i)) for i in range(2)]
    _pause_mid_generation(pool)
    latency = pool.update_weights(new_params, 1, "retract").result(timeout=60)
    pool.resume()
    samples = [s for f in futures for s in f.result(timeout=60)]
    assert pool.version == 1 and pool.metrics()["weight_updates"] == 1
  assert set(latency) == {"transfer_s", "pause_s"}
  for s in samples:
    old = _versions(s) == 0
    assert old[0] and not old[-1] and np.all(np.diff(_versions(s)) >= 0)
    np.testing.assert_allclose(_logp(s)[old], _recompute_logp(params, s, 0.7)[old], atol=1e-4)
    np.testing.assert_allclose(_logp(s)[~old], _recompute_logp(new_params, s, 0.7)[~old],
                               atol=1e-4)


def test_keep_swaps_params_but_keeps_old_kv(engine, params, new_params):
  with GeneratorPool(engine, params) as pool:
    future = pool.submit(_long("a"))
    _pause_mid_generation(pool)
    pool.update_weights(new_params, 1, "keep").result(timeout=60)
    pool.resume()
    (s,) = future.result(timeout=60)
  old = _versions(s) == 0
  assert old[0] and not old[-1] and np.all(np.diff(_versions(s)) >= 0)
  np.testing.assert_allclose(_logp(s)[old], _recompute_logp(params, s, 0.7)[old], atol=1e-4)
  # New-version tokens attend to KV computed under the old params, so they do not
  # match a recomputation under the new params: this is what tells keep from retract.
  assert np.max(np.abs(_logp(s)[~old] - _recompute_logp(new_params, s, 0.7)[~old])) > 1e-3


def test_drain_finishes_in_flight_on_old_params(engine, params, new_params):
  with GeneratorPool(engine, params) as pool:
    in_flight = pool.submit(_long("old", n=2))
    _pause_mid_generation(pool)
    update = pool.update_weights(new_params, 1, "drain")
    queued = pool.submit(_long("new", n=3))
    pool.resume()
    update.result(timeout=60)
    old_samples, new_samples = in_flight.result(timeout=60), queued.result(timeout=60)
    assert pool.metrics()["swap_pause_s"] > 0
  assert all(np.all(_versions(s) == 0) for s in old_samples)
  assert all(np.all(_versions(s) == 1) for s in new_samples)


def test_update_weights_copies_and_validates(engine, params):
  donated = jax.tree.map(lambda x: x + 0, params)
  with GeneratorPool(engine, params) as pool:
    pool.update_weights(donated, 3, "keep").result(timeout=60)
    # The trainer may donate or free its buffers once update_weights returns.
    jax.tree.map(lambda x: x.delete(), donated)
    (s,) = pool.submit(_long("after")).result(timeout=60)
    assert np.all(_versions(s) == 3)
    with pytest.raises(ValueError, match="must exceed"):
      pool.update_weights(params, 3, "keep")
    with pytest.raises(ValueError, match="update mode"):
      pool.update_weights(params, 4, "swap")


def test_abort_frees_slot_for_queued_request(engine, params):
  with GeneratorPool(engine, params) as pool:
    running = pool.submit(_long("running", n=2))
    queued = pool.submit(_long("queued", n=1))
    never = pool.submit(_long("never", n=2))
    _pause_mid_generation(pool)
    assert pool.metrics()["queue_length"] == 3
    assert pool.abort("never") and pool.abort("running")
    assert not pool.abort("running") and not pool.abort("unknown")
    pool.resume()
    aborted = running.result(timeout=60)
    (done,) = queued.result(timeout=60)
    assert pool.metrics()["queue_length"] == 0
  assert [s.finish_reason for s in aborted] == ["aborted", "aborted"]
  assert all(0 < len(s.completion_C) < T - 3 for s in aborted)
  assert all(len(s.completion_C) == len(_logp(s)) == len(_versions(s)) for s in aborted)
  assert [(s.finish_reason, len(s.completion_C)) for s in never.result(timeout=60)] == [
      ("aborted", 0), ("aborted", 0)]
  assert done.finish_reason == "length"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_concurrent_submitters_get_every_request_exactly_once(engine, params, seed):
  rng = random.Random(seed)
  plans = [[(f"t{t}-{i}", rng.randint(1, 3), [rng.randrange(61) for _ in range(rng.randint(1, 16))],
             rng.randint(1, 12), rng.random() < 0.15, rng.random() * 0.003)
            for i in range(rng.randint(3, 8))] for t in range(6)]
  calls, lock = {}, threading.Lock()

  def record(request_id):
    def callback(_):
      with lock:
        calls[request_id] = calls.get(request_id, 0) + 1
    return callback

  def submitter(pool, plan, out):
    for request_id, n, prompt, max_new, abort, pause_s in plan:
      request = Request(request_id, prompt, n=n,
                        sampling=SamplingParams(max_new_tokens=max_new, stop_token_ids=[7]))
      future = pool.submit(request)
      future.add_done_callback(record(request_id))
      out.append((request, future))
      time.sleep(pause_s)
      if abort:
        pool.abort(request_id)

  outs = [[] for _ in plans]
  with GeneratorPool(engine, params) as pool:
    threads = [threading.Thread(target=submitter, args=(pool, plan, out))
               for plan, out in zip(plans, outs)]
    for th in threads:
      th.start()
    for th in threads:
      th.join()
    for request, future in (x for out in outs for x in out):
      samples = future.result(timeout=60)
      assert [s.metadata["index"] for s in samples] == list(range(request.n))
      for s in samples:
        assert s.metadata["request_id"] == request.request_id
        assert s.finish_reason in FINISH_REASONS
        assert list(s.prompt_P) == list(request.prompt)
        assert len(s) == len(s.logp_T) == len(s.versions_T) == len(s.loss_mask_T)
        assert len(s.completion_C) <= request.sampling.max_new_tokens
        assert s.finish_reason == "aborted" or len(s.completion_C) > 0
    assert pool.metrics()["queue_length"] == 0 and pool.metrics()["active_slots"] == 0
  assert calls == {r.request_id: 1 for out in outs for r, _ in out}


@pytest.mark.parametrize("request_kw,match", [
    (dict(prompt=[]), "non-empty"),
    (dict(prompt=list(range(17))), "max_prefill_length"),
    (dict(prompt=[61]), r"\[0, 61\)"),
    (dict(prompt=[1.5]), "integers"),
    (dict(n=0), "n must be"),
    (dict(sampling=SamplingParams(stop_token_ids=[3, 99])), "stop_token_ids"),
])
def test_bad_request_is_rejected_without_disturbing_others(engine, params, request_kw, match):
  with GeneratorPool(engine, params) as pool:
    good = pool.submit(_long("good"))
    with pytest.raises(ValueError, match=match):
      pool.submit(Request(**{"request_id": "bad", "prompt": [1], **request_kw}))
    with pytest.raises(ValueError, match="already in flight"):
      pool.submit(_long("good"))
    (s,) = good.result(timeout=60)
    assert s.finish_reason == "length"


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(seed=-1), "seed"),
    (dict(stop_token_ids=range(33)), "stop_token_ids"),
])
def test_bad_sampling_params(kw, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kw)


def test_submit_after_shutdown_raises(engine, params):
  pool = GeneratorPool(engine, params)
  pending = pool.submit(_long("pending", n=2))
  pool.shutdown()
  assert all(s.finish_reason in ("aborted", "length") for s in pending.result(timeout=1))
  with pytest.raises(RuntimeError, match="shut down"):
    pool.submit(_long("late"))
  with pytest.raises(RuntimeError, match="shut down"):
    pool.update_weights(params, 1)
  pool.shutdown()


# Held slots: a sample of a hold_slot request that ends on a stop id keeps its slot.
_TURN = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3,
                       stop_token_ids=tuple(range(5, 15)))


def _hold(pool, request_id, prompt=(1, 2, 3)):
  (s,) = pool.submit(Request(request_id, list(prompt), sampling=_TURN,
                             hold_slot=True)).result(timeout=60)
  assert s.finish_reason == "stop", "the test needs a sample that stops on a stop id"
  return s, [*s.tokens_T.tolist(), 40, 41]


def test_extend_continues_a_held_sample_as_a_new_request_would(engine, params):
  with GeneratorPool(engine, params) as pool:
    held, context = _hold(pool, "turn1")
    handle = held.metadata["slot"]
    assert handle.length == len(held) and pool.metrics()["held_slots"] == 1
    (extended,) = pool.extend(handle, Request("turn2", context, sampling=_TURN)).result(timeout=60)
    (fresh,) = pool.submit(Request("again", context, sampling=_TURN)).result(timeout=60)
    assert extended.tokens_T.tolist() == fresh.tokens_T.tolist()
    assert extended.prompt_len == len(context) and len(extended.completion_C) > 0
    np.testing.assert_array_equal(_versions(extended), _versions(fresh))
    np.testing.assert_allclose(_logp(extended), _logp(fresh), atol=1e-5)
    np.testing.assert_allclose(_logp(extended), _recompute_logp(params, extended, 1.0),
                               atol=1e-5)
    metrics = pool.metrics()
    assert metrics["extended_in_slot"] == 1 and metrics["held_slots"] == 0
    # The handle was used up; a prompt that does not continue the held sample fails.
    assert pool.extend(handle, Request("stale", context, sampling=_TURN)).result(timeout=60) is None
    other, _ = _hold(pool, "turn1b")
    wrong = pool.extend(other.metadata["slot"], Request("wrong", [1, 2, 4, 5], sampling=_TURN))
    with pytest.raises(ValueError, match="does not continue"):
      wrong.result(timeout=60)
    with pytest.raises(ValueError, match="n=1"):
      pool.extend(handle, Request("two", context, n=2, sampling=_TURN))


def test_release_frees_a_held_slot_and_queued_samples_evict_the_oldest(engine, params):
  with GeneratorPool(engine, params) as pool:
    (first, context), (second, _) = _hold(pool, "a"), _hold(pool, "b")
    assert pool.metrics()["held_slots"] == 2 == pool.engine.max_concurrent_decodes
    pool.release(first.metadata["slot"])
    wait_until(lambda: pool.metrics()["held_slots"] == 1)
    assert pool.extend(first.metadata["slot"], Request("a2", context)).result(timeout=60) is None
    # Two queued samples, one free slot: the held one is evicted for the other.
    (x,), (y,) = [f.result(timeout=60) for f in (pool.submit(_long("x")), pool.submit(_long("y")))]
    metrics = pool.metrics()
    assert metrics["evictions"] == 1 and metrics["held_slots"] == 0
    assert x.finish_reason == y.finish_reason == "length"
    evicted = pool.extend(second.metadata["slot"], Request("b2", [*second.tokens_T, 40]))
    assert evicted.result(timeout=60) is None


def test_abort_and_shutdown_resolve_extensions_and_free_held_slots(engine, params):
  pool = GeneratorPool(engine, params)
  (a, context_a), (b, context_b) = _hold(pool, "a"), _hold(pool, "b")
  pool.pause()
  pending_a = pool.extend(a.metadata["slot"], Request("a2", context_a, sampling=_TURN))
  pending_b = pool.extend(b.metadata["slot"], Request("b2", context_b, sampling=_TURN))
  assert pool.abort("a2")
  (aborted,) = pending_a.result(timeout=60)
  assert aborted.finish_reason == "aborted" and len(aborted.completion_C) == 0
  wait_until(lambda: pool.metrics()["held_slots"] == 1)
  pool.shutdown()  # Still paused, with b's extension waiting.
  (closed,) = pending_b.result(timeout=1)
  assert closed.finish_reason == "aborted" and pool.metrics()["held_slots"] == 0
  with pytest.raises(RuntimeError, match="shut down"):
    pool.extend(b.metadata["slot"], Request("b3", context_b))
