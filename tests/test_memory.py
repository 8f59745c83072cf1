"""Memory: `estimate_memory` by hand for Qwen2.5-1.5B and the configs quote it; the
compiled memory per device (`compiled_memory.generator`, `trainer`) of a tensor-parallel
engine and of the train step on 8 devices."""

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from async_rl.cli import from_dict
from async_rl.models.memory import GIB, describe, estimate_memory
from rl_test_utils import fake_devices

ROOT = Path(__file__).parents[1]
QWEN = ROOT / "configs" / "qwen2_5.py"
ACCELERATOR_VARIANTS = ("1.5b", "7b")  # of configs/qwen2_5.py


def _module():
  spec = importlib.util.spec_from_file_location("qwen2_5", QWEN)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_qwen2_5_1_5b_by_hand():
  cfg = from_dict(_module().get_config("1.5b"))
  # Per layer: q,o 2*1536*12*128; k,v 2*1536*2*128; gate,up,down 3*1536*8960; two norms;
  # q/k/v biases (12+2+2)*128. Tied embedding 151936*1536, final norm 1536.
  per_layer = 2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960 + 2 * 1536 + 16 * 128
  n = 28 * per_layer + 151936 * 1536 + 1536
  assert n == 1_543_714_304
  # The KV budget: 24576 blocks of 16 tokens, 2 kv heads of 128, k and v, 28 layers, bf16.
  kv = 2 * 28 * 24576 * 16 * 2 * 128 * 2
  assert estimate_memory(cfg) == dict(
      params=2 * n, optimizer=4 * n, gradients=4 * n, kv_cache=kv,
      trainer=10 * n, generator=2 * n + kv)
  assert kv == 10.5 * GIB
  # With no budget, every one of the 128 slots at the full 256 + 8192 tokens.
  dense = _module().get_config("1.5b")
  dense.generation.kv_blocks = 0
  assert estimate_memory(from_dict(dense))["kv_cache"] == 2 * 28 * 128 * (256 + 8192) * 2 * 128 * 2


@pytest.mark.parametrize("variant", ACCELERATOR_VARIANTS)
def test_docstring_quotes_the_estimate(variant):
  module = _module()
  cfg = from_dict(module.get_config(variant))
  section = module.__doc__.split(f"\n{variant} (", 1)[1].split("\n\n")[1]
  quoted = dict(re.findall(r"^  (\w+): ([\d.]+ GiB)", section, re.MULTILINE))
  printed = dict(line.split(": ") for line in describe(cfg).splitlines())
  assert quoted == printed


def _json_of(*command):
  env = dict(os.environ, XLA_FLAGS=fake_devices(8),
             PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
  out = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@functools.cache
def _check():
  return _json_of(str(ROOT / "tests" / "memory_check.py"))


def test_a_tensor_parallel_engine_holds_a_kth_per_device():
  r = {int(k): v for k, v in _check()["engine"].items()}
  assert r[4]["kv"] == r[1]["kv"] / 4
  # What the compiler places per device: params, pools and the slots' small state.
  assert r[4]["decode_args_f32"] == pytest.approx(r[1]["decode_args_f32"] / 4, rel=0.05)
  # Only the norms (a few KiB) are whole on every device.
  assert r[4]["params"] == pytest.approx(r[1]["params"] / 4, rel=0.05)
  # Decoding gathers each device's own kv heads' blocks.
  assert r[4]["decode"] == pytest.approx(r[1]["decode"] / 4, rel=0.05)
  # A prefill splits with the heads, but for its embeddings and logits.
  assert r[4]["prefill"] < 1.5 * r[1]["prefill"] / 4


def test_the_train_step_on_8_devices_holds_its_own_row_per_device():
  r = {int(k): v for k, v in _check()["trainer"].items()}
  # Params, moments and gradient buffers shard eight ways; the activations are one
  # row's on each device, as on one device with one row.
  assert r[8]["state"] < r[1]["state"] / 4
  assert r[8]["temp"] < 1.2 * r[1]["temp"]
