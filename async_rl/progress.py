"""What a run prints as it goes: lines that carry their time, and a progress bar on a
terminal only.

A bar redraws itself with carriage returns; in a log file, or in the output Ray
collects, every redraw is kept, and a line printed after one is glued onto it. So the
bar is shown only when its stream is a terminal; elsewhere the step lines alone tell
the progress. Lines echoed through `Progress.echo` clear the bar first, so each starts
on a line of its own and the bar is drawn again below it.
"""

import sys
import time
from typing import Callable, Optional, TextIO

from tqdm import tqdm


def stamped(line: str, now: Optional[float] = None) -> str:
  """`line` after the local date and time (`now`, seconds since the epoch; default:
  the current time)."""
  return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))} {line}"


class Progress:
  """Where a run's lines go, and the bar of its training steps they share a terminal with.

  Lines echoed through it clear the bar first, so each starts on a line of its own,
  and the bar is drawn again below; the bar is drawn only while started, and only on
  a terminal.

  Args:
    echo: where lines go.
    enabled: draw a bar at all (only when `stream` is a terminal).
    stream: where the bar is drawn (default: standard error).
  """

  def __init__(self, echo: Callable[[str], None] = print, *, enabled: bool = True,
               stream: Optional[TextIO] = None):
    self._echo = echo
    self._stream = sys.stderr if stream is None else stream
    self._enabled = enabled and _is_terminal(self._stream)
    self._bar = None

  def echo(self, line: str) -> None:
    """Sends `line` to `echo`, on a line of its own."""
    bar = self._bar
    if bar is None:
      self._echo(line)
      return
    bar.clear()
    self._echo(line)
    bar.refresh()

  def start(self, total: int, initial: int = 0) -> None:
    """Draws the bar (on a terminal): `initial` of `total` steps done."""
    if self._enabled:
      self._bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                       file=self._stream, dynamic_ncols=True)

  def update_to(self, steps: int) -> None:
    bar = self._bar
    if bar is not None and steps > bar.n:
      bar.update(steps - bar.n)

  def close(self) -> None:
    """Leaves the bar as it is, on a line of its own; lines go on below it."""
    bar, self._bar = self._bar, None
    if bar is not None:
      bar.close()


def _is_terminal(stream) -> bool:
  isatty = getattr(stream, "isatty", None)
  return bool(isatty and isatty())
