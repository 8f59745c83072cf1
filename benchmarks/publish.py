"""Weight publish, trainer -> generator, in one process: via the host vs device to device.

  python -m benchmarks.publish            # about a minute on a 2-core CPU

The `small` preset's params (23.7M matmul params, float32) go from a trainer's train
state to a generator engine's devices two ways, the way the training loop published them
before and after it kept device arrays:

  * host: `jax.device_get` of the params, then `Engine.load_params` of the numpy copy;
  * device: `Trainer.device_params`'s copy (`jax.device_put`, may_alias=False), then
    `Engine.load_params`, which reshards device to device (`sharding.reshard`).

Two placements on 8 fake CPU devices: trainer and generator on the same device, and
trainer FSDP-sharded on devices 0-5 with the generator on 6-7. Medians of timed
calls after a warm-up, each blocked on. On a CPU every "device" is host memory, so
both ways are memory copies here; on accelerators the host way also crosses PCIe
twice.

Across processes (`--cross_process`, needs the `ray` extra): what the Ray placement
does each step, with the real parameter server as an actor: the trainer's host copy
(`Trainer.host_params`, in float32 and cast to bfloat16 on the device as
`placement.publish_dtype` does), `publish` to the server actor, and a rollout-worker
actor's `fetch` and `Engine.load_params`. Seconds and bytes per publish for the small
preset, and the bytes of the 1.5B and 7B shapes with the seconds the measured rate
gives them. With LoRA (`--lora_rank`, 0 for none) only the adapters move: the same
path for adapters of that rank on every projection of the small preset, published in
float32 and loaded by the rollout worker's `generation.adapted.AdaptedEngine` (which
merges them into the base it holds), and the adapter bytes of the 1.5B and 7B shapes
beside their full params'. A float32 1024^3 matmul measured first tells how loaded the
machine was.
Prints a table, then one JSON object as the last line.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from async_rl import models, sharding, train_step  # noqa: E402
from async_rl.config import LoraConfig, MeshConfig, model_preset  # noqa: E402
from async_rl.generation import Engine  # noqa: E402
from async_rl.generation.adapted import AdaptedEngine  # noqa: E402
from async_rl.models import lora  # noqa: E402
from benchmarks.common.peak import matmul_peak  # noqa: E402
from benchmarks.common.timer import median_s  # noqa: E402

_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed publishes per variant.")
_CROSS = flags.DEFINE_bool("cross_process", True, "Also time the publish through Ray actors.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 16, "Rank of the LoRA publish row; 0: none.")


def _placement(cfg, trainer_devices, generator_devices, repeats):
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=-1), trainer_devices)
  state, shardings = train_step.create_train_state(cfg, optax.sgd(1.0), mesh, jax.random.key(0))
  params_sh = shardings.params
  engine = Engine(cfg, max_concurrent_decodes=1, max_prefill_length=16, max_target_length=32,
                  mesh=Mesh(np.array(generator_devices).reshape(-1, 1, 1), sharding.AXES))
  via_host = lambda: engine.load_params(jax.device_get(state.params))
  on_device = lambda: engine.load_params(
      jax.device_put(state.params, params_sh, may_alias=False))
  return {"host_s": median_s(via_host, repeats), "device_s": median_s(on_device, repeats)}


class _Fetcher:
  """A rollout worker's side: fetches the newest params and loads them on its engine."""

  def __init__(self, cfg, server, lora_cfg=LoraConfig()):
    self._server, self._version = server, -1
    self._engine = Engine(cfg, max_concurrent_decodes=1, max_prefill_length=16,
                          max_target_length=32)
    if lora_cfg.enabled:  # the base from its pointer (a seed), as a rollout worker loads it
      self._engine = AdaptedEngine(self._engine, lora_cfg.scale,
                                   models.init_params(cfg, jax.random.key(0)))

  def fetch_and_load(self):
    version, params = ray.get(self._server.fetch.remote(self._version))
    self._version = version
    jax.block_until_ready(self._engine.load_params(params))


