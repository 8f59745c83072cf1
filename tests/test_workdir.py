"""A workdir belongs to one run: the lock refuses a second holder and names the first;
a holder that ended without releasing it is taken over; and without `flock` the
lock file's contents decide."""

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys

import pytest

from async_rl.rl import workdir
from async_rl.rl.errors import WorkdirInUseError

_HOLD_AND_DIE = """
import os, sys
from async_rl.rl import workdir
with workdir.hold(sys.argv[1], echo=lambda _: None) as me:
  print(me.run_id, flush=True)
  os._exit(0)  # as if killed: the lock file still names this process
"""


def test_a_second_holder_is_refused_with_the_first_named_and_let_in_after_release(tmp_path):
  lines = []
  with workdir.hold(str(tmp_path), echo=lines.append) as me:
    assert (me.host, me.pid) == (socket.gethostname(), os.getpid())
    assert json.loads((tmp_path / workdir.LOCK_FILE).read_text())["run_id"] == me.run_id
    with pytest.raises(WorkdirInUseError) as refused:
      with workdir.hold(str(tmp_path)):
        pass
    message = str(refused.value)
    assert f"run {me.run_id} (host {me.host}, pid {me.pid}, started {me.started})" in message
    assert str(tmp_path) in message
  assert (tmp_path / workdir.LOCK_FILE).read_text() == ""
  with workdir.hold(str(tmp_path), echo=lines.append) as again:
    assert again.run_id != me.run_id
  assert lines == [], "a released lock is taken silently"


def test_a_holder_that_died_without_releasing_is_taken_over_with_a_line(tmp_path):
  dead = subprocess.run([sys.executable, "-c", _HOLD_AND_DIE, str(tmp_path)], check=True,
                        capture_output=True, text=True, cwd=os.getcwd()).stdout.strip()
  assert workdir.read_holder(str(tmp_path / workdir.LOCK_FILE)).run_id == dead
  lines = []
  with workdir.hold(str(tmp_path), echo=lines.append) as me:
    assert workdir.read_holder(str(tmp_path / workdir.LOCK_FILE)) == me
  assert len(lines) == 1 and f"run {dead} (host {socket.gethostname()}" in lines[0]
  assert "taking over" in lines[0] and "ended without releasing it" in lines[0]


def _without_flock(monkeypatch):
  def flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")
  monkeypatch.setattr(fcntl, "flock", flock)


def _write_holder(tmp_path, **fields):
  holder = workdir.Holder(**{"run_id": "other", "host": socket.gethostname(),
                             "pid": os.getpid(), "started": "then", **fields})
  (tmp_path / workdir.LOCK_FILE).write_text(json.dumps(holder.__dict__))
  return holder


def test_without_flock_a_live_holder_or_one_on_another_host_keeps_the_workdir(
    tmp_path, monkeypatch):
  _without_flock(monkeypatch)
  live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    for fields in ({"pid": live.pid}, {"host": "elsewhere", "pid": 1 << 22}):
      holder = _write_holder(tmp_path, **fields)
      with pytest.raises(WorkdirInUseError) as refused:
        with workdir.hold(str(tmp_path)):
          pass
      assert f"in use by {holder}" in str(refused.value)
      assert "no locks, so if that run has ended, delete" in str(refused.value)
  finally:
    live.kill()
    live.wait()


def test_without_flock_a_holder_whose_process_is_gone_is_taken_over(tmp_path, monkeypatch):
  _without_flock(monkeypatch)
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  holder = _write_holder(tmp_path, pid=gone.pid)
  lines = []
  with workdir.hold(str(tmp_path), echo=lines.append):
    pass
  assert len(lines) == 1 and str(holder) in lines[0]
