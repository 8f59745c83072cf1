"""Session-wide test setup: one persistent JAX compilation cache for the whole run, and
XLA:CPU compiling without LLVM's optimisations.

Many tests compile the same programs (the micro config's train step, prefill and
decode chunks, in this process and in the binaries and benchmarks they start), so a
cache in a fresh temporary directory, set through the environment before jax is
imported, lets the later ones load what an earlier one compiled. Nothing is read
from outside this session's own cache.
"""

import os
import tempfile

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
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()


@pytest.fixture
def gpu_target():
  """Lowering for CUDA on a host without a GPU: the GPU that Pallas's Triton kernels are
  compiled for, which jax >= 0.11 reads from the abstract mesh instead of assuming one."""
  import jax  # noqa: PLC0415 -- after the environment above is set
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
    yield
