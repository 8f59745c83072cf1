"""Our generation engine as a real `jetstream` Engine, and serving a policy with JetStream.

Optional extra: this module imports google-jetstream (0.2.2), which pulls TensorFlow
through seqio (about 1 GB and seconds per process), so nothing else in `async_rl`
imports it.

`JetStreamEngine` subclasses `jetstream.engine.engine_api.Engine` around our
`Engine`, so JetStream's own orchestrator (`Driver`, `LLMOrchestrator`) can serve a
trained policy (`rl.export.serve_checkpoint` does that for a training checkpoint).

The first generated token. Our engine samples it in `prefill`. JetStream 0.2.2's
Driver hands whatever `prefill` returns to `insert` and streams only the tokens that
`generate` returns (its mock engine: "we don't provide a token from prefill"). So
`prefill` returns our `Prefix` (which holds that token), and each `generate` step
emits, per slot, the token pending in the decode state, the one the step feeds to the
model, before sampling the next. The first step after `insert` thus emits the prefill
token, every token is emitted once and in order, and a greedy stream equals our
pool's. A step's newly sampled token is emitted by the next step; once the Driver
finishes a slot it never reads it. A token is valid while it fits in the cache.
(Later JetStream releases have `prefill` return (Prefix, ResultTokens) and stream
that token themselves; this adapter follows the pinned 0.2.2.)

Compatibility shims, both applied on import:
- google-jetstream 0.2.2 calls `jax.tree_map`, which current JAX removed; it is set
  to `jax.tree.map` if missing.
- jetstream's orchestrator sets the root logger to DEBUG and adds a stdout handler
  on import (then logs every decode step); the host program's logging is restored.
"""

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

if not hasattr(jax, "tree_map"):
  jax.tree_map = jax.tree.map

_root_logger = logging.getLogger()
_root_level, _root_handlers = _root_logger.level, list(_root_logger.handlers)
from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

_root_logger.setLevel(_root_level)
for _handler in set(_root_logger.handlers) - set(_root_handlers):
  _root_logger.removeHandler(_handler)

from async_rl.generation import engine as engine_lib  # noqa: E402
from async_rl.generation.sampling import SamplingParams, SlotSampling  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
_TOKENIZER_PATH = "async_rl"  # build_tokenizer gives the engine's own tokenizer
# JetStream pads prompts to these lengths, cut at the engine's max_prefill_length,
# which must be one of them (token_utils.pad_tokens).
PREFILL_LENGTHS = tuple(2 ** i for i in range(4, 16))


class TokenizerApi(tokenizer_api.Tokenizer):
  """A task's tokenizer (`tasks.protocol.TextTokenizer`: pad, EOS and BOS ids, BOS None
  for a model that uses none) behind JetStream's tokenizer API.

  Generation stops at the tokenizer's stop ids, as in training (JetStream's default
  also stops at PAD).
  """

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def encode(self, s: str, **kwargs):
    """Tokenizes `s`, adds BOS if `is_bos` and the tokenizer has one, pads as
    `token_utils.pad_tokens` does."""
    if self.bos_id is None:
      kwargs["is_bos"] = False
    return token_utils.pad_tokens(np.asarray(self._tokenizer.encode(s), np.int32),
                                  self.bos_id, self.pad_id, **kwargs)

  def decode(self, token_ids: list[int], **kwargs) -> str:
    del kwargs
    return self._tokenizer.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self._tokenizer.pad_id

  @property
  def eos_id(self) -> int:
    return self._tokenizer.eos_id

  @property
  def bos_id(self) -> int:
    return self._tokenizer.bos_id

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._tokenizer.stop_ids)


@struct.dataclass
class JetStreamDecodeState:
  """Our engine's decode state plus, per slot, how many tokens were emitted."""
  state: engine_lib.DecodeState
  emitted_S: jax.Array


