"""Placements of an RL run on a cluster: what fits, and how fast each runs (simulated).

A `Workload` (model, batch, lengths) on a `Cluster` (hardware kind, nodes, devices per
node) runs in a `Placement`:

  sync, resident  every device generates, then every device trains (η = 0); the
                  generator's weights and KV cache stay beside the trainer's state;
  sync, offload   the same alternation as real synchronous systems run it (verl's
                  colocated engine: SGLang's `release_memory_occupation`, vLLM's sleep
                  mode): the generator's memory is released while the trainer runs and
                  the trainer's state waits in host memory while the engine generates,
                  so each has the whole device; the trainer's state crosses the host
                  link twice a step (`costs.swap_s`);
  async           disjoint generator and trainer devices, η > 0 (η = 0 on disjoint
                  devices is AReaL's own synchronous baseline, `published`).

`predict` turns a placement into a `sim.SimConfig` with the costs of `plan.costs` and
simulates it with the real staleness gate and admission buffer. `search` enumerates
placements, drops those that do not fit in a device's memory, ranks the rest by a
closed-form estimate, and simulates the best few.
"""

import dataclasses
import functools
import math
from typing import Optional

import numpy as np

from async_rl.config import GenerationConfig, ModelConfig
from async_rl.plan import costs
from async_rl.plan.hardware import Hardware
from async_rl.sim import SimConfig, sample_lengths, simulate

# The share of a device's memory a run may fill: what the runtime, the compiled
# programs' scratch and fragmentation leave. SGLang's `mem_fraction_static` defaults to
# about 0.8-0.9 (less at larger TP degrees), and AReaL's benchmark sets 0.7 above 1.5B
# (benchmark/verl_312a8cb/build_cmd.py); the middle is the nominal value, and the band
# (`plan.band`) sweeps the range.
MEMORY_FRACTION = 0.8
KV_BLOCK_SIZE = next(f.default for f in dataclasses.fields(GenerationConfig)
                     if f.name == "kv_block_size")
_WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one training step needs.

  Attributes:
    model: the model's shapes.
    batch_groups: prompt groups per step (B).
    group_size: samples per prompt (G).
    prompt_tokens: tokens of a prompt.
    max_new_tokens: the longest completion.
    length_dist, length_median, length_sigma, length_alpha, length_samples: the
      completion lengths, as `sim.SimConfig` takes them.
    reward_latency: seconds from a group's last token to its reward.
    train_tokens_per_mb: the trainer's micro-batch, in tokens (its activations).
  """
  model: ModelConfig
  batch_groups: int
  group_size: int
  prompt_tokens: int
  max_new_tokens: int
  length_dist: str = "lognormal"
  length_median: float = 1024.0
  length_sigma: float = 1.0
  length_alpha: float = 1.5
  length_samples: tuple[int, ...] = ()
  reward_latency: float = 0.0
  train_tokens_per_mb: int = 32768

  def length_fields(self) -> dict:
    return dict(length_dist=self.length_dist, length_median=self.length_median,
                length_sigma=self.length_sigma, length_alpha=self.length_alpha,
                length_samples=self.length_samples, max_length=self.max_new_tokens)

  def mean_length(self) -> float:
    """The mean completion length (from a fixed sample of the distribution)."""
    return float(self._lengths().mean())

  def mean_live_tokens(self) -> float:
    """The tokens a busy slot holds, averaged over time: a sample of n tokens holds a
    slot for n steps at n / 2 on average, so long samples weigh n times more:
    prompt + E[n^2] / (2 E[n])."""
    n = self._lengths()
    return self.prompt_tokens + float((n * n).mean() / (2 * n.mean()))

  def train_keys_per_token(self) -> float:
    """The keys a trained token's causal attention reads, averaged over the batch's
    tokens: (E[T^2] + E[T]) / (2 E[T]) over sequences of T = prompt + n tokens."""
    t = self.prompt_tokens + self._lengths()
    return float(((t * t).mean() + t.mean()) / (2 * t.mean()))

  def _lengths(self) -> np.ndarray:
    return _length_sample(tuple(sorted(self.length_fields().items())), self.prompt_tokens)


@functools.lru_cache(maxsize=64)
def _length_sample(fields: tuple, prompt_tokens: int) -> np.ndarray:
  cfg = SimConfig(prompt_tokens=prompt_tokens, **dict(fields))
  return sample_lengths(cfg, np.random.default_rng(0), 20000).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """`nodes` nodes of `devices_per_node` accelerators of kind `hardware`, of whose
  memory a run may fill `memory_fraction`."""
  hardware: Hardware
  nodes: int = 1
  devices_per_node: int = 8
  memory_fraction: float = MEMORY_FRACTION

  @property
  def devices(self) -> int:
    return self.nodes * self.devices_per_node

  @property
  def usable_bytes(self) -> float:
    return self.memory_fraction * self.hardware.hbm_bytes


@dataclasses.dataclass(frozen=True)
class Placement:
  """One way to run a workload on a cluster.

  Attributes:
    mode: "sync" (generation and training alternate on every device) or "async"
      (`gen_devices` generate while `train_devices` train).
    gen_devices: devices running generator engines.
    tp: devices per engine (tensor parallelism).
    train_devices: devices of the trainer.
    fsdp: the trainer's FSDP degree (params sharded over it; data-parallel across
      `train_devices / fsdp` replicas).
    slots: samples each engine decodes at once.
    kv_tokens: each engine's KV budget in tokens.
    max_staleness: η (0 in sync mode).
    update_mode: how new weights reach in-flight samples.
    steps_per_call: decode steps per host round trip of an engine (a slot whose sample
      ends within one waits for its end); 1 by default, where it costs reasoning-length
      samples next to nothing.
    offload: in sync mode, whether the generator's memory is released while the trainer
      runs (and the trainer's state waits on the host while the engine generates),
      rather than both staying resident.
    kv_block_size: tokens per KV block of the engines' paged cache.
  """
  mode: str
  gen_devices: int
  tp: int
  train_devices: int
  fsdp: int
  slots: int
  kv_tokens: int
  max_staleness: Optional[int]
  update_mode: str
  steps_per_call: int = 1
  offload: bool = False
  kv_block_size: int = KV_BLOCK_SIZE

  @property
  def engines(self) -> int:
    return self.gen_devices // self.tp

  @property
  def form(self) -> str:
    """"async", "sync, resident" or "sync, offload"."""
    if self.mode == "async":
      return "async"
    return "sync, offload" if self.offload else "sync, resident"


@dataclasses.dataclass(frozen=True)
class Prediction:
  """A placement's simulated steady state: throughput, where time goes, memory.

  `eta_bound` says whether η held the run back (the staleness gate shut on a free slot,
  or a group was dropped as too stale); if not, a larger η predicts the same.
  """
  placement: Placement
  samples_per_s: float
  tokens_per_s: float
  trained_tokens_per_s: float
  step_s: float
  generator_memory: float
  trainer_memory: float
  slot_occupancy: float
  generator_idle: float
  trainer_idle: float
  staleness_mean: float
  staleness_hist: tuple[int, ...]
  generator_shares: dict
  preempted_per_step: float
  eta_bound: bool

  @property
  def memory_per_device(self) -> float:
    """The largest use of one device's memory (both roles on each device in the
    resident sync form)."""
    p = self.placement
    if p.form == "sync, resident":
      return self.generator_memory + self.trainer_memory
    return max(self.generator_memory, self.trainer_memory)


def device_memory(workload: Workload, p: Placement) -> tuple[float, float]:
  """Bytes per device of a generator engine's device and of a trainer device."""
  m = costs.memory_per_device(workload.model, kv_tokens=p.kv_tokens,
                              block_size=p.kv_block_size, tp=p.tp, fsdp=p.fsdp,
                              train_tokens_per_mb=workload.train_tokens_per_mb)
  return m["generator"], m["trainer"]


def fits(workload: Workload, cluster: Cluster, p: Placement) -> bool:
  """Whether the placement's busiest device holds what it must in the usable memory."""
  gen, train = device_memory(workload, p)
  used = gen + train if p.form == "sync, resident" else max(gen, train)
  return used <= cluster.usable_bytes


