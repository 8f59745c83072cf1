"""SIGTERM and SIGINT as a job scheduler expects them: stop, save, exit 128 + the signal.

The first signal sets the run's stop event (the run checkpoints its current version
and returns; `TrainLoop`); the binary then exits with status 128 + the signal's
number (143 for SIGTERM, 130 for SIGINT), so a job controller sees an interrupted
job, not a finished one, and starts it again. A second signal exits at once with 128
+ its number, saving nothing more.

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
from typing import Callable, Optional, Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _say(line: str) -> None:
  sys.stderr.write(line + "\n")
  sys.stderr.flush()


class StopOnSignals:
  """Sets `stop` on the first of `signals`; exits the process on the second.

  Call from the main thread (Python installs handlers only there). The handlers stay
  installed for the life of the process.

  Attributes:
    received: the first signal's number, or None.
  """

  def __init__(self, stop: threading.Event, signals: Sequence[int] = STOP_SIGNALS,
               say: Callable[[str], None] = _say):
    self.stop, self._signals, self._say = stop, tuple(signals), say
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
                f"with status {128 + sig}; a second signal exits at once")
      self.stop.set()
      return
    self._say(f"{name}, a second signal: exiting at once with status {128 + sig}; only "
              f"checkpoints already written are kept")
    os._exit(128 + sig)
