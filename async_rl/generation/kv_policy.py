"""Which samples hold KV blocks, as vLLM schedules them (`KVPolicy`); the books it reads
and changes are the `HostBatch`'s.

Before each chunk every running sample gets the blocks the chunk writes, oldest
admission first (`grow`). When a pool runs out, a held slot of it is evicted, or else
its most recently admitted sample is preempted (`make_room`): its blocks are freed, its
tokens, log-probs and versions kept, and it waits at the head of the line. Then waiting
samples start while a free slot's pool has their blocks, and those its running samples
need for one more chunk besides (so that a sample just started is not preempted at
once), preempted ones first (re-prefilled: prompt and tokens so far, `place_preempted`),
then queued ones in order (`place_queued`); none is passed over, and running samples
are never preempted for them, but held slots are evicted, oldest first, when no slot is
free or no sample runs to free blocks (`evict_to_admit`). A continuation of a held slot
takes it with the blocks of its prompt and the next chunk, or else frees them and waits
as a new request (`place_extension`). Since a pool holds one sequence of the longest
length, the oldest sample always runs and a waiting one always starts once the samples
ahead of it are done: nothing deadlocks and nothing is lost.
"""

from async_rl.generation.host_batch import HostBatch, Job, Sample


class KVPolicy:
  """The decode thread's KV decisions over `batch`, for chunks of `steps` decode steps."""

  def __init__(self, batch: HostBatch, steps: int):
    self.batch, self.steps = batch, steps

  def grow(self) -> int | None:
    """Gives each running sample, oldest first, the blocks it needs for the next chunk;
    at the first that its pool cannot serve, stops and returns that pool."""
    blocks = self.batch.blocks
    for slot, s in self.batch.occupied():
      if not blocks.grow(slot, s.cache_need(self.steps)):
        return blocks.pools_S[slot]
    return None

  def make_room(self, pool: int) -> str:
    """Frees blocks of `pool` for its running samples: evicts its oldest held slot, else
    preempts its most recently admitted sample (call after `HostBatch.flush`, so that it
    keeps every token the device drew). Returns "evicted" or "preempted"."""
    batch, pools_S = self.batch, self.batch.blocks.pools_S
    held = [h.handle for slot, h in batch.held.items() if pools_S[slot] == pool]
    if held:
      batch.drop_held(held[0])
      return "evicted"
    newest = max((i for i, s in enumerate(batch.slots) if s is not None and pools_S[i] == pool),
                 key=lambda i: batch.slots[i].admitted)
    batch.preempt(newest).preempted = True
    return "preempted"

  def place_preempted(self, sample: Sample) -> tuple[int, int] | None:
    """`place` for a preempted sample, its whole sequence and the next chunk."""
    return self._place(min(sample.length + self.steps, sample.end - 1))

  def place_queued(self, job: Job) -> tuple[int, int] | None:
    """`place` for a new sample of `job`, sharing the prompt's full blocks where its pool
    holds them (`Job.prompt_blocks`)."""
    tokens = min(len(job.prompt_P) + self.steps, self.batch.end_of(job) - 1)
    return self._place(tokens, (job.prompt_blocks, len(job.prompt_P)))

  def place_extension(self, job: Job, version: int) -> bool:
    """Takes the slot `job` continues (`Job.handle`, held for it, its prompt continuing
    the held sequence: `Held.continued_by`) and gives it the blocks of the prompt and the
    next chunk: those it lacks if the params of `version` computed its cache
    (`Held.computed_by`), else new ones. False, freeing the slot's blocks, when its pool
    has too few free: the job then waits as a new request."""
    batch, blocks = self.batch, self.batch.blocks
    held = batch.take_held(job.handle)
    slot = held.handle.slot
    tokens = min(len(job.prompt_P) + self.steps, batch.end_of(job) - 1)
    if held.computed_by(version):
      fits = blocks.grow(slot, tokens)
    else:
      blocks.release(slot)
      fits = blocks.assign(slot, tokens) is not None
    if not fits:
      blocks.release(slot)
    return fits

  def _place(self, tokens: int, prompt: tuple[dict, int] | None = None
             ) -> tuple[int, int] | None:
    """A free slot given the blocks of `tokens` positions (`SlotBlocks.assign`, sharing
    `prompt`'s full blocks where its pool holds them), as (slot, blocks shared); None
    when no free slot's pool has the blocks and, left over, those its running samples
    need for one chunk past the next."""
    batch, blocks = self.batch, self.batch.blocks
    growth = [0] * len(blocks.allocators)
    for i, s in enumerate(batch.slots):
      if s is not None:
        growth[blocks.pools_S[i]] += max(
            blocks.blocks_for(s.cache_need(2 * self.steps)) - len(blocks.blocks[i]), 0)
    for slot in batch.free_slots():
      shared = blocks.assign(slot, tokens, prompt, growth[blocks.pools_S[slot]])
      if shared is not None:
        return slot, shared
    return None

  def evict_to_admit(self) -> bool:
    """For a waiting sample that found no place: evicts the oldest held slot if no slot
    is free or no sample runs to free blocks; whether it did."""
    batch = self.batch
    if batch.held and (not batch.free_slots() or not batch.num_active()):
      return batch.evict_oldest()
    return False
