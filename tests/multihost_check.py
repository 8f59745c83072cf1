"""A few training steps of the micro config on a trainer spread over processes.

  python tests/multihost_check.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS OUT

With NUM_PROCESSES > 1 each process calls `jax.distributed.initialize` (CPU, gloo
collectives) and owns DEVICES_PER_PROCESS fake devices of one global mesh; with 1 it
is the single-process reference on as many devices. Every process builds the same
batches (fixed seeds) and runs `Trainer.train` on them; process 0 writes the final
params and the per-step losses to OUT (.npz).
"""

import os
import sys

PROCESS_ID, NUM_PROCESSES, PORT, DEVICES, OUT = sys.argv[1:6]
# Only the device count: the comparison is of the programs users run, compiled with
# XLA's default optimisations, not the test session's faster-to-compile ones, whose
# rounding differs between the two meshes by a few ulps more.
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
import numpy as np  # noqa: E402

if int(NUM_PROCESSES) > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=int(NUM_PROCESSES),
                             process_id=int(PROCESS_ID))

from async_rl import sharding  # noqa: E402
from async_rl.rl import build  # noqa: E402
from async_rl.trajectory import Group, Trajectory  # noqa: E402
from rl_test_utils import small_config  # noqa: E402

STEPS = 3


def _groups(cfg, step):
  rng = np.random.default_rng(step)
  groups = []
  for g in range(cfg.batch_groups):
    prompt = rng.integers(3, cfg.model.vocab_size, 6)
    trajs = []
    for _ in range(cfg.generation.group_size):
      n = int(rng.integers(2, cfg.generation.max_new_tokens))
      trajs.append(Trajectory.from_completion(
          prompt, rng.integers(3, cfg.model.vocab_size, n), rng.normal(-3.0, 0.3, n),
          np.full(n, step, np.int32), "stop", reward=float(rng.random())))
    groups.append(Group(f"p{step}/{g}", trajs))
  return groups


def main():
  # Adam's eps >> |gradient| makes the update linear in the gradient (like SGD), so
  # the reduction-order rounding of tiny gradients is not amplified into the params.
  cfg = small_config(**{"batching.max_tokens_per_mb": 48, "optimizer.eps": 1.0,
                        "optimizer.learning_rate": 1e-2})
  mesh = sharding.make_mesh(cfg.mesh)
  trainer = build.make_trainer(cfg, mesh)
  losses = [trainer.train(_groups(cfg, step))["loss"] for step in range(STEPS)]
  params = trainer.host_params()
  if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(OUT, losses=np.array(losses), devices=jax.device_count(), **flat)


if __name__ == "__main__":
  main()
