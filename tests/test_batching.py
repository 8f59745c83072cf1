"""Tests for async_rl.batching: FFD allocation, packing, bucketed shapes."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl import batching
from async_rl.trajectory import Trajectory

_SETTINGS = settings(max_examples=60, deadline=None)


def _seq(prompt, completion, behav_logp=None, versions=None, advantage=0.0):
  """A single-turn trajectory; the test keeps its advantage in `metadata`."""
  n = len(completion)
  return Trajectory.from_completion(
      np.array(prompt, np.int32), np.array(completion, np.int32),
      np.zeros(n, np.float32) if behav_logp is None else behav_logp,
      np.zeros(n, np.int32) if versions is None else versions, "stop",
      metadata={"advantage": advantage})


def _adv(seqs):
  return np.array([s.metadata["advantage"] for s in seqs], np.float32)


def _random_seqs(seed, n, max_prompt=6, max_completion=8):
  rng = np.random.default_rng(seed)
  seqs = []
  for _ in range(n):
    p, c = rng.integers(1, max_prompt + 1), rng.integers(0, max_completion + 1)
    tokens = rng.integers(1, 1000, p + c).astype(np.int32)
    seqs.append(_seq(tokens[:p], tokens[p:], -rng.exponential(size=c).astype(np.float32),
                     rng.integers(0, 20, c).astype(np.int32),
                     float(np.float32(rng.normal()))))
  return seqs


def _unpack_rows(batch):
  """Per flattened row, the segments as dicts; checks the layout invariants on the way."""
  M, R, T = batch.tokens.shape
  flat = {k: v.reshape(M * R, T) for k, v in vars(batch).items() if v is not None}
  rows = []
  for r in range(M * R):
    seg_T = flat["segment_ids"][r]
    pad = seg_T == 0
    assert not flat["tokens"][r][pad].any() and not flat["positions"][r][pad].any()
    assert not flat["loss_mask"][r][pad].any() and not flat["behav_logp"][r][pad].any()
    assert not flat["advantages"][r][pad].any()
    ids = [k for k, _ in itertools.groupby(seg_T) if k]
    # Segment ids run 1, 2, 3, ... in order, each one contiguous, so no two sequences
    # of a row share an id.
    assert ids == list(range(1, len(ids) + 1))
    # Padding only after the last segment.
    assert not pad[:int(np.count_nonzero(~pad))].any()
    segments = []
    for sid in ids:
      idx = np.flatnonzero(seg_T == sid)
      mask = flat["loss_mask"][r][idx]
      assert set(np.unique(mask)) <= {0.0, 1.0}
      np.testing.assert_array_equal(flat["positions"][r][idx], np.arange(idx.size))
      prompt_len = int(np.argmax(mask)) if mask.any() else idx.size
      # Completion positions are exactly the tail after the prompt.
      np.testing.assert_array_equal(mask, np.arange(idx.size) >= prompt_len)
      gen = idx[prompt_len:]
      assert not flat["behav_logp"][r][idx[:prompt_len]].any()
      assert not flat["advantages"][r][idx[:prompt_len]].any()
      adv = np.unique(flat["advantages"][r][gen])
      assert adv.size <= 1
      segments.append(dict(
          tokens=flat["tokens"][r][idx].tolist(), prompt_len=prompt_len,
          behav_logp=flat["behav_logp"][r][gen].tolist(),
          advantage=float(adv[0]) if adv.size else None))
    rows.append(segments)
  return rows


def _as_dict(seq):
  has_completion = len(seq) > seq.prompt_len
  return dict(tokens=seq.tokens_T.tolist(), prompt_len=seq.prompt_len,
              behav_logp=seq.logp_T[seq.prompt_len:].tolist(),
              advantage=float(np.float32(seq.metadata["advantage"])) if has_completion else None)


# ffd_allocate: hand cases.

def test_ffd_fewest_sequences_beats_first_fit():
  # Budget 10. 7 and 7 open two groups; every 1 fits both. First fit would fill
  # group 0 to [7,1,1,1]; "fewest sequences" alternates, earliest group on ties.
  assert batching.ffd_allocate([7, 7, 1, 1, 1, 1], 10) == [[0, 2, 4], [1, 3, 5]]
  # 6 and 5 open two groups; the 1s alternate (first fit: [[0, 2, 3, 4], [1]]).
  assert batching.ffd_allocate([6, 5, 1, 1, 1], 10) == [[0, 2, 4], [1, 3]]


def test_ffd_fewest_sequences_only_among_groups_that_fit():
  # Budget 10: [9] [8] open; 2 goes to group 1, as group 0 (earlier, as few
  # sequences) cannot take it; 1 then fits only group 0; the last 1 fits nowhere.
  assert batching.ffd_allocate([9, 8, 2, 1, 1], 10) == [[0, 3], [1, 2], [4]]


def test_ffd_decreasing_order_ties_by_index():
  assert batching.ffd_allocate([3, 5, 3], 5) == [[1], [0], [2]]
  assert batching.ffd_allocate([4, 4, 4], 8) == [[0, 1], [2]]


def test_ffd_min_groups():
  assert batching.ffd_allocate([2, 2, 2, 2], 100) == [[0, 1, 2, 3]]
  # Redone from three empty groups: the longest three seed them.
  assert batching.ffd_allocate([2, 2, 2, 2], 100, min_groups=3) == [[0, 3], [1], [2]]
  assert batching.ffd_allocate([1, 3, 2, 4], 100, min_groups=2) == [[3, 2], [1, 0]]
  # FFD already gives enough groups: unchanged.
  assert batching.ffd_allocate([6, 6, 6], 10, min_groups=2) == [[0], [1], [2]]
  # Fewer sequences than groups: singletons, then empty groups.
  assert batching.ffd_allocate([2, 5], 100, min_groups=4) == [[1], [0], [], []]
  assert batching.ffd_allocate([], 8) == [[]]
  assert batching.ffd_allocate([], 8, min_groups=0) == []


def test_ffd_oversize_sequence_names_index_length_and_budget():
  with pytest.raises(ValueError, match=r"sequence 1 has length 12.*max_tokens_per_mb=10"):
    batching.ffd_allocate([3, 12, 4], 10)
  with pytest.raises(ValueError, match="max_tokens_per_mb"):
    batching.ffd_allocate([1], 0)
  with pytest.raises(ValueError, match="negative"):
    batching.ffd_allocate([1, -1], 4)


# ffd_allocate: properties.

@st.composite
def _allocation_problem(draw):
  budget = draw(st.integers(1, 64))
  lengths = draw(st.lists(st.integers(0, budget), max_size=40))
  return lengths, budget, draw(st.integers(0, 8))


def _check_fewest_fit_rule(lengths, budget, groups):
  """Replays the allocation in processing order and checks each choice against the rule."""
  where = {i: g for g, group in enumerate(groups) for i in group}
  totals, counts = [], []
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    fits = [g for g in range(len(totals)) if totals[g] + lengths[i] <= budget]
    if fits:
      assert where[i] == min(fits, key=lambda g: (counts[g], g))
    else:
      assert where[i] == len(totals)
      totals.append(0)
      counts.append(0)
    totals[where[i]] += lengths[i]
    counts[where[i]] += 1


@_SETTINGS
@given(_allocation_problem())
def test_ffd_properties(problem):
  lengths, budget, min_groups = problem
  groups = batching.ffd_allocate(lengths, budget, min_groups)
  assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
  assert all(sum(lengths[i] for i in g) <= budget for g in groups)
  assert batching.ffd_allocate(list(lengths), budget, min_groups) == groups
  assert len(groups) >= max(min_groups, 1 if lengths else 0)
  for g in groups:
    assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
  if len(lengths) >= min_groups:
    assert all(groups)
  else:
    assert len(groups) == min_groups
    assert sum(1 for g in groups if g) == len(lengths)
  plain = batching.ffd_allocate(lengths, budget, min_groups=0)
  _check_fewest_fit_rule(lengths, budget, plain)
  if len(plain) >= min_groups:
    assert groups == plain


# pack.

def test_pack_hand_case():
  a = _seq([11, 12], [13, 14], behav_logp=[-0.5, -0.25], versions=[3, 4], advantage=1.5)
  b = _seq([21], [22, 23], behav_logp=[-1.0, -2.0], versions=[5, 5], advantage=-2.0)
  batch = batching.pack([a, b], [1.5, -2.0], [[0, 1]], rows_per_mb=2, row_len=8)
  assert batch.tokens.shape == (1, 2, 8)
  expected = dict(
      tokens=([11, 12, 13, 14, 21, 22, 23, 0], np.int32),
      positions=([0, 1, 2, 3, 0, 1, 2, 0], np.int32),
      segment_ids=([1, 1, 1, 1, 2, 2, 2, 0], np.int32),
      loss_mask=([0, 0, 1, 1, 0, 1, 1, 0], np.float32),
      behav_logp=([0, 0, -0.5, -0.25, 0, -1, -2, 0], np.float32),
      advantages=([0, 0, 1.5, 1.5, 0, -2, -2, 0], np.float32))
  assert set(expected) | {"versions", "ref_logp", "top_k", "top_p"} == set(vars(batch)), \
      "only what the device reads"
  assert batch.versions is None, "versions are packed only when asked"
  assert batch.top_k is None and batch.top_p is None, "no truncation, no truncation fields"
  assert batch.ref_logp is None, "the trainer adds reference log-probs, packing does not"
  for name, (row, dtype) in expected.items():
    got = getattr(batch, name)
    assert got.dtype == dtype, name
    np.testing.assert_array_equal(got[0, 0], np.array(row, dtype), err_msg=name)
    np.testing.assert_array_equal(got[0, 1], np.zeros(8, dtype), err_msg=name)


def test_pack_places_each_tokens_truncation_on_its_loss_mask():
  a = dataclasses.replace(_seq([11, 12], [13, 14]), top_k=5, top_p=0.9)
  b = _seq([21], [22, 23])  # no truncation: the full softmax
  batch = batching.pack([a, b], [0.0, 0.0], [[0, 1]], rows_per_mb=1, row_len=8)
  np.testing.assert_array_equal(batch.top_k[0, 0], [0, 0, 5, 5, 0, 0, 0, 0])
  np.testing.assert_allclose(batch.top_p[0, 0], [1, 1, 0.9, 0.9, 1, 1, 1, 1])
  assert batch.top_k.dtype == np.int32 and batch.top_p.dtype == np.float32
  padded = batching.pad_micro_batches(batch, 2)
  np.testing.assert_array_equal(padded.top_k[1], 0)
  np.testing.assert_array_equal(padded.top_p[1], 1)


def test_pack_follows_the_loss_mask():
  # A multi-turn episode: prompt, two policy tokens, one environment token (mask 0,
  # no behaviour log-prob), one more policy token masked out (too stale).
  traj = Trajectory(tokens_T=np.array([5, 6, 7, 8, 9, 10], np.int32),
                    loss_mask_T=np.array([0, 1, 1, 0, 1, 0], bool),
                    logp_T=np.array([0, -1, -2, 0, -3, -4], np.float32),
                    versions_T=np.array([-1, 0, 0, -1, 1, 1], np.int32), prompt_len=1,
                    finish_reason="stop", reward=1.0)
  batch = batching.pack([traj], [0.5], [[0]], rows_per_mb=1, row_len=8)
  np.testing.assert_array_equal(batch.loss_mask[0, 0], [0, 1, 1, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(batch.behav_logp[0, 0], [0, -1, -2, 0, -3, 0, 0, 0])
  np.testing.assert_array_equal(batch.advantages[0, 0], [0, .5, .5, 0, .5, 0, 0, 0])


def test_packed_batch_is_a_pytree():
  batch = batching.pack([_seq([1], [2])], [0.0], [[0]], rows_per_mb=1, row_len=8)
  leaves = jax.tree.leaves(batch)
  assert len(leaves) == 6 and all(x.shape == (1, 1, 8) for x in leaves)


def test_pack_rejects_group_over_row_len():
  seqs = [_seq([1, 2], [3, 4]), _seq([5], [6, 7])]
  with pytest.raises(ValueError, match="group 0 holds 7 tokens, over row_len=6"):
    batching.pack(seqs, _adv(seqs), [[0, 1]], rows_per_mb=1, row_len=6)
  with pytest.raises(ValueError, match="one advantage per trajectory"):
    batching.pack(seqs, [0.0], [[0], [1]], rows_per_mb=1, row_len=6)


@_SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), rows_per_mb=st.integers(1, 3),
       budget=st.integers(14, 40))
def test_pack_round_trip(seed, n, rows_per_mb, budget):
  seqs = _random_seqs(seed, n)
  groups = batching.ffd_allocate([len(s) for s in seqs], budget)
  batch = batching.pack(seqs, _adv(seqs), groups, rows_per_mb=rows_per_mb, row_len=budget)
  num_rows = -(-len(groups) // rows_per_mb) * rows_per_mb
  assert batch.tokens.shape == (num_rows // rows_per_mb, rows_per_mb, budget)
  rows = _unpack_rows(batch)
  assert rows == [[_as_dict(seqs[i]) for i in g] for g in groups] + [[]] * (
      num_rows - len(groups))


# pack_dynamic and bucketed shapes.

def test_default_row_buckets():
  assert batching.default_row_buckets(1024) == (64, 128, 256, 512, 1024)
  assert batching.default_row_buckets(100) == (104,)  # 50 is under the smallest
  assert batching.default_row_buckets(100, smallest=16) == (32, 56, 104)  # 13 < 16
  assert batching.default_row_buckets(8) == (8,)
  assert batching.default_row_buckets(16384, smallest=4096) == (4096, 8192, 16384)
  # The longest sequence a run can produce adds its own row length (rounded to 8).
  assert batching.default_row_buckets(1024, longest=80) == (64, 80, 128, 256, 512, 1024)
  assert batching.default_row_buckets(1024, longest=77) == (64, 80, 128, 256, 512, 1024)
  assert batching.default_row_buckets(1024, longest=256) == (64, 128, 256, 512, 1024)
  assert batching.default_row_buckets(1024, longest=2000) == (64, 128, 256, 512, 1024)
  with pytest.raises(ValueError, match="longest"):
    batching.default_row_buckets(1024, longest=0)


def test_sequences_that_fill_the_longest_bucket_get_rows_of_their_own():
  # The GRPO workload: 64 sequences of 80 tokens. Without the 80 bucket they sit
  # three to a row of 256 (or one to a row of 128); with it, one per row, no padding.
  seqs = [_seq(range(3, 19), range(20, 84)) for _ in range(64)]
  kw = dict(max_tokens_per_mb=1024, num_shards=1)
  without = batching.pack_dynamic(seqs, np.zeros(64), **kw,
                                  row_buckets=batching.default_row_buckets(1024))
  assert without.tokens.shape[2] == 256
  batch = batching.pack_dynamic(seqs, np.zeros(64), **kw,
                                row_buckets=batching.default_row_buckets(1024, longest=80))
  # 64 rows, at most 12 to a micro-batch: 6 micro-batches of 11 rows (66 slots, not 72).
  assert batch.tokens.shape == (8, 11, 80)
  assert (batch.segment_ids <= 1).all() and int((batch.segment_ids > 0).sum()) == 64 * 80
  rows_M = (batch.segment_ids > 0).any(-1).sum(-1)
  np.testing.assert_array_equal(rows_M, [11, 11, 11, 11, 10, 10, 0, 0])


def test_row_counts_are_the_eighths_of_the_most():
  assert batching.row_counts(80, max_tokens_per_mb=1024, num_shards=1) == (2, 3, 5, 6, 8, 9,
                                                                           11, 12)
  assert batching.row_counts(80, max_tokens_per_mb=320, num_shards=1) == (1, 2, 3, 4)
  assert batching.row_counts(80, max_tokens_per_mb=320, num_shards=2) == (2, 4, 6, 8)
  assert batching.row_counts(512, max_tokens_per_mb=256, num_shards=4) == (4,)


def test_pack_dynamic_gives_each_part_as_many_real_micro_batches():
  # The train step shares the micro-batches out in num_parts equal parts (minibatches
  # x gradient threads), micro-batch k + parts * i to part k: with 64 rows of at most
  # 12, 3 parts get 2 each (6 x 11 rows), 4 parts 2 each (8 x 8 rows, no padding) and
  # 5 parts 2 each (10 x 8 rows: 7 would do, but R moves in eighths of 12).
  seqs = [_seq(range(3, 19), range(20, 84)) for _ in range(64)]
  kw = dict(max_tokens_per_mb=1024, num_shards=1, row_buckets=(80,))
  for parts, shape in ((3, (8, 11, 80)), (4, (8, 8, 80)), (5, (16, 8, 80))):
    batch = batching.pack_dynamic(seqs, np.zeros(64), **kw, num_parts=parts)
    assert batch.tokens.shape == shape
    real_M = (batch.segment_ids > 0).any((1, 2))
    padded = batching.pad_micro_batches(batch, parts)
    per_part = (padded.segment_ids > 0).any((1, 2)).reshape(-1, parts).sum(0)
    assert real_M.sum() % parts == 0 and len(set(per_part.tolist())) == 1, (parts, per_part)
  # Two rows for four parts: two micro-batches of a row each (R = 2, the least eighth
  # of 12), which the trainer pads to four.
  batch = batching.pack_dynamic(seqs[:2], np.zeros(2), **kw, num_parts=4)
  assert batch.tokens.shape == (2, 2, 80)
  np.testing.assert_array_equal((batch.segment_ids > 0).any(-1).sum(-1), [1, 1])
  with pytest.raises(ValueError, match="num_parts"):
    batching.pack_dynamic(seqs, np.zeros(64), **kw, num_parts=0)


def test_rows_per_mb():
  # Each of the shards holds max_tokens_per_mb // T rows, at least one.
  assert batching.rows_per_mb(256, max_tokens_per_mb=1024, num_shards=1) == 4
  assert batching.rows_per_mb(256, max_tokens_per_mb=1024, num_shards=2) == 8
  assert batching.rows_per_mb(104, max_tokens_per_mb=100, num_shards=8) == 8


def test_pack_dynamic_hand_case():
  seqs = [_seq([1] * 2, [2] * n) for n in (8, 7, 6, 3, 2)]  # lengths 10, 9, 8, 5, 4
  batch = batching.pack_dynamic(seqs, _adv(seqs), max_tokens_per_mb=16, num_shards=2,
                                row_buckets=(8, 16))
  # Only rows of 16 hold the 10-token sequence. FFD under 16: 10, 9, 8 open three
  # groups; 5 joins the first (all hold one, earliest wins); 4 fits only the second
  # and third and joins the second. R = 2 shards x 1 row; rows of 15, 13 and 8 tokens
  # make two micro-batches, dealt longest first in snake order.
  assert batching.ffd_allocate([len(s) for s in seqs], 16) == [[0, 3], [1, 4], [2]]
  assert batch.tokens.shape == (2, 2, 16)
  tokens_MR = (batch.segment_ids > 0).sum(-1)
  np.testing.assert_array_equal(tokens_MR, [[15, 0], [13, 8]])
  np.testing.assert_array_equal(batch.segment_ids[1, 0, 13:], [0, 0, 0])


def test_pack_dynamic_prefers_short_rows_at_equal_slots():
  seqs = [_seq([1] * 2, [2] * 6) for _ in range(4)]  # four of 8 tokens
  # Rows of 8, 16 or 32 all run one micro-batch of 32 slots; the shortest rows win.
  batch = batching.pack_dynamic(seqs, _adv(seqs), max_tokens_per_mb=32, num_shards=1,
                                row_buckets=(8, 16, 32))
  assert batch.tokens.shape == (1, 4, 8)


def test_pack_dynamic_weighs_attention_against_slots():
  seqs = [_seq([1] * 2, [2] * 7) for _ in range(6)]  # six of 9 tokens, budget 32
  kw = dict(max_tokens_per_mb=32, num_shards=1, row_buckets=(16, 32))
  # Rows of 16 hold one each: 6 rows, R = 2, 3 micro-batches, 96 slots. Rows of 32
  # hold three: 2 rows, R = 1, 2 micro-batches (padded to 2), 64 slots.
  shape = lambda **extra: batching.pack_dynamic(seqs, _adv(seqs), **kw, **extra).tokens.shape
  assert shape() == (2, 1, 32)
  # With attention_len 8 the costs are 96 (1 + 16/8) = 288 and 64 (1 + 32/8) = 320.
  assert shape(attention_len=8) == (4, 2, 16)
  # At 16 they tie (192 each) and the shorter rows win.
  assert shape(attention_len=16) == (4, 2, 16)


def test_pack_dynamic_pads_micro_batches_to_power_of_two():
  seqs = [_seq([1] * 4, [2] * 4) for _ in range(5)]  # 5 rows of 8 under budget 8
  batch = batching.pack_dynamic(seqs, _adv(seqs), max_tokens_per_mb=8, num_shards=1,
                                row_buckets=(8,))
  assert batch.tokens.shape == (8, 1, 8)
  assert batch.segment_ids[:5].all() and not batch.segment_ids[5:].any()
  assert not batch.loss_mask[5:].any()


def test_pack_dynamic_errors():
  seqs = [_seq([1] * 10, [2] * 20)]
  with pytest.raises(ValueError, match="no row bucket in \\(8, 16\\) holds a sequence of 30"):
    batching.pack_dynamic(seqs, _adv(seqs), max_tokens_per_mb=64, num_shards=1,
                          row_buckets=(16, 8))
  with pytest.raises(ValueError, match="num_shards"):
    batching.pack_dynamic(seqs, _adv(seqs), max_tokens_per_mb=64, num_shards=0,
                          row_buckets=(32,))


def _layout(seqs, row_len, budget, shards, parts):
  """(real micro-batches, R) for rows of `row_len`: the fewest micro-batches of at most
  `rows_per_mb` rows, a multiple of `parts`, and the fewest `row_counts` rows that hold
  the rows in them."""
  groups = batching.ffd_allocate([len(s) for s in seqs], row_len, min_groups=shards)
  most = batching.rows_per_mb(row_len, max_tokens_per_mb=budget, num_shards=shards)
  num_mb = -(-len(groups) // most)
  num_mb = min(-(-num_mb // parts) * parts, len(groups))
  counts = batching.row_counts(row_len, max_tokens_per_mb=budget, num_shards=shards)
  return num_mb, min(r for r in counts if r * num_mb >= len(groups))


def _cost(seqs, row_len, budget, shards, attention_len, parts=1):
  num_mb, R = _layout(seqs, row_len, budget, shards, parts)
  return num_mb * R * row_len * (1 + row_len / attention_len)


@_SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(0, 24), shards=st.integers(1, 4),
       attention_len=st.sampled_from([4.0, 40.0, float("inf")]), parts=st.integers(1, 3),
       budget=st.sampled_from([32, 96]))
def test_pack_dynamic_round_trip_and_layout(seed, n, shards, attention_len, parts, budget):
  buckets = (8, 16, 32)
  seqs = _random_seqs(seed, n, max_prompt=8, max_completion=24)
  batch = batching.pack_dynamic(seqs, _adv(seqs), max_tokens_per_mb=budget,
                                num_shards=shards, row_buckets=buckets,
                                attention_len=attention_len, num_parts=parts)
  M, R, T = batch.tokens.shape
  longest = max((len(s) for s in seqs), default=0)
  # T is the cheapest bucket that holds the longest sequence (ties: the shortest).
  fitting = [b for b in buckets if b >= longest]
  costs = {b: _cost(seqs, b, budget, shards, attention_len, parts) for b in fitting}
  assert T == min(fitting, key=lambda b: (costs[b], b))
  real_mb, expected_R = _layout(seqs, T, budget, shards, parts)
  assert R == expected_R <= batching.rows_per_mb(T, max_tokens_per_mb=budget,
                                                 num_shards=shards)
  assert R in batching.row_counts(T, max_tokens_per_mb=budget, num_shards=shards)
  groups = batching.ffd_allocate([len(s) for s in seqs], T, min_groups=shards)
  # Fewer rows per micro-batch would not hold them; fewer micro-batches would break
  # the budget or the parts.
  assert R * real_mb >= len(groups)
  assert real_mb % parts == 0 or real_mb == len(groups)  # a row each, too few for parts
  assert M & (M - 1) == 0 and real_mb <= M < 2 * real_mb
  row_tokens_MR = (batch.segment_ids > 0).sum(-1)
  assert row_tokens_MR.max() <= T
  rows = _unpack_rows(batch)
  key = lambda d: repr(sorted(d.items()))
  assert sorted(map(key, (d for row in rows for d in row))) == sorted(
      key(_as_dict(s)) for s in seqs)
  assert sum(1 for row in rows if row) == sum(1 for g in groups if g)
  mb_tokens_M = row_tokens_MR.sum(-1)
  # All-empty padding micro-batches come last; real ones are balanced to within
  # the longest row.
  assert not mb_tokens_M[real_mb:].any()
  if sum(1 for g in groups if g) >= real_mb:
    assert mb_tokens_M[:real_mb].all()
  assert mb_tokens_M[:real_mb].max() - mb_tokens_M[:real_mb].min() <= row_tokens_MR.max()


def test_pack_dynamic_reuses_a_compiled_shape_within_the_slack():
  # 64 rows of 80: cheapest 6 x 11 rows (66 slots). A compiled [8, 12, 80] holds them
  # in 6 x 12 (72 slots, 9% more); [4, 12, 80] does not hold them.
  seqs = [_seq(range(3, 19), range(20, 84)) for _ in range(64)]
  kw = dict(max_tokens_per_mb=1024, num_shards=1, row_buckets=(80, 128))
  shape = lambda **extra: batching.pack_dynamic(seqs, np.zeros(64), **kw, **extra).tokens.shape
  assert shape() == (8, 11, 80)
  assert shape(compiled={(8, 12, 80)}, reuse_slack=0.1) == (8, 12, 80)
  assert shape(compiled={(8, 12, 80)}, reuse_slack=0.05) == (8, 11, 80)
  assert shape(compiled={(4, 12, 80)}, reuse_slack=1.0) == (8, 11, 80)
  # More empty micro-batches cost nothing in the estimate; a compiled row count
  # `row_counts` would not pick (13 > the most, 12) is never taken.
  assert shape(compiled={(16, 11, 80), (8, 13, 80)}, reuse_slack=0.0) == (16, 11, 80)
  assert shape(compiled={(8, 13, 80)}, reuse_slack=1.0) == (8, 11, 80)
  # The cheapest of several that hold the batch, rows of another length included.
  assert shape(compiled={(8, 12, 80), (8, 8, 128)}, reuse_slack=1.0) == (8, 12, 80)
  batch = batching.pack_dynamic(seqs, np.zeros(64), **kw, compiled={(8, 12, 80)},
                                reuse_slack=0.1)
  np.testing.assert_array_equal((batch.segment_ids > 0).any(-1).sum(-1),
                                [11, 11, 11, 11, 10, 10, 0, 0])
  with pytest.raises(ValueError, match="reuse_slack"):
    shape(reuse_slack=-0.1)


@_SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(1, 24), shards=st.integers(1, 3),
       parts=st.integers(1, 3), slack=st.sampled_from([0.0, 0.1, 0.5]))
def test_pack_dynamic_reuse_keeps_every_token_and_bounds_the_cost(seed, n, shards, parts,
                                                                    slack):
  kw = dict(max_tokens_per_mb=96, num_shards=shards, row_buckets=(8, 16, 32),
            attention_len=40.0, num_parts=parts)
  earlier = [_random_seqs(seed + k, n + k, max_prompt=8, max_completion=24) for k in (1, 2)]
  compiled = {batching.pad_micro_batches(batching.pack_dynamic(s, _adv(s), **kw),
                                         parts).tokens.shape for s in earlier}
  seqs = _random_seqs(seed, n, max_prompt=8, max_completion=24)
  fresh = batching.pack_dynamic(seqs, _adv(seqs), **kw)
  batch = batching.pack_dynamic(seqs, _adv(seqs), **kw, compiled=compiled, reuse_slack=slack)
  M, R, T = batch.tokens.shape
  cheapest = min(_cost(seqs, b, 96, shards, 40.0, parts) for b in (8, 16, 32)
                 if b >= max(len(s) for s in seqs))
  groups = batching.ffd_allocate([len(s) for s in seqs], T, min_groups=shards)
  real_mb = int((batch.segment_ids > 0).any((1, 2)).sum())
  if (M, R, T) in compiled:
    assert real_mb * R * T * (1 + T / 40.0) <= cheapest * (1 + slack) + 1e-9
  else:
    assert batch.tokens.shape == fresh.tokens.shape
  assert R * M >= len(groups)
  key = lambda d: repr(sorted(d.items()))
  assert sorted(key(d) for row in _unpack_rows(batch) for d in row) == sorted(
      key(_as_dict(s)) for s in seqs)


def test_pack_dynamic_shapes_stay_in_bucket_set():
  rng = np.random.default_rng(0)
  budget, shards, max_n = 64, 2, 40
  buckets = batching.default_row_buckets(budget, smallest=8)
  max_m = 1 << (-(-max_n // shards) - 1).bit_length()
  allowed = {(1 << k, r, t) for k in range(max_m.bit_length()) for t in buckets
             for r in batching.row_counts(t, max_tokens_per_mb=budget, num_shards=shards)}
  shapes = set()
  for _ in range(300):
    n = int(rng.integers(1, max_n + 1))
    hi = int(rng.choice([8, 16, 32, budget]))
    totals = rng.integers(2, hi + 1, n)
    prompts = [int(rng.integers(1, t + 1)) for t in totals]
    seqs = [_seq([1] * p, [2] * (t - p)) for t, p in zip(totals, prompts)]
    batch = batching.pack_dynamic(seqs, _adv(seqs), max_tokens_per_mb=budget,
                                  num_shards=shards, row_buckets=buckets, attention_len=100.0)
    shapes.add(batch.tokens.shape)
    assert len({x.shape for x in jax.tree.leaves(batch)}) == 1
  assert shapes <= allowed
  assert len({t for _, _, t in shapes}) > 1


def test_versions_are_packed_only_when_asked_and_padding_keeps_them():
  a = _seq([11, 12], [13, 14], versions=[3, 4])
  b = _seq([21], [22], versions=[5])
  plain = batching.pack([a, b], [0.0, 0.0], [[0], [1]], rows_per_mb=1, row_len=4)
  assert plain.versions is None and len(jax.tree.leaves(plain)) == 6
  batch = batching.pack([a, b], [0.0, 0.0], [[0], [1]], rows_per_mb=1, row_len=4,
                        with_versions=True)
  np.testing.assert_array_equal(batch.versions[:, 0], [[-1, -1, 3, 4], [-1, 5, -1, -1]])
  padded = batching.pad_micro_batches(batch, 3)
  assert padded.tokens.shape == (3, 1, 4) and (padded.versions[2] == -1).all()
  assert not padded.loss_mask[2].any() and not padded.segment_ids[2].any()
  assert batching.pad_micro_batches(plain, 2) is plain
  assert batching.pad_micro_batches(plain, 4).versions is None


def test_pack_dynamic_carries_versions_at_the_row_length_it_picks():
  # Trajectory i's completion tokens all carry version i, so a packed version names
  # the trajectory its token came from.
  seqs = [_seq([1] * 2, [2] * 7, versions=[i] * 7) for i in range(6)]  # six of 9 tokens
  kw = dict(max_tokens_per_mb=32, num_shards=1, row_buckets=(16, 32), attention_len=8)
  plain = batching.pack_dynamic(seqs, _adv(seqs), **kw)
  batch = batching.pack_dynamic(seqs, _adv(seqs), **kw, with_versions=True)
  assert batch.tokens.shape == (4, 2, 16) and plain.versions is None  # rows of 16 won
  for name in ("tokens", "positions", "segment_ids", "loss_mask", "behav_logp", "advantages"):
    np.testing.assert_array_equal(getattr(batch, name), getattr(plain, name), err_msg=name)
  on = batch.loss_mask > 0
  assert (batch.versions[~on] == -1).all()
  np.testing.assert_array_equal(np.bincount(batch.versions[on]), [7] * 6)
  # A row of 16 holds one trajectory, so each row's tokens carry one version.
  rows_RT, on_RT = batch.versions.reshape(-1, 16), on.reshape(-1, 16)
  assert all(len(set(v[m])) <= 1 for v, m in zip(rows_RT, on_RT))
  padded = batching.pad_micro_batches(batch, 3)
  assert padded.versions.shape == (6, 2, 16) and (padded.versions[4:] == -1).all()
