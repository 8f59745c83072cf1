"""A discrete-event simulation of generators, reward, buffer, trainer and weight updates.

Events are decode-segment ends: between two of them a generator's occupancy, and so
its step time, is constant, so a segment runs until its shortest sample finishes, or
until the next decode-step boundary after something the generator must react to (new
weights, freed gate capacity). Admission goes through the real `StalenessGate`
(acquired at the generator's weights version) and the real `AdmissionBuffer` (a
group with a token older than v - η is dropped when offered or, while waiting, when v
moves; the trainer takes the oldest groups first): a finished group is offered as a
`trajectory.Group` that carries one token of each version that generated its tokens.
With stale groups dropped (the buffer's default), its decisions depend only on the
oldest and newest versions of a group's trained tokens, so they are those of the full
group; the token counts (trained tokens, the staleness histogram) are kept here, from
each sample's runs of equal versions.

When a decode step's cost grows with the live tokens, a segment is timed at its
middle step (the cost is linear in the live tokens, which grow by one per slot and
step), and it also ends after its slots have grown by `_GROWTH` of what they hold, so
that a segment cut short by an event, or crossing from reads to compute, is timed
closely; under a KV budget it ends before the budget is exceeded. A generator whose
slots reach their KV budget gives back the newest samples' blocks until `_KV_HEADROOM`
of the budget is free, and takes a new or preempted sample only below that mark (a
serving engine's scheduler admits conservatively after a retraction), so that a full
cache does not preempt and re-admit a sample at every step.
"""

import dataclasses
import heapq
import itertools
import math
import numpy as np

from async_rl.param_server.buffer import AdmissionBuffer
from async_rl.param_server.gate import StalenessGate
from async_rl.sim.config import SimConfig, sample_lengths
from async_rl.trajectory import Group, Trajectory

Interval = tuple[float, float, str]
_GROWTH = 0.25
_KV_HEADROOM = 0.05


@dataclasses.dataclass
class SimResult:
  """What `simulate` predicts. Staleness counts trained generated tokens.

  `slot_occupancy` is the mean fraction of all generator slots holding a sample over the
  wall time; `preempted` counts samples moved out of their slot for lack of KV room;
  `gate_closed` counts the times a generator with a free slot found the staleness window
  shut (η, not the concurrency cap, held it back: with none and no dropped group, a
  larger η runs the same events);
  `generator_shares` splits the generators' time into what their timelines label
  ("decode", "prefill", "update") and "idle".
  """
  config: SimConfig
  wall_time: float
  trained_samples: int
  trained_tokens: int
  generated_tokens: int
  dropped_groups: int
  samples_per_s: float
  tokens_per_s: float
  generator_idle: float
  trainer_idle: float
  staleness_mean: float
  staleness_max: int
  staleness_hist: list[int]
  slot_occupancy: float
  preempted: int
  gate_closed: int
  generator_shares: dict[str, float]
  step_end_times: list[float]
  timelines: dict[str, list[Interval]]  # component -> merged busy (start, end, label)


class _Sample:
  __slots__ = ("group", "length", "done", "versions", "joined", "seq")

  def __init__(self, group, length):
    self.group, self.length, self.done = group, int(length), 0
    self.versions: list[list[int]] = []  # [version, tokens] runs, oldest first.
    self.joined = self.seq = 0  # Its generator's clock when it took its slot, and its turn.


class _Group:
  __slots__ = ("samples", "finished")

  def __init__(self):
    self.samples: list[_Sample] = []
    self.finished = 0


def _scored(group: _Group) -> Group:
  """The finished group as the buffer sees it: one sample holding one token of each
  version its samples' tokens carry (the module's docstring)."""
  versions = np.unique([v for s in group.samples for v, _ in s.versions]).astype(np.int32)
  return Group(None, (Trajectory.from_completion(
      np.zeros(1, np.int32), np.zeros(versions.size, np.int32),
      np.zeros(versions.size, np.float32), versions, "length", reward=0.0),))


