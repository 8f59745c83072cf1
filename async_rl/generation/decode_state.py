"""The engine's decode state and the pure device functions over it.

This is the functional core of `engine.Engine`, which jits these functions with its
shardings and donates the decode state. Shapes: S slots, T the cache length, P a
padded prompt length, B prompts prefilled together.
"""

import jax
import jax.numpy as jnp
from flax import struct

from async_rl import models
from async_rl.generation import sampling as sampling_lib
from async_rl.generation.sampling import SlotSampling


@struct.dataclass
class Prefix:
  """B prefilled prompts, ready to be inserted into slots.

  `cache` holds k and v, L arrays [B, K, P, E] each, for the padded prompts; `logits_BV`
  are the logits after each prompt's last real token (kept so more samples of a
  prompt can be drawn by `insert_samples` without recomputing it); `tokens_B` and
  `logp_B` are each prompt's first generated token, drawn with `sampling_B`, which
  sits at position `lengths_B`. `starts_B` is the position of a sample's first
  generated token, its prompt length: the length less the tokens that a re-prefilled
  sample generated before.
  """
  cache: dict
  logits_BV: jax.Array
  lengths_B: jax.Array
  starts_B: jax.Array
  tokens_B: jax.Array
  logp_B: jax.Array
  sampling_B: SlotSampling


@struct.dataclass
class DecodeState:
  """Everything one decode step transforms, for all S slots.

  `tokens_S` is each slot's last generated token, not yet fed to the model;
  `positions_S` its sequence position. The cache holds k and v, L arrays [S, K, T, E]
  each (`models.init_cache`). An idle slot sits at position T, where
  decoding writes nothing. `end_S` is one past the position of a slot's last allowed
  token (prompt length plus `max_new_tokens`, capped by T); `generate_chunk` advances
  only live slots (see `live`).
  """
  cache: dict
  tokens_S: jax.Array
  positions_S: jax.Array
  sampling_S: SlotSampling
  end_S: jax.Array


@struct.dataclass
class ResultTokens:
  """Tokens emitted by one prefill (S = 1), one `insert_samples` (row i for its sample
  i) or one decode step, with their log-probs and the sequence positions they occupy."""
  tokens_S: jax.Array
  logp_S: jax.Array
  positions_S: jax.Array


@struct.dataclass
class ChunkTokens:
  """Tokens emitted by one `generate_chunk` call, T = `steps_per_call` per slot.

  Slot s emitted `tokens_ST[s, :count_S[s]]` (a slot stops for good within a chunk,
  so what it emits is a prefix of the steps); `steps` is how many steps the loop
  ran, at most T.
  """
  tokens_ST: jax.Array
  logp_ST: jax.Array
  count_S: jax.Array
  steps: jax.Array


def prefill(params, tokens_BP, lengths_B, generated_B, sampling_B, *, cfg):
  """Prefills B prompts in one forward; returns their Prefix and first tokens."""
  B = tokens_BP.shape[0]
  logits_BPV, cache = models.prefill(params, cfg, tokens_BP, lengths_B)
  logits_BV = logits_BPV[jnp.arange(B), lengths_B - 1]
  tokens_B, logp_B = sampling_lib.sample(logits_BV, sampling_B, lengths_B)
  prefix = Prefix(cache=cache, logits_BV=logits_BV, lengths_B=lengths_B,
                  starts_B=lengths_B - generated_B, tokens_B=tokens_B, logp_B=logp_B,
                  sampling_B=sampling_B)
  return prefix, ResultTokens(tokens_B, logp_B, lengths_B)


def _insert_row(prefix, row, token, sampling, state, slot):
  """Puts prompt `row` of `prefix` into `slot`, with first token `token`."""
  def put(c, p):
    p_row = jax.lax.dynamic_slice_in_dim(p, row, 1, axis=0)
    return jax.lax.dynamic_update_slice(c, p_row.astype(c.dtype), (slot, 0, 0, 0))

  T = models.cache_len(state.cache)
  end = jnp.minimum(prefix.starts_B[row] + sampling.max_new_tokens, T)
  sampling_S = jax.tree.map(lambda a, x: a.at[slot].set(x), state.sampling_S, sampling)
  return DecodeState(cache=jax.tree.map(put, state.cache, prefix.cache),
                     tokens_S=state.tokens_S.at[slot].set(token),
                     positions_S=state.positions_S.at[slot].set(prefix.lengths_B[row]),
                     sampling_S=sampling_S, end_S=state.end_S.at[slot].set(end))


def insert(prefix, state, slot):
  """Puts the first prompt of `prefix`, with its own first token, into `slot`."""
  return _insert_row(prefix, 0, prefix.tokens_B[0],
                     jax.tree.map(lambda x: x[0], prefix.sampling_B), state, slot)


def draw(logits_BV, lengths_B, rows_S, sampling_S):
  """First tokens of new samples: row i is drawn from prompt `rows_S[i]`'s logits with
  `sampling_S[i]`, at the position after that prompt."""
  positions_S = lengths_B[rows_S]
  tokens_S, logp_S = sampling_lib.sample(logits_BV[rows_S], sampling_S, positions_S)
  return ResultTokens(tokens_S, logp_S, positions_S)


def insert_samples(prefix, state, rows_S, slots_S, tokens_S, sampling_S, count):
  """Inserts `count` samples: sample i, of prompt `rows_S[i]`, with first token
  `tokens_S[i]` drawn under `sampling_S[i]`, goes to slot `slots_S[i]`. Only `count`
  copies of a prompt's cache are written, however many slots there are."""

  def insert_one(i, state):
    sampling = jax.tree.map(lambda x: x[i], sampling_S)
    return _insert_row(prefix, rows_S[i], tokens_S[i], sampling, state, slots_S[i])

  return jax.lax.fori_loop(0, count, insert_one, state)


