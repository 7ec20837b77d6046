"""TensorBoard event files written by hand, so the client needs neither torch nor
tensorboard: the TFRecord framing (length, masked CRC32C of the length, the record, masked
CRC32C of the record) around `Event` protobufs encoded field by field (wall_time, step,
file_version in the first event, a summary of scalar values). CRC32C (Castagnoli) is pure
Python over a lookup table."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

FILE_VERSION = "brain.Event:2"


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        out.append(c)
    return out


_CRC_TABLE = _table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: uint64 length, masked CRC of the length, the data, masked CRC of it."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # a negative int64 is its ten-byte two's complement
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def scalar_event(wall_time: float, step: int, tag: str, value: float) -> bytes:
    """An `Event` {wall_time: 1, step: 2, summary: 5 {value: 1 {tag: 1, simple_value: 2}}}."""
    value_msg = _bytes_field(1, tag.encode("utf-8")) + b"\x15" + struct.pack("<f", value)
    summary = _bytes_field(1, value_msg)
    return (
        b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + _bytes_field(5, summary)
    )


def version_event(wall_time: float) -> bytes:
    """The first event of a file: {wall_time: 1, file_version: 3}."""
    return b"\x09" + struct.pack("<d", wall_time) + _bytes_field(3, FILE_VERSION.encode())


def _float32(value: float) -> float:
    """The value as simple_value (a float32) can hold it: overflow becomes ±inf."""
    try:
        struct.pack("<f", value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")
    return value


class EventWriter:
    """One event file in `directory`, named as TensorBoard looks for them."""

    def __init__(self, directory: Path, now: float | None = None):
        now = time.time() if now is None else now
        host = socket.gethostname() or "localhost"
        self.path = directory / f"events.out.tfevents.{int(now)}.{host}.torchyard"
        self._file: BinaryIO = open(self.path, "xb")  # noqa: SIM115 (closed by close())
        self._file.write(record(version_event(now)))

    def scalars(self, points: Iterable[tuple[str, int, float, float]]) -> None:
        """(tag, step, value, wall_time) each."""
        out = bytearray()
        for tag, step, value, wall_time in points:
            out += record(scalar_event(wall_time, step, tag, _float32(value)))
        self._file.write(out)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
