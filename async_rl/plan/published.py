"""Published measurements the planner is checked against, with every input's source.

AReaL (arXiv 2505.24298) runs R1-distilled Qwen models on H800 nodes of 8 GPUs. Three
of its measurements are reproduced here:

  Table 1         wall-clock hours of 250 PPO steps, synchronous against asynchronous
                  AReaL on the same GPUs: 1.5B on 16 nodes, 7B on 24.
  Table 7         trained tokens/s of the 1.5B model on one node at 8k context, 64
                  prompts x 16 answers, against the staleness bound η (0 to 16).
  interruptible   generation tokens/s on 4 nodes with interruptible generation and
                  without it (our "retract" against "drain"), 1.5B and 7B.

The setup, with its sources:

  batch           512 prompts x 16 answers per step (Table 1): AReaL's benchmark settings
                  (inclusionAI/AReaL, benchmark/verl_v0_3_0_post1_312a8cb/README.md,
                  "following DAPO and VAPO").
  lengths         1,024 prompt tokens, at most the context minus the prompt new ("32k
                  context minus 1k prompt", the same README;
                  `ppo.gen.max_new_tokens=ctx-1024` in benchmark/verl_312a8cb/build_cmd.py).
  device split    from 4 nodes on, 3/4 of the GPUs run SGLang engines at tensor
                  parallelism 1 (1.5B and 7B) and 1/4 train (`get_allocation_mode` in
                  build_cmd.py); on one node, AReaL's own examples give 4 GPUs to SGLang
                  and 4 to training (`allocation_mode=sglang.d4p1m1+d2p2m1`).
  synchronous     AReaL's synchronous PPO runs on that same split, generation and
                  training alternating (its `run_sync_ppo.sh` example passes the same
                  allocation to training/main_sync_ppo.py): here, the asynchronous
                  placement at η = 0 (drain), not one of `search`'s colocated forms.
  staleness       η = 4 (`max_head_offpolicyness=4`, the setting the AReaL repository
                  gives for its asynchronous runs, examples/configs/v0.2-qwen2-math).
  model shapes    Qwen2.5-1.5B and -7B (the R1-distilled models keep their base's
                  shapes): `config.MODEL_PRESETS`; `QWEN25_CONFIGS` holds the family's
                  `config.json` shapes from 0.5B to 32B.

Not published, so assumed, and swept by the band (`plan.band`): the completion lengths
of the R1-distilled models during training (a lognormal of median 8,000 tokens and
log-sd 1.0, mean about 11k, 8% at a 32k context's cap; the same for both sizes, and
the same distribution cut at the cap of a shorter context), its spread, the slots per
engine (128), the memory fraction (`search.MEMORY_FRACTION`), and on one node the
device split; the update mode of the asynchronous engines ("retract": SGLang's
interruptible generation re-prefills); for the interruptible-generation figure, the
rest of its setup (Table 1's workload and split, η = 4, at 32k context).
"""

import dataclasses

import numpy as np

from async_rl.config import model_preset
from async_rl.plan.hardware import HARDWARE
from async_rl.plan.search import Cluster, Placement, Workload, max_kv_tokens

AREAL_LENGTHS = dict(length_dist="lognormal", length_median=8000.0, length_sigma=1.0)
PROMPT_TOKENS = 1024
SLOTS = 128


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
TABLE1_STEPS = 250
# η: trained tokens/s (thousands, one node, 1.5B, 8k context, 64 x 16).
AREAL_TABLE7 = ((0, 27.1e3), (1, 47.8e3), (2, 47.8e3), (4, 49.0e3), (8, 51.5e3), (16, 52.0e3))
# preset: (generation tokens/s with interruptible generation, without), on 4 nodes.
AREAL_INTERRUPTIBLE = (("qwen2.5-1.5b", 231e3, 207e3), ("qwen2.5-7b", 130e3, 111e3))
INTERRUPTIBLE_NODES = 4

# Hugging Face config.json shapes of the Qwen2.5 family (Qwen/Qwen2.5-*/config.json).
_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], hidden_act="silu", rms_norm_eps=1e-6,
               rope_theta=1000000.0, max_position_embeddings=32768, torch_dtype="bfloat16")
