"""The host side of the paged KV cache (`generation.paged`): which blocks are free, who
holds each, and the block table of every slot. `BlockAllocator` hands blocks out and
counts their holders; `SlotBlocks` keeps each slot's blocks and tables, so that the
samples of a group share their prompt's blocks. Pure Python and NumPy, no device work.
"""

import numpy as np


class OutOfBlocks(RuntimeError):
  """More blocks were asked for than are free."""


def table_row(blocks, num_blocks: int, max_blocks: int) -> np.ndarray:
  """A slot's block-table row [M] (int32) in a pool of `num_blocks` blocks: `blocks`,
  then N = `num_blocks` (no block) up to `max_blocks` columns."""
  if len(blocks) > max_blocks:
    raise ValueError(f"{len(blocks)} blocks do not fit a table of {max_blocks} columns")
  row = np.full(max_blocks, num_blocks, np.int32)
  row[:len(blocks)] = blocks
  return row


class BlockAllocator:
  """The free list and reference counts of a paged cache's N blocks, on the host.

  A block is free at count 0. `allocate` hands out free blocks at count 1, `share` adds
  a holder to allocated blocks and `free` drops one, returning a block to the free list
  when its last holder lets go. Asking for more blocks than are free raises
  `OutOfBlocks` and changes nothing, so that the caller can preempt and retry; freeing or
  sharing a free block raises `ValueError`. Each hand-out of a block gets a new serial
  number, so that a record of blocks and their serials (`serials`, `still_held`) tells
  whether they are still the ones it names, not freed and handed out to someone else.
  """

  def __init__(self, num_blocks: int, block_size: int):
    if num_blocks < 1 or block_size < 1:
      raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    self.num_blocks, self.block_size = num_blocks, block_size
    self._refs = [0] * num_blocks
    self._serials = [0] * num_blocks
    self._handed_out = 0
    # A stack: the most recently freed block is handed out first.
    self._free = list(range(num_blocks - 1, -1, -1))

  @property
  def num_free(self) -> int:
    return len(self._free)

  def refcount(self, block: int) -> int:
    return self._refs[self._check(block)]

  def blocks_for(self, tokens: int) -> int:
    """The blocks that hold `tokens` positions."""
    return -(-tokens // self.block_size)

  def allocate(self, n: int) -> list[int]:
    """`n` free blocks, each now held once."""
    if n < 0:
      raise ValueError(f"cannot allocate {n} blocks")
    if n > len(self._free):
      raise OutOfBlocks(f"{n} blocks asked for, {len(self._free)} of {self.num_blocks} free")
    blocks = [self._free.pop() for _ in range(n)]
    for b in blocks:
      self._refs[b] = 1
      self._handed_out += 1
      self._serials[b] = self._handed_out
    return blocks

  def share(self, blocks) -> None:
    """One more holder for each of `blocks` (all allocated)."""
    blocks = [self._check(b) for b in blocks]
    for b in blocks:
      if not self._refs[b]:
        raise ValueError(f"block {b} is free; only allocated blocks can be shared")
    for b in blocks:
      self._refs[b] += 1

  def free(self, blocks) -> None:
    """One holder fewer for each of `blocks`; all or none are released."""
    drops = {}
    for b in map(self._check, blocks):
      drops[b] = drops.get(b, 0) + 1
    for b, n in drops.items():
      if n > self._refs[b]:
        raise ValueError(f"block {b} freed {n} times but held {self._refs[b]} times "
                         "(a double free)")
    for b, n in drops.items():
      self._refs[b] -= n
      if not self._refs[b]:
        self._free.append(b)

  def serials(self, blocks) -> tuple[int, ...]:
    """The serial numbers of the hand-outs that gave out `blocks` (all allocated)."""
    return tuple(self._serials[b] for b in map(self._check, blocks))

  def still_held(self, blocks, serials) -> bool:
    """Whether each of `blocks` is still allocated by the hand-out `serials` names."""
    return all(self._refs[b] and self._serials[b] == n
               for b, n in zip(map(self._check, blocks), serials, strict=True))

  def table(self, blocks, max_blocks: int) -> np.ndarray:
    """A slot's table row of this pool: `table_row`."""
    return table_row(blocks, self.num_blocks, max_blocks)

  def _check(self, block) -> int:
    if not isinstance(block, (int, np.integer)) or not 0 <= block < self.num_blocks:
      raise ValueError(f"{block!r} is not a block of a pool of {self.num_blocks}")
    return int(block)


class SlotBlocks:
  """The blocks each of an engine's S slots holds, and the block tables they make.

  An engine has one pool of N blocks, or one per slot group (`cpu.SlotGroupEngine`):
  slot s draws from pool `pools_S[s]`'s `BlockAllocator`, and its table lists blocks of
  that pool. Tables have M columns, enough for the longest sequence.

  The samples of one prompt share the prompt's full blocks (`assign` with a `prompt`
  record, which the caller keeps per prompt): the first slot of a pool to start the
  prompt allocates them and records them, and later slots of that pool share them for as
  long as any holder is left; the last, partial block, which decoding goes on to fill, is
  each slot's own. No block that two slots hold is ever written after the first writes it.
  """

  def __init__(self, pools_S, *, num_blocks: int, block_size: int, max_blocks: int):
    self.pools_S = list(pools_S)
    self.allocators = [BlockAllocator(num_blocks, block_size)
                       for _ in range(max(self.pools_S) + 1)]
    self.block_size, self.max_blocks = block_size, max_blocks
    self.blocks = [[] for _ in self.pools_S]

  @property
  def num_blocks(self) -> int:
    """Blocks in all pools together."""
    return sum(a.num_blocks for a in self.allocators)

  @property
  def num_free(self) -> int:
    return sum(a.num_free for a in self.allocators)

  def allocator(self, slot: int) -> BlockAllocator:
    return self.allocators[self.pools_S[slot]]

  def blocks_for(self, tokens: int) -> int:
    return -(-tokens // self.block_size)

  def assign(self, slot: int, tokens: int, prompt: tuple[dict, int] | None = None,
             keep_free: int = 0) -> int | None:
    """Gives `slot`, which holds no block, the blocks of its first `tokens` positions.

    With `prompt` = (record, length), the prompt's `length // Z` full blocks are shared
    with the slots of this pool that `record` lists, or allocated and listed there.
    Returns how many leading blocks were shared (written already), or None, changing
    nothing, when the pool would have fewer than `keep_free` blocks left.
    """
    if self.blocks[slot]:
      raise ValueError(f"slot {slot} already holds blocks {self.blocks[slot]}")
    allocator, pool = self.allocator(slot), self.pools_S[slot]
    total = self.blocks_for(tokens)
    if total > self.max_blocks:
      raise ValueError(f"{tokens} positions do not fit a table of {self.max_blocks} blocks")
    record, full = prompt if prompt is not None else ({}, 0)
    full = min(full // self.block_size, total)
    listed = record.get(pool)
    shared = listed is not None and allocator.still_held(*listed)
    if total - full * shared + keep_free > allocator.num_free:
      return None
    if shared:
      head = list(listed[0])
      allocator.share(head)
    else:
      head = allocator.allocate(full)
      if full:
        record[pool] = (head, allocator.serials(head))
    self.blocks[slot] = head + allocator.allocate(total - full)
    return full if shared else 0

  def grow(self, slot: int, tokens: int) -> bool:
    """Gives `slot` the blocks it lacks for its first `tokens` positions; False, changing
    nothing, when its pool has too few free blocks."""
    if self.blocks_for(tokens) > self.max_blocks:
      raise ValueError(f"{tokens} positions do not fit a table of {self.max_blocks} blocks")
    need = self.blocks_for(tokens) - len(self.blocks[slot])
    if need > self.allocator(slot).num_free:
      return False
    if need > 0:
      self.blocks[slot] += self.allocator(slot).allocate(need)
    return True

  def release(self, slot: int) -> None:
    """Drops `slot`'s hold on its blocks."""
    self.allocator(slot).free(self.blocks[slot])
    self.blocks[slot] = []

  def row(self, slot: int) -> np.ndarray:
    """Slot `slot`'s table row [M]."""
    return self.allocator(slot).table(self.blocks[slot], self.max_blocks)

  def table(self, slots) -> np.ndarray:
    """The block tables [S, M] (int32) of `slots`; every other slot's row is empty."""
    slots = set(slots)
    # Every pool has N blocks, so N means "no block" in every row.
    return np.stack([table_row(b if s in slots else [], self.allocators[0].num_blocks,
                               self.max_blocks) for s, b in enumerate(self.blocks)])
