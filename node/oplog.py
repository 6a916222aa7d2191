"""Durable, append-only log of CRDT ops in the data dir.

Record: ``uint32 length | uint32 crc32(payload) | payload`` where payload is the op's msgpack wire form. ``append``
writes a batch and fsyncs before it returns, so an op is on disk before we acknowledge it. On open, records are
read back in order. A damaged record (bad checksum, absurd length, undecodable) is skipped: the reader finds the
next intact record and goes on, so one flipped byte costs one record, not everything after it. Damaged bytes are
kept aside in ``<log>.damaged`` (appended, never lost), and the log is rewritten without them (atomically); a torn
tail (a crash inside an append: no intact record after it) is cut the same way. ``damaged_mid`` counts damaged
stretches followed by intact records: acknowledged ops may be gone, and the caller must re-fetch the node's own
ops from peers before writing again. Never a crash. ``rewrite`` keeps only the records a predicate accepts (the
replicator drops ops their authors' bases restated), atomically. Blocking file I/O: call it through
``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import msgpack

from swarmd.transport.files import write_durably

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
        self.damaged_mid = 0  # damaged stretches with intact records after them (acknowledged ops may be lost)
        self.damaged_bytes = 0

    def open(self) -> list[Any]:
        """Read every intact record (setting damaged stretches aside) and open the log for appending."""
        wires, good_end = [], 0
        self.damaged_mid = self.damaged_bytes = 0
        if self.path.exists():
            with open(self.path, "rb") as f:
                data = f.read()
            spans, damaged = _scan(data)
            wires = [wire for wire, _, _ in spans]
            if damaged:
                self._set_aside(data, spans, damaged)
            good_end = sum(end - start for _, start, end in spans)
        self._file = open(self.path, "ab")
        self.records, self.size = len(wires), good_end
        return wires

    def _set_aside(self, data: bytes, spans: list, damaged: list[tuple[int, int]]) -> None:
        last_good = spans[-1][2] if spans else 0
        self.damaged_mid = sum(1 for start, _ in damaged if start < last_good)
        self.damaged_bytes = sum(end - start for start, end in damaged)
        self.truncated_bytes = sum(end - start for start, end in damaged if start >= last_good)
        with open(self.path.with_name(self.path.name + ".damaged"), "ab") as f:
            for start, end in damaged:
                f.write(data[start:end])
            f.flush()
            os.fsync(f.fileno())
        if self.damaged_mid:
            logger.warning(
                "op log %s: %d damaged stretch(es) (%d B) skipped and kept in %s.damaged; %d intact records kept. "
                "Ops written before the damage may be lost: this node re-fetches its own ops from a peer before its "
                "next write", self.path, self.damaged_mid, self.damaged_bytes, self.path.name, len(spans))
        else:
            logger.warning("op log %s: cut %d bytes of corrupt or torn tail after %d intact records "
                           "(kept in %s.damaged)",
                           self.path, self.truncated_bytes, len(spans), self.path.name)
        write_durably(self.path, (memoryview(data)[start:end] for _, start, end in spans))

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

    def rewrite(self, select) -> bool:
        """Rewrite the log with only the records that ``select(wires)`` (a flag per record, in file order) keeps,
        in their order, atomically (a new file, fsync'd, renamed over the old one): compaction. Appends wait
        meanwhile. False (nothing changed) if the log is closed or a record turned out damaged since it was opened
        (it is set aside at the next start)."""
        with self._lock:
            if self._file is None:
                return False
            self._file.flush()
            with open(self.path, "rb") as f:
                data = f.read()
            spans, damaged = _scan(data)
            if damaged:
                logger.warning("op log %s: damaged since it was opened; not compacted", self.path)
                return False
            flags = select([wire for wire, _, _ in spans])
            kept = [(start, end) for (_, start, end), keep in zip(spans, flags, strict=True) if keep]
            write_durably(self.path, (memoryview(data)[start:end] for start, end in kept))
            self._file.close()
            self._file = open(self.path, "ab")
            self.records, self.size = len(kept), sum(end - start for start, end in kept)
            return True

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _record_at(data: bytes, offset: int) -> tuple[Any, int] | None:
    """The intact record starting at ``offset`` and where it ends, or None."""
    if offset + HEADER.size > len(data):
        return None
    length, crc = HEADER.unpack_from(data, offset)
    start, end = offset + HEADER.size, offset + HEADER.size + length
    if length > MAX_RECORD or end > len(data):
        return None
    payload = data[start:end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0), end
    except Exception:
        return None


def _scan(data: bytes) -> tuple[list[tuple[Any, int, int]], list[tuple[int, int]]]:
    """(intact records as (wire, start, end), damaged stretches as (start, end)), in file order. After a damaged
    record the next intact one is found by trying each later offset (a false match needs a CRC-32 collision)."""
    spans, damaged, offset = [], [], 0
    while offset < len(data):
        found = _record_at(data, offset)
        if found is not None:
            spans.append((found[0], offset, found[1]))
            offset = found[1]
            continue
        resume = next((o for o in range(offset + 1, len(data) - HEADER.size + 1) if _record_at(data, o)), len(data))
        damaged.append((offset, resume))
        offset = resume
    return spans, damaged


class MemoryOpLog:
    """The op log of a simulated node: :class:`OpLog`'s interface, its records kept in memory (a node restarted in
    the same process finds them again, as a restarted process finds its file)."""

    def __init__(self):
        self.wires: list[Any] = []
        self.records = 0
        self.size = 0
        self.truncated_bytes = 0
        self.damaged_mid = 0
        self.damaged_bytes = 0

    def open(self) -> list[Any]:
        return list(self.wires)

    def append(self, wires: list[Any]) -> None:
        self.wires.extend(wires)
        self.records += len(wires)
        self.size += sum(len(msgpack.packb(w, use_bin_type=True)) + HEADER.size for w in wires)

    def rewrite(self, select) -> bool:
        self.wires = [w for w, keep in zip(self.wires, select(self.wires), strict=True) if keep]
        self.records = len(self.wires)
        self.size = sum(len(msgpack.packb(w, use_bin_type=True)) + HEADER.size for w in self.wires)
        return True

    def close(self) -> None:
        pass
