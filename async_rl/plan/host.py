"""A model's own programs timed on this machine's cores: the costs of "this machine".

On a CPU a small model's steps are bound by dispatching its ops one after another and by
how far its small matmuls spread over the cores, neither of which the bytes and FLOPs
of `plan.costs` count: a decode step of a tiny model costs a near-fixed time whatever
its slots, and a training step on two cores is not twice as fast as on one. So for this
machine the planner does not take a roofline of a matmul peak: it times the model's
decode step (`transformer.decode`) and its training micro-batch (the gradient of the
log-likelihood of `transformer.forward`) at the shapes a placement runs them, in a
process pinned to that placement's cores, dispatched at once from as many threads as
the placement's engine and trainer use (the CPU engine decodes its slots in groups, one
thread each; the trainer splits a step's micro-batches among its threads). Every figure
is a measurement taken when asked for; none is fitted to a benchmark's result.

  decode     the step at one slot a group and at the group's full slots, every group
             stepping at once: a line, its intercept the fixed cost of a step, its
             slope a slot's, spread over the groups.
  prefill    a group's prompts at once, per prompt token.
  train      one micro-batch of `tokens_per_mb` tokens per thread, forward and backward,
             plus one forward when the proximal policy's log-probs are recomputed; a
             step runs its micro-batches in rounds of one per thread (`train_step_s`).
"""

import dataclasses
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


@dataclasses.dataclass(frozen=True)
class MeasuredCosts:
  """What one side of a placement costs on the cores it was measured on, in seconds.

  Attributes:
    decode_base: a decode step's fixed cost, whatever its active slots.
    decode_per_slot: what each active slot adds to a decode step.
    prefill_per_token: a prompt token's prefill.
    train_mb_s: a round of training micro-batches, one per thread, all at once.
    tokens_per_mb: the tokens of one micro-batch.
    threads: the threads the programs were dispatched from at once.
    source: what was measured, and where.
  """
  decode_base: float
  decode_per_slot: float
  prefill_per_token: float
  train_mb_s: float
  tokens_per_mb: int
  threads: int
  source: str


def decode_line(one_s: float, full_s: float, group_slots: int,
                groups: int) -> tuple[float, float]:
  """A decode step's (fixed cost, cost per active slot) from its time with one slot and
  with `group_slots` slots in each of `groups` groups stepping at once: the active
  slots of an engine spread over its groups, so a slot costs a group's slope over
  `groups`. A slope measured below zero (noise on a flat step) counts as zero."""
  if group_slots <= 1:
    return full_s, 0.0
  slope = max(0.0, (full_s - one_s) / (group_slots - 1))
  return full_s - slope * group_slots, slope / groups


def train_step_s(costs: MeasuredCosts, tokens: float) -> float:
  """A training step's time over `tokens` tokens: packed into the fewest micro-batches
  (short sequences fill their rows), run in rounds of one per thread."""
  micro_batches = math.ceil(tokens / costs.tokens_per_mb)
  return math.ceil(micro_batches / costs.threads) * costs.train_mb_s


