"""The hardware table: what one accelerator of each kind can do, each figure with its source.

Peak FLOP/s are dense bf16 tensor-core rates (no sparsity); bandwidths are bytes per
second per device, one direction. `nvlink_bw` is what one device can send to another of
its node; `network_bw` what it can send to another node (one NIC per GPU);
`host_link_bw` what it can move to and from its host's memory (PCIe).

What the kernels and the serving engine make of those rates is an `Efficiency`, one per
architecture, each figure from a published measurement; `plan.costs` turns it into
functions of the model's shapes and the parallelism (a device's share of the matmuls,
its share of the reads).

"this machine" (`measure_host`) is measured when asked for: a jitted float32 matmul for
the peak and a large array copy for the bandwidth, so its efficiencies are 1.0 (the
measurement already is what runs) and its step overhead 0.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """What kernels and a serving engine achieve of a device's rates.

  Attributes:
    matmul: two (matmul params a device holds, fraction of peak) points: a training or
      prefill step's GEMMs reach the fraction, log-linear in the params between and
      beyond them (`costs.matmul_eff`).
    attention: the fraction of peak the attention kernels reach, forward and backward.
    decode_read: the fraction of HBM bandwidth a decode step's reads reach (its
      weights, and the keys and values of its live tokens).
    step_overhead_s: a serving engine's fixed time per decode step, whatever it reads:
      kernel launches, sampling over the vocabulary, the scheduler's bookkeeping. It is
      of the order of a small model's whole step and sets the pace of a batch's tail,
      where one slot decodes for thousands of steps.
    source: where each figure comes from.
  """
  matmul: tuple[tuple[float, float], tuple[float, float]]
  attention: float
  decode_read: float
  step_overhead_s: float
  source: str


# The serving engine's decode step. FlashInfer (arXiv 2501.01005) measures its decode
# attention kernels at 70-80% of HBM bandwidth on Hopper and Ampere; 0.7, the low end,
# is taken for every read of a decode step (weights and keys and values). Qwen's speed
# benchmark of SGLang 0.4.6 (qwen.readthedocs.io, "Speed Benchmark", Qwen3 series, one
# H20 of 4.0 TB/s, batch 1) decodes Qwen3-0.6B at 414 tokens/s: 2.41 ms a step, of which
# reading its 1.19 GB of weights and ~0.12 GB of keys and values at 0.7 explains 0.47
# ms; the rest, 1.9 ms, is the engine's per-step cost, the same on every kind (it is
# the engine's and its host's). The same benchmark's Qwen3-8B takes 12.2 ms a step
# where weights plus 1.9 ms give 7.4: on that H20 a large model's batch-1 step reads
# below 0.7, so at small batch the step is a lower bound.
_DECODE_READ = 0.7
_STEP_OVERHEAD_S = 1.9e-3
_ENGINE = ("decode: FlashInfer, arXiv 2501.01005; Qwen's SGLang 0.4.6 speed benchmark, "
           "batch 1 (Qwen3-0.6B)")

HOPPER = Efficiency(
    # Megatron-LM (github.com/NVIDIA/Megatron-LM, "Training Speed and Scalability"): on
    # H100, weak-scaled GPT models reach 41% MFU at the smallest, 2B params, and 47-48%
    # at the largest, 462B ("larger GEMMs have higher arithmetic intensity").
    matmul=((2e9, 0.41), (462e9, 0.475)),
    # FlashAttention-3 (arXiv 2407.08608): FlashAttention-2, whose variable-length kernels
    # the trainers of verl and AReaL call, reaches 35% of an H100's peak.
    attention=0.35,
    decode_read=_DECODE_READ, step_overhead_s=_STEP_OVERHEAD_S,
    source="matmul: Megatron-LM README, H100 weak scaling; attention: FlashAttention-3 "
           "paper (FlashAttention-2 on H100); " + _ENGINE)
AMPERE = Efficiency(
    # Megatron-LM (arXiv 2104.04473, Table 1): GPT models on A100 reach 44% of peak at
    # 1.7B params and 52% at 1T.
    matmul=((1.7e9, 0.44), (1e12, 0.52)),
    # FlashAttention-2 (arXiv 2307.08691): forward and backward at 50-73% of an A100's
    # peak; 0.5 is the low end.
    attention=0.5,
    decode_read=_DECODE_READ, step_overhead_s=_STEP_OVERHEAD_S,
    source="matmul: Megatron-LM paper, Table 1 (A100); attention: FlashAttention-2 paper; "
           + _ENGINE)
# No published measurement of these kernels on Blackwell was at hand: Hopper's figures,
# a lower bound for a newer chip.
BLACKWELL = dataclasses.replace(HOPPER, source="Hopper's figures (none published for "
                                "Blackwell at hand): " + HOPPER.source)
MEASURED = Efficiency(matmul=((1.0, 1.0), (2.0, 1.0)), attention=1.0, decode_read=1.0,
                      step_overhead_s=0.0,
                      source="measured: the rates already are what runs")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator kind; rates per device, bytes in SI units.

  Attributes:
    name: the kind's name (`HARDWARE`'s key).
    peak_flops: dense bf16 matmul FLOP/s.
    hbm_bw: memory bandwidth, bytes/s.
    hbm_bytes: memory capacity, bytes.
    nvlink_bw: device-to-device bandwidth within a node, bytes/s per direction.
    network_bw: bandwidth to another node, bytes/s per device.
    host_link_bw: bandwidth to and from the host's memory, bytes/s per direction.
    link_latency_s: the latency of one small collective within a node.
    efficiency: what kernels and the serving engine make of these rates.
    source: where the rates come from.
  """
  name: str
  peak_flops: float
  hbm_bw: float
  hbm_bytes: float
  nvlink_bw: float
  network_bw: float
  host_link_bw: float
  link_latency_s: float
  efficiency: Efficiency
  source: str


