"""Progress output: a bar on a terminal that lines never glue onto, and nothing but the
lines in a log file (no redraws); every line the run prints carries its time."""

import io
import re

from async_rl.progress import Progress, stamped


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def _shown(text):
  """What a terminal shows of `text`: per line, what follows its last carriage return
  (tqdm clears a line by overwriting it with spaces)."""
  return [row.rsplit("\r", 1)[-1].rstrip() for row in text.split("\n")]


def _run(stream, echo):
  progress = Progress(echo, stream=stream)
  progress.echo("before the bar")
  progress.start(total=4, initial=1)
  for step in (2, 3, 4):
    progress.echo(f"v={step} reward=0.5")
    progress.update_to(step)
  progress.update_to(4)
  progress.close()
  progress.echo("after the bar")


def test_in_a_log_file_only_the_lines_are_written():
  stream, lines = io.StringIO(), []
  _run(stream, lines.append)
  assert stream.getvalue() == ""
  assert lines == ["before the bar", "v=2 reward=0.5", "v=3 reward=0.5", "v=4 reward=0.5",
                   "after the bar"]


def test_on_a_terminal_the_bar_stays_and_each_line_is_on_its_own():
  terminal = _Terminal()
  _run(terminal, lambda line: terminal.write(line + "\n"))
  shown = [row for row in _shown(terminal.getvalue()) if row]
  lines = [row for row in shown if not row.startswith("train:")]
  assert lines == ["before the bar", "v=2 reward=0.5", "v=3 reward=0.5", "v=4 reward=0.5",
                   "after the bar"]
  bars = [row for row in shown if row.startswith("train:")]
  assert bars and re.search(r"\b4/4\b", bars[-1]), shown
  assert shown.index(bars[-1]) == len(shown) - 2, "the bar closes above the last line"


def test_a_disabled_bar_is_not_drawn_even_on_a_terminal():
  terminal, lines = _Terminal(), []
  progress = Progress(lines.append, enabled=False, stream=terminal)
  progress.start(3)
  progress.echo("v=1")
  progress.update_to(1)
  progress.close()
  assert terminal.getvalue() == "" and lines == ["v=1"]


def test_lines_carry_the_local_date_and_time():
  assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d v=1 reward=0\.5",
                      stamped("v=1 reward=0.5"))
  assert stamped("x", now=946728000).startswith("2000-01-01 ")  # noon UTC