def group_sizes(slots: int, threads: int) -> list[int]:
  """The slots of each of an engine's `threads` groups (as even as they split)."""
  groups = max(1, min(threads, slots))
  return [slots // groups + (g < slots % groups) for g in range(groups)]


def measure(model, *, slots: int, context: int, prompt_tokens: int, sequence_tokens: int,
            tokens_per_mb: int, threads: int, recompute_logp: bool = True,
            reps: int = 3) -> MeasuredCosts:
  """Times `model`'s programs in this process (see the module's docstring).

  Args:
    model: a `config.ModelConfig`.
    slots: the engine's slots, split into `threads` groups.
    context: the tokens a slot's KV cache holds at a decode step.
    prompt_tokens: a prompt's tokens.
    sequence_tokens: a trained sequence's tokens (prompt and completion); a micro-batch
      packs sequences of this length into one row, each attending to itself.
    tokens_per_mb: the tokens of one training micro-batch.
    threads: threads that dispatch at once (the engine's groups, the trainer's threads).
    recompute_logp: whether a training step also runs a forward for the proximal
      policy's log-probs.
    reps: each timing is the best of this many.
  """
  import jax  # noqa: PLC0415 - the planner needs no JAX; only measuring does
  import jax.numpy as jnp  # noqa: PLC0415

  from async_rl.models import transformer  # noqa: PLC0415

  params = transformer.init_params(model, jax.random.PRNGKey(0))
  group = group_sizes(slots, threads)[0]
  threads = len(group_sizes(slots, threads))
  pool = ThreadPoolExecutor(threads)

  def at_once(make_call) -> float:
    calls = [make_call() for _ in range(threads)]
    run = lambda: list(pool.map(lambda c: jax.block_until_ready(c()), calls))
    run()  # compiles
    return min(_timed(run) for _ in range(reps))

  decode = jax.jit(lambda p, c, t, s: transformer.decode(p, model, c, t, s)[0])

  def decode_call(n):
    cache = transformer.init_cache(model, n, context + 1)
    tokens = jnp.zeros((n,), jnp.int32)
    positions = jnp.full((n,), context, jnp.int32)
    return lambda: decode(params, cache, tokens, positions)

  base, per_slot = decode_line(at_once(lambda: decode_call(1)), at_once(lambda: decode_call(group)),
                               group, threads)

  prefill = jax.jit(lambda p, t, n: transformer.prefill(p, model, t, n)[0])

  def prefill_call():
    tokens = jnp.zeros((group, prompt_tokens), jnp.int32)
    return lambda: prefill(params, tokens, jnp.full((group,), prompt_tokens, jnp.int32))

  prefill_s = at_once(prefill_call) / (threads * group * prompt_tokens)

  def loglik(p, tokens, positions, segments):
    logits = transformer.forward(p, model, tokens, positions, segments)
    return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1).sum()

  grad = jax.jit(jax.grad(loglik))
  logp = jax.jit(loglik)

  def train_call(fn):
    tokens = jnp.zeros((1, tokens_per_mb), jnp.int32)
    index = jnp.arange(tokens_per_mb, dtype=jnp.int32)[None]
    positions, segments = index % sequence_tokens, index // sequence_tokens + 1
    return lambda: fn(params, tokens, positions, segments)

  train_s = at_once(lambda: train_call(grad))
  if recompute_logp:
    train_s += at_once(lambda: train_call(logp))
  pool.shutdown()
  return MeasuredCosts(
      decode_base=base, decode_per_slot=per_slot, prefill_per_token=prefill_s,
      train_mb_s=train_s, tokens_per_mb=tokens_per_mb, threads=threads,
      source=f"measured: {model.d_model}-wide {model.n_layers}-layer model's decode "
             f"({threads} x {group} slots, {context} tokens), prefill and "
             f"{tokens_per_mb}-token micro-batch from {threads} threads")


def measure_on_cores(cores: set[int], **kwargs) -> MeasuredCosts:
  """`measure(**kwargs)` in a fresh process pinned to `cores`, as a placement's side runs
  there (XLA sizes its thread pool by the cores it may use), under whatever else runs
  on the machine. `kwargs["model"]` is a `config.ModelConfig`."""
  kwargs = dict(kwargs, model=dataclasses.asdict(kwargs["model"]))
  code = ("import dataclasses, json, os, sys; os.sched_setaffinity(0, set(json.loads("
          "sys.argv[1]))); from async_rl.config import ModelConfig; "
          "from async_rl.plan.host import measure; kw = json.loads(sys.argv[2]); "
          "kw['model'] = ModelConfig(**kw['model']); "
          "print(json.dumps(dataclasses.asdict(measure(**kw))))")
  out = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(cores)),
                        json.dumps(kwargs)], capture_output=True, text=True, check=True)
  fields = json.loads(out.stdout.strip().splitlines()[-1])
  fields["source"] += f" on cores {sorted(cores)}"
  return MeasuredCosts(**fields)


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start

