"""The simulator's bookkeeping: mode equivalences, the staleness bound, determinism."""

import dataclasses

import numpy as np
import pytest

from async_rl.sim import DecodeCost, SimConfig, sample_lengths, simulate

# With constant lengths, B * G = generators * slots makes every wave fill all slots
# and finish at once, so sync and async see the same event times, computed by the
# same float operations in the same order; only summation order may differ.
_REL = 1e-9


def _aligned(**kw):
  base = dict(num_generators=4, slots=8, batch_groups=8, group_size=4, length_dist="constant",
              length_median=50, trainer_per_token=0.0, reward_latency=0.0, weight_sync=0.0,
              prefill_per_token=1e-4)
  base.update(kw)
  return SimConfig(**base)


# Under retract, async refills a slot at the wave's end and then re-prefills it when
# the (instant) update lands; sync updates first. So retract coincides only with a
# free prefill; `test_retract_pays_one_re_prefill_per_wave` checks the difference.
@pytest.mark.parametrize("update_mode, prefill", [("keep", 1e-4), ("drain", 1e-4),
                                                  ("retract", 0.0)])
@pytest.mark.parametrize("eta", [1, 4, None])
def test_zero_cost_trainer_constant_lengths_sync_equals_async(update_mode, prefill, eta):
  sync = simulate(_aligned(mode="sync", trainer_accelerators=4, max_staleness=0,
                           prefill_per_token=prefill), 6)
  asyn = simulate(_aligned(mode="async", trainer_accelerators=1, max_staleness=eta,
                           update_mode=update_mode, prefill_per_token=prefill), 6)
  assert sync.trained_samples == asyn.trained_samples == 6 * 32
  assert asyn.samples_per_s == pytest.approx(sync.samples_per_s, rel=_REL)
  assert asyn.tokens_per_s == pytest.approx(sync.tokens_per_s, rel=_REL)
  np.testing.assert_allclose(asyn.step_end_times, sync.step_end_times, rtol=_REL)
  # One wave per step: 50 decode steps at full occupancy plus the prefill of 8 slots.
  wave = 50 * (0.02 + 0.0005 * 8) + prefill * 128 * 8
  assert sync.step_end_times[0] == pytest.approx(wave, rel=_REL)


def test_retract_pays_one_re_prefill_per_wave():
  sync = simulate(_aligned(mode="sync", trainer_accelerators=4, max_staleness=0), 4)
  asyn = simulate(_aligned(mode="async", max_staleness=1, update_mode="retract"), 4)
  wave = 50 * (0.02 + 0.0005 * 8) + 1e-4 * 128 * 8
  np.testing.assert_allclose(sync.step_end_times, wave * np.arange(1, 5), rtol=_REL)
  # Waves after the first re-prefill their 8 fresh slots (prompts only) once.
  np.testing.assert_allclose(np.diff(asyn.step_end_times), wave + 1e-4 * 128 * 8, rtol=_REL)


@pytest.mark.parametrize("update_mode", ["retract", "keep", "drain"])
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_staleness_never_exceeds_eta(update_mode, eta):
  maxes = []
  for seed in range(3):
    cfg = SimConfig(num_generators=3, trainer_accelerators=1, slots=8, batch_groups=4,
                    group_size=4, max_staleness=eta, update_mode=update_mode,
                    length_dist="pareto", length_alpha=1.2, length_median=40, max_length=2000,
                    trainer_per_token=2e-5, reward_latency=0.05, weight_sync=0.01)
    res = simulate(cfg, 12, seed)
    assert res.staleness_max <= eta
    assert len(res.staleness_hist) <= eta + 1
    assert sum(res.staleness_hist) == res.trained_tokens
    assert res.trained_samples == 12 * 16
    maxes.append(res.staleness_max)
  assert max(maxes) == eta  # The bound is reached, so the check above has teeth.