class _Generator:
  """One engine. Its active samples advance together, a token each per decode step, so
  none is touched until it leaves its slot: `clock` counts the engine's decode steps,
  `log` holds the clock at which each weights version began, and a sample's tokens and
  their versions are settled from the two when it finishes or is preempted."""

  def __init__(self, idx, prompt_tokens):
    self.name = f"generator{idx}"
    self.prompt_tokens = prompt_tokens
    self.version = 0
    self.active: dict[_Sample, None] = {}  # In the order they took their slots.
    self.queue: list[_Sample] = []
    self.ends: list = []  # Heap of (clock at which a sample ends, its seq, it).
    self.clock = 0
    self.log = [[0, 0]]  # [clock, version]: the tokens from that clock on carry it.
    self.live = 0  # Tokens the active samples' KV cache holds: prompts and generated.
    self.seg_start = self.seg_end = 0.0
    self.dt = 0.0
    self.scheduled = False
    self.epoch = 0

  def join(self, sample, seq):
    sample.joined, sample.seq = self.clock, seq
    self.active[sample] = None
    self.live += self.prompt_tokens + sample.done
    heapq.heappush(self.ends, (self.clock + sample.length - sample.done, seq, sample))

  def leave(self, sample) -> int:
    """Settles the sample's tokens and versions up to the clock (or its length, when it
    ended within the chunk), and frees its slot; returns the steps its slot ran past
    its end."""
    del self.active[sample]
    ran = self.clock - sample.joined
    kept = min(ran, sample.length - sample.done)
    self.live -= self.prompt_tokens + sample.done + ran
    start, end, log = sample.joined, sample.joined + kept, self.log
    k = len(log) - 1
    while log[k][0] > start:
      k -= 1
    runs = sample.versions
    for i in range(k, len(log)):
      tokens = (end if i + 1 == len(log) else min(end, log[i + 1][0])) - max(start, log[i][0])
      if tokens <= 0:
        continue
      if runs and runs[-1][0] == log[i][1]:
        runs[-1][1] += tokens
      else:
        runs.append([log[i][1], tokens])
    sample.done += kept
    return ran - kept

  def finished(self) -> list:
    """The active samples that have reached their length, in the order they joined."""
    out = []
    while self.ends and self.ends[0][0] <= self.clock:
      _, seq, sample = heapq.heappop(self.ends)
      if sample.seq == seq and sample in self.active:  # Else preempted since.
        out.append(sample)
    return out

  def left(self) -> int:
    """The fewest steps any active sample has left."""
    while self.ends[0][2].seq != self.ends[0][1] or self.ends[0][2] not in self.active:
      heapq.heappop(self.ends)
    return self.ends[0][0] - self.clock

  def set_version(self, version):
    if self.log[-1][0] == self.clock:
      self.log[-1][1] = version
    else:
      self.log.append([self.clock, version])
    self.version = version


