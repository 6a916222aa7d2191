"""Durable, append-only log of CRDT ops in the data dir.

Record: ``uint32 length | uint32 crc32(payload) | payload`` where payload is the op's msgpack wire form. ``append``
writes a batch and fsyncs before it returns, so an op is on disk before we acknowledge it. On open, records are
read back in order; a torn or corrupt tail (short header, short body, bad checksum, absurd length) is cut off with a
warning, never a crash. Blocking file I/O: call it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any, Iterator

import msgpack

logger = logging.getLogger(__name__)

HEADER = struct.Struct(">II")
MAX_RECORD = 1 << 20


class OpLog:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        self.records = 0
        self.size = 0
        self.truncated_bytes = 0

    def open(self) -> list[Any]:
        """Read every intact record (cutting a corrupt tail) and open the log for appending."""
        wires, good_end = [], 0
        if self.path.exists():
            with open(self.path, "rb") as f:
                data = f.read()
            for wire, end in _records(data):
                wires.append(wire)
                good_end = end
            if good_end < len(data):
                self.truncated_bytes = len(data) - good_end
                logger.warning(
                    "op log %s: cut %d bytes of corrupt or torn tail after %d intact records",
                    self.path, self.truncated_bytes, len(wires),
                )
                with open(self.path, "r+b") as f:
                    f.truncate(good_end)
                    f.flush()
                    os.fsync(f.fileno())
        self._file = open(self.path, "ab")
        self.records, self.size = len(wires), good_end
        return wires

    def append(self, wires: list[Any]) -> None:
        if not wires:
            return
        chunks = []
        for wire in wires:
            payload = msgpack.packb(wire, use_bin_type=True)
            chunks.append(HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        blob = b"".join(chunks)
        with self._lock:
            if self._file is None:
                raise OSError(f"op log {self.path} is closed")
            self._file.write(blob)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.records += len(wires)
            self.size += len(blob)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _records(data: bytes) -> Iterator[tuple[Any, int]]:
    offset = 0
    while offset + HEADER.size <= len(data):
        length, crc = HEADER.unpack_from(data, offset)
        start, end = offset + HEADER.size, offset + HEADER.size + length
        if length > MAX_RECORD or end > len(data):
            return
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            return
        try:
            wire = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0)
        except Exception:
            return
        yield wire, end
        offset = end
