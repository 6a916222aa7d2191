"""The bulk protocol's wire: the pubsub topic and its announcements (``Announcement``), the TCP request and the
stream's frames, the limits on both, the errors a pull raises, and the content hash (BLAKE3) every blob is named by.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3

from swarmd.protocols.gossip import Message
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.wire import WIRE, Bytes, Int, List, Map, Str, UnknownKind

TOPIC = "swarmd/bulk"
MAX_ANNOUNCEMENTS = 20_000  # live announcements held, in all
MAX_PER_AUTHOR = 256  # ... and per announcing peer
ANNOUNCEMENT_TTL = 900.0  # seconds an announcement (and its sources) is kept
REQUEST_DOMAIN = b"swarmd/bulk/request/v1\x00"
HEADER = struct.Struct(">BQ")
MAX_REQUEST = 4096
MAX_BLOB = 4 << 30
OK, UNKNOWN, REFUSED = 0, 1, 2
CHUNK = 1 << 20
STREAM_SPEC = ProtocolSpec("bulk", "1.0.0", max_frame=CHUNK + 64, kinds=frozenset({1, 2, 3}))
REQUEST, HEAD, DATA = 1, 2, 3

_REQUEST = Map.of(hash=Bytes(exact=32), peer=Str(128), ts=Int(), sig=Bytes(exact=64))
_REQUEST_EXAMPLE = {"hash": bytes(32), "peer": "12D3KooW...", "ts": 1_800_000_000_000, "sig": bytes(64)}
_SIGNED = REQUEST_DOMAIN.rstrip(b"\0").decode()
WIRE.blob("(bulk TCP port)", "bulk.tcp-request", _REQUEST, _REQUEST_EXAMPLE, max_size=MAX_REQUEST, signed=_SIGNED,
          doc="u32 length | this map; the reply is u8 status | u64 size | the bytes (status 0 ok, 1 unknown, "
              "2 refused); then the connection's next request, if any (a refusal closes it)")
WIRE.frame(STREAM_SPEC, REQUEST, "bulk.request", _REQUEST, _REQUEST_EXAMPLE, signed=_SIGNED,
           doc="send me the blob with this BLAKE3 hash (signed: hash | ts)")
WIRE.frame(STREAM_SPEC, HEAD, "bulk.head", Map.of(status=Int(0, 2), size=Int(0, MAX_BLOB)),
           {"status": OK, "size": 1024}, doc="0 ok, 1 unknown hash, 2 refused; then DATA frames")
WIRE.frame(STREAM_SPEC, DATA, "bulk.data", Bytes(CHUNK), b"\0" * 16, doc="the next bytes of the blob")
_ANNOUNCEMENT = Map.of(hash=Bytes(exact=32), size=Int(0, MAX_BLOB), codec=Str(128), topic=Str(128), round=Int(),
                       fragment=Int(), addrs=List(Str(63), 8))
_ANNOUNCEMENT_EXAMPLE = {"hash": bytes(32), "size": 1024, "codec": "e3m0", "topic": "diloco/run", "round": 3,
                         "fragment": 0, "addrs": ["127.0.0.1:4100"]}
ANNOUNCE = WIRE.message(TOPIC, 1, "bulk.announce", _ANNOUNCEMENT, _ANNOUNCEMENT_EXAMPLE, max_size=2048,
                        doc="a blob we hold and serve (TCP addresses; none: over our streams only)")
HAVE = WIRE.message(TOPIC, 2, "bulk.have", _ANNOUNCEMENT, _ANNOUNCEMENT_EXAMPLE, max_size=2048,
                    doc="a blob we pulled, verified and now serve too")


class BulkError(Exception):
    pass


class BadData(BulkError):
    """The source served bytes whose hash does not match."""


HASH_THREADS_FROM = 16 << 20  # bytes: a blob hashed on every core from this size, on one below it


def hasher(nbytes: int) -> blake3.blake3:
    """A BLAKE3 hasher for ``nbytes`` of input: on every core for a large input (200 MB: 14 ms against 26 on one
    core), on one for the parts of an update (1.6 MB: 0.20 ms on one core, 0.28 ms and twice the CPU on two, and
    many times that where other processes hold the cores: the pool's threads wait for one another)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if nbytes >= HASH_THREADS_FROM else 1)


def content_hash(data: bytes | memoryview) -> bytes:
    """BLAKE3 of ``data`` (``hasher``)."""
    h = hasher(len(data))
    h.update(data)
    return h.digest()


@dataclass(frozen=True)
class Announcement:
    hash: bytes
    size: int
    codec: str
    topic: str
    round: int
    fragment: int
    addrs: tuple[str, ...]  # "host:port" of the bulk server
    author: str

    @classmethod
    def parse(cls, message: Message) -> Announcement | None:
        try:
            _, obj = WIRE.unpack(TOPIC, message.data)
        except (MalformedMessage, UnknownKind):
            return None
        return cls(obj["hash"], obj["size"], obj["codec"], obj["topic"], obj["round"], obj["fragment"],
                   tuple(obj["addrs"]), message.author)
