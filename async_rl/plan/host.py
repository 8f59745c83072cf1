"""A run's own engine and trainer timed on this machine's cores: the costs of "this machine".

On a CPU a small model's steps are bound by dispatching its ops one after another, by
the host work around them (the scheduler's bookkeeping, packing a batch) and by how far
its small matmuls spread over the cores, none of which the bytes and FLOPs of
`plan.costs` count: a decode step of a tiny model costs a near-fixed time whatever its
slots, and a training step on two cores is not twice as fast as on one. So for this
machine the planner does not take a roofline of a matmul peak: `measure` times the
engine, generator pool and trainer a placement runs, which the caller builds from the
placement's own config (its slots, slot groups and gradient threads) with the run's
builder, on synthetic work of the workload's shapes. Every figure is a measurement
taken when asked for; none is fitted to a benchmark's result.

  decode     a request of one sample and one of every slot, each at two lengths with
             no stop token: the difference of the lengths gives the step's time at one
             and at full slots (a line: its intercept the step's fixed cost, its slope a
             slot's), the rest the prefill of the request's prompts.
  prefill    the prompts of every slot at once, per prompt token (above).
  train      a step of the trainer on one batch of the workload's shape (its groups,
             prompt length and output lengths at evenly spaced quantiles of the
             length distribution), after a first step that compiles; per token it holds.
"""

import time
from contextlib import AbstractContextManager
from typing import Callable, Sequence

import numpy as np

from async_rl.generation.request import Request
from async_rl.generation.sampling import SamplingParams
from async_rl.plan.costs import MeasuredCosts
from async_rl.trajectory import Group, Trajectory


def decode_line(one_s: float, full_s: float, slots: int) -> tuple[float, float]:
  """A decode step's (fixed cost, cost per active slot) from its time with one active
  slot and with `slots`, through the step at full slots. Noise can tilt the line past
  what a cost can be: a slope below zero (a flat step) counts as zero, an intercept
  below zero (a step at one slot measured as next to nothing) as zero."""
  if slots <= 1:
    return full_s, 0.0
  slope = max(0.0, (full_s - one_s) / (slots - 1))
  if full_s < slope * slots:
    return 0.0, full_s / slots
  return full_s - slope * slots, slope


def step_and_rest(short_s: float, long_s: float, short: int, long: int) -> tuple[float, float]:
  """(time per decode step, the rest) of requests timed at `short_s` and `long_s` for
  `short` and `long` new tokens: each request is a prefill, then one step per token.
  Where noise makes the long request no slower than the short one, all of its time
  counts as steps (a step's upper bound)."""
  if long <= short:
    raise ValueError(f"the long request ({long} tokens) must be longer than the short ({short})")
  step = (long_s - short_s) / (long - short)
  if step <= 0:
    return long_s / long, 0.0
  return step, max(0.0, long_s - step * long)


def request_lengths(room: int, steps_per_call: int) -> tuple[int, int]:
  """The new tokens of the short and the long request that time a decode step, where a
  sample has `room` for new tokens: the long one as long as room allows, the short one
  about half of it, both whole chunks of `steps_per_call` steps where two chunks fit.

  Raises:
    ValueError: no room for two decode steps.
  """
  if room < 2:
    raise ValueError(f"timing a decode step needs room for two new tokens, got {room}")
  chunk = steps_per_call if room >= 2 * steps_per_call else 1
  long = room // chunk * chunk
  return long // chunk // 2 * chunk, long


def quantile_lengths(lengths: Sequence[int], n: int) -> list[int]:
  """`n` output lengths at evenly spaced quantiles of `lengths`: a batch whose token
  count is the distribution's mean, with no draw's luck in it."""
  ordered = sorted(int(x) for x in lengths)
  return [ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / n))] for i in range(n)]


def measure(cfg, *, trainer, open_pool: Callable[[], AbstractContextManager],
            prompt_tokens: int, lengths: Sequence[int], reps: int = 3) -> MeasuredCosts:
  """Times a run's engine, pool and trainer in this process (the module's docstring).

  Args:
    cfg: the `config.ExperimentConfig` the placement runs (its model, generation,
      batching, PPO and CPU thread settings).
    trainer: the run's trainer, built from `cfg` (`train(groups)` runs one step).
    open_pool: opens the run's generator pool over one engine built from `cfg` (a
      context manager whose value takes `submit(request)`); it is closed before the
      trainer is timed.
    prompt_tokens: a prompt's tokens.
    lengths: output lengths the workload draws from (capped at
      `cfg.generation.max_new_tokens`).
    reps: each timing is the best of this many.
  """
  import jax  # noqa: PLC0415 - the planner needs no JAX; only measuring does

  g = cfg.generation
  rng = np.random.default_rng(cfg.seed)
  prompt = [int(t) for t in rng.integers(0, cfg.model.vocab_size, prompt_tokens)]
  short, long = request_lengths(min(g.max_new_tokens, g.max_length - prompt_tokens),
                                g.steps_per_call)
  ids = iter(range(1 << 30))

  with open_pool() as pool:

    def generate(n: int, new_tokens: int) -> float:
      request = Request(next(ids), prompt, n, SamplingParams(max_new_tokens=new_tokens))
      start = time.perf_counter()
      pool.submit(request).result()
      return time.perf_counter() - start

    def step_and_prefill(n: int) -> tuple[float, float]:
      generate(n, long)  # compiles
      return step_and_rest(min(generate(n, short) for _ in range(reps)),
                           min(generate(n, long) for _ in range(reps)), short, long)

    one_step, _ = step_and_prefill(1)
    full_step, prefill_s = step_and_prefill(g.num_slots)
  base, per_slot = decode_line(one_step, full_step, g.num_slots)

  outputs = quantile_lengths([min(n, g.max_new_tokens) for n in lengths],
                             cfg.batch_groups * g.group_size)

  def batch(rep: int) -> list:
    samples = iter(outputs)
    return [Group(f"measure{rep}/{i}", tuple(
        Trajectory.from_completion(prompt, rng.integers(0, cfg.model.vocab_size, n),
                                   np.full(n, -1.0, np.float32), np.zeros(n, np.int32), "stop",
                                   reward=float(rng.random()))
        for n in (next(samples) for _ in range(g.group_size))))
        for i in range(cfg.batch_groups)]

  def train(rep: int) -> float:
    groups = batch(rep)
    start = time.perf_counter()
    trainer.train(groups)
    jax.block_until_ready(trainer.state)
    return time.perf_counter() - start

  train(0)  # compiles
  train_s = min(train(rep) for rep in range(1, reps + 1))
  tokens = len(outputs) * prompt_tokens + sum(outputs)
  return MeasuredCosts(
      decode_base=base, decode_per_slot=per_slot,
      prefill_per_token=prefill_s / (g.num_slots * prompt_tokens),
      train_per_token=train_s / tokens,
      source=f"measured: the run's engine ({g.num_slots} slots, requests of {short} and "
             f"{long} tokens) and trainer (a {tokens}-token batch)")
