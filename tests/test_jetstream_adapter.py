"""The JetStream adapter: a real jetstream Engine, JetStream's orchestrator serves a policy.

Everything that imports jetstream (and so TensorFlow, ~1 GB) runs in subprocesses:
tests/jetstream_adapter_check.py and launch/serve_jetstream.py.

JetStream 0.2.2's Driver streams only the tokens `generate` returns, not the one our
engine samples in prefill; the adapter emits each slot's pending token from
`generate`. Equality with our pool's greedy tokens, first token included, is the
check that this contract holds: a dropped or repeated first token shifts everything.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest

from async_rl.cli import from_dict
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from async_rl.rl.checkpoint import Checkpointer, Meta
from async_rl.sharding import make_mesh
from async_rl.tasks import CharTokenizer
from async_rl.train_step import create_train_state

ROOT = Path(__file__).parents[1]
requires_jetstream = pytest.mark.skipif(
    importlib.util.find_spec("jetstream") is None,
    reason="google-jetstream is not installed (pip install 'async_rl[jetstream]')")


def _run(*args):
  out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_core_modules_do_not_import_jetstream():
  # The binaries each define their flags, so no two of them share a process.
  code = ("import importlib, pkgutil, sys, async_rl\n"
          "for m in pkgutil.walk_packages(async_rl.__path__, 'async_rl.'):\n"
          "  if not m.name.endswith('.jetstream_adapter') and not m.name.startswith(\n"
          "      'async_rl.launch.'): importlib.import_module(m.name)\n"
          "print(sorted(m for m in sys.modules\n"
          "             if m.split('.')[0] in ('jetstream', 'seqio', 'tensorflow')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert out.returncode == 0, out.stderr[-4000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.fixture(scope="module")
def check():
  return _run(str(ROOT / "tests" / "jetstream_adapter_check.py"))


def _until_stop(tokens, stop_id):
  """Our pool's completion as JetStream streams it: without the stop token."""
  return tokens[:tokens.index(stop_id)] if stop_id in tokens else tokens


@requires_jetstream
def test_adapter_is_a_jetstream_engine(check):
  interface = check["interface"]
  assert interface["is_engine"] and interface["tokenizer_is_api"]
  assert interface["still_abstract"] == [] and interface["not_overridden"] == []
  assert interface["tokenizer_still_abstract"] == []
  assert interface["jax_tree_map"]


@requires_jetstream
def test_orchestrator_greedy_tokens_equal_pool(check):
  expected = [_until_stop(t, check["eos_id"]) for t in check["expected"]]
  # Both end conditions are exercised: the length limit and the stop token.
  assert any(len(t) == check["max_tokens"] for t in expected)
  assert any(len(t) < check["max_tokens"] for t in expected)
  assert check["served_text_prompts"] == expected
  assert check["served_token_prompts"] == expected
  assert check["served_text"] == check["expected_text"]
  assert check["served_token_text"] == [""] * len(expected)  # JetStream returns ids only.


@requires_jetstream
def test_bad_prompts_raise_and_the_server_keeps_serving(check):
  assert len(check["errors"]) == 3, check["errors"]
  assert "max_prefill_length" in check["errors"][0]
  assert "not in the vocabulary" in check["errors"][1]
  assert "outside [0, 32)" in check["errors"][2]
  assert check["served_after_errors"] == check["served_text_prompts"][0]


def _greedy(engine, params, prompts, max_tokens, tokenizer):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=max_tokens,
                            stop_token_ids=(tokenizer.eos_id,))
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(Request(i, [tokenizer.bos_id, *tokenizer.encode(p)],
                                   sampling=sampling)) for i, p in enumerate(prompts)]
    return [_until_stop(f.result(timeout=120)[0].completion_C.tolist(), tokenizer.eos_id)
            for f in futures]


@requires_jetstream
def test_serve_binary_serves_the_latest_checkpoint(tmp_path):
  spec = importlib.util.spec_from_file_location("micro", ROOT / "configs" / "micro.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = from_dict(module.get_config())
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), keep=3)
  states = {}
  for step, seed in ((2, 1), (5, 3)):
    states[step], _ = create_train_state(cfg.model, optax.adam(1e-3), mesh,
                                         jax.random.key(seed))
    checkpointer.save(step, states[step], Meta(step), wait=True)
  checkpointer.close()

  prompts, max_tokens, tokenizer = ["3+4=", "12*3=", "(5-1)*"], 8, CharTokenizer()
  # The engine launch/serve_jetstream.py builds (rl.export.serve):
  # micro's max_prompt_len 24 rounds up to JetStream's prefill length 32.
  engine = Engine(cfg.model, max_concurrent_decodes=cfg.generation.num_slots,
                  max_prefill_length=32, max_target_length=32 + cfg.generation.max_new_tokens)
  expected = {step: _greedy(engine, s.params, prompts, max_tokens, tokenizer)
              for step, s in states.items()}
  assert expected[5] != expected[2]  # Serving the wrong checkpoint would be caught.

  served = _run("-m", "launch.serve_jetstream", "--config=configs/micro.py",
                f"--workdir={tmp_path}", *(f"--prompt={p}" for p in prompts),
                f"--max_tokens={max_tokens}")
  assert [s["prompt"] for s in served] == prompts
  assert [s["token_ids"] for s in served] == expected[5]
  assert [s["text"] for s in served] == [tokenizer.decode(t, strict=False)
                                          for t in expected[5]]
