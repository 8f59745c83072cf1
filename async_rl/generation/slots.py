"""Starting samples in slots, for the generator pool's decode thread.

Each function takes the engine, the live params and their version, the decode state
and the host batch, starts samples on the device and records them in the batch, and
returns the new decode state (the old one is donated). The tokens they draw are read
with the batch's next `flush`.
"""

import numpy as np

from async_rl.generation.host_batch import Held, HostBatch, Job
from async_rl.generation.decode_state import DecodeState
from async_rl.generation.engine import Engine
from async_rl.generation.sampling import SlotSampling


def start_samples(engine: Engine, params, version: int, state: DecodeState, batch: HostBatch,
                  taken: list[tuple[Job, int]], free: list[int]) -> DecodeState:
  """Starts sample `index` of `job`, for each (job, index) of `taken`, in the slots
  `free` (one each, in order). A job's prompt is prefilled once for all its samples,
  unless a weight update came since."""
  jobs = list(dict.fromkeys(job for job, _ in taken))
  stale = [job for job in jobs if job.prefix is None or job.prefix_version != version]
  if stale:
    # The prefill's own first-token draw goes unused: insert_samples draws each.
    refs = engine.prefill_many(
        params=params, prompts=[job.prompt_P for job in stale],
        samplings=[SlotSampling.create(job.request.sampling, job.seed, 0) for job in stale])
    for job, ref in zip(stale, refs):
      job.prefix, job.prefix_version = ref, version
  # One insert_samples call per Prefix: prompts prefilled together start together.
  starts = {}
  for slot, (job, index) in zip(free, taken):
    prefix, row = job.prefix
    sampling = SlotSampling.create(job.request.sampling, job.seed, index)
    starts.setdefault(id(prefix), (prefix, []))[1].append((slot, job, index, sampling, row))
    job.unstarted -= 1
  for job in jobs:
    if not job.unstarted:
      job.prefix = None
  for prefix, entries in starts.values():
    state, first = engine.insert_samples(prefix, state, [e[4] for e in entries],
                                         [e[0] for e in entries], [e[3] for e in entries])
    batch.occupy([e[:4] for e in entries], first, version)
  return state


def continue_held(engine: Engine, params, version: int, state: DecodeState, batch: HostBatch,
                  job: Job, held: Held) -> tuple[DecodeState, bool]:
  """Starts `job` (one sample, whose prompt continues `held`'s sequence) in the held
  slot. Returns the new state and whether the cache was continued: it is when the
  params that computed all of it are still live, else the whole prompt is prefilled
  again in the slot."""
  slot, length = held.handle.slot, held.tokens_T.size
  sampling = SlotSampling.create(job.request.sampling, job.seed, 0)
  in_slot = held.cache_version == version
  if in_slot:
    # The held sample's last token was drawn but never fed, so its K/V goes first.
    state, first = engine.extend(params, state, slot, job.prompt_P[length - 1:], length - 1,
                                 sampling)
  else:
    padded, true_length = engine.pad_tokens(job.prompt_P)
    prefix, first = engine.prefill(params=params, padded_tokens=padded,
                                   true_length=true_length, sampling=sampling)
    state = engine.insert(prefix, state, slot)
  job.unstarted = 0
  batch.occupy([(slot, job, 0, sampling)], first, version)
  return state, in_slot


def continues(job: Job, held: Held) -> bool:
  """Whether `job`'s prompt is `held`'s sequence followed by at least one token."""
  length = held.tokens_T.size
  return job.prompt_P.size > length and np.array_equal(job.prompt_P[:length], held.tokens_T)


def restart_all(engine: Engine, params, version: int, state: DecodeState,
                batch: HostBatch) -> DecodeState:
  """Re-prefills every running sample (prompt and tokens so far) under `params`
  ("retract"), so each continues from a cache they computed."""
  for slot, s in batch.occupied():
    padded, length = engine.pad_tokens(np.concatenate([s.job.prompt_P, s.tokens]))
    prefix, result = engine.prefill(params=params, padded_tokens=padded, true_length=length,
                                    sampling=s.sampling, generated=len(s.tokens))
    state = engine.insert(prefix, state, slot)
    batch.restart(slot, result, version)
  batch.flush()
  return state
