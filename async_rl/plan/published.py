"""Published measurements the planner is checked against, with every input's source.

AReaL (arXiv 2505.24298), Table 1: wall-clock hours of 250 PPO steps of the
R1-distilled Qwen models on H800 nodes of 8 GPUs, synchronous AReaL against
asynchronous AReaL on the same GPUs. The setup:

  batch           512 prompts x 16 answers per step: AReaL's benchmark settings
                  (inclusionAI/AReaL, benchmark/verl_v0_3_0_post1_312a8cb/README.md,
                  "following DAPO and VAPO").
  lengths         1,024 prompt tokens, at most 31,744 new ("32k context minus 1k
                  prompt", the same README; `ppo.gen.max_new_tokens=ctx-1024` in
                  benchmark/verl_312a8cb/build_cmd.py).
  device split    3/4 of the GPUs run SGLang engines at tensor parallelism 1 (1.5B and
                  7B), 1/4 train (`get_allocation_mode` in build_cmd.py).
  staleness       η = 4 (`max_head_offpolicyness=4`, the setting the AReaL repository
                  gives for its asynchronous runs, examples/configs/v0.2-qwen2-math).
  model shapes    Qwen2.5-1.5B and -7B (the R1-distilled models keep their base's
                  shapes): `config.MODEL_PRESETS`.

Not published, so assumed: the completion lengths of the R1-distilled models during
training, taken as a lognormal of median 8,000 tokens and log-sd 1.0 (mean about 11k,
4% at the cap), the same for both sizes; the synchronous baseline as this project runs
it (every GPU generates at tensor parallelism 1, then every GPU trains, FSDP within a
node); the update mode of the asynchronous engines ("retract": SGLang's interruptible
generation re-prefills); 128 slots per engine and SGLang's memory use
(`search.USABLE_MEMORY`), the KV budget being what is left.
"""

import dataclasses

from async_rl.config import model_preset
from async_rl.plan.hardware import HARDWARE
from async_rl.plan.search import (Cluster, Placement, Prediction, Workload, max_kv_tokens,
                                  predict, sim_scale)

AREAL_LENGTHS = dict(length_dist="lognormal", length_median=8000.0, length_sigma=1.0)


@dataclasses.dataclass(frozen=True)
class ArealRow:
  """One row of AReaL's Table 1: hours of 250 steps, synchronous and asynchronous."""
  preset: str
  nodes: int
  sync_hours: float
  async_hours: float

  @property
  def speedup(self) -> float:
    return self.sync_hours / self.async_hours


AREAL_TABLE1 = (ArealRow("qwen2.5-1.5b", 16, 41.0, 14.8), ArealRow("qwen2.5-7b", 24, 57.7, 25.4))


def areal_setup(row: ArealRow, *, nodes: int = 0, max_staleness: int = 4):
  """The workload, the cluster (`nodes` overrides the row's) and the sync and async
  placements of one row."""
  workload = Workload(model_preset(row.preset), batch_groups=512, group_size=16,
                      prompt_tokens=1024, max_new_tokens=31744, **AREAL_LENGTHS)
  cluster = Cluster(HARDWARE["H800"], nodes or row.nodes, 8)
  n = cluster.devices
  gen = n // 4 * 3
  sync = Placement("sync", gen_devices=n, tp=1, train_devices=n, fsdp=8, slots=128,
                   kv_tokens=max_kv_tokens(workload, cluster, tp=1, fsdp=8, sync=True),
                   max_staleness=0, update_mode="drain")
  train = n - gen
  asyn = Placement("async", gen_devices=gen, tp=1, train_devices=train, fsdp=train,
                   slots=128,
                   kv_tokens=max_kv_tokens(workload, cluster, tp=1, fsdp=train, sync=False),
                   max_staleness=max_staleness, update_mode="retract")
  return workload, cluster, sync, asyn


def predict_pair(row: ArealRow, *, nodes: int = 0, max_staleness: int = 4,
                 max_simulated_samples: int = 512) -> tuple[Prediction, Prediction]:
  """The simulated sync and async runs of `areal_setup`, each on the same fraction of
  the system (`search.predict`'s `scale`)."""
  workload, cluster, sync, asyn = areal_setup(row, nodes=nodes, max_staleness=max_staleness)
  scale = sim_scale(workload, asyn, max_simulated_samples)
  return (predict(workload, cluster, sync, steps=5, scale=scale),
          predict(workload, cluster, asyn, steps=5, scale=scale))
