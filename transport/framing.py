"""Framing for all of swarmd's own protocols, in one place.

Wire format of one message on a stream::

    uint32 big-endian length N | N bytes: msgpack array [kind: int, body: any]

- Protocol ids carry a version: ``/swarmd/<name>/<major.minor.patch>``.
- The length prefix is checked against the protocol's ``max_frame`` *before* the body is read, so a peer cannot make
  us allocate more than that.
- Decoding is strict: no msgpack ext types (so no timestamps or custom objects), string map keys only, no trailing
  bytes, and the kind must be one the protocol declares, checked before the body is decoded.
- Decoding is budgeted by the input's size (:func:`unpack`): a container costs ~60 B in Python but one byte on the
  wire, so containers are capped at one per ``CONTAINER_BYTES`` bytes of input and one container's announced length
  at half the input; a frame of a million empty maps is refused after its budget, not unpacked whole.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from swarmd.transport.errors import FrameTooLarge, MalformedMessage, StreamClosed

HEADER = struct.Struct(">I")
PROTOCOL_PREFIX = "/swarmd/"

ITEM_BYTES = 16  # at most one decoded object (a container, an array element, a map key or value) per 16 input bytes
ITEM_FLOOR = 4096  # ... plus this many, whatever the size (a few hundred KiB at most)
ITEM_TIER = 1 << 16  # beyond this many bytes, one object per ITEM_BYTES_LARGE: large honest frames are mostly bytes
ITEM_BYTES_LARGE = 64  # (a 1,000-op PUSH is 5 objects per op of >= 150 B; bulk data, checkpoints, tensors: bytes)


@dataclass(frozen=True)
class ProtocolSpec:
    """A versioned protocol: its id, the largest frame it accepts and the message kinds it knows."""

    name: str
    version: str
    max_frame: int
    kinds: frozenset[int] = field(default_factory=frozenset)
    idle_timeout: float = 60.0  # an inbound stream that sends nothing for this long is closed
    # decoded objects a frame beyond 64 KiB may carry: one per this many bytes (``unpack``); a protocol whose large
    # honest frames are many small objects (a log of signed messages) says so, up to one per ITEM_BYTES
    item_bytes: int = ITEM_BYTES_LARGE

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"bad protocol name {self.name!r}")
        if self.max_frame <= 0 or self.max_frame > 2**32 - 1:
            raise ValueError("max_frame must be in (0, 2**32)")
        if any(not 0 <= k <= 0x7F for k in self.kinds):
            raise ValueError("message kinds are 0..127 (one msgpack byte)")
        if not ITEM_BYTES <= self.item_bytes <= ITEM_BYTES_LARGE:
            raise ValueError(f"item_bytes must be {ITEM_BYTES}..{ITEM_BYTES_LARGE}")

    @property
    def id(self) -> str:
        return f"{PROTOCOL_PREFIX}{self.name}/{self.version}"


@dataclass(frozen=True)
class Message:
    kind: int
    body: Any


def encode(kind: int, body: Any) -> bytes:
    """The msgpack payload of one message (without the length prefix)."""
    return msgpack.packb([int(kind), body], use_bin_type=True)


def frame(kind: int, body: Any, spec: ProtocolSpec) -> bytes:
    """Length prefix + payload. Raises FrameTooLarge if the message exceeds the protocol's limit."""
    if not 0 <= kind <= 0x7F:
        raise ValueError(f"message kind {kind} is not 0..127")
    payload = encode(kind, body)
    if len(payload) > spec.max_frame:
        raise FrameTooLarge(f"{spec.id}: outgoing message of {len(payload)} B exceeds limit {spec.max_frame} B")
    return HEADER.pack(len(payload)) + payload


class _OverBudget(Exception):
    pass


