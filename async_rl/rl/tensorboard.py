"""TensorBoard event files: scalars, text, and a purge of later steps, written with
TensorBoard's own messages and record framing.

An event file is a sequence of TFRecords, each an `Event` protocol buffer: the file's
version first, then one event per summary. The messages are `tensorboard`'s own
(`tensorboard.compat.proto`), and so is the framing with its checksums
(`tensorboard.summary.writer.record_writer.RecordWriter`). The file is opened here, not
by `tensorboard`'s `EventFileWriter`, which goes through `tf.io.gfile` and so imports
TensorFlow wherever it is installed (tensorboardX imports PyTorch likewise): no process
that logs a run imports either. Events are flushed as they are written, so a killed run
loses none.

A scalar is stored as a float32 (`simple_value`), as TensorBoard plots it: inf and nan
are written as such, and a finite value beyond float32's range as ±inf.
"""

import math
import numbers
import os
import socket
import time

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.record_writer import RecordWriter

FILE_VERSION = "brain.Event:2"


class EventWriter:
  """Appends events to a new file in `logdir`
  (`events.out.tfevents.<seconds>.<host><suffix>`, as TensorBoard finds them).

  `add_scalar` and `add_text` raise ValueError or TypeError, and write nothing, when
  their event cannot be encoded (a tag or text that is not UTF-8, a value that is not a
  number).

  Args:
    logdir: the directory (made if missing).
    purge_step: TensorBoard hides the events of this step and later ones that earlier
      files of the directory hold (a resumed run's superseded steps); None: none.
    suffix: ends the file's name.
  """

  def __init__(self, logdir: str, purge_step=None, suffix: str = ""):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    self.path = os.path.join(
        logdir, f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}{suffix}")
    self._records = RecordWriter(open(self.path, "ab"))
    self._write(event_pb2.Event(wall_time=now, step=purge_step or 0,
                                file_version=FILE_VERSION))
    if purge_step is not None:
      self._write(event_pb2.Event(wall_time=now, step=purge_step, session_log=event_pb2.SessionLog(
          status=event_pb2.SessionLog.START)))

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(
        tag=tag, simple_value=_float(value))])
    self._write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

  def add_text(self, tag: str, content: str, step: int) -> None:
    self._write(event_pb2.Event(wall_time=time.time(), step=step,
                                summary=text_pb(tag, content)))

  def close(self) -> None:
    self._records.close()

  def _write(self, event) -> None:
    self._records.write(event.SerializeToString())
    self._records.flush()


def _float(value) -> float:
  """`value` as a float; an integer beyond float's range as ±inf, as float32 holds it."""
  if not isinstance(value, numbers.Real):
    raise TypeError(f"a scalar must be a real number, got {type(value).__name__}")
  try:
    return float(value)
  except OverflowError:
    return math.inf if value > 0 else -math.inf