def test_unbounded_staleness_exceeds_small_bounds():
  """The bound test above could not fail if staleness never arose: here it does."""
  cfg = SimConfig(num_generators=3, trainer_accelerators=1, slots=8, batch_groups=4,
                  group_size=4, max_staleness=None, length_dist="pareto", length_alpha=1.2,
                  length_median=40, max_length=2000, trainer_per_token=2e-5)
  assert simulate(cfg, 12, 0).staleness_max >= 2


def test_a_bound_that_never_shuts_the_gate_runs_like_any_larger_one():
  kw = dict(num_generators=3, trainer_accelerators=1, slots=8, batch_groups=4, group_size=4,
            length_dist="pareto", length_alpha=1.2, length_median=40, max_length=2000,
            trainer_per_token=2e-5)
  tight = simulate(SimConfig(max_staleness=1, **kw), 6)
  assert tight.gate_closed > 0  # η = 1 holds generation back here...
  loose = simulate(SimConfig(max_staleness=8, **kw), 6)
  assert loose.gate_closed == loose.dropped_groups == 0
  # ...and η = 8 never does, so any larger bound, or none, runs the same events.
  for eta in (9, None):
    same = simulate(SimConfig(max_staleness=eta, **kw), 6)
    assert same.step_end_times == loose.step_end_times and same.timelines == loose.timelines


def test_eta_zero_async_alternates_like_sync():
  kw = dict(num_generators=4, trainer_accelerators=2, slots=8, batch_groups=6, group_size=4,
            max_staleness=0, length_dist="lognormal", length_median=60, max_length=1000,
            trainer_per_token=1e-4, reward_latency=0.03, weight_sync=0.02)
  sync = simulate(SimConfig(mode="sync", **kw), 8, seed=3)
  asyn = simulate(SimConfig(mode="async", **kw), 8, seed=3)
  assert asyn.staleness_max == sync.staleness_max == 0
  assert asyn.dropped_groups == 0
  assert asyn.step_end_times == sync.step_end_times
  assert asyn.timelines == sync.timelines
  assert (sync.config.accelerators, asyn.config.accelerators) == (4, 6)
  # Alternation: no generator is busy while the trainer trains.
  for start, end, _ in sync.timelines["trainer"]:
    for name, lane in sync.timelines.items():
      if name != "trainer":
        assert all(e <= start or s >= end for s, e, _ in lane), name


def test_long_tail_makes_async_faster_at_equal_accelerators():
  kw = dict(slots=16, batch_groups=32, group_size=4, length_dist="lognormal",
            length_median=200, length_sigma=1.2, max_length=8000, trainer_per_token=1e-4,
            weight_sync=0.1, reward_latency=0.05)
  sync = simulate(SimConfig(mode="sync", num_generators=8, trainer_accelerators=8,
                            max_staleness=0, **kw), 10)
  asyn = simulate(SimConfig(mode="async", num_generators=6, trainer_accelerators=2,
                            max_staleness=4, **kw), 10)
  assert sync.config.accelerators == asyn.config.accelerators == 8
  assert asyn.samples_per_s > 1.5 * sync.samples_per_s
  assert asyn.generator_idle < sync.generator_idle


def test_deterministic_for_a_seed():
  cfg = SimConfig(num_generators=3, batch_groups=4, group_size=4, max_staleness=2)
  a, b, c = simulate(cfg, 5, seed=7), simulate(cfg, 5, seed=7), simulate(cfg, 5, seed=8)
  assert a == b
  assert a.step_end_times != c.step_end_times


def test_sample_lengths():
  rng = np.random.default_rng(0)
  for dist in ("lognormal", "pareto"):
    cfg = SimConfig(length_dist=dist, length_median=100, max_length=1000)
    n_N = sample_lengths(cfg, rng, 20000)
    assert n_N.min() >= 1 and n_N.max() == 1000
    assert np.median(n_N) == pytest.approx(100, rel=0.05)
  assert set(sample_lengths(SimConfig(length_dist="constant", length_median=7), rng, 9)) == {7}
  empirical = SimConfig(length_dist="empirical", length_samples=(3, 3, 3, 40))
  n_N = sample_lengths(empirical, rng, 20000)
  assert set(n_N) == {3, 40} and np.mean(n_N == 40) == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize("field, value", [
    ("mode", "both"), ("update_mode", "pause"), ("length_dist", "zipf"),
    ("num_generators", 0), ("slots", 0), ("batch_groups", 0), ("group_size", 0),
    ("trainer_accelerators", 0), ("decode", 0.02), ("trainer_per_token", -1.0),
    ("weight_sync", -0.1), ("max_staleness", -1), ("length_median", 10**6),
    ("length_sigma", -1.0), ("length_alpha", 0.0)])
