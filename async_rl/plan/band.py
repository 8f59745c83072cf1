"""The band: every prediction run again over what was not published or not given.

A prediction rests on inputs nobody measured for this run: how spread the completion
lengths are, how many samples an engine really holds at once, how much of a device's
memory the serving engine leaves to its KV cache, and, where the user left it open,
the engines' tensor-parallel degree (or, for a published run that did not state it, the
split of its devices). `scenarios` varies each of them alone, one step each way from its
nominal value, and re-derives each placement's KV budget for the varied inputs (a
placement that no longer fits has no prediction there); `run` simulates every placement
in every scenario. The band of a figure is its range over the scenarios, and the
assumption that moves it most is the one whose two scenarios span the widest range.

`recommend` picks, among the search's best placements, the one whose worst case over
the band is best, and names the placements whose bands reach into its own: those the
model cannot tell apart.
"""

import dataclasses
import math
from typing import Callable, Optional

from async_rl.plan.search import (Cluster, Placement, Prediction, Workload, fits,
                                  max_kv_tokens, predict_scaled)

LENGTH_SPREAD = "length spread"
SLOTS = "slots per engine"
MEMORY_FRACTION = "memory fraction"
TP_DEGREE = "TP degree"
DEVICE_SPLIT = "device split"
ASSUMPTIONS = (LENGTH_SPREAD, SLOTS, MEMORY_FRACTION, TP_DEGREE, DEVICE_SPLIT)
_SPREAD = 1.25  # the length distribution's log-sd (or Pareto tail index) times or over this
_MEMORY_STEP = 0.1  # the memory fraction, plus or minus
_MEMORY_MAX = 0.95


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One way the unknowns could be: the workload and cluster, and each placement as it
  would run then (None where it no longer fits; absent where the assumption does not
  apply to it).

  Attributes:
    assumption: the assumption varied ("" for the nominal scenario).
    value: its value here, in words.
  """
  assumption: str
  value: str
  workload: Workload
  cluster: Cluster
  placements: dict


def refit(workload: Workload, cluster: Cluster, p: Placement) -> Optional[Placement]:
  """`p` with its KV budget re-derived for `workload` on `cluster` (the most that fits,
  at most its slots at full length), or None if no sequence fits."""
  seq = workload.prompt_tokens + workload.max_new_tokens
  kv = min(max_kv_tokens(workload, cluster, tp=p.tp, fsdp=p.fsdp, form=p.form,
                         block_size=p.kv_block_size), p.slots * seq)
  if kv < seq:
    return None
  out = dataclasses.replace(p, kv_tokens=kv)
  return out if fits(workload, cluster, out) else None


def scenarios(workload: Workload, cluster: Cluster, placements: dict[str, Placement], *,
              sweep=ASSUMPTIONS) -> list[Scenario]:
  """The nominal scenario, then two per assumption of `sweep` that applies (the length
  spread of a lognormal or Pareto distribution; slots halved and doubled; the memory
  fraction down and up; the TP degree halved and doubled within a node; an asynchronous
  placement's generating devices one eighth of the cluster fewer and more)."""
  out = [Scenario("", "nominal", workload, cluster, dict(placements))]

  def add(assumption, value, w, c, change=lambda p: p):
    varied = {}
    for name, p in placements.items():
      q = change(p)
      if q is not None:
        varied[name] = refit(w, c, q)
    out.append(Scenario(assumption, value, w, c, varied))

  if LENGTH_SPREAD in sweep and workload.length_dist == "lognormal":
    for f in (1 / _SPREAD, _SPREAD):
      sigma = workload.length_sigma * f
      add(LENGTH_SPREAD, f"log-sd {sigma:.2f}",
          dataclasses.replace(workload, length_sigma=sigma), cluster)
  if LENGTH_SPREAD in sweep and workload.length_dist == "pareto":
    for f in (_SPREAD, 1 / _SPREAD):  # a smaller tail index spreads more
      alpha = workload.length_alpha * f
      add(LENGTH_SPREAD, f"tail index {alpha:.2f}",
          dataclasses.replace(workload, length_alpha=alpha), cluster)
  if SLOTS in sweep:
    for f in (0.5, 2.0):
      add(SLOTS, f"x{f:g}", workload, cluster,
          lambda p, f=f: dataclasses.replace(p, slots=max(1, int(p.slots * f))))
  if MEMORY_FRACTION in sweep:
    for d in (-_MEMORY_STEP, _MEMORY_STEP):
      fraction = min(_MEMORY_MAX, cluster.memory_fraction + d)
      add(MEMORY_FRACTION, f"{fraction:.2f}", workload,
          dataclasses.replace(cluster, memory_fraction=fraction))
  if TP_DEGREE in sweep:
    for f in (0.5, 2.0):
      add(TP_DEGREE, f"x{f:g}", workload, cluster, lambda p, f=f: _tp(p, f, cluster))
  if DEVICE_SPLIT in sweep:
    step = cluster.devices // 8
    for d in (-step, step):
      add(DEVICE_SPLIT, f"{d:+d} generating", workload, cluster,
          lambda p, d=d: _split(p, d))
  return out


def _tp(p: Placement, f: float, cluster: Cluster) -> Optional[Placement]:
  tp = int(p.tp * f)
  if tp < 1 or tp > cluster.devices_per_node or p.gen_devices % tp:
    return None
  return dataclasses.replace(p, tp=tp)


def _split(p: Placement, d: int) -> Optional[Placement]:
  if p.mode != "async" or not 0 < p.gen_devices + d < p.gen_devices + p.train_devices:
    return None
  gen, train = p.gen_devices + d, p.train_devices - d
  if gen % p.tp or train % min(p.fsdp, train):
    return None
  return dataclasses.replace(p, gen_devices=gen, train_devices=train,
                             fsdp=train if p.fsdp == p.train_devices else p.fsdp)


@dataclasses.dataclass(frozen=True)
class Band:
  """Every placement predicted in every scenario (`predictions[i][name]`, None where it
  does not fit, absent where the scenario does not apply to it)."""
  scenarios: tuple[Scenario, ...]
  predictions: tuple[dict, ...]

  @property
  def nominal(self) -> dict:
    return self.predictions[0]

  def values(self, f: Callable[[dict], Optional[float]]) -> list[tuple[Scenario, float]]:
    """`f` of each scenario's predictions, where it has a value."""
    out = []
    for s, preds in zip(self.scenarios, self.predictions):
      value = f(preds)
      if value is not None:
        out.append((s, value))
    return out

  def range(self, f) -> tuple[float, float]:
    """The least and greatest of `f` over the scenarios."""
    values = [v for _, v in self.values(f)]
    return min(values), max(values)

  def most(self, f) -> tuple[str, float, float]:
    """The assumption whose scenarios move `f` most from the nominal: its name and the
    range of `f` over them and the nominal ("" if nothing varies)."""
    values = self.values(f)
    nominal = [v for s, v in values if not s.assumption]
    best = ("", min(nominal, default=math.nan), max(nominal, default=math.nan))
    for assumption in dict.fromkeys(s.assumption for s, _ in values if s.assumption):
      vs = nominal + [v for s, v in values if s.assumption == assumption]
      if max(vs) - min(vs) > best[2] - best[1]:
        best = (assumption, min(vs), max(vs))
    return best


def run(workload: Workload, cluster: Cluster, placements: dict[str, Placement], *,
        sweep=ASSUMPTIONS, nominal: Optional[dict] = None, steps: int = 6,
        max_simulated_samples: int = 1024) -> Band:
  """Simulates every placement in every scenario (`nominal`: predictions of the nominal
  scenario already made, reused)."""
  cases = scenarios(workload, cluster, placements, sweep=sweep)
  # A scenario that leaves a placement as it was (a memory fraction that does not move
  # a KV budget its slots already cap) runs the same simulation: simulated once.
  done = {}
  preds = []
  for case in cases:
    out = {}
    for name, p in case.placements.items():
      key = (case.workload, dataclasses.replace(case.cluster, memory_fraction=0.0), p)
      if not case.assumption and nominal and name in nominal:
        out[name] = done[key] = nominal[name]
      elif p is None:
        out[name] = None
      else:
        if key not in done:
          done[key] = predict_scaled(case.workload, case.cluster, p, steps=steps,
                                     max_simulated_samples=max_simulated_samples)
        out[name] = done[key]
    preds.append(out)
  return Band(tuple(cases), tuple(preds))


def rate(name: str) -> Callable[[dict], Optional[float]]:
  """A placement's samples per second in a scenario: 0 where it does not fit, None
  where the scenario does not apply to it."""
  return lambda preds: (None if name not in preds
                        else preds[name].samples_per_s if preds[name] else 0.0)


def speedup(num: str, den: str) -> Callable[[dict], Optional[float]]:
  """The ratio of two placements' throughputs in a scenario."""
  return lambda preds: (preds[num].samples_per_s / preds[den].samples_per_s
                        if preds.get(num) and preds.get(den) else None)


@dataclasses.dataclass(frozen=True)
class Recommendation:
  """What `recommend` found.

  Attributes:
    best: the name of the placement whose worst case over the band is best.
    best_sync, best_async: the same within each mode (None if none fits).
    ranges: each candidate's samples/s over the band (least, nominal, greatest; the
      least is 0 where it does not fit in some scenario).
    close: the candidates whose band reaches the best one's worst case.
    band: the band itself.
  """
  best: str
  best_sync: Optional[str]
  best_async: Optional[str]
  ranges: dict
  close: tuple[str, ...]
  band: Band


def recommend(workload: Workload, cluster: Cluster, results: dict[str, list[Prediction]], *,
              top: int = 2, sweep=ASSUMPTIONS, steps: int = 6,
              max_simulated_samples: int = 1024) -> Optional[Recommendation]:
  """Bands the `top` best distinct placements of each mode of `search`'s `results` and
  picks the best across the band (None if nothing fits)."""
  candidates = {}
  for mode in ("sync", "async"):
    seen = set()
    for pred in results.get(mode, []):  # fastest first
      shape = (pred.placement.gen_devices, pred.placement.tp, pred.placement.fsdp,
               pred.placement.slots, pred.placement.offload)
      if shape not in seen and len(seen) < top:
        seen.add(shape)
        candidates[f"{mode}{len(seen)}"] = pred
  if not candidates:
    return None
  band = run(workload, cluster, {k: v.placement for k, v in candidates.items()}, sweep=sweep,
             nominal=candidates, steps=steps, max_simulated_samples=max_simulated_samples)
  ranges = {}
  for name in candidates:
    lo, hi = band.range(rate(name))
    ranges[name] = (lo, band.nominal[name].samples_per_s, hi)

  def worst_case(name):
    return (ranges[name][0], ranges[name][1])

  best = max(ranges, key=worst_case)
  by_mode = {m: max((k for k in ranges if k.startswith(m)), key=worst_case, default=None)
             for m in ("sync", "async")}
  close = tuple(k for k in ranges if k != best and ranges[k][2] >= ranges[best][0])
  return Recommendation(best=best, best_sync=by_mode["sync"], best_async=by_mode["async"],
                        ranges=ranges, close=close, band=band)
