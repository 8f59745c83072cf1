"""The engine's decode state and the pure device functions over it.

This is the functional core of `engine.Engine`, which jits these functions with its
shardings and donates the decode state. Shapes: S slots, T the cache length, P a
padded prompt length, B prompts prefilled together, N samples of one prompt.
"""

import jax
import jax.numpy as jnp
from flax import struct

from async_rl import models
from async_rl.generation import sampling as sampling_lib
from async_rl.generation.sampling import SlotSampling


@struct.dataclass
class Prefix:
  """A prefilled prompt, ready to be inserted into a slot.

  `cache` holds k and v of shape [L, 1, P, K, E] for the padded prompt; `logits_V`
  are the logits after the last real token (kept so more samples of the same
  prompt can be drawn by `insert_samples` without recomputing the prompt); `token` and
  `logp` are the first generated token, which sits at position `length`. `start` is
  the position of the sample's first generated token, its prompt length: `length`
  less the tokens of a re-prefilled sample that were generated before.
  """
  cache: dict
  logits_V: jax.Array
  length: jax.Array
  start: jax.Array
  token: jax.Array
  logp: jax.Array
  sampling: SlotSampling


@struct.dataclass
class DecodeState:
  """Everything one decode step transforms, for all S slots.

  `tokens_S` is each slot's last generated token, not yet fed to the model;
  `positions_S` its sequence position. The cache holds k and v of shape
  [L, S, T, K, E]. An idle slot sits at position T, where decoding writes nothing.
  `end_S` is one past the position of a slot's last allowed token (prompt length
  plus `max_new_tokens`, capped by T); `generate_chunk` advances only live slots
  (see `live`).
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


def draw(logits_V, length, sampling_N):
  """Draws N tokens at position `length` from the same logits, one per sampling row."""
  N, V = sampling_N.seed.shape[0], logits_V.shape[0]
  positions_N = jnp.full(N, length)
  tokens_N, logp_N = sampling_lib.sample(jnp.broadcast_to(logits_V, (N, V)), sampling_N,
                                         positions_N)
  return ResultTokens(tokens_N, logp_N, positions_N)


def prefill_rows(params, tokens_BP, lengths_B, generated_B, sampling_B, *, cfg):
  """Prefills B prompts in one forward; returns their B Prefixes and first tokens."""
  B = tokens_BP.shape[0]
  logits_BPV, cache = models.prefill(params, cfg, tokens_BP, lengths_B)
  logits_BV = logits_BPV[jnp.arange(B), lengths_B - 1]
  tokens_B, logp_B = sampling_lib.sample(logits_BV, sampling_B, lengths_B)
  prefixes = [Prefix(cache=jax.tree.map(lambda c: c[:, b:b + 1], cache), logits_V=logits_BV[b],
                     length=lengths_B[b], start=lengths_B[b] - generated_B[b], token=tokens_B[b],
                     logp=logp_B[b], sampling=jax.tree.map(lambda x: x[b], sampling_B))
              for b in range(B)]
  return prefixes, ResultTokens(tokens_B, logp_B, lengths_B)


def prefill(params, tokens_P, length, generated, sampling, *, cfg):
  """`prefill_rows` of one prompt; returns its Prefix and first token."""
  (prefix,), result = prefill_rows(params, tokens_P[None], length[None], generated[None],
                                   jax.tree.map(lambda x: x[None], sampling), cfg=cfg)
  return prefix, result


def insert(prefix, state, slot):
  """Puts `prefix`, its first token and its sampling into `slot`."""
  cache = jax.tree.map(
      lambda c, p: jax.lax.dynamic_update_slice(c, p.astype(c.dtype), (0, slot, 0, 0, 0)),
      state.cache, prefix.cache)
  sampling_S = jax.tree.map(lambda a, x: a.at[slot].set(x), state.sampling_S, prefix.sampling)
  end = jnp.minimum(prefix.start + prefix.sampling.max_new_tokens, state.cache["k"].shape[2])
  return DecodeState(cache=cache, tokens_S=state.tokens_S.at[slot].set(prefix.token),
                     positions_S=state.positions_S.at[slot].set(prefix.length),
                     sampling_S=sampling_S, end_S=state.end_S.at[slot].set(end))


def insert_samples(prefix, state, slots_S, tokens_S, sampling_S, count):
  """`insert` of the first `count` rows: sample i, with first token `tokens_S[i]`
  drawn under `sampling_S[i]`, goes to slot `slots_S[i]`. Only `count` copies of the
  prompt's cache are written, however many slots there are."""

  def insert_one(i, state):
    sampling = jax.tree.map(lambda x: x[i], sampling_S)
    return insert(prefix.replace(token=tokens_S[i], sampling=sampling), state, slots_S[i])

  return jax.lax.fori_loop(0, count, insert_one, state)


def live(state: DecodeState) -> jax.Array:
  """Bool [S]: the slots whose sample goes on, i.e. whose last token is not a stop id
  and is not at the last allowed position. Idle slots (position T) are not live."""
  stopped_S = jnp.any(state.tokens_S[:, None] == state.sampling_S.stop_ids, axis=1)
  return (state.positions_S + 1 < state.end_S) & ~stopped_S


def generate(params, state, *, cfg):
  """One decode step of every slot, as JetStream's `generate`: no slot stops."""
  logits_SV, cache = models.decode(params, cfg, state.cache, state.tokens_S, state.positions_S)
  # Idle slots stay parked at position T (past the cache end) instead of counting up.
  positions_S = jnp.minimum(state.positions_S + 1, state.cache["k"].shape[2])
  tokens_S, logp_S = sampling_lib.sample(logits_SV, state.sampling_S, positions_S)
  new_state = state.replace(cache=cache, tokens_S=tokens_S, positions_S=positions_S)
  return new_state, ResultTokens(tokens_S, logp_S, positions_S)


def generate_chunk(params, state, *, cfg, steps):
  """Up to `steps` decode steps of the live slots in one `while_loop`.

  A slot stops for good at a stop id, at its token budget or at the cache end, and
  the loop exits early once no slot is live. Keys depend only on (seed, sample
  index, position), so the tokens do not depend on `steps`.
  """
  S, T = state.tokens_S.shape[0], state.cache["k"].shape[2]

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
