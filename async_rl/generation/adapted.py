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
from typing import Any

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
    scale: the adapters' alpha / r.
    base: the frozen base params (stacked layout, host or device arrays), copied onto
      the engine's devices; None: given later (`set_base`), before the first adapters.
  """

  def __init__(self, engine: Engine, scale: float, base: Any = None):
    self._engine, self._scale = engine, scale
    self._base = self._merge = None
    self._adapters_sharding = NamedSharding(engine.mesh, PartitionSpec())
    if base is not None:
      self.set_base(base)

  def __getattr__(self, name):  # cfg, buckets, prefill, generate_chunk, ...
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self._engine, name)

  def set_base(self, base) -> None:
    """Takes the frozen base: a copy on the engine's devices, in the serving layout, so
    the caller may drop or donate `base`."""
    self._base = self._engine.load_params(base)
    self._merge = jax.jit(functools.partial(lora.merge, scale=self._scale),
                          out_shardings=jax.tree.map(lambda x: x.sharding, self._base))

  def load_params(self, adapters):
    """The base with `adapters` merged in, on the engine's devices, in the serving
    layout; never aliases `adapters`.

    Raises:
      RuntimeError: no base was given yet (`set_base`).
    """
    if self._base is None:
      raise RuntimeError("an adapted engine needs its frozen base (set_base) before the "
                         "first adapters")
    return self._merge(self._base, sharding.reshard(adapters, self._adapters_sharding))