@jax.jit
def _emit_pending(state: engine_lib.DecodeState, emitted_S):
  """JetStream's packed [S, 3] (token, valid, length) of the pending tokens."""
  valid_S = state.positions_S < state.cache.tables_SM.shape[1] * state.cache.block_size
  emitted_S = emitted_S + 1
  data_S3 = jnp.stack([state.tokens_S, valid_S.astype(jnp.int32), emitted_S], axis=1)
  return data_S3, emitted_S


@jax.jit
def _reset_slot(emitted_S, slot):
  return emitted_S.at[slot].set(0)


class JetStreamEngine(engine_api.Engine):
  """A `jetstream.engine.engine_api.Engine` over our `Engine`.

  JetStream's orchestrator knows nothing of KV blocks, so slot s holds blocks s M to
  (s + 1) M - 1 of the engine's pool, a whole sequence's worth: the engine's KV budget
  must be its default, every slot at full length.

  Args:
    engine: our engine; its `max_prefill_length` must be one of `PREFILL_LENGTHS`.
    params: the policy's params, which `load_params()` places on the engine's
      devices (JetStream's server calls it without arguments).
    sampling: how every request is sampled (greedy by default). Only temperature,
      top_k, top_p and seed apply: a JetStream request sets its own length and the
      tokenizer's `stop_tokens` end it. Request i draws with (seed, i), so a run is
      reproducible for a fixed seed and arrival order.
    tokenizer: the task's tokenizer, which `build_tokenizer` wraps.
  """

  def __init__(self, engine: engine_lib.Engine, params, *,
               tokenizer, sampling: SamplingParams = GREEDY):
    if engine.max_prefill_length not in PREFILL_LENGTHS:
      raise ValueError(f"max_prefill_length must be one of JetStream's prefill lengths "
                       f"{PREFILL_LENGTHS}, got {engine.max_prefill_length}")
    if engine.num_blocks < engine.max_concurrent_decodes * engine.max_blocks:
      raise ValueError(f"the engine's kv_blocks ({engine.num_blocks}) must hold every slot at "
                       f"full length ({engine.max_concurrent_decodes} x {engine.max_blocks})")
    self.engine = engine
    self._params = params
    self._sampling = sampling
    self._tokenizer = tokenizer
    self._requests = itertools.count()

  def load_params(self):
    """A copy of the params on the engine's devices."""
    return self.engine.load_params(self._params)

  def prefill(self, *, params, existing_prefix=None, padded_tokens,
              true_length: int) -> engine_lib.Prefix:
    """The prompt's KV cache and its first generated token (emitted by `generate`)."""
    if existing_prefix is not None:
      raise NotImplementedError("prefix caching (existing_prefix) is not supported")
    # JetStream keeps the last tokens of an over-long prompt but reports its full length.
    true_length = min(int(true_length), padded_tokens.shape[0])
    sampling = SlotSampling.create(self._sampling, seed=self._sampling.seed or 0,
                                   index=next(self._requests))
    prefix, _ = self.engine.prefill(params=params, padded_tokens=padded_tokens,
                                    true_length=true_length, sampling=sampling)
    return prefix

  def insert(self, prefix: engine_lib.Prefix, decode_state: JetStreamDecodeState,
             slot: int) -> JetStreamDecodeState:
    M = self.engine.max_blocks
    return JetStreamDecodeState(
        self.engine.insert(prefix, decode_state.state, slot, range(slot * M, (slot + 1) * M)),
        _reset_slot(decode_state.emitted_S, np.int32(slot)))

  def generate(self, params, decode_state: JetStreamDecodeState):
    """Emits each slot's pending token, then runs one decode step (see module doc)."""
    data_S3, emitted_S = _emit_pending(decode_state.state, decode_state.emitted_S)
    state, _ = self.engine.generate(params, decode_state.state)
    result = engine_api.ResultTokens(data=data_S3, tokens_idx=(0, 1), valid_idx=(1, 2),
                                     length_idx=(2, 3), samples_per_slot=1)
    return JetStreamDecodeState(state, emitted_S), result

  def init_decode_state(self) -> JetStreamDecodeState:
    return JetStreamDecodeState(
        self.engine.init_decode_state(),
        jax.device_put(np.zeros(self.max_concurrent_decodes, np.int32),
                       self.get_prefix_destination_sharding()))

  def get_prefix_destination_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path=_TOKENIZER_PATH)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenizerApi:
    if metadata.path != _TOKENIZER_PATH:
      raise ValueError(f"unknown tokenizer {metadata.path!r}; expected {_TOKENIZER_PATH!r}")
    return TokenizerApi(self._tokenizer)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine.max_concurrent_decodes

  @property
  def samples_per_slot(self) -> int:
    return self.engine.samples_per_slot

  @property
  def max_prefill_length(self) -> int:
    return self.engine.max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self.engine.mesh

  @property
  def colocated_cpus(self) -> None:
    """None: the engine is not split across accelerator hosts."""
    return None


