"""On 8 fake CPU devices: a tensor-parallel engine against the one-device engine, and a run
with the trainer on 4 devices and two 2-device generator replicas.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/placement_check.py WORKDIR

Prints, as its last line, one JSON object of what `tests/test_placement.py` asserts.
"""

import dataclasses
import json
import sys

import jax
import numpy as np

from async_rl import models
from async_rl.generation import GeneratorPool, Request, SamplingParams
from async_rl.rl import build, entry
from async_rl.rl.checkpoint import restore_params
from rl_test_utils import small_config


def engine_outputs(cfg, params, devices):
  """Each sample's tokens and behaviour log-probs from an engine on `devices`."""
  requests = [Request(i, list(range(3, 3 + 2 + i)), n=2,
                      sampling=SamplingParams(max_new_tokens=12, seed=i, temperature=1.0))
              for i in range(4)]
  with GeneratorPool(build.make_engine(cfg, devices), params) as pool:
    samples = [s for f in [pool.submit(r) for r in requests] for s in f.result(timeout=300)]
  return ([s.completion_C.tolist() for s in samples],
          np.concatenate([s.logp_T[s.prompt_len:] for s in samples]))


def main(workdir):
  devices = jax.devices()
  assert len(devices) == 8, devices
  cfg = small_config(**{"model.n_heads": 4, "model.n_kv_heads": 2, "cpu.decode_threads": 1})
  params = jax.jit(models.init_params, static_argnums=0)(cfg.model, jax.random.key(0))
  one_tokens, one_logp = engine_outputs(cfg, params, devices[:1])
  tp_tokens, tp_logp = engine_outputs(cfg, params, devices[2:4])
  tp_engine = build.make_engine(cfg, devices[2:4])
  sharded = [x for x in jax.tree.leaves(tp_engine.load_params(params))
             if len(x.sharding.device_set) == 2 and not x.sharding.is_fully_replicated]

  run = dataclasses.replace(cfg, num_steps=3, placement=dataclasses.replace(
      cfg.placement, trainer_devices=4, devices_per_replica=2), mesh=dataclasses.replace(
          cfg.mesh, fsdp=4), rollout=dataclasses.replace(
              cfg.rollout, reward_fn="reward_fns_for_tests:length"))
  placed = build.split_devices(run.placement, devices, devices)
  summary = entry.run(run, workdir, echo=lambda _: None, progress=False)
  last = summary["history"][-1]
  start = build.make_trainer(run, jax.sharding.Mesh(np.array(devices[:4]).reshape(1, 4, 1),
                                                    ("data", "fsdp", "tensor"))).state.params
  end = restore_params(f"{workdir}/checkpoints", run.model)
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end)))
  print(json.dumps({
      "tp_tokens_equal": one_tokens == tp_tokens,
      "tp_logp_max_abs_diff": float(np.max(np.abs(one_logp - tp_logp))),
      "tp_sharded_leaves": len(sharded),
      "trainer_devices": [d.id for d in placed.trainer],
      "replica_devices": [[d.id for d in r] for r in placed.replicas],
      "end_version": summary["end_version"],
      "replica_tokens": [r["generated_tokens"] for r in last["workers"]["0"]["pool"]["replicas"]],
      "trained_tokens": [m["trained_tokens"] for m in summary["history"]],
      "params_moved": moved,
  }))


if __name__ == "__main__":
  main(sys.argv[1])
