"""SIGTERM and SIGINT as a job scheduler expects them: stop, save, exit 128 + the signal.

The first signal sets the run's stop event (the run checkpoints its current version
and returns; `TrainLoop`); the binary then exits with status 128 + the signal's
number (143 for SIGTERM, 130 for SIGINT), so a job controller sees an interrupted
job, not a finished one, and starts it again. A second signal exits at once with 128
+ its number, saving nothing more, and so does the first signal itself when the
stop has not ended the process within `grace_s` (`STOP_GRACE_S` by default): a
stop that hangs (a checkpoint write that never finishes, a wait on a wedged thread)
still ends the process. Checkpoint writes are atomic, so one cut short leaves the
previous checkpoints whole.

Python runs a signal handler only between bytecodes of the main thread, which may be
inside a compile or a device wait for a long time; so the handler does nothing
itself, and a thread of this module reads the signals from the interpreter's wakeup
file descriptor, which the C-level handler writes the moment a signal arrives. A
light module (no JAX): a binary installs it before anything slow is imported.
"""

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional, Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds from the first signal to the process's exit at the latest: room for a step
# and a save on a large model, a bound on a stop that hangs.
STOP_GRACE_S = 120.0


def _say(line: str) -> None:
  sys.stderr.write(line + "\n")
  sys.stderr.flush()


class StopOnSignals:
  """Sets `stop` on the first of `signals`; exits the process on the second, or
  `grace_s` after the first.

  Call from the main thread (Python installs handlers only there). The handlers stay
  installed for the life of the process.

  Attributes:
    received: the first signal's number, or None.
  """

  def __init__(self, stop: threading.Event, signals: Sequence[int] = STOP_SIGNALS,
               say: Callable[[str], None] = _say, grace_s: float = STOP_GRACE_S):
    self.stop, self._signals, self._say = stop, tuple(signals), say
    self._grace_s = grace_s
    self.received: Optional[int] = None
    rx, tx = os.pipe()
    os.set_blocking(tx, False)
    signal.set_wakeup_fd(tx, warn_on_full_buffer=False)
    for sig in self._signals:
      signal.signal(sig, lambda *_: None)  # the thread below acts, at once
    threading.Thread(target=self._watch, args=(rx,), name="stop on signals",
                     daemon=True).start()

  @property
  def exit_status(self) -> Optional[int]:
    """128 + the first signal's number; None if none came."""
    return None if self.received is None else 128 + self.received

  def _watch(self, rx: int):
    while data := os.read(rx, 64):
      for sig in data:
        if sig in self._signals:
          self._on(sig)

  def _on(self, sig: int):
    name = signal.Signals(sig).name
    if self.received is None:
      self.received = sig
      self._say(f"{name}: stopping: the run checkpoints its current version, then exits "
                f"with status {128 + sig} (within {self._grace_s:g} s); a second signal "
                f"exits at once")
      threading.Thread(target=self._exit_after_grace, args=(sig,), name="stop grace",
                       daemon=True).start()
      self.stop.set()
      return
    self._say(f"{name}, a second signal: exiting at once with status {128 + sig}; only "
              f"checkpoints already written are kept")
    os._exit(128 + sig)

  def _exit_after_grace(self, sig: int):
    time.sleep(self._grace_s)
    self._say(f"{signal.Signals(sig).name}: the stop did not end the run within "
              f"{self._grace_s:g} s: exiting with status {128 + sig}; only checkpoints "
              f"already written are kept")
    os._exit(128 + sig)
