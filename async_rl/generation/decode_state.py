"""The engine's decode state and the pure device functions over it.

This is the functional core of `engine.Engine`, which jits these functions with its
shardings and donates the decode state. Shapes: S slots, P a padded prompt length, B
prompts prefilled together, M block-table columns, Z tokens per block; `max_len` is the
longest sequence a slot may hold (at most M Z).
"""

import jax
import jax.numpy as jnp
from flax import struct

from async_rl import models
from async_rl.generation import paged, sampling as sampling_lib
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
  `positions_S` its sequence position. The cache is a `paged.PagedCache`: L pools of
  blocks for k and v, and each slot's block table, which the host sets (`insert`,
  `extend`, `generate_chunk`). An idle slot sits at position M Z, past every table,
  where decoding writes nothing. `end_S` is one past the position of a slot's last
  allowed token (prompt length plus `max_new_tokens`, capped by the longest sequence);
  `generate_chunk` advances only live slots (see `live`).
  """
  cache: paged.PagedCache
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


def prefill(params, tokens_BP, lengths_B, generated_B, sampling_B, *, cfg, kernels):
  """Prefills B prompts in one forward, its attention by `kernels`
  (`models.attention.KERNELS`); returns their Prefix and first tokens.

  Its temporaries grow linearly in P (`models.prefill`), so a sequence of the longest
  length can be prefilled again (a preempted or retracted sample).
  """
  logits_BV, cache = models.prefill(params, cfg, tokens_BP, lengths_B, kernels=kernels)
  tokens_B, logp_B = sampling_lib.sample(logits_BV, sampling_B, lengths_B)
  prefix = Prefix(cache=cache, logits_BV=logits_BV, lengths_B=lengths_B,
                  starts_B=lengths_B - generated_B, tokens_B=tokens_B, logp_B=logp_B,
                  sampling_B=sampling_B)
  return prefix, ResultTokens(tokens_B, logp_B, lengths_B)


def _past_tables(cache: paged.PagedCache) -> int:
  """M Z: the first position no block table reaches, where idle slots sit."""
  return cache.tables_SM.shape[1] * cache.block_size


def _insert_row(prefix, row, token, sampling, state, slot, table_M, shared, max_len):
  """Puts prompt `row` of `prefix` into `slot`, whose blocks `table_M` lists (the first
  `shared` of them written already), with first token `token`."""
  end = jnp.minimum(prefix.starts_B[row] + sampling.max_new_tokens, max_len)
  sampling_S = jax.tree.map(lambda a, x: a.at[slot].set(x), state.sampling_S, sampling)
  return DecodeState(cache=paged.insert(state.cache, prefix.cache, row, slot, table_M, shared),
                     tokens_S=state.tokens_S.at[slot].set(token),
                     positions_S=state.positions_S.at[slot].set(prefix.lengths_B[row]),
                     sampling_S=sampling_S, end_S=state.end_S.at[slot].set(end))


def insert(prefix, state, slot, table_M, *, max_len):
  """Puts the first prompt of `prefix`, with its own first token, into `slot`, whose
  blocks `table_M` lists."""
  return _insert_row(prefix, 0, prefix.tokens_B[0],
                     jax.tree.map(lambda x: x[0], prefix.sampling_B), state, slot, table_M, 0,
                     max_len)


def draw(logits_BV, lengths_B, rows_S, sampling_S):
  """First tokens of new samples: row i is drawn from prompt `rows_S[i]`'s logits with
  `sampling_S[i]`, at the position after that prompt."""
  positions_S = lengths_B[rows_S]
  tokens_S, logp_S = sampling_lib.sample(logits_BV[rows_S], sampling_S, positions_S)
  return ResultTokens(tokens_S, logp_S, positions_S)


def insert_samples(prefix, state, rows_S, slots_S, tokens_S, sampling_S, tables_SM, shared_S,
                   count, *, max_len):
  """Inserts `count` samples: sample i, of prompt `rows_S[i]`, with first token
  `tokens_S[i]` drawn under `sampling_S[i]`, goes to slot `slots_S[i]`, whose blocks
  `tables_SM[i]` lists. Its first `shared_S[i]` blocks are a prompt's full blocks that
  an earlier sample wrote, so only the rest of the prompt is written again."""

  def insert_one(i, state):
    sampling = jax.tree.map(lambda x: x[i], sampling_S)
    return _insert_row(prefix, rows_S[i], tokens_S[i], sampling, state, slots_S[i],
                       tables_SM[i], shared_S[i], max_len)

  return jax.lax.fori_loop(0, count, insert_one, state)


def extend(params, state, tokens_P, count, slot, start, sampling, table_M, *, cfg, max_len,
           decoding):
  """Continues a held sample in `slot`, whose blocks `table_M` now lists: feeds the first
  `count` tokens of `tokens_P` through the decode step at positions `start ..`
  (attending to the slot's cached keys and values, writing their own), then draws the
  slot's next token with `sampling` at position `start + count`, as `prefill` would for
  the whole sequence.

  Only the slot's blocks are computed on; the tokens are fed one by one because the
  decode step (read as `decoding`, a `paged.Decoding`) is the path that wrote the rest
  of the cache.
  """
  tables_SM = state.cache.tables_SM.at[slot].set(table_M)
  one = state.cache.replace(tables_SM=table_M[None])

  def feed(i, carry):
    one, _ = carry
    logits_1V, one = paged.decode(params, cfg, one, tokens_P[i][None], (start + i)[None],
                                  reads=paged.Reads("columns", table_M.shape[0]),
                                  decoding=decoding)
    return one, logits_1V

  one, logits_1V = jax.lax.fori_loop(
      0, count, feed, (one, jnp.zeros((1, cfg.vocab_size), jnp.float32)))
  position = start + count
  tokens_1, logp_1 = sampling_lib.sample(logits_1V, jax.tree.map(lambda x: x[None], sampling),
                                         position[None])
  sampling_S = jax.tree.map(lambda a, x: a.at[slot].set(x), state.sampling_S, sampling)
  new_state = DecodeState(
      cache=one.replace(tables_SM=tables_SM), tokens_S=state.tokens_S.at[slot].set(tokens_1[0]),
      positions_S=state.positions_S.at[slot].set(position), sampling_S=sampling_S,
      end_S=state.end_S.at[slot].set(jnp.minimum(position + sampling.max_new_tokens, max_len)))
  return new_state, ResultTokens(tokens_1, logp_1, position[None])


def live(state: DecodeState, num_blocks: int) -> jax.Array:
  """Bool [S]: the slots whose sample goes on, i.e. that hold a block of the pool of
  `num_blocks`, whose last token is not a stop id and is not at the last allowed
  position. Idle slots are not live, nor are slots the host took every block from (a
  finished or preempted sample)."""
  stopped_S = jnp.any(state.tokens_S[:, None] == state.sampling_S.stop_ids, axis=1)
  has_blocks_S = state.cache.tables_SM[:, 0] < num_blocks
  return (state.positions_S + 1 < state.end_S) & ~stopped_S & has_blocks_S


def generate(params, state, *, cfg, decoding):
  """One decode step of every slot, as JetStream's `generate`: no slot stops; attention
  reads every column of every table, as `decoding` (a `paged.Decoding`) reads them."""
  reads = paged.Reads("columns", state.cache.tables_SM.shape[1])
  logits_SV, cache = paged.decode(params, cfg, state.cache, state.tokens_S, state.positions_S,
                                  reads=reads, decoding=decoding)
  # Idle slots stay parked past the tables instead of counting up.
  positions_S = jnp.minimum(state.positions_S + 1, _past_tables(state.cache))
  tokens_S, logp_S = sampling_lib.sample(logits_SV, state.sampling_S, positions_S)
  new_state = state.replace(cache=cache, tokens_S=tokens_S, positions_S=positions_S)
  return new_state, ResultTokens(tokens_S, logp_S, positions_S)


def generate_chunk(params, state, tables_SM, *, cfg, steps, reads, decoding):
  """Up to `steps` decode steps of the live slots in one `while_loop`, with the block
  tables `tables_SM`.

  `reads`, what attention reads (static), must hold the tables (`decoding.reads`,
  `decoding` the engine's `paged.Decoding`). A slot stops for good at a stop id or at
  its token budget, and the loop exits early once no slot is live. Keys depend only on
  (seed, sample index, position), so the tokens do not depend on `steps` or `reads`.
  """
  cache = state.cache.replace(tables_SM=tables_SM)
  kv, decode, finish = decoding.decoder(params, cfg, cache, reads)
  # The loop carries the cache as `kv` only, so that its buffers have one holder and
  # are updated in place.
  state = state.replace(cache=cache.replace(k=None, v=None))
  S, N, nowhere = state.tokens_S.shape[0], cache.num_blocks, _past_tables(cache)

  def cond(carry):
    step, state, _, _ = carry
    return (step < steps) & jnp.any(live(state, N))

  def body(carry):
    step, state, kv, (tokens_TS, logp_TS) = carry
    live_S = live(state, N)
    # A stopped slot writes nowhere and keeps its token and position, so it stays
    # stopped until `insert` gives the slot a new sample.
    write_S = jnp.where(live_S, state.positions_S, nowhere)
    logits_SV, kv = decode(kv, state.tokens_S, write_S)
    positions_S = jnp.where(live_S, state.positions_S + 1, state.positions_S)
    tokens_S, logp_S = sampling_lib.sample(logits_SV, state.sampling_S, positions_S)
    state = state.replace(tokens_S=jnp.where(live_S, tokens_S, state.tokens_S),
                          positions_S=positions_S)
    return step + 1, state, kv, (tokens_TS.at[step].set(tokens_S), logp_TS.at[step].set(logp_S))

  start_S = state.positions_S
  out = (jnp.zeros((steps, S), jnp.int32), jnp.zeros((steps, S), jnp.float32))
  ran, state, kv, (tokens_TS, logp_TS) = jax.lax.while_loop(cond, body, (0, state, kv, out))
  count_S = state.positions_S - start_S
  return state.replace(cache=finish(kv, start_S, count_S, steps)), ChunkTokens(
      tokens_ST=tokens_TS.T, logp_ST=logp_TS.T, count_S=count_S, steps=ran)


def init_decode_state(*, cfg, num_slots, num_blocks, block_size, max_blocks):
  """An empty pool of `num_blocks` blocks, every table empty and every slot idle."""
  cache = paged.init_cache(cfg, num_slots=num_slots, num_blocks=num_blocks,
                           block_size=block_size, max_blocks=max_blocks)
  return DecodeState(cache=cache, tokens_S=jnp.zeros(num_slots, jnp.int32),
                     positions_S=jnp.full(num_slots, _past_tables(cache), jnp.int32),
                     sampling_S=jax.tree.map(jnp.asarray, SlotSampling.zeros(num_slots)),
                     end_S=jnp.zeros(num_slots, jnp.int32))
