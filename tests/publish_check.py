"""Run in a subprocess with 8 fake CPU devices: trainer on 6, generator on 2.

The in-process publish path (trainer -> parameter server -> generator pool) runs
with every host transfer disallowed, explicit ones (`device_get`, `device_put` of
numpy) included; device-to-device copies are what it may do.
Prints, as JSON, where the generator's params live and whether they equal the
trainer's.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from async_rl import sharding  # noqa: E402
from async_rl.config import MeshConfig  # noqa: E402
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams  # noqa: E402
from async_rl.param_server import ParameterServer  # noqa: E402
from async_rl.rl import build  # noqa: E402
from rl_test_utils import small_config  # noqa: E402


def main():
  cfg = small_config()
  devices = jax.devices()
  trainer = build.make_trainer(cfg, sharding.make_mesh(MeshConfig(data=3, fsdp=2), devices[:6]))
  generator_mesh = Mesh(np.array(devices[6:]).reshape(2, 1, 1), sharding.AXES)
  g = cfg.generation
  engine = Engine(cfg.model, max_concurrent_decodes=2, max_prefill_length=g.max_prompt_len,
                  max_target_length=g.max_prompt_len + g.max_new_tokens, mesh=generator_mesh)
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  with (jax.transfer_guard_device_to_host("disallow_explicit"),
        jax.transfer_guard_host_to_device("disallow_explicit")):
    server.publish(0, trainer.device_params())
    version, params = server.fetch(-1)
    pool = GeneratorPool(engine, params, version=version)
    # A second publish, as after a training step, swapped into the running pool.
    server.publish(1, trainer.device_params())
    version, params = server.fetch(0)
    pool.update_weights(params, version, "keep").result(timeout=60)
    # A tensor-parallel generator layout: the moved copy is sliced on its devices.
    tensor_mesh = Mesh(np.array(devices[6:]).reshape(1, 1, 2), sharding.AXES)
    split = sharding.reshard(params, sharding.param_shardings(params, tensor_mesh))
  trained = jax.device_get(trainer.state.params)
  # The pool keeps the engine's serving layout: one dict per layer.
  live = jax.device_get(pool._scheduler.params)
  live = dict(live, layers=jax.tree.map(lambda *ls: np.stack(ls), *live["layers"]))
  sample = pool.submit(Request("r", [1, 2, 3], sampling=SamplingParams(
      max_new_tokens=4, seed=0))).result(timeout=60)[0]
  pool.shutdown()
  print(json.dumps({
      "trainer_devices": sorted(d.id for d in trainer.state.params["embed"].devices()),
      "generator_devices": sorted({d.id for x in jax.tree.leaves(pool._scheduler.params)
                                   for d in x.devices()}),
      "published_on_devices": all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)),
      "equal": all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained),
                                                        jax.tree.leaves(live))),
      "split_sharded": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(split)),
      "split_equal": all(np.array_equal(a, b) for a, b in zip(
          jax.tree.leaves(trained), jax.tree.leaves(jax.device_get(split)))),
      "pool_version": pool.version, "sampled_tokens": int(len(sample.completion_C)),
  }))


if __name__ == "__main__":
  main()