_NCCL_LATENCY_S = 10e-6  # nccl-tests: small all-reduce within an NVLink node, ~10 us.
_PCIE5 = 64 * GB  # PCIe Gen5 x16, per direction (the datasheets' 128 GB/s both ways)
_PCIE4 = 32 * GB  # PCIe Gen4 x16, per direction (64 GB/s both ways)

HARDWARE: dict[str, Hardware] = {
    h.name: h for h in (
        Hardware("H800", peak_flops=989e12, hbm_bw=3.35e12, hbm_bytes=80 * GB,
                 nvlink_bw=200 * GB, network_bw=50 * GB, host_link_bw=_PCIE5,
                 link_latency_s=_NCCL_LATENCY_S, efficiency=HOPPER,
                 source="NVIDIA H800 SXM datasheet (NVLink 400 GB/s bidirectional, PCIe "
                        "Gen5 128 GB/s); 400 Gb/s NIC per GPU"),
        Hardware("H100", peak_flops=989e12, hbm_bw=3.35e12, hbm_bytes=80 * GB,
                 nvlink_bw=450 * GB, network_bw=50 * GB, host_link_bw=_PCIE5,
                 link_latency_s=_NCCL_LATENCY_S, efficiency=HOPPER,
                 source="NVIDIA H100 SXM datasheet (NVLink 900 GB/s bidirectional, PCIe "
                        "Gen5 128 GB/s); ConnectX-7 400 Gb/s per GPU"),
        Hardware("H200", peak_flops=989e12, hbm_bw=4.8e12, hbm_bytes=141 * GB,
                 nvlink_bw=450 * GB, network_bw=50 * GB, host_link_bw=_PCIE5,
                 link_latency_s=_NCCL_LATENCY_S, efficiency=HOPPER,
                 source="NVIDIA H200 SXM datasheet (NVLink 900 GB/s bidirectional, PCIe "
                        "Gen5 128 GB/s); ConnectX-7 400 Gb/s per GPU"),
        Hardware("A100-80GB", peak_flops=312e12, hbm_bw=2.039e12, hbm_bytes=80 * GB,
                 nvlink_bw=300 * GB, network_bw=25 * GB, host_link_bw=_PCIE4,
                 link_latency_s=_NCCL_LATENCY_S, efficiency=AMPERE,
                 source="NVIDIA A100 80GB SXM datasheet (NVLink 600 GB/s bidirectional, "
                        "PCIe Gen4 64 GB/s); HDR 200 Gb/s per GPU"),
        Hardware("B200", peak_flops=2.25e15, hbm_bw=8.0e12, hbm_bytes=180 * GB,
                 nvlink_bw=900 * GB, network_bw=50 * GB, host_link_bw=_PCIE5,
                 link_latency_s=_NCCL_LATENCY_S, efficiency=BLACKWELL,
                 source="NVIDIA HGX B200 datasheet (per GPU: 1/8 of the board, dense; "
                        "NVLink 1.8 TB/s bidirectional, PCIe Gen5); ConnectX-7 400 Gb/s "
                        "per GPU"),
    )
}
HOST = "host"


def measure_host(size: int = 1024, reps: int = 5, copy_bytes: int = 2**27) -> Hardware:
  """"this machine": its best jitted float32 matmul rate and array-copy bandwidth.

  A CPU's processes share one memory, so its links (to other devices and to the host)
  are the copy bandwidth too, and its capacity is the physical memory.
  """
  import jax  # noqa: PLC0415 - the table needs no JAX; only measuring does
  import jax.numpy as jnp  # noqa: PLC0415
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, a))
  best = min(_timed(lambda: jax.block_until_ready(matmul(a, a))) for _ in range(reps))
  peak = 2 * size**3 / best
  src = np.ones(copy_bytes // 8)
  dst = np.empty_like(src)
  copy = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
  bw = 2 * copy_bytes / copy  # a copy reads and writes every byte
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return Hardware(HOST, peak_flops=peak, hbm_bw=bw, hbm_bytes=float(memory), nvlink_bw=bw,
                  network_bw=bw, host_link_bw=bw, link_latency_s=0.0, efficiency=MEASURED,
                  source=f"measured: jitted {size}x{size} float32 matmul, "
                         f"{copy_bytes >> 20} MiB copy")


def measure_cores(cores: set[int], **sizes) -> Hardware:
  """`measure_host(**sizes)` in a fresh process pinned to `cores` (XLA sizes its thread
  pool by the cores it may use), so a share of this machine is measured as it runs,
  under whatever else runs on it."""
  code = ("import dataclasses, json, os, sys; os.sched_setaffinity(0, set(json.loads("
          "sys.argv[1]))); from async_rl.plan.hardware import measure_host; "
          "print(json.dumps(dataclasses.asdict(measure_host(**json.loads(sys.argv[2])))))")
  out = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(cores)),
                        json.dumps(sizes)], capture_output=True, text=True, check=True)
  fields = json.loads(out.stdout.strip().splitlines()[-1])
  fields.update(name=f"{HOST} cores {sorted(cores)}", efficiency=MEASURED)
  return Hardware(**fields)


def hardware(name: str) -> Hardware:
  """The table's entry `name`, or "host" measured now; an unknown name raises ValueError."""
  if name == HOST:
    return measure_host()
  if name not in HARDWARE:
    raise ValueError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)} or {HOST!r}")
  return HARDWARE[name]


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start
