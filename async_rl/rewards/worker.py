"""The reward worker process and its wire format.

`RewardService` starts each worker as a fresh interpreter (`python -c`, see
`worker_command`) with the caller's sys.path. A worker reads requests from one pipe
and answers on another, one at a time; a message is a pickle prefixed by its 8-byte
length. Requests are pickled `(fn_key, fn, payload)`, or None to stop: `payload` is
the pickled `(completion, reference)`, and `fn` says what `fn_key` is the first time
the worker sees the key (None after): a registry name, or a function pickled by
value with cloudpickle (`ship_fn`). Answers are ("ready", pid) once, then
("ok", reward) or ("error", message) per call. Reward functions run in the worker's
main thread, so those that use signals work. A worker may be given a limit on its
address space (RLIMIT_AS, the soft limit only, so that a sandbox it starts can set
its own); an allocation past it raises MemoryError, which scores as an error.
"""

import ctypes
import json
import math
import numbers
import os
import pickle
import resource
import signal
import struct
import sys

import cloudpickle

from async_rl.rewards.registry import resolve_reward_fn

_HEADER = struct.Struct("<Q")
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from async_rl.rewards.worker import serve; serve(*map(int, sys.argv[2:]))")


def worker_command(rx: int, tx: int, memory_mb: int = 0) -> list[str]:
  """The command that starts a worker reading fd `rx` and writing fd `tx`, with at most
  `memory_mb` of address space (0: no limit)."""
  return [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(rx), str(tx),
          str(os.getpid()), str(memory_mb)]


def ship_fn(fn) -> str | bytes:
  """What a worker needs to load `fn`: its name, or the function pickled by value
  (cloudpickle pickles a function it cannot import by reference, one defined in a
  notebook or `__main__`, with the globals it uses). Raises if it cannot be pickled."""
  return fn if isinstance(fn, str) else cloudpickle.dumps(fn)


def _load_fn(shipped: str | bytes):
  return resolve_reward_fn(shipped if isinstance(shipped, str) else pickle.loads(shipped))


def send_bytes(fd: int, data: bytes):
  view = memoryview(_HEADER.pack(len(data)) + data)
  while view:
    view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
  chunks = []
  while n:
    chunk = os.read(fd, min(n, 1 << 20))
    if not chunk:
      raise EOFError
    chunks.append(chunk)
    n -= len(chunk)
  return b"".join(chunks)


def recv(fd: int):
  """The next message on `fd`; raises EOFError when the writer has gone."""
  (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
  return pickle.loads(_read_exact(fd, n))


def _as_reward(value) -> float:
  if not isinstance(value, numbers.Real):
    raise TypeError(f"reward must be a real number, got {type(value).__name__}")
  if not math.isfinite(value):
    raise ValueError(f"reward must be finite, got {value}")
  return float(value)


def _exit_with_parent(parent_pid: int):
  if sys.platform == "linux":
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  if os.getppid() != parent_pid:
    os._exit(1)


def _limit_memory(memory_mb: int):
  if memory_mb:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS,
                       (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def serve(rx: int, tx: int, parent_pid: int, memory_mb: int = 0):
  """The worker's loop: answers requests on `rx` until told to stop or orphaned."""
  _exit_with_parent(parent_pid)
  _limit_memory(memory_mb)
  fns = {}
  send_bytes(tx, pickle.dumps(("ready", os.getpid())))
  while True:
    try:
      request = recv(rx)
    except EOFError:
      return
    if request is None:
      return
    key, shipped, payload = request
    try:
      if shipped is not None:
        fns[key] = _load_fn(shipped)
      completion, reference = pickle.loads(payload)
      answer = ("ok", _as_reward(fns[key](completion, reference)))
    except Exception as e:  # Whatever the function does wrong scores 0 and is counted.
      answer = ("error", f"{type(e).__name__}: {e}")
    send_bytes(tx, pickle.dumps(answer))