class _Simulation:

  def __init__(self, cfg: SimConfig, num_steps: int, seed: int):
    self.cfg, self.num_steps = cfg, num_steps
    self.rng = np.random.default_rng(seed)
    self.gate = StalenessGate(max_staleness=cfg.max_staleness, batch_groups=cfg.batch_groups,
                              max_concurrent=cfg.num_generators * cfg.slots)
    self.gens = [_Generator(i, cfg.prompt_tokens) for i in range(cfg.num_generators)]
    self.joins = itertools.count()
    self.events: list = []
    self.order = itertools.count()
    self.published = 0  # Trainer version v: training steps completed.
    self.buffer = AdmissionBuffer(cfg.max_staleness)
    self.offered: dict[int, _Group] = {}  # The buffered groups, by ticket.
    self.staleness_hist: list[int] = []  # Trained tokens by staleness.
    self.trainer_busy = False
    self.slot_time = 0.0
    self.preempted = self.gate_closed = 0
    self.generated = self.trained_samples = self.trained_tokens = 0
    self.step_end_times: list[float] = []
    self.timelines: dict[str, list[Interval]] = {g.name: [] for g in self.gens}
    self.timelines["trainer"] = []

  def run(self) -> float:
    for gen in self.gens:
      self._wake(gen, 0.0)
    while len(self.step_end_times) < self.num_steps:
      if not self.events:
        raise RuntimeError("simulation stalled: no event left before the last step")
      now, _, kind, obj, epoch = heapq.heappop(self.events)
      if kind == "gen":
        if epoch == obj.epoch:
          obj.scheduled = False
          self._advance(obj, now)
      elif kind == "reward":
        self._offer(obj, now)
        self._try_train(now)
      else:
        self._trained(now)
    return self.step_end_times[-1]

  def _push(self, time, kind, obj=None, epoch=0):
    heapq.heappush(self.events, (time, next(self.order), kind, obj, epoch))

  def _busy(self, name, start, end, label):
    if end <= start:
      return
    lane = self.timelines[name]
    if lane and lane[-1][2] == label and lane[-1][1] == start:
      lane[-1] = (lane[-1][0], end, label)
    else:
      lane.append((start, end, label))

  def _wake(self, gen, time):
    gen.epoch += 1
    gen.scheduled = True
    self._push(time, "gen", gen, gen.epoch)

  def _poke(self, gen, now):
    """Makes `gen` react at its next decode-step boundary (between two steps)."""
    if not gen.scheduled:
      self._wake(gen, now)
      return
    if not gen.active or now >= gen.seg_end:
      return
    steps = self._whole_chunks(math.ceil(max(0.0, now - gen.seg_start) / gen.dt - 1e-9))
    boundary = gen.seg_start + steps * gen.dt
    if boundary < gen.seg_end:
      self._wake(gen, boundary)

  def _advance(self, gen, now):
    cfg = self.cfg
    if gen.active and now > gen.seg_start:
      steps = round((now - gen.seg_start) / gen.dt)
      self.slot_time += len(gen.active) * (now - gen.seg_start)
      self._busy(gen.name, gen.seg_start, now, "decode")
      gen.clock += steps
      gen.live += steps * len(gen.active)
      self.generated += steps * len(gen.active)
      for sample in gen.finished():
        self.generated -= gen.leave(sample)
        group = sample.group
        group.finished += 1
        if group.finished == cfg.group_size:
          self._push(now + cfg.reward_latency, "reward", group)
    low_water = (1 - _KV_HEADROOM) * cfg.kv_tokens
    if cfg.kv_tokens and gen.live + len(gen.active) > cfg.kv_tokens:
      while len(gen.active) > 1 and gen.live + len(gen.active) > low_water:
        sample = next(reversed(gen.active))  # The newest sample gives its KV back.
        gen.leave(sample)
        gen.queue.insert(0, sample)
        self.preempted += 1
    overhead, label = 0.0, "prefill"
    if self.published > gen.version:
      if cfg.update_mode == "drain" and gen.active:
        self._schedule(gen, now, 0.0)  # In-flight finish on the old weights.
        return
      if cfg.update_mode == "retract":
        overhead += cfg.prefill_per_token * gen.live
      overhead += cfg.weight_sync
      gen.set_version(self.published)
      label = "update"
    self._dispatch(gen, now)
    starting = gen.queue[:cfg.slots - len(gen.active)]
    if cfg.kv_tokens:
      live, fits = gen.live + len(gen.active), 0
      for sample in starting:
        live += cfg.prompt_tokens + sample.done + 1
        if live > low_water and (gen.active or fits):
          break
        fits += 1
      starting = starting[:fits]
    del gen.queue[:len(starting)]
    overhead += cfg.prefill_per_token * sum(cfg.prompt_tokens + s.done for s in starting)
    for sample in starting:
      gen.join(sample, next(self.joins))
    self._busy(gen.name, now, now + overhead, label)
    self._schedule(gen, now + overhead, overhead)

  def _dispatch(self, gen, now):
    """Starts new groups while the gate allows, each on the least loaded engine with a
    free slot (a router balancing requests across servers, as real systems do); `gen`
    is the engine reacting now, any other that receives a group reacts at its next
    decode-step boundary. An engine draining in-flight samples before new weights
    takes none."""
    cfg = self.cfg
    while True:
      if self.gate.capacity(gen.version) <= 0:  # Shut for this engine: no scan needed.
        if cfg.slots - len(gen.active) - len(gen.queue) > 0:
          self.gate_closed += self.gate.running < self.gate.max_concurrent
        return
      target, least = None, cfg.slots
      for e in self.gens:
        load = len(e.active) + len(e.queue)
        if load < least and not self._draining(e):
          target, least = e, load
      if target is None:
        return
      if not self.gate.acquire(target.version):
        self.gate_closed += self.gate.running < self.gate.max_concurrent
        return
      group = _Group()
      group.samples = [_Sample(group, n) for n in sample_lengths(cfg, self.rng, cfg.group_size)]
      target.queue.extend(group.samples)
      if target is not gen:
        self._poke(target, now)

  def _draining(self, gen) -> bool:
    return self.published > gen.version and self.cfg.update_mode == "drain" and bool(gen.active)

  def _schedule(self, gen, start, overhead):
    gen.seg_start = start
    if not gen.active:
      gen.seg_end = start
      if overhead > 0:
        self._wake(gen, start)  # Pick up whatever arrived while updating.
      return
    cfg, a, live = self.cfg, len(gen.active), gen.live
    steps = gen.left()
    if cfg.decode.grows_with_live_tokens:
      steps = min(steps, max(1, math.ceil(_GROWTH * live / a)))
    if cfg.kv_tokens:
      steps = min(steps, max(1, (cfg.kv_tokens - live) // a))
    steps = self._whole_chunks(steps)
    # The step's cost is linear in the live tokens, which grow by `a` a step: the mean
    # step of the segment is the step at its middle.
    gen.dt = cfg.decode.step_s(a, live + a * (steps - 1) / 2)
    gen.seg_end = start + steps * gen.dt
    self._wake(gen, gen.seg_end)

  def _whole_chunks(self, steps: int) -> int:
    """`steps` rounded up to whole chunks of decode steps (`steps_per_call`)."""
    k = self.cfg.steps_per_call
    return -(-steps // k) * k

  def _offer(self, group, now):
    ticket = next(self.order)
    if self.buffer.offer(_scored(group), self.published, ticket=ticket):
      self.offered[ticket] = group
      self.gate.finish_accepted()
    else:
      self.gate.finish_rejected()
      self._poke_all(now)

  def _try_train(self, now):
    cfg = self.cfg
    if self.trainer_busy or len(self.buffer) < cfg.batch_groups:
      return
    generated = 0
    for ticket, _ in self.buffer.take(cfg.batch_groups, self.published):
      for sample in self.offered.pop(ticket).samples:
        generated += sample.length
        for version, tokens in sample.versions:
          stale = self.published - version
          self.staleness_hist.extend([0] * (stale + 1 - len(self.staleness_hist)))
          self.staleness_hist[stale] += tokens
    tokens = generated + cfg.prompt_tokens * cfg.batch_groups * cfg.group_size
    self.trained_tokens += generated
    self.trained_samples += cfg.batch_groups * cfg.group_size
    duration = cfg.trainer_step_base + cfg.trainer_per_token * tokens / cfg.trainer_accelerators
    self.trainer_busy = True
    self._busy("trainer", now, now + duration, "train")
    self._push(now + duration, "trained")

  def _trained(self, now):
    self.trainer_busy = False
    self.published += 1
    self.step_end_times.append(now)
    self.gate.set_version(self.published)
    dropped = self.buffer.purge(self.published)
    for ticket in dropped:
      del self.offered[ticket]
    self.gate.drop_accepted(len(dropped))
    self._poke_all(now)
    self._try_train(now)

  def _poke_all(self, now):
    for gen in self.gens:
      wants = self.published > gen.version or (
          self.cfg.slots - len(gen.active) - len(gen.queue) > 0)
      if wants and not self._draining(gen):
        self._poke(gen, now)

  def result(self, end: float) -> SimResult:
    cfg = self.cfg
    for gen in self.gens:
      if gen.active:
        self._busy(gen.name, gen.seg_start, end, "decode")
    for name, lane in self.timelines.items():
      self.timelines[name] = [(s, min(e, end), label) for s, e, label in lane if s < end]
    busy = {name: sum(e - s for s, e, _ in lane) for name, lane in self.timelines.items()}
    gen_busy = sum(v for k, v in busy.items() if k != "trainer")
    gen_time = cfg.num_generators * end
    shares = {}
    for name, lane in self.timelines.items():
      if name != "trainer":
        for s, e, label in lane:
          shares[label] = shares.get(label, 0.0) + (e - s) / gen_time
    shares["idle"] = max(0.0, 1 - gen_busy / gen_time)
    hist = list(self.staleness_hist)
    counted = sum(hist)
    return SimResult(
        config=cfg, wall_time=end, trained_samples=self.trained_samples,
        trained_tokens=self.trained_tokens, generated_tokens=self.generated,
        dropped_groups=self.buffer.dropped, samples_per_s=self.trained_samples / end,
        tokens_per_s=self.trained_tokens / end,
        generator_idle=shares["idle"],
        trainer_idle=max(0.0, 1 - busy["trainer"] / end),
        staleness_mean=sum(k * c for k, c in enumerate(hist)) / max(counted, 1),
        staleness_max=len(hist) - 1 if counted else 0, staleness_hist=hist,
        slot_occupancy=self.slot_time / (gen_time * cfg.slots), preempted=self.preempted,
        gate_closed=self.gate_closed,
        generator_shares=shares,
        step_end_times=list(self.step_end_times), timelines=self.timelines)


def simulate(cfg: SimConfig, num_steps: int, seed: int = 0) -> SimResult:
  """Simulates `num_steps` training steps of `cfg`; deterministic for a given `seed`.

  Throughput counts the samples and generated tokens trained by the end of the last
  step, over that step's end time.
  """
  if not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
  if not isinstance(cfg, SimConfig):
    raise ValueError(f"cfg must be a SimConfig, got {type(cfg).__name__}")
  sim = _Simulation(cfg, num_steps, seed)
  return sim.result(sim.run())
