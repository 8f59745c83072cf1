"""Speed for XLA:CPU only, behind one boundary: the builder (`rl.build`) chooses these
wrappers on the CPU backend; the core engine and train step never see them.

XLA:CPU runs the programs dispatched from one thread one after another, and a small
program's ops mostly one at a time on one core; programs dispatched from different
threads run at the same time. So a generator's slots split into groups, each an
`Engine` of its own decoded from its own thread (`SlotGroupEngine`), and a training
step's micro-batches split among threads that each sum their share's gradients
(`threaded_steps`). Its decode steps read the paged KV cache through a dense window or
a list of blocks, whichever costs less (`PagedDecoding`).
"""

from async_rl.cpu.engine import SlotGroupEngine
from async_rl.cpu.paged_decode import PagedDecoding
from async_rl.cpu.threads import Dispatchers, cores, default_threads
from async_rl.cpu.train_step import threaded_steps
