"""Run in a subprocess with 8 fake CPU devices: the sharded update equals one device's.

The update is one SGD step with learning rate 1, so the parameter change is the
gradient itself (Adam would divide near-zero gradients by their own magnitude and
amplify reduction-order rounding). Prints the relative gradient difference per layout.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from async_rl import batching, loss, sharding, train_step  # noqa: E402
from async_rl.config import MeshConfig, ModelConfig  # noqa: E402
from async_rl.trajectory import Trajectory  # noqa: E402

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=8, d_ff=64)
LOSS = loss.make_loss("decoupled_ppo", eps_clip=0.2)


def _batch(num_shards):
  rng = np.random.default_rng(0)
  seqs = []
  for _ in range(16):
    p, c = int(rng.integers(2, 6)), int(rng.integers(1, 10))
    tokens = rng.integers(0, 64, p + c)
    seqs.append(Trajectory.from_completion(tokens[:p], tokens[p:], rng.normal(-4.0, 0.3, c),
                                           np.zeros(c, np.int32), "stop"))
  return batching.pack_dynamic(seqs, rng.normal(size=len(seqs)), max_tokens_per_mb=32,
                               num_shards=num_shards, row_buckets=(32,))


def _update(mesh_cfg, devices):
  mesh = sharding.make_mesh(mesh_cfg, devices)
  R = sharding.num_batch_shards(mesh)
  tx = optax.sgd(1.0)
  state, shardings = train_step.create_train_state(CFG, tx, mesh, jax.random.key(0))
  batch = _batch(8)
  assert batch.tokens.shape[1] % R == 0
  prox = train_step.jit_recompute_logp(mesh, shardings.params, model_cfg=CFG)(
      state.params, batch)
  step = train_step.jit_train_step(mesh, shardings, model_cfg=CFG, loss_fn=LOSS)
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = step(state, batch, prox)
  grads = jax.tree.map(lambda a, b: np.asarray(a) - b, state.params, before)
  return grads, np.asarray(prox), state, float(metrics["loss"])


def main():
  ref, ref_prox, _, ref_loss = _update(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  out = {}
  for name, cfg in {"fsdp": MeshConfig(data=1, fsdp=8, tensor=1),
                    "tensor": MeshConfig(data=2, fsdp=1, tensor=4),
                    "mixed": MeshConfig(data=2, fsdp=2, tensor=2)}.items():
    params, prox, state, loss_value = _update(cfg, jax.devices())
    rel = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
              for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)))
    sharded = sum(not leaf.sharding.is_fully_replicated
                  for leaf in jax.tree.leaves(state.params))
    out[name] = {"grad_rel_diff": rel, "loss_diff": abs(loss_value - ref_loss),
                 "prox_max_abs_diff": float(np.abs(prox - ref_prox).max()),
                 "sharded_leaves": sharded}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
