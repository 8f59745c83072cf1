"""TensorBoard event files, written directly: scalars, text, and a purge of later steps.

An event file is a sequence of TFRecords (a little-endian uint64 length, its masked
CRC-32C, the bytes, their masked CRC-32C), each an `Event` protocol buffer: the file's
version first, then one event per summary. The few messages written here are encoded
by hand (field number and wire type, then the value), which spares every process that
logs a run the import of a protobuf library, TensorFlow or a writer that pulls in
PyTorch. Events are flushed as they are written, so a killed run loses none.

The messages and fields used (tensorflow/core/util/event.proto, framework/summary.proto,
tensor.proto, tensor_shape.proto):

  Event          wall_time 1 (double), step 2 (int64), and one of file_version 3
                 (string), summary 5 (Summary), session_log 7 (SessionLog)
  SessionLog     status 1 (enum: START = 1)
  Summary        value 1 (repeated Value)
  Value          tag 1 (string), simple_value 2 (float), tensor 8 (TensorProto),
                 metadata 9 (SummaryMetadata)
  SummaryMetadata  plugin_data 1 (PluginData: plugin_name 1)
  TensorProto    dtype 1 (enum: DT_STRING = 7), tensor_shape 2 (dim 2: size 1),
                 string_val 8 (repeated bytes)
"""

import os
import socket
import struct
import time

_START = 1
_DT_STRING = 7


def _crc32c_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    table.append(crc)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), the checksum of TFRecords."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
  """`data` framed as one TFRecord."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", _masked(crc32c(length))) + data
          + struct.pack("<I", _masked(crc32c(data))))


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # negative int64s take ten bytes, as two's complement
  out = bytearray()
  while True:
    out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
    n >>= 7
    if not n:
      return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint(field << 3 | wire_type)


def _int(field: int, n: int) -> bytes:
  return _key(field, 0) + _varint(n)


def _bytes(field: int, data: bytes) -> bytes:
  return _key(field, 2) + _varint(len(data)) + data


def event(step: int, *, wall_time: float, file_version: str = "", summary: bytes = b"",
          session_start: bool = False) -> bytes:
  """An encoded `Event`."""
  out = _key(1, 1) + struct.pack("<d", wall_time) + _int(2, step)
  if file_version:
    out += _bytes(3, file_version.encode())
  if summary:
    out += _bytes(5, summary)
  if session_start:
    out += _bytes(7, _int(1, _START))
  return out


def scalar(tag: str, value: float) -> bytes:
  """An encoded `Summary` of one scalar."""
  return _bytes(1, _bytes(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value))


def text(tag: str, content: str) -> bytes:
  """An encoded `Summary` of one text entry (TensorBoard's text plugin)."""
  tensor = _int(1, _DT_STRING) + _bytes(2, _bytes(2, _int(1, 1))) + _bytes(8, content.encode())
  metadata = _bytes(1, _bytes(1, b"text"))
  return _bytes(1, _bytes(1, tag.encode()) + _bytes(8, tensor) + _bytes(9, metadata))


class EventWriter:
  """Appends events to a new file in `logdir`
  (`events.out.tfevents.<seconds>.<host><suffix>`, as TensorBoard finds them).

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
    self._file = open(self.path, "ab")
    self._write(event(0 if purge_step is None else purge_step, wall_time=now,
                      file_version="brain.Event:2"))
    if purge_step is not None:
      self._write(event(purge_step, wall_time=now, session_start=True))

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    self._write(event(step, wall_time=time.time(), summary=scalar(tag, float(value))))

  def add_text(self, tag: str, content: str, step: int) -> None:
    self._write(event(step, wall_time=time.time(), summary=text(tag, content)))

  def close(self) -> None:
    self._file.close()

  def _write(self, data: bytes) -> None:
    self._file.write(record(data))
    self._file.flush()