def max_kv_tokens(workload: Workload, cluster: Cluster, *, tp: int, fsdp: int, form: str,
                  block_size: int = KV_BLOCK_SIZE) -> int:
  """The largest KV budget of an engine that fits beside the rest, in whole blocks
  (0 if none does, or if the trainer itself does not fit)."""
  m = costs.memory_per_device(workload.model, kv_tokens=0, block_size=block_size, tp=tp,
                              fsdp=fsdp, train_tokens_per_mb=workload.train_tokens_per_mb)
  if m["trainer"] > cluster.usable_bytes:
    return 0
  room = cluster.usable_bytes - m["generator"]
  if form == "sync, resident":
    room -= m["trainer"]
  per_token = costs.kv_bytes_per_token(workload.model) / min(tp, workload.model.n_kv_heads)
  return int(max(room, 0) // (per_token * block_size)) * block_size


def sim_config(workload: Workload, cluster: Cluster, p: Placement,
               measured: Optional[costs.MeasuredCosts] = None) -> SimConfig:
  """The placement as the simulator takes it, its costs from `plan.costs`; with
  `measured` (`plan.host`: the run's own engine and trainer timed on the devices), its
  decode, prefill and training costs are those instead."""
  model, hw = workload.model, cluster.hardware
  multi_node = cluster.nodes > 1
  trainer_multi_node = p.train_devices > cluster.devices_per_node
  step_base = costs.train_sync_s(model, hw, p.train_devices, crosses_nodes=trainer_multi_node)
  if p.form == "sync, offload":
    step_base += costs.swap_s(model, hw, fsdp=p.fsdp)
  cfg = SimConfig(
      mode=p.mode, num_generators=p.engines, trainer_accelerators=p.train_devices,
      slots=p.slots, decode=costs.decode_cost(model, hw, tp=p.tp, block_size=p.kv_block_size),
      prefill_per_token=costs.prefill_s_per_token(model, hw, workload.prompt_tokens, tp=p.tp),
      prompt_tokens=workload.prompt_tokens, kv_tokens=p.kv_tokens,
      reward_latency=workload.reward_latency,
      trainer_per_token=costs.train_s_per_token(model, hw, workload.train_keys_per_token()),
      trainer_step_base=step_base,
      weight_sync=costs.publish_s(model, hw, crosses_nodes=multi_node),
      max_staleness=p.max_staleness, batch_groups=workload.batch_groups,
      group_size=workload.group_size, update_mode=p.update_mode,
      steps_per_call=p.steps_per_call, **workload.length_fields())
  if measured is None:
    return cfg
  return dataclasses.replace(cfg, decode=measured.decode,
                             prefill_per_token=measured.prefill_per_token,
                             trainer_per_token=measured.train_per_token, trainer_step_base=0.0)


def predict(workload: Workload, cluster: Cluster, p: Placement, *, steps: int = 6,
            scale: int = 1, seed: int = 0,
            measured: Optional[costs.MeasuredCosts] = None) -> Prediction:
  """Simulates `steps` training steps and measures those after the first
  `_WARMUP_STEPS` (the pipeline's fill).

  `scale` > 1 simulates 1/scale of the system: the engines divided by it, the batch
  too (to whole groups: the nearest), and the trainer's devices too, by making each
  token cost as much more on them as the batch shrank, so each device sees the same
  load (the throughput is scaled back). The longest sample of a smaller batch is a
  little shorter, which flatters sync slightly. `measured`: as `sim_config` takes it.

  Raises:
    ValueError: if `scale` divides the engines unevenly.
  """
  cfg = sim_config(workload, cluster, p, measured)
  if scale > 1:
    if cfg.num_generators % scale:
      raise ValueError(f"scale {scale} must divide the {cfg.num_generators} engines")
    groups = max(1, round(cfg.batch_groups / scale))
    cfg = dataclasses.replace(
        cfg, num_generators=cfg.num_generators // scale, batch_groups=groups,
        trainer_per_token=cfg.trainer_per_token * cfg.batch_groups / groups)
  res = simulate(cfg, steps, seed)
  ends = res.step_end_times
  step_s = (ends[-1] - ends[_WARMUP_STEPS - 1]) / (steps - _WARMUP_STEPS)
  samples = workload.batch_groups * workload.group_size
  generated = res.trained_tokens / res.trained_samples
  gen, train = device_memory(workload, p)
  return Prediction(
      placement=p, samples_per_s=samples / step_s,
      tokens_per_s=generated * samples / step_s,
      trained_tokens_per_s=(generated + workload.prompt_tokens) * samples / step_s,
      step_s=step_s, generator_memory=gen, trainer_memory=train,
      slot_occupancy=res.slot_occupancy, generator_idle=res.generator_idle,
      trainer_idle=res.trainer_idle, staleness_mean=res.staleness_mean,
      staleness_hist=tuple(res.staleness_hist), generator_shares=res.generator_shares,
      preempted_per_step=res.preempted / steps,
      eta_bound=res.gate_closed > 0 or res.dropped_groups > 0)


def predict_scaled(workload: Workload, cluster: Cluster, p: Placement, *, steps: int = 6,
                   max_simulated_samples: int = 1024) -> Prediction:
  """`predict` on the smallest fraction of the system that keeps the simulated batch
  within `max_simulated_samples` samples (`sim_scale`)."""
  return predict(workload, cluster, p, steps=steps,
                 scale=sim_scale(workload, p, max_simulated_samples))


def estimate_samples_per_s(workload: Workload, cluster: Cluster, p: Placement) -> float:
  """A closed-form steady state, to rank placements before simulating them.

  Generation: every engine keeps its slots full (as many as the KV budget holds), each
  holding `Workload.mean_live_tokens` on average, and prefills its share of the batch's
  prompts; in async mode each new version also costs it the weights' transfer and,
  under "retract", a prefill of every sample it holds. Training: its per-token cost.
  Async runs at the slower of the two; sync pays both in turn, and its generation lasts
  as long as the longest sample of the batch (taken at the length cap).
  """
  cfg = sim_config(workload, cluster, p)
  mean = workload.mean_length()
  live_per_sample = workload.mean_live_tokens()
  active = max(1, min(p.slots, int(p.kv_tokens // live_per_sample)))
  samples = workload.batch_groups * workload.group_size
  step = cfg.decode.step_s(active, int(active * live_per_sample))
  gen_samples_per_s = p.engines * active / (step * mean)
  train_s = cfg.trainer_step_base + cfg.trainer_per_token * samples * (
      workload.prompt_tokens + mean) / p.train_devices + cfg.weight_sync
  per_engine = math.ceil(samples / p.engines)
  prompts_s = cfg.prefill_per_token * workload.prompt_tokens * per_engine
  if p.mode == "async":
    update_s = cfg.weight_sync
    if p.update_mode == "retract":
      update_s += cfg.prefill_per_token * active * live_per_sample
    gen_s = samples / gen_samples_per_s + prompts_s + update_s
    return min(samples / gen_s, samples / train_s)
  waves = max(1, per_engine / active)
  tail = workload.max_new_tokens * cfg.decode.step_s(
      1, workload.prompt_tokens + workload.max_new_tokens)
  gen_s = max(waves * step * mean, tail) + prompts_s
  return samples / (gen_s + train_s)


def fsdp_degrees(cluster: Cluster, train_devices: int) -> list[int]:
  """The trainer's FSDP degrees tried: a node, every power-of-two number of nodes that
  divides the trainer, and the whole trainer (a sharded trainer spans as many nodes as
  it needs)."""
  per_node = cluster.devices_per_node
  out = {min(train_devices, per_node), train_devices}
  k = per_node
  while k < train_devices:
    if train_devices % k == 0:
      out.add(k)
    k *= 2
  return sorted(out)


def tp_degrees(cluster: Cluster) -> list[int]:
  """The engines' tensor-parallel degrees tried: powers of two within a node."""
  per_node = cluster.devices_per_node
  return [t for t in (1, 2, 4, 8) if t <= per_node and per_node % t == 0]


def candidates(workload: Workload, cluster: Cluster, *, mode: str,
               etas=(1, 2, 4, 8), update_modes=("retract", "keep"),
               slots=(64, 128, 256), gen_fractions=(0.5, 0.625, 0.75, 0.875),
               tps=None) -> list:
  """Every placement of `mode` that fits in memory (in sync mode, both forms), its KV
  budget the most that fits (and no more than its slots at full length)."""
  n = cluster.devices
  seq = workload.prompt_tokens + workload.max_new_tokens
  out = []
  for tp in tps or tp_degrees(cluster):
    if mode == "sync":
      splits = [(n, n)]
    else:
      splits = sorted({(g, n - g) for f in gen_fractions
                       for g in [int(round(n * f / tp)) * tp] if 0 < g < n})
    forms = ("sync, resident", "sync, offload") if mode == "sync" else ("async",)
    for (gen, train), form in ((s, f) for s in splits for f in forms):
      for fsdp in fsdp_degrees(cluster, train):
        kv_max = max_kv_tokens(workload, cluster, tp=tp, fsdp=fsdp, form=form)
        if kv_max < seq:
          continue
        for s in slots:
          base = dict(mode=mode, gen_devices=gen, tp=tp, train_devices=train, fsdp=fsdp,
                      slots=s, kv_tokens=min(kv_max, s * seq))
          if mode == "sync":
            out.append(Placement(max_staleness=0, update_mode="drain",
                                 offload=form == "sync, offload", **base))
          else:
            out.extend(Placement(max_staleness=eta, update_mode=u, **base)
                       for eta in etas for u in update_modes)
  return [p for p in out if fits(workload, cluster, p)]


def search(workload: Workload, cluster: Cluster, *, top: int = 3, steps: int = 6,
           max_simulated_samples: int = 1024, **grid) -> dict[str, list[Prediction]]:
  """The best placements of each mode, simulated, fastest first.

  Candidates are ranked by `estimate_samples_per_s`; of the `top` best distinct shapes
  (η and update mode aside) the best is simulated at every η and update mode of the
  grid, the others at the grid's middle ones; each at a scale that keeps its simulated
  batch within `max_simulated_samples` samples (`sim_scale`). A run that η never held
  back (`Prediction.eta_bound`) stands for the same shape and update mode at every
  larger η, unsimulated.
  """
  out = {}
  for mode in ("sync", "async"):
    cands = candidates(workload, cluster, mode=mode, **grid)
    estimates = {}
    for p in cands:
      if _shape(p) not in estimates:
        estimates[_shape(p)] = estimate_samples_per_s(workload, cluster, p)
    # The best `top` shapes, whatever their FSDP degree; between equal estimates, the
    # larger degree (less memory per device).
    best = {}
    for shape in sorted(estimates, key=lambda k: (-estimates[k], -k[3])):
      layout = shape[:3] + shape[4:]
      if layout not in best and len(best) < top:
        best[layout] = shape
    first = next(iter(best.values()), None)
    etas = sorted({p.max_staleness for p in cands})
    modes = sorted({p.update_mode for p in cands})
    middle = (etas[len(etas) // 2] if etas else 0, modes[-1] if modes else "drain")
    chosen = [p for p in cands if _shape(p) in best.values() and (
        _shape(p) == first or (p.max_staleness, p.update_mode) == middle)]
    preds, unbound = [], {}
    for p in sorted(chosen, key=lambda p: (_shape(p), p.update_mode, p.max_staleness)):
      same = unbound.get((_shape(p), p.update_mode))
      if same is not None:  # A smaller η never held it back: the same events.
        preds.append(dataclasses.replace(same, placement=p))
        continue
      pred = predict_scaled(workload, cluster, p, steps=steps,
                            max_simulated_samples=max_simulated_samples)
      preds.append(pred)
      if not pred.eta_bound:
        unbound[(_shape(p), p.update_mode)] = pred
    out[mode] = sorted(preds, key=lambda r: -r.samples_per_s)
  return out


def _shape(p: Placement) -> tuple:
  return (p.gen_devices, p.tp, p.train_devices, p.fsdp, p.slots, p.offload)


def sim_scale(workload: Workload, p: Placement, limit: int) -> int:
  """The smallest divisor of the engines that brings the batch within `limit` samples
  (`predict`'s `scale`), preferring one that divides the batch's groups too (the
  batch then shrinks exactly); the engine count if none does."""
  divisors = [k for k in range(1, p.engines + 1) if p.engines % k == 0]
  fitting = [k for k in divisors
             if max(1, round(workload.batch_groups / k)) * workload.group_size <= limit]
  exact = [k for k in fitting if workload.batch_groups % k == 0]
  return (exact or fitting or [p.engines])[0]
