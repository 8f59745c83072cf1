"""Starting samples in slots, for the generator pool's decode thread.

Each function takes the engine, the live params and their version, the decode state
and the host batch, starts samples on the device in slots the batch has placed (given
their blocks) and records them in the batch, and returns the new decode state (the old
one is donated). The tokens they draw are read with the batch's next `flush`.
"""

import numpy as np

from async_rl.generation.decode_state import DecodeState
from async_rl.generation.engine import Engine
from async_rl.generation.host_batch import Held, HostBatch, Job, Sample
from async_rl.generation.sampling import SlotSampling


def start_samples(engine: Engine, params, version: int, state: DecodeState, batch: HostBatch,
                  started: list[tuple[int, Sample, int]]) -> DecodeState:
  """Inserts the new samples of `started`, each (slot, sample, blocks shared): the
  sample's slot holds its blocks, the first `shared` of them its prompt's full blocks
  that an earlier sample wrote. A job's prompt is prefilled once for all its samples,
  unless a weight update came since."""
  jobs = list(dict.fromkeys(s.job for _, s, _ in started))
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
  for slot, sample, shared in started:
    prefix, row = sample.job.prefix
    starts.setdefault(id(prefix), (prefix, []))[1].append((slot, sample, shared, row))
    sample.job.unstarted -= 1
  for job in jobs:
    if not job.unstarted:
      job.prefix = None
  for prefix, entries in starts.values():
    state, first = engine.insert_samples(
        prefix, state, [row for *_, row in entries], [slot for slot, *_ in entries],
        [s.sampling for _, s, _, _ in entries],
        [batch.blocks.blocks[slot] for slot, *_ in entries], [shared for _, _, shared, _ in entries])
    batch.add_first(first, [(slot, s) for slot, s, _, _ in entries], version)
  return state


def resume_samples(engine: Engine, params, version: int, state: DecodeState,
                   batch: HostBatch, resumed: list[tuple[int, Sample]]) -> DecodeState:
  """Resumes each preempted (slot, sample) of `resumed` in the slot it was placed in and
  moved to (`HostBatch.resume`): its prompt
  and the tokens it generated so far are prefilled under `params` and it draws its next
  token, as it would have without the preemption (a draw's key depends only on the
  sample and the position)."""
  for slot, sample in resumed:
    padded, length = engine.pad_tokens(np.concatenate(
        [sample.job.prompt_P, np.asarray(sample.tokens, np.int32)]))
    prefix, first = engine.prefill(params=params, padded_tokens=padded, true_length=length,
                                   sampling=sample.sampling, generated=len(sample.tokens))
    state = engine.insert(prefix, state, slot, batch.blocks.blocks[slot])
    batch.add_first(first, [(slot, sample)], version)
  return state


def continue_held(engine: Engine, params, version: int, state: DecodeState, batch: HostBatch,
                  job: Job, held: Held) -> tuple[DecodeState, bool]:
  """Starts `job` (one sample, whose prompt continues `held`'s sequence) in the held
  slot, which holds the blocks it needs. Returns the new state and whether the cache
  was continued: it is when the params that computed all of it are still live
  (`continues_in_slot`), else the whole prompt is prefilled again in the slot."""
  slot, length = held.handle.slot, held.tokens_T.size
  sampling = SlotSampling.create(job.request.sampling, job.seed, 0)
  blocks = batch.blocks.blocks[slot]
  in_slot = continues_in_slot(held, version)
  if in_slot:
    # The held sample's last token was drawn but never fed, so its K/V goes first.
    state, first = engine.extend(params, state, slot, job.prompt_P[length - 1:], length - 1,
                                 sampling, blocks)
  else:
    padded, true_length = engine.pad_tokens(job.prompt_P)
    prefix, first = engine.prefill(params=params, padded_tokens=padded,
                                   true_length=true_length, sampling=sampling)
    state = engine.insert(prefix, state, slot, blocks)
  job.unstarted = 0
  sample = batch.start(slot, job, 0, sampling, version)
  batch.add_first(first, [(slot, sample)], version)
  return state, in_slot


def continues_in_slot(held: Held, version: int) -> bool:
  """Whether `held`'s cache was computed by the params of `version` throughout, so
  that a continuation extends it rather than prefilling again."""
  return held.cache_version == version


def continues(job: Job, held: Held) -> bool:
  """Whether `job`'s prompt is `held`'s sequence followed by at least one token."""
  length = held.tokens_T.size
  return job.prompt_P.size > length and np.array_equal(job.prompt_P[:length], held.tokens_T)