QWEN25_CONFIGS = {
    "0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, num_hidden_layers=24, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, num_hidden_layers=28, vocab_size=151936,
                 tie_word_embeddings=True),
    "3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
               num_key_value_heads=2, num_hidden_layers=36, vocab_size=151936,
               tie_word_embeddings=True),
    "7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
               num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064,
               tie_word_embeddings=False, max_position_embeddings=131072),
    "14b": dict(_QWEN25, hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                num_key_value_heads=8, num_hidden_layers=48, vocab_size=152064,
                tie_word_embeddings=False, rms_norm_eps=1e-5,
                max_position_embeddings=131072),
    "32b": dict(_QWEN25, hidden_size=5120, intermediate_size=27648, num_attention_heads=40,
                num_key_value_heads=8, num_hidden_layers=64, vocab_size=152064,
                tie_word_embeddings=False, rms_norm_eps=1e-5,
                max_position_embeddings=131072),
}


def areal_workload(preset: str, *, context: int = 32768, batch_groups: int = 512,
                   group_size: int = 16) -> Workload:
  """AReaL's workload for a model preset at a context length: the assumed lengths
  (`AREAL_LENGTHS`) cut at the context's cap. Where the cap is below the median, the
  cut distribution is handed over as a sample of it."""
  cap = context - PROMPT_TOKENS
  if AREAL_LENGTHS["length_median"] <= cap:
    lengths = dict(AREAL_LENGTHS)
  else:
    raw = AREAL_LENGTHS["length_median"] * np.exp(
        AREAL_LENGTHS["length_sigma"] * np.random.default_rng(0).standard_normal(4096))
    lengths = dict(length_dist="empirical",
                   length_samples=tuple(int(n) for n in np.clip(np.rint(raw), 1, cap)))
  return Workload(model_preset(preset), batch_groups=batch_groups, group_size=group_size,
                  prompt_tokens=PROMPT_TOKENS, max_new_tokens=cap, **lengths)


def areal_cluster(nodes: int) -> Cluster:
  return Cluster(HARDWARE["H800"], nodes, 8)


def areal_split(workload: Workload, cluster: Cluster, *, gen_devices: int,
                max_staleness: int, slots: int = SLOTS) -> Placement:
  """AReaL's placement: `gen_devices` SGLang engines at tensor parallelism 1, the rest
  training (FSDP over all of them), "retract" updates; at η = 0 its synchronous
  baseline (generation and training alternating on the same split, "drain")."""
  train = cluster.devices - gen_devices
  seq = workload.prompt_tokens + workload.max_new_tokens
  kv = max_kv_tokens(workload, cluster, tp=1, fsdp=train, form="async")
  return Placement("async", gen_devices=gen_devices, tp=1, train_devices=train, fsdp=train,
                   slots=slots, kv_tokens=min(kv, slots * seq), max_staleness=max_staleness,
                   update_mode="retract" if max_staleness else "drain")


def three_quarters(cluster: Cluster) -> int:
  """The generating devices of AReaL's split from 4 nodes on (`get_allocation_mode`)."""
  return cluster.devices // 4 * 3


def table1_setup(row: ArealRow, *, nodes: int = 0, max_staleness: int = 4):
  """The workload, the cluster (`nodes` overrides the row's) and the synchronous and
  asynchronous placements of one row of Table 1."""
  workload, cluster = areal_workload(row.preset), areal_cluster(nodes or row.nodes)
  gen = three_quarters(cluster)
  return (workload, cluster, areal_split(workload, cluster, gen_devices=gen, max_staleness=0),
          areal_split(workload, cluster, gen_devices=gen, max_staleness=max_staleness))


def table7_setup(max_staleness: int):
  """Table 7's workload, cluster (one node) and placement at η = `max_staleness`."""
  workload = areal_workload("qwen2.5-1.5b", context=8192, batch_groups=64)
  cluster = areal_cluster(1)
  return workload, cluster, areal_split(workload, cluster, gen_devices=4,
                                        max_staleness=max_staleness)


def interruptible_setup(preset: str, update_mode: str):
  """The interruptible-generation figure's workload, cluster and placement:
  "retract" (with it) or "drain" (without)."""
  workload, cluster = areal_workload(preset), areal_cluster(INTERRUPTIBLE_NODES)
  p = areal_split(workload, cluster, gen_devices=three_quarters(cluster), max_staleness=4)
  return workload, cluster, dataclasses.replace(p, update_mode=update_mode)
