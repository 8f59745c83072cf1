"""Run in a subprocess (it imports jetstream, hence TensorFlow): the adapter's checks.

Serves a random tiny model through JetStream's Driver and `LLMOrchestrator.Decode`
(more prompts than slots, text and token-id prompts, concurrently), and the same
prompts greedily through our GeneratorPool. Prints one JSON object as its last line.
"""

import json

import jax

from async_rl import models
from async_rl.config import ModelConfig
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams, jetstream_adapter
from async_rl.tasks import CharTokenizer

from jetstream.engine import engine_api, tokenizer_api  # pylint: disable=g-bad-import-order

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=8, d_ff=64)
PROMPTS = ["1+2=", "34*5=", "7", "(8-9)*3=", "12+", "99=", "6 ", "0\n"]
MAX_TOKENS = 12


def _interface(engine):
  cls = jetstream_adapter.JetStreamEngine
  tokenizer = engine.build_tokenizer(engine.get_tokenizer())
  return {
      "is_engine": isinstance(engine, engine_api.Engine),
      "still_abstract": sorted(cls.__abstractmethods__),
      "not_overridden": sorted(n for n in engine_api.Engine.__abstractmethods__ | {
          "build_tokenizer"} if n not in vars(cls)),
      "tokenizer_is_api": isinstance(tokenizer, tokenizer_api.Tokenizer),
      "tokenizer_still_abstract": sorted(type(tokenizer).__abstractmethods__),
      "jax_tree_map": hasattr(jax, "tree_map"),
  }


def main():
  tokenizer = CharTokenizer()
  params = models.init_params(CFG, jax.random.key(0))
  engine = Engine(CFG, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=40)
  token_prompts = [tokenizer.encode(p) for p in PROMPTS]
  greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS,
                          stop_token_ids=(tokenizer.eos_id,))
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(Request(i, [tokenizer.bos_id, *p], sampling=greedy))
               for i, p in enumerate(token_prompts)]
    expected = [f.result(timeout=120)[0].completion_C.tolist() for f in futures]

  adapter = jetstream_adapter.JetStreamEngine(engine, params, tokenizer=tokenizer)
  with jetstream_adapter.JetStreamServer(adapter) as server:
    text_out = server.complete(PROMPTS, max_tokens=MAX_TOKENS)
    token_out = server.complete(token_prompts, max_tokens=MAX_TOKENS)
    errors = []
    for bad in (["1" * 16], ["a"], [[40]]):
      try:
        server.complete(bad, max_tokens=MAX_TOKENS)
      except ValueError as e:
        errors.append(str(e))
    after_errors = server.complete(PROMPTS[:1], max_tokens=MAX_TOKENS)

  print(json.dumps({
      "interface": _interface(adapter),
      "max_tokens": MAX_TOKENS,
      "eos_id": tokenizer.eos_id,
      "expected": expected,
      "expected_text": [tokenizer.decode(t, strict=False) for t in expected],
      "served_text_prompts": [c.token_ids for c in text_out],
      "served_text": [c.text for c in text_out],
      "served_token_prompts": [c.token_ids for c in token_out],
      "served_token_text": [c.text for c in token_out],
      "errors": errors,
      "served_after_errors": after_errors[0].token_ids,
  }))


if __name__ == "__main__":
  main()
