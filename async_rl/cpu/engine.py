"""An engine whose slots split into groups, each decoded from its own thread.

One `Engine` of S / W slots serves W slot groups, each with its own decode state (W
the decode threads) and so its own pool of KV blocks (the engine's `kv_blocks` each);
slot s of the S the pool sees is slot s // W of group s % W, so a pool filling its
lowest free slots first spreads its samples evenly over the groups. A decode chunk dispatches each group's call from its
own thread, so the W programs run at once, one per core; every other call touches one
group. The tokens are those of one engine over S slots: a draw's key depends only on
(seed, sample index, position).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from async_rl.cpu.threads import Dispatchers
from async_rl.generation.decode_state import ChunkTokens, ResultTokens
from async_rl.generation.engine import Engine
from async_rl.generation.sampling import SamplingParams, SlotSampling

MIN_GROUP_SLOTS = 8  # The fewest slots `num_groups` gives a group.


def num_groups(num_slots: int, threads: int) -> int:
  """W for `threads` decode threads: the most groups, at most one per thread, that split
  `num_slots` evenly into groups of at least `MIN_GROUP_SLOTS`; 1 if none does."""
  return max([g for g in range(1, threads + 1)
              if num_slots % g == 0 and num_slots // g >= MIN_GROUP_SLOTS] or [1])


def _interleave(results):
  """The groups' per-slot results as one over all S slots: group g's row l is slot
  l W + g. A chunk's `steps` is the most any group ran (so the pool's wasted slot-steps
  count, for a group whose slots all stopped earlier, the steps it did not run)."""
  def join(*x):
    stacked = jnp.stack(x, axis=1)
    return stacked.reshape(-1, *stacked.shape[2:])

  if isinstance(results[0], ChunkTokens):
    joined = jax.tree.map(join, *(r.replace(steps=r.steps[None]) for r in results))
    return joined.replace(steps=joined.steps.max())
  return jax.tree.map(join, *results)


def _rows(results, index_N):
  """Rows `index_N` of the groups' `insert_samples` results laid end to end."""
  return jax.tree.map(lambda *x: jnp.concatenate(x)[index_N], *results)


class SlotGroupEngine:
  """`engine` (of S / W slots) serving S = W x its slots, in W decode states.

  Presents the `Engine` interface the generator pool uses; its decode state is a tuple
  of the W groups' states.
  """

  def __init__(self, engine: Engine, groups: int):
    self._engine, self._groups = engine, groups
    self._dispatchers = Dispatchers(groups, "decode-group")
    self._interleave = jax.jit(_interleave)
    self._rows = jax.jit(_rows)

  def __getattr__(self, name):  # cfg, buckets, lengths, load_params, prefill, ...
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self._engine, name)

  @property
  def max_concurrent_decodes(self) -> int:
    return self._groups * self._engine.max_concurrent_decodes

  @property
  def num_pools(self) -> int:
    """One block pool per group."""
    return self._groups

  def pool_of(self, slot: int) -> int:
    return self._locate(slot)[0]

  @property
  def kv_cache_bytes(self) -> int:
    return self._groups * self._engine.kv_cache_bytes

  def _locate(self, slot: int) -> tuple[int, int]:
    return slot % self._groups, slot // self._groups

  def init_decode_state(self):
    return tuple(self._engine.init_decode_state() for _ in range(self._groups))

  def insert(self, prefix, decode_state, slot: int, blocks):
    g, local = self._locate(slot)
    return _replace(decode_state, g, self._engine.insert(prefix, decode_state[g], local, blocks))

  def insert_samples(self, prefix, decode_state, rows: Sequence[int], slots: Sequence[int],
                     samplings, blocks, shared):
    """As `Engine.insert_samples`, the samples of each group inserted in one call."""
    by_group: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
      by_group.setdefault(slot % self._groups, []).append(i)
    results, index_N = [], np.zeros(self.max_concurrent_decodes, np.int32)
    rows_per_result = self._engine.max_concurrent_decodes
    for g, members in by_group.items():
      state, first = self._engine.insert_samples(
          prefix, decode_state[g], [rows[i] for i in members],
          [slots[i] // self._groups for i in members], [samplings[i] for i in members],
          [blocks[i] for i in members], [shared[i] for i in members])
      decode_state = _replace(decode_state, g, state)
      for j, i in enumerate(members):
        index_N[i] = len(results) * rows_per_result + j
      results.append(first)
    # Pad to W results, so that the gather compiles once.
    results += [results[0]] * (self._groups - len(results))
    return decode_state, self._rows(tuple(results), index_N)

  def extend(self, params, decode_state, slot: int, tokens, start: int, sampling, blocks):
    g, local = self._locate(slot)
    state, result = self._engine.extend(params, decode_state[g], local, tokens, start, sampling,
                                        blocks)
    return _replace(decode_state, g, state), result

  def generate(self, params, decode_state) -> tuple[tuple, ResultTokens]:
    return self._each_group(self._engine.generate, [(params, s) for s in decode_state])

  def generate_chunk(self, params, decode_state, tables_SM) -> tuple[tuple, ChunkTokens]:
    """As `Engine.generate_chunk`; group g decodes with the rows of its slots (g, g + W,
    ...), reading as many table columns as its own longest slot needs."""
    return self._each_group(self._engine.generate_chunk,
                            [(params, s, tables_SM[g::self._groups])
                             for g, s in enumerate(decode_state)])

  def _each_group(self, fn, args):
    states, results = zip(*self._dispatchers.map(fn, args))
    return states, self._interleave(results)

  def warmup(self, params) -> None:
    """The engine's warmup, and the calls that join the groups' results."""
    self._engine.warmup(params)
    params = self._engine.load_params(params)
    state = self.init_decode_state()
    prefix, _ = self._engine.prefill(
        params=params, padded_tokens=np.zeros(self._engine.prefill_buckets[0], np.int32),
        true_length=1, sampling=_any_sampling())
    state, first = self.insert_samples(prefix, state, [0], [0], [_any_sampling()], [[0]], [0])
    state, result = self.generate(params, state)
    tables_SM = np.full((self.max_concurrent_decodes, self.max_blocks), self.num_blocks,
                        np.int32)
    tables_SM[0, 0] = 0
    state, chunk = self.generate_chunk(params, state, tables_SM)
    jax.block_until_ready((first, result, chunk))


def _any_sampling():
  return SlotSampling.create(SamplingParams(), seed=0, index=0)


def _replace(states: tuple, g: int, state) -> tuple:
  return states[:g] + (state,) + states[g + 1:]
