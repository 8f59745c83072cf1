"""The device mesh and the one table of partition rules for params and batches.

Axes: `data` (pure data parallelism: params replicated), `fsdp` (data parallelism with
params and optimizer state sharded along their model-width dimension), `tensor`
(heads, MLP width and vocabulary split across devices). Batches shard their row
dimension over `data` x `fsdp`.
"""

import functools
import re
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from async_rl.config import MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (regex on the "/"-joined param path, spec). Stacked layer params lead with L,
# which is never sharded: `lax.scan` slices it. First match wins.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"^embed$", P("tensor", "fsdp")),
    (r"^lm_head$", P("fsdp", "tensor")),
    # LoRA adapters (`models.lora`): a few rank-r columns per weight, replicated.
    (r"layers/\w+_lora_(a|b)$", P()),
    (r"layers/(q|k|v)$", P(None, "fsdp", "tensor", None)),
    (r"layers/(q|k|v)_bias$", P(None, "tensor", None)),
    (r"layers/o$", P(None, "tensor", None, "fsdp")),
    (r"layers/(gate|up)$", P(None, "fsdp", "tensor")),
    (r"layers/down$", P(None, "tensor", "fsdp")),
    (r"norm$", P()),
)


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A mesh over `devices` (default: all) with the config's axis sizes."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = cfg.axis_sizes(len(devices))
  return Mesh(np.array(devices).reshape([sizes[a] for a in AXES]), AXES)


def _fit(spec: P, shape, mesh: Mesh) -> P:
  """Drops mesh axes from dims they do not divide (e.g. 2 kv heads on tensor=4)."""
  out = []
  for axis, dim in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape):
    size = mesh.shape[axis] if axis else 1
    out.append(axis if axis and dim % size == 0 else None)
  return P(*out)


# A generator's paged KV pools, [K, N, Z, E] per layer: kv heads over `tensor`, as the k
# and v projections split them, so each device keeps the keys and values of its heads.
KV_POOL_SPEC = P("tensor")


def kv_pool_sharding(shape, mesh: Mesh) -> NamedSharding:
  """The sharding of one KV pool of `shape` on a generator's `mesh` (`KV_POOL_SPEC`)."""
  return NamedSharding(mesh, _fit(KV_POOL_SPEC, shape, mesh))


# A prefill's KV cache, [B, K, P, E] per layer (`models.prefill`), split as the pools
# that it is copied into, so that neither the prefill nor the copy gathers it.
PREFIX_CACHE_SPEC = P(None, "tensor")


def prefix_cache_sharding(shape, mesh: Mesh) -> NamedSharding:
  """The sharding of one layer's prefill cache of `shape` on a generator's `mesh`."""
  return NamedSharding(mesh, _fit(PREFIX_CACHE_SPEC, shape, mesh))


def param_spec(path: str, shape, mesh: Mesh) -> P:
  for pattern, spec in PARAM_RULES:
    if re.search(pattern, path):
      if len(spec) > len(shape):
        raise ValueError(f"partition rule {pattern!r} has rank {len(spec)} but param "
                         f"{path!r} has shape {shape}")
      return _fit(spec, shape, mesh)
  raise ValueError(f"no partition rule matches param {path!r}; add one to PARAM_RULES")


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_shardings(abstract_params, mesh: Mesh):
  """NamedShardings for a (possibly abstract) params tree, from `PARAM_RULES`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(_path_str(path), x.shape, mesh)),
      abstract_params)


def state_shardings(abstract_state, abstract_params, mesh: Mesh):
  """Shards any sub-tree shaped like the params (optimizer moments) like the params.

  Leaves of optimizer state that mirror a param have that param's path as a suffix
  of their own; everything else (counts, scalars) is replicated.
  """
  by_path = {}
  jax.tree_util.tree_map_with_path(
      lambda path, x: by_path.setdefault(_path_str(path), x.shape), abstract_params)

  def one(path, x):
    p = _path_str(path)
    for param_path, shape in by_path.items():
      if p.endswith(param_path) and tuple(x.shape) == tuple(shape):
        return NamedSharding(mesh, param_spec(param_path, x.shape, mesh))
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(one, abstract_state)


def batch_sharding(mesh: Mesh, leading_axes: int = 1) -> NamedSharding:
  """Rows of a batch over data x fsdp; `leading_axes` unsharded dims come first."""
  return NamedSharding(mesh, P(*([None] * leading_axes), BATCH_AXES))


def num_batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


@functools.lru_cache(maxsize=None)
def _relayout(shardings: tuple):
  # One compiled identity per tuple of target shardings: the jit wrapper must be
  # reused, or every publish would compile again.
  return jax.jit(lambda xs: xs, out_shardings=list(shardings))


def _replicated(devices) -> NamedSharding:
  return NamedSharding(Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("all",)), P())


def reshard(tree, shardings):
  """A copy of `tree` on `shardings` (one sharding or a matching tree), device to device.

  `jax.device_put` copies a leaf through the host when its target lives on other
  devices than its source and none of the source's shards is a target shard (the
  trainer's FSDP layout onto a generator's devices, say). Such leaves are gathered
  whole on their own devices (a collective), the whole copies move to the target
  devices, and there they are sliced into the target layout. Leaves whose target
  shares their devices, and host arrays, go through one batched `jax.device_put`.
  Never aliases `tree`, so the caller may donate or delete its buffers.
  """
  leaves, treedef = jax.tree.flatten(tree)
  targets = jax.tree.leaves(jax.tree.broadcast(shardings, tree),
                            is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  cross = [i for i, (x, t) in enumerate(zip(leaves, targets))
           if isinstance(x, jax.Array) and x.sharding.device_set != t.device_set]
  direct = [i for i in range(len(leaves)) if i not in set(cross)]
  out = [None] * len(leaves)
  moved = jax.device_put([leaves[i] for i in direct], [targets[i] for i in direct],
                         may_alias=False)
  for i, x in zip(direct, moved):
    out[i] = x
  by_devices = {}
  for i in cross:
    key = (frozenset(leaves[i].sharding.device_set), frozenset(targets[i].device_set))
    by_devices.setdefault(key, []).append(i)
  for (src, dst), idx in by_devices.items():
    whole = _relayout((_replicated(src),) * len(idx))([leaves[i] for i in idx])
    there = jax.device_put(whole, [_replicated(dst)] * len(idx))
    sliced = _relayout(tuple(targets[i] for i in idx))(there)
    for i, x in zip(idx, sliced):
      out[i] = x
  return jax.tree.unflatten(treedef, out)