def extend(params, state, tokens_P, count, slot, start, sampling, *, cfg):
  """Continues a held sample in `slot`: feeds the first `count` tokens of `tokens_P`
  through the decode step at positions `start ..` (attending to the slot's cached
  keys and values, writing their own), then draws the slot's next token with
  `sampling` at position `start + count`, as `prefill` would for the whole sequence.

  Only the slot's rows of the cache are computed on; the tokens are fed one by one
  because the decode step is the path that wrote the rest of the cache.
  """
  T = models.cache_len(state.cache)
  cache_1 = jax.tree.map(lambda c: jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=0), state.cache)

  def feed(i, carry):
    cache_1, _ = carry
    logits_1V, cache_1 = models.decode(params, cfg, cache_1, tokens_P[i][None],
                                       (start + i)[None])
    return cache_1, logits_1V

  cache_1, logits_1V = jax.lax.fori_loop(
      0, count, feed, (cache_1, jnp.zeros((1, cfg.vocab_size), jnp.float32)))
  position = start + count
  tokens_1, logp_1 = sampling_lib.sample(logits_1V, jax.tree.map(lambda x: x[None], sampling),
                                         position[None])
  sampling_S = jax.tree.map(lambda a, x: a.at[slot].set(x), state.sampling_S, sampling)
  cache = jax.tree.map(
      lambda c, c1: jax.lax.dynamic_update_slice(c, c1.astype(c.dtype), (slot, 0, 0, 0)),
      state.cache, cache_1)
  new_state = DecodeState(
      cache=cache, tokens_S=state.tokens_S.at[slot].set(tokens_1[0]),
      positions_S=state.positions_S.at[slot].set(position), sampling_S=sampling_S,
      end_S=state.end_S.at[slot].set(jnp.minimum(position + sampling.max_new_tokens, T)))
  return new_state, ResultTokens(tokens_1, logp_1, position[None])


def live(state: DecodeState) -> jax.Array:
  """Bool [S]: the slots whose sample goes on, i.e. whose last token is not a stop id
  and is not at the last allowed position. Idle slots (position T) are not live."""
  stopped_S = jnp.any(state.tokens_S[:, None] == state.sampling_S.stop_ids, axis=1)
  return (state.positions_S + 1 < state.end_S) & ~stopped_S


def generate(params, state, *, cfg):
  """One decode step of every slot, as JetStream's `generate`: no slot stops."""
  logits_SV, cache = models.decode(params, cfg, state.cache, state.tokens_S, state.positions_S)
  # Idle slots stay parked at position T (past the cache end) instead of counting up.
  positions_S = jnp.minimum(state.positions_S + 1, models.cache_len(state.cache))
  tokens_S, logp_S = sampling_lib.sample(logits_SV, state.sampling_S, positions_S)
  new_state = state.replace(cache=cache, tokens_S=tokens_S, positions_S=positions_S)
  return new_state, ResultTokens(tokens_S, logp_S, positions_S)


def generate_chunk(params, state, *, cfg, steps):
  """Up to `steps` decode steps of the live slots in one `while_loop`.

  A slot stops for good at a stop id, at its token budget or at the cache end, and
  the loop exits early once no slot is live. Keys depend only on (seed, sample
  index, position), so the tokens do not depend on `steps`.
  """
  S, T = state.tokens_S.shape[0], models.cache_len(state.cache)

  def cond(carry):
    step, state, _ = carry
    return (step < steps) & jnp.any(live(state))

  def body(carry):
    step, state, (tokens_TS, logp_TS) = carry
    live_S = live(state)
    # A stopped slot writes nowhere and keeps its token and position, so it stays
    # stopped until `insert` gives the slot a new sample.
    write_S = jnp.where(live_S, state.positions_S, T)
    logits_SV, cache = models.decode(params, cfg, state.cache, state.tokens_S, write_S)
    positions_S = jnp.where(live_S, state.positions_S + 1, state.positions_S)
    tokens_S, logp_S = sampling_lib.sample(logits_SV, state.sampling_S, positions_S)
    state = state.replace(cache=cache, tokens_S=jnp.where(live_S, tokens_S, state.tokens_S),
                          positions_S=positions_S)
    return step + 1, state, (tokens_TS.at[step].set(tokens_S), logp_TS.at[step].set(logp_S))

  start_S = state.positions_S
  out = (jnp.zeros((steps, S), jnp.int32), jnp.zeros((steps, S), jnp.float32))
  ran, state, (tokens_TS, logp_TS) = jax.lax.while_loop(cond, body, (0, state, out))
  return state, ChunkTokens(tokens_ST=tokens_TS.T, logp_ST=logp_TS.T,
                            count_S=state.positions_S - start_S, steps=ran)


def init_decode_state(*, cfg, num_slots, max_len):
  """An empty cache with every slot idle."""
  return DecodeState(cache=models.init_cache(cfg, num_slots, max_len),
                     tokens_S=jnp.zeros(num_slots, jnp.int32),
                     positions_S=jnp.full(num_slots, max_len, jnp.int32),
                     sampling_S=jax.tree.map(jnp.asarray, SlotSampling.zeros(num_slots)),
                     end_S=jnp.zeros(num_slots, jnp.int32))