def unpack(payload: bytes, *, what: str = "msgpack", item_bytes: int = ITEM_BYTES_LARGE) -> Any:
    """Strictly decode one msgpack value under a budget proportional to ``len(payload)``. Raises MalformedMessage.

    The budget counts decoded objects: each map or array, each of its elements, each key and value, at most
    ``ITEM_FLOOR`` plus one per ``ITEM_BYTES`` of the first 64 KiB and one per ``ITEM_BYTES_LARGE`` beyond. No single
    map or array may be longer than that (the C unpacker checks before it allocates one), and the total is checked as
    each container completes. A Python object costs 30-60 bytes, so the peak memory of any input stays under about 4x
    its size (a bare ``msgpack.unpackb`` lets a list of two-letter strings cost 20x, and nested empty maps 70x). The
    densest honest messages (gossip's IHAVE ids, one per 18 bytes; CRDT version-vector pages, one per ~28) fit.
    ``item_bytes``: a protocol's own allowance beyond 64 KiB (``ProtocolSpec.item_bytes``, at least ITEM_BYTES)."""
    n = len(payload)
    budget = ITEM_FLOOR + min(n, ITEM_TIER) // ITEM_BYTES + max(0, n - ITEM_TIER) // max(ITEM_BYTES, item_bytes)
    left = [budget]

    def count(container):
        left[0] -= 1 + (2 * len(container) if type(container) is dict else len(container))
        if left[0] < 0:
            raise _OverBudget
        return container

    longest = budget
    try:
        return msgpack.unpackb(
            payload, raw=False, strict_map_key=True, use_list=True, max_ext_len=0, object_hook=count,
            list_hook=count, max_array_len=longest, max_map_len=longest,
        )
    except _OverBudget:
        raise MalformedMessage(f"{what}: more objects than {len(payload)} B may carry", kind="oversized") from None
    except (ValueError, msgpack.UnpackException, TypeError, UnicodeDecodeError, RecursionError) as e:
        if "exceeds max" in str(e):
            raise MalformedMessage(f"{what}: a container longer than {len(payload)} B may carry",
                                   kind="oversized") from None
        raise MalformedMessage(f"{what}: undecodable msgpack ({type(e).__name__})") from None


def decode(payload: bytes, spec: ProtocolSpec) -> Message:
    """Strictly decode one payload, its kind checked before its body. Raises MalformedMessage."""
    if len(payload) < 2 or payload[0] != 0x92:  # a fixarray of two: [kind, body]
        raise MalformedMessage(f"{spec.id}: a message must be [kind:int, body]")
    kind = payload[1]
    if kind > 0x7F:  # kinds are positive fixints (0..127)
        raise MalformedMessage(f"{spec.id}: a message kind must be a small int")
    if spec.kinds and kind not in spec.kinds:
        raise MalformedMessage(f"{spec.id}: unknown message kind {kind}")
    return Message(kind, unpack(memoryview(payload)[2:], what=spec.id, item_bytes=spec.item_bytes))


async def read_header(reader: asyncio.StreamReader, spec: ProtocolSpec) -> int | None:
    """Read one frame's length prefix, checked against the protocol's limit; None on a clean end of stream."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise StreamClosed(f"{spec.id}: stream ended inside a frame header") from None
    (length,) = HEADER.unpack(header)
    if length > spec.max_frame:
        raise FrameTooLarge(f"{spec.id}: incoming frame of {length} B exceeds limit {spec.max_frame} B")
    return length


PREALLOCATE = 1 << 16


async def read_body(reader: asyncio.StreamReader, length: int, spec: ProtocolSpec) -> bytes | bytearray:
    """A frame's body. A large one is read into one buffer of its exact size, chunk by chunk as it arrives: the
    reader's own buffer never grows past its limit, and no buffer is grown by reallocation (a run of large frames
    read with ``readexactly`` fragmented the heap: 24 frames of 8 MiB kept ~150 MB of RSS)."""
    if length <= PREALLOCATE:
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise StreamClosed(f"{spec.id}: stream ended inside a frame body") from None
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    while got < length:
        chunk = await reader.read(min(length - got, 1 << 20))
        if not chunk:
            raise StreamClosed(f"{spec.id}: stream ended inside a frame body")
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return buf


async def read_frame(reader: asyncio.StreamReader, spec: ProtocolSpec) -> bytes | None:
    """Read one frame's payload; None on a clean end of stream between frames."""
    length = await read_header(reader, spec)
    return None if length is None else await read_body(reader, length, spec)


async def read_message(reader: asyncio.StreamReader, spec: ProtocolSpec) -> Message | None:
    payload = await read_frame(reader, spec)
    return None if payload is None else decode(payload, spec)


def unpack_record(payload: bytes, *, max_size: int) -> Any:
    """Strictly decode a standalone msgpack blob (e.g. a signed record body)."""
    if len(payload) > max_size:
        raise FrameTooLarge(f"record of {len(payload)} B exceeds limit {max_size} B")
    return unpack(payload, what="record")


def pack_record(obj: Any) -> bytes:
    """Canonical msgpack encoding used for everything that is signed (maps must be built with sorted keys)."""
    return msgpack.packb(obj, use_bin_type=True)