def test_bad_config_names_the_field(field, value):
  with pytest.raises(ValueError, match=f"SimConfig.{field} "):
    dataclasses.replace(SimConfig(), **{field: value})


@pytest.mark.parametrize("samples", [(), (0, 5), (5, 10**6)])
def test_empirical_lengths_must_lie_in_range(samples):
  with pytest.raises(ValueError, match="SimConfig.length_samples "):
    SimConfig(length_dist="empirical", length_samples=samples)


def test_sync_requires_eta_zero_and_positive_steps():
  with pytest.raises(ValueError, match="SimConfig.max_staleness "):
    SimConfig(mode="sync", max_staleness=1)
  with pytest.raises(ValueError, match="num_steps"):
    simulate(SimConfig(), 0)


def test_kv_budget_of_one_sequence_decodes_one_sample_at_a_time():
  # 178 tokens hold one prompt of 128 and its 50 generated tokens: the slots serialise.
  cfg = _aligned(mode="sync", num_generators=1, trainer_accelerators=1, max_staleness=0,
                 batch_groups=2, group_size=4, max_length=50, kv_tokens=178)
  res = simulate(cfg, 2)
  per_sample = 50 * (0.02 + 0.0005 * 1) + 1e-4 * 128
  np.testing.assert_allclose(res.step_end_times, 8 * per_sample * np.arange(1, 3), rtol=_REL)
  # One of 8 slots holds a sample while decoding (prefill is not decoding).
  decoding = 50 * (0.02 + 0.0005) / per_sample
  assert res.slot_occupancy == pytest.approx(decoding / 8, rel=1e-9) and res.preempted == 0


def test_kv_budget_preempts_and_resumes_with_a_re_prefill():
  # Two samples start (10 + 10 tokens) but cannot both grow to 10 + 50.
  kw = dict(mode="sync", num_generators=1, trainer_accelerators=1, max_staleness=0, slots=2,
            batch_groups=1, group_size=2, prompt_tokens=10, length_dist="constant",
            length_median=50, max_length=50, trainer_per_token=0.0, prefill_per_token=1e-3)
  free = simulate(SimConfig(**kw), 1)
  tight = simulate(SimConfig(kv_tokens=80, **kw), 1)
  assert free.preempted == 0 and tight.preempted >= 1
  assert tight.trained_tokens == free.trained_tokens == 100
  assert tight.step_end_times[0] > free.step_end_times[0]


def test_decode_step_is_a_roofline_of_reads_and_compute():
  # Compute 0.01 s per slot beats reads 0.02 + 0.0005 per slot from 3 slots on.
  sync = simulate(_aligned(mode="sync", trainer_accelerators=4, max_staleness=0,
                           decode=DecodeCost(base=0.02, per_slot=0.0005,
                                             compute_per_slot=0.01)), 2)
  wave = 50 * (0.01 * 8) + 1e-4 * 128 * 8
  assert sync.step_end_times[0] == pytest.approx(wave, rel=_REL)
  # Reads growing with the live tokens: 128 + 50 per slot at the end, so between.
  grown = simulate(_aligned(mode="sync", trainer_accelerators=4, max_staleness=0,
                            decode=DecodeCost(base=0.02, per_slot=0.0005,
                                              per_token=1e-5)), 2)
  low = 50 * (0.02 + 0.0005 * 8 + 1e-5 * 8 * 128) + 1e-4 * 128 * 8
  high = 50 * (0.02 + 0.0005 * 8 + 1e-5 * 8 * 178) + 1e-4 * 128 * 8
  assert low < grown.step_end_times[0] < high


