"""An engine that serves LoRA adapters on a frozen base it holds (`models.lora`).

With LoRA only the adapters are published, so a generator's params are the adapters:
`load_params` takes them and returns the base with them merged in, in the serving
layout, and the pool decodes the plain model. Merging costs one pass over the adapted
weights per publish, and memory: the engine keeps the base (copied onto its devices
once) beside the merged params each pool holds. Adding the low-rank terms in every
decode step instead would need no second copy but costs small matmuls per layer per
token, which measured slower on CPU (decode runs many steps per version).
"""

import functools
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from async_rl import sharding
from async_rl.generation.engine import Engine
from async_rl.models import lora


class AdaptedEngine:
  """`engine` serving a frozen base with the adapters given to `load_params` merged in.

  Presents the `Engine` interface the generator pool uses; every call but
  `load_params` is the engine's own, on the merged params it returns.

  Args:
    engine: the engine (or `cpu.SlotGroupEngine`) to serve with.
    base: returns the frozen base params (stacked layout, host or device arrays); called
      once, by the first `load_params` (a run's warm-started base is written after its
      engines are built), and then dropped, with whatever it holds.
    scale: the adapters' alpha / r.
  """

  def __init__(self, engine: Engine, base: Callable[[], Any], scale: float):
    self._engine = engine
    self._load_base, self._scale = base, scale
    self._base = self._merge = None
    self._adapters_sharding = NamedSharding(engine.mesh, PartitionSpec())

  def __getattr__(self, name):  # cfg, buckets, prefill, generate_chunk, ...
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self._engine, name)

  def load_params(self, adapters):
    """The base with `adapters` merged in, on the engine's devices, in the serving
    layout; never aliases `adapters`."""
    if self._base is None:
      self._base = self._engine.load_params(self._load_base())
      self._load_base = None  # a loader that caches would keep a second copy alive
      self._merge = jax.jit(functools.partial(lora.merge, scale=self._scale),
                            out_shardings=jax.tree.map(lambda x: x.sharding, self._base))
    return self._merge(self._base, sharding.reshard(adapters, self._adapters_sharding))
