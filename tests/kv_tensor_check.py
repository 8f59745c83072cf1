"""Run in a subprocess with 8 fake CPU devices: a tensor-parallel generator engine.

The engine on 2 devices, params split over heads (`sharding.param_shardings` on a
`tensor` = 2 mesh), its KV pools split over kv heads (`sharding.kv_pool_sharding`), at
a budget that preempts; the same requests on one device. Prints, as JSON, how the
pools are laid out and whether the samples agree.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from async_rl import models, sharding  # noqa: E402
from async_rl.config import ModelConfig  # noqa: E402
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams  # noqa: E402

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=8, d_ff=64)


def _engine(**kw):
  return Engine(CFG, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=64,
                kv_blocks=20, kv_block_size=4, **kw)


def _run(engine, params, requests):
  with GeneratorPool(engine, params) as pool:
    samples = [s for f in [pool.submit(r) for r in requests] for s in f.result(timeout=300)]
    return samples, pool.metrics(), pool._scheduler._state


def main():
  params = models.init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  requests = [Request(i, rng.integers(0, 61, rng.integers(1, 17)).tolist(), n=3,
                      sampling=SamplingParams(max_new_tokens=int(rng.integers(4, 48)), seed=i))
              for i in range(6)]
  alone, _, _ = _run(_engine(), params, requests)
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2), sharding.AXES)
  split = sharding.param_shardings(params, mesh)
  tensor, metrics, state = _run(_engine(mesh=mesh, param_sharding=split), params, requests)
  print(json.dumps({
      "pool_spec": [str(x) for x in state.cache.k[0].sharding.spec],
      "pool_devices": len(state.cache.k[0].sharding.device_set),
      "preemptions": metrics["preemptions"],
      "tokens_equal": all(np.array_equal(a.tokens_T, b.tokens_T) for a, b in zip(alone, tensor)),
      "logp_max_diff": float(max(np.abs(a.logp_T - b.logp_T).max()
                                 for a, b in zip(alone, tensor))),
  }))


if __name__ == "__main__":
  main()
