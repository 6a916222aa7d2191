"""Framing for all of swarmd's own protocols, in one place.

Wire format of one message on a stream::

    uint32 big-endian length N | N bytes: msgpack array [kind: int, body: any]

- Protocol ids carry a version: ``/swarmd/<name>/<major.minor.patch>``.
- The length prefix is checked against the protocol's ``max_frame`` *before* the body is read, so a peer cannot make
  us allocate more than that.
- Decoding is strict: no msgpack ext types (so no timestamps or custom objects), string map keys only, no trailing
  bytes, and the kind must be one the protocol declares.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from transport.errors import FrameTooLarge, MalformedMessage, StreamClosed

HEADER = struct.Struct(">I")
PROTOCOL_PREFIX = "/swarmd/"


@dataclass(frozen=True)
class ProtocolSpec:
    """A versioned protocol: its id, the largest frame it accepts and the message kinds it knows."""

    name: str
    version: str
    max_frame: int
    kinds: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"bad protocol name {self.name!r}")
        if self.max_frame <= 0 or self.max_frame > 2**32 - 1:
            raise ValueError("max_frame must be in (0, 2**32)")

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
    payload = encode(kind, body)
    if len(payload) > spec.max_frame:
        raise FrameTooLarge(f"{spec.id}: outgoing message of {len(payload)} B exceeds limit {spec.max_frame} B")
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes, spec: ProtocolSpec) -> Message:
    """Strictly decode one payload. Raises MalformedMessage on anything unexpected."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, max_ext_len=0)
    except (ValueError, msgpack.UnpackException, TypeError, UnicodeDecodeError) as e:
        raise MalformedMessage(f"{spec.id}: undecodable msgpack ({type(e).__name__})") from None
    if not isinstance(obj, list) or len(obj) != 2 or type(obj[0]) is not int:
        raise MalformedMessage(f"{spec.id}: a message must be [kind:int, body]")
    kind = obj[0]
    if spec.kinds and kind not in spec.kinds:
        raise MalformedMessage(f"{spec.id}: unknown message kind {kind}")
    return Message(kind, obj[1])


async def read_frame(reader: asyncio.StreamReader, spec: ProtocolSpec) -> bytes | None:
    """Read one frame's payload; None on a clean end of stream between frames."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise StreamClosed(f"{spec.id}: stream ended inside a frame header") from None
    (length,) = HEADER.unpack(header)
    if length > spec.max_frame:
        raise FrameTooLarge(f"{spec.id}: incoming frame of {length} B exceeds limit {spec.max_frame} B")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise StreamClosed(f"{spec.id}: stream ended inside a frame body") from None


async def read_message(reader: asyncio.StreamReader, spec: ProtocolSpec) -> Message | None:
    payload = await read_frame(reader, spec)
    return None if payload is None else decode(payload, spec)


def unpack_record(payload: bytes, *, max_size: int) -> Any:
    """Strictly decode a standalone msgpack blob (e.g. a signed record body)."""
    if len(payload) > max_size:
        raise FrameTooLarge(f"record of {len(payload)} B exceeds limit {max_size} B")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, max_ext_len=0)
    except (ValueError, msgpack.UnpackException, TypeError, UnicodeDecodeError) as e:
        raise MalformedMessage(f"undecodable record ({type(e).__name__})") from None


def pack_record(obj: Any) -> bytes:
    """Canonical msgpack encoding used for everything that is signed (maps must be built with sorted keys)."""
    return msgpack.packb(obj, use_bin_type=True)