@dataclasses.dataclass(frozen=True)
class Completion:
  """What JetStream streamed back for one prompt, stop token excluded.

  `text` is empty for a prompt given as token ids (JetStream then returns ids only).
  """
  text: str
  token_ids: list[int]


class JetStreamServer:
  """JetStream's own Driver with `engine` for prefill and generate, in this process.

  Use as a context manager, or call `stop`.
  """

  def __init__(self, engine: JetStreamEngine):
    self.engine = engine
    params = engine.load_params()
    self.driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                                      prefill_params=[params], generate_params=[params],
                                      interleaved_mode=True)
    self._service = orchestrator.LLMOrchestrator(driver=self.driver)
    self._tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    # One event loop for the server's lifetime: a stream ends at the first of two
    # `call_soon_threadsafe` calls the Driver makes to close it, so a loop closed as
    # soon as the stream ends (`asyncio.run`) fails the second, and the Driver then
    # kills the process.
    self._loop = asyncio.new_event_loop()
    self._loop_thread = threading.Thread(target=self._loop.run_forever,
                                         name="jetstream-client", daemon=True)
    self._loop_thread.start()

  def complete(self, prompts: Sequence[str | Sequence[int]], *,
               max_tokens: int) -> list[Completion]:
    """Sends the prompts concurrently through `LLMOrchestrator.Decode`.

    A prompt is text, or token ids; JetStream prepends BOS to either. Prompts are
    checked here, because an exception in a Driver thread kills the process.

    Raises:
      ValueError: `max_tokens` < 1, a character or id outside the vocabulary, or a
        prompt longer than `max_prefill_length` with its BOS.
    """
    if max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    requests = [jetstream_pb2.DecodeRequest(max_tokens=max_tokens, **self._content(p))
                for p in prompts]

    async def collect(request):
      text, token_ids = [], []
      async for response in self._service.Decode(request):
        sample, = response.stream_content.samples
        text.append(sample.text)
        token_ids.extend(sample.token_ids)
      return Completion("".join(text), token_ids)

    async def collect_all():
      return await asyncio.gather(*map(collect, requests))

    return asyncio.run_coroutine_threadsafe(collect_all(), self._loop).result()

  def _content(self, prompt) -> dict:
    if isinstance(prompt, str):
      _, length = self._tokenizer.encode(prompt, jax_padding=False)
      content = dict(text_content=jetstream_pb2.DecodeRequest.TextContent(text=prompt))
    else:
      if self._tokenizer.bos_id is None:
        raise ValueError("a prompt of token ids needs a tokenizer with a BOS id, which "
                         "JetStream prepends to it; give the prompt as text")
      token_ids = [int(t) for t in prompt]
      vocab_size = self.engine.engine.cfg.vocab_size
      if not all(0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt {token_ids} has ids outside [0, {vocab_size})")
      length = len(token_ids) + 1
      content = dict(token_content=jetstream_pb2.DecodeRequest.TokenContent(
          token_ids=token_ids))
    if length > self.engine.max_prefill_length:
      raise ValueError(f"prompt {prompt!r} has {length} tokens with BOS, more than "
                       f"max_prefill_length {self.engine.max_prefill_length}")
    return content

  def stop(self) -> None:
    self.driver.stop()
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._loop_thread.join()
    self._loop.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()
