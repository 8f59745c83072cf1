"""The hardware table: what one accelerator of each kind can do, each figure with its source.

Peak FLOP/s are dense bf16 tensor-core rates (no sparsity); bandwidths are bytes per
second per device, one direction. `nvlink_bw` is what one device can send to another of
its node; `network_bw` what it can send to another node (one NIC per GPU). Three
constants describe what the kernels and the serving engine make of those rates, one
value per kind and never per experiment:

  decode_eff       the fraction of `hbm_bw` a decode step's reads achieve (paged
                   attention and weight-streaming GEMV kernels are bandwidth bound).
  mfu              the fraction of `peak_flops` a prefill or a training step achieves
                   (model FLOPs utilisation).
  step_overhead_s  the serving engine's fixed cost per decode step, whatever it reads:
                   kernel launches (one per op of every layer, even from a CUDA graph),
                   sampling over the vocabulary, and the scheduler's bookkeeping. It is
                   small beside a 7B model's step but of the order of a 1.5B model's, and
                   it sets the pace of a batch's tail, where one slot decodes for
                   thousands of steps.

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
class Hardware:
  """One accelerator kind; rates per device, bytes in SI units.

  Attributes:
    name: the kind's name (`HARDWARE`'s key).
    peak_flops: dense bf16 matmul FLOP/s.
    hbm_bw: memory bandwidth, bytes/s.
    hbm_bytes: memory capacity, bytes.
    nvlink_bw: device-to-device bandwidth within a node, bytes/s per direction.
    network_bw: bandwidth to another node, bytes/s per device.
    link_latency_s: the latency of one small collective within a node.
    decode_eff: achieved fraction of `hbm_bw` in a decode step.
    mfu: achieved fraction of `peak_flops` in prefill and training.
    step_overhead_s: a serving engine's fixed time per decode step.
    source: where the figures come from.
  """
  name: str
  peak_flops: float
  hbm_bw: float
  hbm_bytes: float
  nvlink_bw: float
  network_bw: float
  link_latency_s: float
  decode_eff: float
  mfu: float
  step_overhead_s: float
  source: str


# The efficiency constants, shared by the kinds they were measured on.
# decode_eff: FlashInfer (arXiv 2501.01005) measures its decode attention kernels at
#   70-80% of HBM bandwidth on Hopper and Ampere; 0.7 is the low end.
# mfu: Megatron-LM (arXiv 2104.04473, Table 1) reaches 44-52% of A100 peak on GPT
#   models; on Hopper, MegaScale (arXiv 2402.15627) and NVIDIA's Megatron-Core
#   performance tables report about 40% for models of a few billion params, whose
#   small matmuls fill the larger chip less.
_DECODE_EFF = 0.7
_MFU_AMPERE = 0.45
_MFU_HOPPER = 0.40
_MFU_BLACKWELL = 0.40
_NCCL_LATENCY_S = 10e-6  # nccl-tests: small all-reduce within an NVLink node, ~10 us.
# step_overhead_s: Qwen's speed benchmark of SGLang 0.4.6 (qwen.readthedocs.io, "Speed
#   Benchmark", Qwen3 series, one H20 of 4.0 TB/s, batch 1) decodes Qwen3-0.6B at 414
#   tokens/s: 2.41 ms a step, of which reading its 1.19 GB of weights and ~0.12 GB of
#   keys and values at `_DECODE_EFF` explains 0.47 ms; the rest, 1.9 ms, is the engine's
#   per-step cost. The same benchmark's larger models decode slower still than weights
#   plus 1.9 ms at `_DECODE_EFF` (Qwen3-8B: 12.2 ms against 7.4 ms), so it is a lower
#   bound. It is the engine's and the host's, not the GPU's: the same for every kind.
_STEP_OVERHEAD_S = 1.9e-3

HARDWARE: dict[str, Hardware] = {
    h.name: h for h in (
        Hardware("H800", peak_flops=989e12, hbm_bw=3.35e12, hbm_bytes=80 * GB,
                 nvlink_bw=200 * GB, network_bw=50 * GB, link_latency_s=_NCCL_LATENCY_S,
                 decode_eff=_DECODE_EFF, mfu=_MFU_HOPPER, step_overhead_s=_STEP_OVERHEAD_S,
                 source="NVIDIA H800 SXM datasheet (NVLink 400 GB/s bidirectional); "
                        "400 Gb/s NIC per GPU"),
        Hardware("H100", peak_flops=989e12, hbm_bw=3.35e12, hbm_bytes=80 * GB,
                 nvlink_bw=450 * GB, network_bw=50 * GB, link_latency_s=_NCCL_LATENCY_S,
                 decode_eff=_DECODE_EFF, mfu=_MFU_HOPPER, step_overhead_s=_STEP_OVERHEAD_S,
                 source="NVIDIA H100 SXM datasheet (NVLink 900 GB/s bidirectional); "
                        "ConnectX-7 400 Gb/s per GPU"),
        Hardware("H200", peak_flops=989e12, hbm_bw=4.8e12, hbm_bytes=141 * GB,
                 nvlink_bw=450 * GB, network_bw=50 * GB, link_latency_s=_NCCL_LATENCY_S,
                 decode_eff=_DECODE_EFF, mfu=_MFU_HOPPER, step_overhead_s=_STEP_OVERHEAD_S,
                 source="NVIDIA H200 SXM datasheet (NVLink 900 GB/s bidirectional); "
                        "ConnectX-7 400 Gb/s per GPU"),
        Hardware("A100-80GB", peak_flops=312e12, hbm_bw=2.039e12, hbm_bytes=80 * GB,
                 nvlink_bw=300 * GB, network_bw=25 * GB, link_latency_s=_NCCL_LATENCY_S,
                 decode_eff=_DECODE_EFF, mfu=_MFU_AMPERE, step_overhead_s=_STEP_OVERHEAD_S,
                 source="NVIDIA A100 80GB SXM datasheet (NVLink 600 GB/s bidirectional); "
                        "HDR 200 Gb/s per GPU"),
        Hardware("B200", peak_flops=2.25e15, hbm_bw=8.0e12, hbm_bytes=180 * GB,
                 nvlink_bw=900 * GB, network_bw=50 * GB, link_latency_s=_NCCL_LATENCY_S,
                 decode_eff=_DECODE_EFF, mfu=_MFU_BLACKWELL, step_overhead_s=_STEP_OVERHEAD_S,
                 source="NVIDIA HGX B200 datasheet (per GPU: 1/8 of the board, dense; "
                        "NVLink 1.8 TB/s bidirectional); ConnectX-7 400 Gb/s per GPU"),
    )
}
HOST = "host"


def measure_host(size: int = 1024, reps: int = 5, copy_bytes: int = 2**27) -> Hardware:
  """"this machine": its best jitted float32 matmul rate and array-copy bandwidth.

  A CPU's processes share one memory, so its links are the copy bandwidth too, and its
  capacity is the physical memory.
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
                  network_bw=bw, link_latency_s=0.0, decode_eff=1.0, mfu=1.0,
                  step_overhead_s=0.0,
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
  fields["name"] = f"{HOST} cores {sorted(cores)}"
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