def _cross_process(cfg, repeats):
  """Seconds per publish through Ray, in float32 and bfloat16 (module docstring)."""
  global ray  # noqa: PLW0603 - the extra is imported only when asked for
  import ray  # noqa: PLC0415
  from async_rl.config import StalenessConfig  # noqa: PLC0415
  from async_rl.param_server import ParameterServer  # noqa: PLC0415
  from async_rl.rl.trainer import _cast  # noqa: PLC0415
  ray.init(include_dashboard=False, num_cpus=2)
  try:
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    state, _ = train_step.create_train_state(cfg, optax.sgd(1.0), mesh, jax.random.key(0))
    out = {}
    for dtype in ("float32", "bfloat16"):
      # A server of its own: a run publishes one dtype throughout.
      server = ray.remote(ParameterServer).options(max_concurrency=4).remote(
          StalenessConfig(), 1)
      fetcher = ray.remote(_Fetcher).remote(cfg, server)
      version = [0]

      def publish(dtype=dtype, server=server, fetcher=fetcher, version=version):
        host = jax.device_get(_cast(state.params, jax.numpy.dtype(dtype)))
        ray.get(server.publish.remote(version[0], host))
        ray.get(fetcher.fetch_and_load.remote())
        version[0] += 1
      seconds = median_s(publish, repeats)  # The untimed call compiles the cast and the load.
      nbytes = cfg.num_params() * jax.numpy.dtype(dtype).itemsize
      out[dtype] = {"seconds": seconds, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9}
      ray.kill(fetcher)
      ray.kill(server)
    if _LORA_RANK.value:
      out["lora"] = _cross_process_lora(cfg, mesh, LoraConfig(rank=_LORA_RANK.value), repeats)
    return out
  finally:
    ray.shutdown()


def _cross_process_lora(cfg, mesh, lora_cfg, repeats):
  """Seconds per publish of LoRA adapters through Ray, loaded by an adapted engine."""
  from async_rl.config import StalenessConfig  # noqa: PLC0415
  from async_rl.param_server import ParameterServer  # noqa: PLC0415
  state, _ = train_step.create_train_state(cfg, optax.sgd(1.0), mesh, jax.random.key(0),
                                           lora_cfg=lora_cfg)
  server = ray.remote(ParameterServer).options(max_concurrency=4).remote(StalenessConfig(), 1)
  fetcher = ray.remote(_Fetcher).remote(cfg, server, lora_cfg)
  version = [0]

  def publish():
    ray.get(server.publish.remote(version[0], jax.device_get(state.params)))
    ray.get(fetcher.fetch_and_load.remote())
    version[0] += 1
  try:
    seconds = median_s(publish, repeats)
  finally:
    ray.kill(fetcher)
    ray.kill(server)
  nbytes = lora.num_params(cfg, lora_cfg) * 4
  return {"rank": lora_cfg.rank, "seconds": seconds, "bytes": nbytes}


def main(argv):
  del argv
  cfg = model_preset("small", vocab_size=256, max_seq_len=256)
  devices = jax.devices()
  peak = matmul_peak() / 1e9
  results = {
      "same_device": _placement(cfg, devices[:1], devices[:1], _REPEATS.value),
      "trainer_6_generator_2": _placement(cfg, devices[:6], devices[6:], _REPEATS.value),
  }
  mb = cfg.num_params() * 4 / 2**20
  print(f"small preset, {mb:.0f} MiB of float32 params; median of {_REPEATS.value}; "
        f"matmul peak {peak:.0f} GFLOP/s")
  print(f"{'placement':<24}{'via host ms':>12}{'device ms':>11}{'host/device':>13}")
  for name, r in results.items():
    r["ratio"] = r["host_s"] / r["device_s"]
    print(f"{name:<24}{r['host_s'] * 1e3:>12.1f}{r['device_s'] * 1e3:>11.1f}{r['ratio']:>12.2f}x")
  cross = {}
  if _CROSS.value:
    cross = _cross_process(cfg, _REPEATS.value)
    print("\nacross processes (Ray), small preset; then the shapes at the measured rate")
    print(f"{'model':<16}{'dtype':<10}{'GB':>8}{'s / publish':>13}")
    lora_row = cross.pop("lora", None)
    for dtype, r in cross.items():
      print(f"{'small':<16}{dtype:<10}{r['bytes'] / 1e9:>8.3f}{r['seconds']:>13.3f}")
    if lora_row:
      print(f"{'small':<16}{'lora' + str(lora_row['rank']):<10}{lora_row['bytes'] / 1e9:>8.3f}"
            f"{lora_row['seconds']:>13.3f}  (adapters, float32; the load merges them)")
    shapes = {}
    for name in ("qwen2.5-1.5b", "qwen2.5-7b"):
      model = model_preset(name)
      sizes = {dtype: model.num_params() * jax.numpy.dtype(dtype).itemsize for dtype in cross}
      if lora_row:  # the adapters in float32, at the float32 params' rate
        sizes[f"lora{lora_row['rank']}"] = 4 * lora.num_params(
            model, LoraConfig(rank=lora_row["rank"]))
      for label, nbytes in sizes.items():
        seconds = nbytes / 1e9 / cross.get(label, cross["float32"])["gb_per_s"]
        shapes[f"{name}/{label}"] = {"bytes": nbytes, "seconds_at_measured_rate": seconds}
        print(f"{name:<16}{label:<10}{nbytes / 1e9:>8.3f}{seconds:>13.3f}")
    cross["shapes"] = shapes
    if lora_row:
      cross["lora"] = lora_row
  print(json.dumps({"params_mib": mb, "matmul_gflops": peak, **results,
                    "cross_process": cross}))


if __name__ == "__main__":
  app.run(main)