def test_chunks_hold_a_finished_samples_slot_to_the_chunks_end():
  # One slot, two samples of 50 tokens each, chunks of 8: each sample runs 56 steps
  # (7 chunks), keeps its 50 tokens, and the next joins only after its chunk ends.
  kw = dict(mode="sync", num_generators=1, trainer_accelerators=1, max_staleness=0, slots=1,
            batch_groups=1, group_size=2, prompt_tokens=10, length_dist="constant",
            length_median=50, max_length=50, trainer_per_token=0.0, prefill_per_token=0.0,
            decode=DecodeCost(base=0.01))
  every_step = simulate(SimConfig(**kw), 2)
  chunked = simulate(SimConfig(steps_per_call=8, **kw), 2)
  np.testing.assert_allclose(every_step.step_end_times, [1.0, 2.0], rtol=_REL)
  np.testing.assert_allclose(chunked.step_end_times, [1.12, 2.24], rtol=_REL)
  assert chunked.trained_tokens == every_step.trained_tokens == 200
  assert chunked.generated_tokens == every_step.generated_tokens == 200
  # Chunks of 5 divide 50: no slot is held past its sample's end.
  exact = simulate(SimConfig(steps_per_call=5, **kw), 2)
  np.testing.assert_allclose(exact.step_end_times, [1.0, 2.0], rtol=_REL)


def test_decode_cost_is_a_roofline_and_names_bad_fields():
  cost = DecodeCost(base=0.01, per_slot=0.001, per_token=1e-5, compute_per_slot=0.004)
  assert cost.step_s(2, 100) == pytest.approx(0.01 + 0.002 + 0.001)  # reads bound
  assert cost.step_s(10, 100) == pytest.approx(0.04)  # compute bound
  assert cost.grows_with_live_tokens and not DecodeCost(base=0.01).grows_with_live_tokens
  with pytest.raises(ValueError, match="DecodeCost.base "):
    DecodeCost(base=-1.0)
  with pytest.raises(ValueError, match="a step of one slot must take time"):
    DecodeCost(base=0.0, per_token=1e-5)
  assert DecodeCost(base=0.0, per_slot=1e-3).step_s(4, 0) == pytest.approx(4e-3)
  with pytest.raises(ValueError, match="DecodeCost.per_token "):
    DecodeCost(base=0.01, per_token=-1.0)


def test_a_group_is_admitted_by_its_versions_not_its_token_count():
  """The simulator offers a group as one sample holding one token of each version its
  tokens carry; the buffer must decide on it as on the full group, at every version and
  bound."""
  from async_rl.param_server.buffer import AdmissionBuffer  # noqa: PLC0415
  from async_rl.trajectory import Group, Trajectory  # noqa: PLC0415

  def sample(versions):
    return Trajectory.from_completion(
        np.zeros(1, np.int32), np.zeros(versions.size, np.int32),
        np.zeros(versions.size, np.float32), versions, "length", reward=0.0)

  def full(runs):
    return Group(None, tuple(sample(np.concatenate([np.full(n, v) for v, n in r]))
                             for r in runs))

  def compact(runs):
    return Group(None, (sample(np.unique([v for r in runs for v, _ in r])),))

  rng = np.random.default_rng(0)
  groups = [[[(v, int(rng.integers(1, 50))) for v in sorted(rng.choice(8, 3, replace=False))]
             for _ in range(2)] for _ in range(40)]
  for eta in (0, 1, 3):
    a, b = AdmissionBuffer(eta), AdmissionBuffer(eta)
    for ticket, runs in enumerate(groups):
      version = ticket // 5
      assert a.offer(full(runs), 8 + version, ticket) == b.offer(compact(runs), 8 + version,
                                                                 ticket)
      if ticket % 7 == 6:
        assert a.purge(9 + version) == b.purge(9 + version)
    assert [t for t, _ in a.take(len(a), 16)] == [t for t, _ in b.take(len(b), 16)]
    assert a.dropped == b.dropped > 0
