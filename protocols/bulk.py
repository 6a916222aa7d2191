"""Bulk tensor transfer: announce through pubsub, pull over a direct TCP connection, verify the hash, then hand over.

Small messages go through :mod:`protocols.gossip`; tensors do not. A publisher stores the bytes, announces
``{hash, size, codec, topic, round, fragment, addrs}`` on the ``swarmd/bulk`` topic (signed like every pubsub
message), and receivers pull the bytes from the announcer, or from any peer that already has them (holders announce
``HAVE`` for a hash they verified). Nothing is handed to a loop before its BLAKE3 hash matches; a source that serves
other bytes is penalised and the next source is tried.

Transport: a plain TCP connection to the holder's bulk port (the address it announces), never a relayed libp2p
connection: relays carry announcements only. The receiver reads into one preallocated buffer with an asyncio
``BufferedProtocol`` (measured here: a whole-message ``readexactly`` halves asyncio throughput, and the p2p daemon's
streams peak at ~0.5 GB/s on loopback). A request is signed by the requester (peer id, hash, time), so a holder
serves members only and can rate-limit them; integrity comes from the hash, so the stream itself needs no
encryption (the same bytes are announced to the whole swarm).

Wire (TCP): request ``u32 length | msgpack {"hash", "peer", "ts", "sig"}``; reply ``u8 status | u64 size | bytes``
(status 0 ok, 1 unknown hash, 2 refused). A connection carries further requests, one after another, each
answered in full before the next is sent (a server keeps an idle one KEEPALIVE s; a client keeps its idle ones in a
``ConnectionPool`` for less), so a round's pulls from one source reuse one connection: no new TCP handshake, and on
a real link no new slow start, for each chunk. A server that closes after one reply (an older node) is still
understood: a pooled connection closed before its reply is retried once on a new one. A server holds at most
``max_served()`` connections at once; at a new one past that it closes one that waits for a request, the longest
waiting of the host with the most waiting (a flood of idle connections from one host closes its own), counted
(``connections_evicted``).

Behind NATs a holder's TCP port is not reachable, but a hole-punched libp2p connection is (``node.nat``). So the
same request also works as a stream, ``/swarmd/bulk/1.0.0``: REQUEST {hash, peer, ts, sig} (peer must be the
stream's authenticated peer), HEAD {status, size}, then DATA frames of at most 1 MiB. A holder refuses it on a
relayed connection (relays carry control traffic only). A receiver uses it for sources it reaches on a
hole-punched connection, and for directly connected sources whose TCP address did not answer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import blake3
import msgpack
from aiohttp import web

from swarmd.node.services import NodeContext
from swarmd.protocols.gossip import Gossip, Message, Verdict
from swarmd.transport import clock
from swarmd.transport.clock import Clock
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.framing import ProtocolSpec, unpack
from swarmd.transport.identity import verify
from swarmd.transport.penalties import RateLimitedLog, TokenBuckets
from swarmd.transport.wire import WIRE, Bytes, Int, List, Map, Str, UnknownKind

logger = logging.getLogger(__name__)

TOPIC = "swarmd/bulk"
MAX_ANNOUNCEMENTS = 20_000  # live announcements held, in all
MAX_PER_AUTHOR = 256  # ... and per announcing peer
ANNOUNCEMENT_TTL = 900.0  # seconds an announcement (and its sources) is kept
SERVE_RATE, SERVE_BURST = 200.0, 400.0  # requests per second a peer may make of us (fast runs pull often)
MAX_SERVING_PER_PEER = 4  # transfers to one peer at once
REQUEST_DOMAIN = b"swarmd/bulk/request/v1\x00"
HEADER = struct.Struct(">BQ")
MAX_REQUEST = 4096
MAX_BLOB = 4 << 30
DEFAULT_MAX_BYTES = 2 << 30  # blobs held, in all, unless a service reserves more (``reserve``)
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


class _Closed(BulkError):
    """The source closed the connection before its reply was whole (``before_reply``: before its first byte)."""

    def __init__(self, message: str, before_reply: bool):
        super().__init__(message)
        self.before_reply = before_reply


class ConnectionPool:
    """A client's idle bulk connections, by source address: a pull takes one (the most recently used) or dials a new
    one, and gives it back once its reply came whole and checked. At most POOL_PER_ADDR a source and POOL_MAX in
    all; one idle for POOL_IDLE is closed (``expire``; and when taken)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._idle: dict[str, list[tuple[float, asyncio.Transport, _Receiver]]] = {}
        self.counters: collections.Counter = collections.Counter()

    def take(self, addr: str) -> tuple[asyncio.Transport, _Receiver] | None:
        held = self._idle.get(addr)
        now = self._clock()
        while held:
            since, transport, protocol = held.pop()
            if not protocol.closed and not transport.is_closing() and now - since < POOL_IDLE:
                if not held:
                    del self._idle[addr]
                self.counters["reused"] += 1
                return transport, protocol
            transport.close()
        self._idle.pop(addr, None)
        return None

    def give(self, addr: str, transport: asyncio.Transport, protocol: _Receiver) -> None:
        held = self._idle.setdefault(addr, [])
        if protocol.closed or transport.is_closing() or len(held) >= POOL_PER_ADDR or self.idle() >= POOL_MAX:
            transport.close()
            if not held:
                del self._idle[addr]
            return
        held.append((self._clock(), transport, protocol))

    def idle(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def expire(self) -> None:
        now = self._clock()
        for addr in list(self._idle):
            keep = []
            for since, transport, protocol in self._idle[addr]:
                if protocol.closed or transport.is_closing() or now - since >= POOL_IDLE:
                    transport.close()
                else:
                    keep.append((since, transport, protocol))
            if keep:
                self._idle[addr] = keep
            else:
                del self._idle[addr]

    def close(self) -> None:
        for held in self._idle.values():
            for _, transport, _ in held:
                transport.close()
        self._idle.clear()


HASH_THREADS_FROM = 16 << 20  # bytes: a blob hashed on every core from this size, on one below it
INLINE_HASH = 1 << 20  # bytes: a pulled blob up to this size is hashed on the event loop (0.2 ms at most)


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


GROW = 16 << 20  # a body up to this size is read into a bytearray of its size; a larger one into ``_large_buffer``
LOWAT = 256 << 10  # a body's socket wakes us when this much has come at most (SO_RCVLOWAT), not at every packet
WAKE_EVERY = 0.05  # s: ... or what the transfer's rate brings in that long, whichever is less
HOLD = 4 * WAKE_EVERY  # s: bytes held in the kernel this long without a read (a source that paused) are read then
IDLE_TIMEOUT = 30.0  # a source that sends nothing for this long is dropped
KEEPALIVE = 10.0  # s a server waits for a connection's next request (and for its first)
POOL_IDLE = 5.0  # s a client keeps an idle connection (under KEEPALIVE: the server closes it after the client)
POOL_PER_ADDR = 4  # idle connections kept to one source (a round pulls a few chunks of one source at once)
POOL_MAX = 64  # ... and to all sources together
# connections a server holds at once (idle ones included), so that a flood of them (anyone may dial the port we
# announce) cannot take the file descriptors the node needs: a quarter of the process's limit, 64 to 1024
SERVED_MIN, SERVED_MAX = 64, 1024


def max_served() -> int:
    """The connections a bulk server holds at once (see SERVED_MIN): a quarter of the soft RLIMIT_NOFILE."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return SERVED_MIN * 4
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        return SERVED_MAX
    return max(SERVED_MIN, min(SERVED_MAX, soft // 4))


def _large_buffer(size: int) -> mmap.mmap | bytearray:
    """A receive buffer for a body over GROW: anonymous memory of its whole size, whose pages the kernel provides
    as bytes are written into them, so it holds what actually arrived (a source announcing 4 GiB and sending 1 MiB
    costs 1 MiB), with no copy as it fills. (A bytearray from GROW, doubled as bytes come, allocates a 256 MiB
    body 1.9x over in fresh pages and copies it once on the way: 0.24 s of a 0.45 s pull on loopback.) Where the
    kernel refuses to map the size (an overcommit limit), a bytearray of GROW that ``get_buffer`` doubles."""
    try:  # private: plain anonymous memory, as a bytearray's (a shared mapping's pages are shmem)
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError):
        return bytearray(GROW)


class _Receiver(asyncio.BufferedProtocol):
    """Reads the reply header, then the body straight into its buffer (``_large_buffer`` over GROW: memory held as
    the bytes arrive; a bytearray that doubles where that cannot be mapped, so the copies stay amortised). One reply
    at a time; with ``keep`` the connection stays open after a complete one (``begin`` readies the next), and a
    byte that comes between replies (none is asked for) closes it."""

    def __init__(self, max_size: int, keep: bool = False):
        self.keep = keep
        self.closed = False
        self.idle = False  # between replies: nothing is expected
        self.transport = None
        self.lowat = 1  # the socket's SO_RCVLOWAT (``_wake_at``)
        self.release: asyncio.TimerHandle | None = None  # while it is over 1: ``_release``
        self.begin(max_size)

    def begin(self, max_size: int) -> None:
        """Ready for the next reply (of at most ``max_size`` bytes)."""
        self.idle = False
        self.max_size = max_size
        self.header = bytearray(HEADER.size)
        self.got_header = 0
        self.body: bytearray | None = None
        self.view: memoryview | None = None
        self.got = 0
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.status = None
        self.size = 0
        self.last_progress = self.started = time.monotonic()

    def rest(self) -> None:
        """Between replies: the last one's body is the caller's now (the connection, idle in a pool, holds no
        reference to it)."""
        self.body = self.view = None
        self.done = asyncio.get_running_loop().create_future()
        self.done.set_result(None)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def _wake_at(self, nbytes: int) -> None:
        """Wake us when ``nbytes`` have come (SO_RCVLOWAT: the kernel holds the socket unreadable till then; an
        end or an error wakes us at once). On a link slower than this machine bytes come a packet or two at a time,
        and each would come up to Python on its own. Back to 1 when nothing was read for HOLD (``_release``: a source
        that paused, or slowed below the rate so far): what has come is never held longer."""
        nbytes = max(1, nbytes)
        if nbytes == self.lowat:
            return
        sock = self.transport.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self.lowat = nbytes
        except (OSError, AttributeError):
            return  # a transport without a socket option: every read wakes us
        if nbytes > 1 and self.release is None:
            self.release = asyncio.get_running_loop().call_later(HOLD, self._release)

    def _release(self) -> None:
        self.release = None
        if self.done.done() or self.lowat == 1:
            return
        idle = time.monotonic() - self.last_progress
        if idle >= HOLD:
            self._wake_at(1)  # the rate is measured again from the next read
        else:
            self.release = asyncio.get_running_loop().call_later(HOLD - idle, self._release)

    def get_buffer(self, sizehint: int):
        if self.idle:  # bytes nobody asked for: read into a scratch buffer, then the connection is closed
            return memoryview(bytearray(64))
        if self.body is None:
            return memoryview(self.header)[self.got_header:]
        if self.got == len(self.body):  # a new, larger buffer (the loop may still hold a view of the old one)
            grown = bytearray(min(self.size, 2 * len(self.body)))
            grown[:self.got] = self.view[:self.got]
            self.body, self.view = grown, memoryview(grown)
        return self.view[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.idle:
            self.transport.close()  # (a source that sends between replies is not reused)
            return
        if self.body is None:
            self.got_header += nbytes
            if self.got_header < HEADER.size:
                return
            self.status, size = HEADER.unpack(self.header)
            if self.status != OK:
                self._finish(BulkError(f"source answered status {self.status}"))
                return
            if size > self.max_size:
                self._finish(BulkError(f"source offers {size} B, more than announced"))
                return
            self.size = size
            self.body = bytearray(size) if size <= GROW else _large_buffer(size)
            self.view = memoryview(self.body)
            self.started = time.monotonic()
            if size == 0:
                self._finish(None)
            return
        self.got += nbytes
        now = self.last_progress = time.monotonic()
        if self.got == self.size:
            self._finish(None)
            return
        # wake us when WAKE_EVERY's bytes at the rate so far have come (at most LOWAT, and the rest at the end)
        rate = self.got / max(now - self.started, 1e-3)
        want = max(1, min(LOWAT, int(rate * WAKE_EVERY), self.size - self.got))
        if want > 2 * self.lowat or 2 * want < self.lowat or self.size - self.got < self.lowat:
            self._wake_at(want)

    def _stop_release(self) -> None:
        if self.release is not None:
            self.release.cancel()
            self.release = None

    def _finish(self, error: Exception | None) -> None:
        self._stop_release()
        if not self.done.done():
            if error is None:
                self.done.set_result(self.body)
            else:
                self.done.set_exception(error)
        if error is None and self.keep and not self.closed:
            self.idle = True
            self._wake_at(1)  # the next reply's header wakes us at its first byte
        else:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._stop_release()
        if not self.done.done():
            self.done.set_exception(_Closed(f"connection closed after {self.got} B ({exc})", self.got_header == 0))


async def fetch(addr: str, blob_hash: bytes, size: int, request: bytes, *, timeout: float = 120.0,
                idle_timeout: float = IDLE_TIMEOUT, progress: Callable[[int], None] | None = None,
                pool: ConnectionPool | None = None) -> bytearray | mmap.mmap:
    """Pull one blob from ``addr`` ("host:port") and verify it (a bytearray, or for a body over GROW the anonymous
    memory it was read into: ``_large_buffer``); ``progress(bytes so far)`` is called about once a second. With
    ``pool``, over an idle connection of it where there is one (and a connection that served the
    blob whole goes back to it). Raises BulkError / BadData / OSError."""
    conn = pool.take(addr) if pool is not None else None
    if conn is not None:
        try:
            return await _fetch_on(conn, addr, blob_hash, size, request, timeout, idle_timeout, progress, pool,
                                   reused=True)
        except _Closed as e:
            if not e.before_reply:
                raise
            # closed before its reply began: the source's end of an idle connection (its keep-alive over, or a
            # source that serves one request a connection): once more, on a new one
            pool.counters["reuse_failed"] += 1
    host, port = addr.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    conn = await asyncio.wait_for(
        loop.create_connection(lambda: _Receiver(size, keep=pool is not None), host.strip("[]"), int(port)), 10.0
    )
    return await _fetch_on(conn, addr, blob_hash, size, request, timeout, idle_timeout, progress, pool)


async def _fetch_on(conn: tuple[asyncio.Transport, _Receiver], addr: str, blob_hash: bytes, size: int,
                    request: bytes, timeout: float, idle_timeout: float, progress: Callable[[int], None] | None,
                    pool: ConnectionPool | None, reused: bool = False) -> bytearray | mmap.mmap:
    """One request and its reply on a connection (``reused``: one from the pool, its last reply over): given back
    to ``pool`` once the reply came whole and matched, closed otherwise."""
    transport, protocol = conn
    if reused:
        protocol.begin(size)
    deadline = time.monotonic() + timeout
    kept = False
    try:
        transport.write(struct.pack(">I", len(request)) + request)
        while True:
            try:
                body = await asyncio.wait_for(asyncio.shield(protocol.done), min(1.0, idle_timeout))
                break
            except asyncio.TimeoutError:
                if progress is not None:
                    progress(protocol.got)
                now = time.monotonic()
                if now > deadline:
                    raise BulkError(f"{addr}: not done after {timeout:.0f} s ({protocol.got} B)") from None
                if now - protocol.last_progress > idle_timeout:
                    raise BulkError(f"{addr}: no bytes for {idle_timeout:.0f} s ({protocol.got} B)") from None
        if len(body) != size:
            raise BadData(f"{addr} served {len(body)} B, announced {size} B")
        # (a part of an update on the loop: a hand-off to a worker thread cost more than its hash, 0.03 ms for 200 KB)
        digest = content_hash(body) if size <= INLINE_HASH else await asyncio.to_thread(content_hash, body)
        if digest != blob_hash:
            raise BadData(f"{addr} served bytes whose hash does not match the announcement")
        if pool is not None and protocol.idle:
            protocol.rest()
            pool.give(addr, transport, protocol)
            kept = True
        return body
    finally:
        if not kept:
            transport.close()
        if not protocol.done.done():
            protocol.done.cancel()


async def fetch_stream(transport, peer: str, blob_hash: bytes, size: int, request: dict, *,
                       timeout: float = 120.0, progress: Callable[[int], None] | None = None) -> bytearray:
    """Pull one blob from ``peer`` over a ``/swarmd/bulk`` stream and verify it; ``progress(bytes so far)`` is
    called with 0 once the source has answered (its HEAD), then as each frame comes. Raises BulkError / BadData /
    TransportError / ProtocolViolation."""
    async with asyncio.timeout(timeout):
        async with await transport.open_stream(peer, STREAM_SPEC, timeout=10) as stream:
            await stream.send(REQUEST, request)
            head = await stream.read_required()
            if head.kind != HEAD or not isinstance(head.body, dict) or set(head.body) != {"status", "size"}:
                raise MalformedMessage("bulk: expected HEAD {status, size}")
            if head.body["status"] != OK:
                raise BulkError(f"source answered status {head.body['status']}")
            if head.body["size"] != size:
                raise BadData(f"source offers {head.body['size']} B, announced {size} B")
            if progress is not None:
                progress(0)  # the source answered: what comes from now is the transfer (its link's rate)
            body = bytearray()  # grows with what arrives, not with what was announced
            while len(body) < size:
                chunk = await asyncio.wait_for(stream.read_required(), IDLE_TIMEOUT)
                if chunk.kind != DATA or not isinstance(chunk.body, bytes) or not chunk.body \
                        or len(chunk.body) > size - len(body):
                    raise BadData(f"bulk: bad DATA frame after {len(body)} B")
                body += chunk.body
                if progress is not None:
                    progress(len(body))
    digest = await asyncio.to_thread(content_hash, body)
    if digest != blob_hash:
        raise BadData("served bytes whose hash does not match the announcement")
    return body


class BulkService:
    """Holds blobs, serves them over TCP, announces them, pulls and verifies others'."""

    name = "bulk"

    def __init__(self, gossip: Gossip, *, host: str = "127.0.0.1", port: int = 0, max_bytes: int = DEFAULT_MAX_BYTES,
                 on_blob: Callable[[Announcement, bytearray], None] | None = None, tcp: bool = True):
        self.gossip = gossip
        self.tcp = tcp  # False: no TCP server, blobs are served and pulled over the transport's streams only
        self.host, self.port = host, port
        self.max_bytes = max_bytes
        self.blobs: collections.OrderedDict[bytes, bytearray] = collections.OrderedDict()
        self._held = 0  # bytes in blobs
        self.announcements: dict[bytes, Announcement] = {}  # in arrival order
        self.sources: dict[bytes, list[tuple[str, str]]] = collections.defaultdict(list)  # hash -> (peer, addr)
        self._announced_at: dict[bytes, float] = {}
        self._by_author_hashes: dict[str, collections.deque] = {}  # author -> its live announcements, oldest first
        self._rate = TokenBuckets(SERVE_RATE, SERVE_BURST)  # requests per requester
        self._serving: collections.Counter = collections.Counter()
        self._served_at = 0.0  # when the last transfer we served ended (monotonic)
        self._serving_blobs: collections.Counter = collections.Counter()  # blob hash -> transfers of it under way
        self._log = RateLimitedLog(logger, interval=30.0)
        self._hosts_cache: tuple[float, dict[str, set[str]]] | None = None
        self._hosts_listing: asyncio.Task | None = None  # the listing under way (``_peer_hosts``)
        self.counters: collections.Counter = collections.Counter()
        self.on_blob = on_blob
        self._server: asyncio.AbstractServer | None = None
        self._ctx: NodeContext | None = None
        self._addrs: list[str] = []
        self._pool = ConnectionPool()  # our idle connections to sources, for the next pulls from them
        # the connections we serve (idle ones included), and the task serving each
        self._connections: dict[asyncio.StreamWriter, asyncio.Task | None] = {}
        # of those, the ones waiting for a request (a first or a next one, until it is read whole), by the host
        # they came from, each host's longest waiting first: the ones a full server may close (``_make_room``)
        self._waiting: dict[str, dict[asyncio.StreamWriter, None]] = {}
        self._waiting_host: dict[asyncio.StreamWriter, str] = {}
        self._evicted: set[asyncio.StreamWriter] = set()
        self.max_connections: int | None = None  # None: max_served(), read at each new connection

    # ------------------------------------------------------------------ lifecycle
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self._rate = TokenBuckets(SERVE_RATE, SERVE_BURST, clock=ctx.clock.monotonic)
        self._pool = ConnectionPool(clock=ctx.clock.monotonic)
        self._log = RateLimitedLog(logger, interval=30.0, clock=ctx.clock.monotonic)
        if self.tcp:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_REQUEST + 16)
            self.port = self._server.sockets[0].getsockname()[1]
            hosts = [self.host]
            if self.host in ("0.0.0.0", "::", ""):  # announce the addresses peers already reach us on
                hosts = sorted({a.split("/")[2] for a in await ctx.transport.addresses() if a.startswith("/ip4/")})
            self._addrs = [f"{h}:{self.port}" for h in hosts][:8]
        self.gossip.subscribe(TOPIC, max_size=2048, validator=self._validate, queue_size=0)
        await ctx.transport.serve(STREAM_SPEC, self._serve_stream)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            self._expire(self._clock().monotonic())

    def _expire(self, now: float) -> None:
        for blob_hash in [h for h, t in self._announced_at.items() if now - t > ANNOUNCEMENT_TTL]:
            self._forget(blob_hash)
        self._rate.prune()
        self._pool.expire()

    def _forget(self, blob_hash: bytes) -> None:
        a = self.announcements.pop(blob_hash, None)
        self._announced_at.pop(blob_hash, None)
        self.sources.pop(blob_hash, None)
        if a is not None:
            mine = self._by_author_hashes.get(a.author)
            if mine is not None:
                try:
                    mine.remove(blob_hash)
                except ValueError:
                    pass
                if not mine:
                    del self._by_author_hashes[a.author]

    async def close(self) -> None:
        if self._hosts_listing is not None and not self._hosts_listing.done():
            self._hosts_listing.cancel()
        self._pool.close()
        if self._server is not None:
            self._server.close()
            serving = [t for t in self._connections.values() if t is not None]
            for writer in list(self._connections):  # idle ones wait for a next request: they end at their EOF
                writer.close()
            if serving:
                await asyncio.wait(serving, timeout=5.0)
            await self._server.wait_closed()

    def _clock(self) -> Clock:
        return self._ctx.clock if self._ctx is not None else clock.current()

    @property
    def addrs(self) -> list[str]:
        return self._addrs

    # ------------------------------------------------------------------ publishing
    def put(self, data: bytes | bytearray, *, codec: str = "raw", topic: str = "", round: int = 0,
            fragment: int = 0) -> bytes:
        """Store ``data`` and announce it; returns its hash."""
        blob_hash = content_hash(data)
        self._keep(blob_hash, bytearray(data))
        self._announce("announce", blob_hash, len(data), codec, topic, round, fragment)
        return blob_hash

    def keep(self, data: bytes | bytearray) -> bytes:
        """Store ``data`` to serve without announcing it (a protocol that names the hash in its own signed message,
        as the DiLoCo exchange's parts do); returns its hash."""
        blob_hash = content_hash(data)
        self._keep(blob_hash, bytearray(data))
        return blob_hash

    def keep_prepared(self, blob_hash: bytes, data: bytearray) -> bytes:
        """:meth:`keep` for our own bytes whose hash (``content_hash``) and copy were made off the event loop (in a
        worker thread, with the encoding): the loop only files them. ``data`` is handed over, not copied."""
        self._keep(blob_hash, data)
        return blob_hash

    def drop(self, hashes) -> None:
        """Stop holding (and serving) these blobs."""
        for blob_hash in hashes:
            blob = self.blobs.pop(blob_hash, None)
            if blob is not None:
                self._held -= len(blob)

    def _announce(self, kind, blob_hash, size, codec, topic, round, fragment) -> None:
        body = WIRE.pack(ANNOUNCE if kind == "announce" else HAVE, {
            "hash": blob_hash, "size": size, "codec": codec, "topic": topic, "round": round, "fragment": fragment,
            "addrs": self.addrs})
        self.gossip.publish(TOPIC, body)

    def reserve(self, nbytes: int) -> None:
        """Let the store hold at least ``nbytes`` beyond its default: a service whose blobs outgrow the default
        (a large model's updates, kept for a few rounds) says so when it knows their size."""
        self.max_bytes = max(self.max_bytes, DEFAULT_MAX_BYTES + nbytes)

    def _keep(self, blob_hash: bytes, data: bytearray) -> None:
        old = self.blobs.get(blob_hash)
        self._held += len(data) - (len(old) if old is not None else 0)
        self.blobs[blob_hash] = data
        self.blobs.move_to_end(blob_hash)
        while self._held > self.max_bytes and len(self.blobs) > 1:
            self._held -= len(self.blobs.popitem(last=False)[1])
            self.counters["blobs_evicted"] += 1  # the oldest first: a peer that still wants it gets "not held"
            self._log.log(logging.WARNING, "evicted", "bulk: over its %d bytes, the oldest blobs are dropped "
                          "before their service releases them", self.max_bytes)

    def _validate(self, message: Message) -> Verdict:
        a = Announcement.parse(message)
        if a is None:
            return Verdict.REJECT
        if a.hash not in self.announcements:
            mine = self._by_author_hashes.setdefault(a.author, collections.deque())
            if len(mine) >= MAX_PER_AUTHOR:  # the author's oldest announcement gives way to its newest
                self.counters["announcements_over_cap"] += 1
                self._forget(mine[0])
            while len(self.announcements) >= MAX_ANNOUNCEMENTS:
                self._forget(next(iter(self.announcements)))
                self.counters["announcements_evicted"] += 1
            self.announcements[a.hash] = a
            self._announced_at[a.hash] = self._clock().monotonic()
            self._by_author_hashes.setdefault(a.author, collections.deque()).append(a.hash)
        sources = self.sources[a.hash]
        for addr in a.addrs or ("",):  # no TCP address: a holder served over its streams only
            if (a.author, addr) not in sources and len(sources) < 64:
                sources.append((a.author, addr))
        return Verdict.ACCEPT

    # ------------------------------------------------------------------ pulling
    async def pull(self, blob_hash: bytes, *, timeout: float = 300.0,
                   progress: Callable[[int], None] | None = None) -> tuple[bytearray, str]:
        """The verified bytes of an announced blob, from the first source that serves them right (``progress``:
        called with the bytes received so far, as they come)."""
        if blob_hash in self.blobs:
            return self.blobs[blob_hash], "local"
        a = self.announcements.get(blob_hash)
        if a is None:
            raise BulkError("no announcement for this hash")
        body, peer = await self._fetch(blob_hash, a.size, self.sources[blob_hash], timeout, progress)
        self._announce("have", blob_hash, a.size, a.codec, a.topic, a.round, a.fragment)
        if self.on_blob is not None:
            self.on_blob(a, body)
        return body, peer

    async def pull_from(self, blob_hash: bytes, size: int, peer: str, addrs: list[str], *,
                        timeout: float = 300.0, progress: Callable[[int], None] | None = None) -> bytearray:
        """The verified bytes of a blob that ``peer`` named (hash and size) in a message it signed, from that peer:
        over its TCP address on a host we already reach it on, or over a direct libp2p stream; never a relay
        (``progress`` as for ``pull``)."""
        if blob_hash in self.blobs:
            return self.blobs[blob_hash]
        if not 0 < size <= MAX_BLOB:
            raise BulkError(f"size {size} out of range")
        body, _ = await self._fetch(blob_hash, size, [(peer, a) for a in addrs[:8]] or [(peer, "")], timeout,
                                    progress)
        self._keep(blob_hash, body)  # others of the round may ask us for it (its first holder may be gone)
        return body

    async def _fetch(self, blob_hash: bytes, size: int, sources: list[tuple[str, str]],
                     timeout: float, progress: Callable[[int], None] | None = None) -> tuple[bytearray, str]:
        ctx = self._ctx
        errors = []
        hosts = await self._peer_hosts()
        # bulk bytes never cross a relay: sources we reach directly first; one we only reach through a relay is
        # tried last (its TCP address may still answer) and said so, while holders with a direct path serve it
        sources = sorted(sources, key=lambda s: not ctx.direct(s[0]))
        tried_streams = set()
        for peer, addr in sources:
            if ctx.transport.penalties.is_banned(peer):
                continue
            # a hole-punched peer's TCP address is behind its NAT: ask over the punched connection instead; and we
            # dial a TCP address only on a host we already reach that peer on (an announcement cannot make us
            # connect to any other host: loopback, the LAN, a third party)
            ways = []
            if not ctx.punched(peer) and addr:
                if addr.rsplit(":", 1)[0].strip("[]") in hosts.get(peer, ()):
                    ways.append(addr)
                else:
                    self.counters["refused_addr"] += 1
                    self._log.log(logging.INFO, ("addr", peer), "bulk: not dialing %s announced by %s: not a host "
                                  "we reach that peer on", addr, peer)
            if ctx.direct(peer) and peer not in tried_streams:
                ways.append("stream")
                tried_streams.add(peer)
            elif not ctx.direct(peer):
                self.counters["relayed_sources"] += 1
                logger.info("bulk %s: no direct path to %s (relayed or not connected); bulk transfers never go "
                            "through a relay, so trying its TCP address %s last", blob_hash.hex()[:16], peer, addr)
            body = None
            for way in ways:
                ts = int(self._clock().time() * 1000)
                request = {"hash": blob_hash, "peer": ctx.identity.peer_id, "ts": ts,
                           "sig": ctx.identity.sign(REQUEST_DOMAIN + blob_hash + str(ts).encode())}
                where = f"{peer[-8:]}@{way}"
                try:
                    if way == "stream":
                        body = await fetch_stream(ctx.transport, peer, blob_hash, size, request, timeout=timeout,
                                                  progress=progress)
                        self.counters["pulled_over_stream"] += 1
                    else:
                        body = await fetch(way, blob_hash, size, msgpack.packb(request, use_bin_type=True),
                                           timeout=timeout, progress=progress, pool=self._pool)
                    break
                except (BadData, ProtocolViolation) as e:
                    ctx.transport.penalties.penalize(peer, "bad_data", str(e))
                    self.counters["bad_data"] += 1
                    errors.append(f"{where}: {e}")
                    break
                except (BulkError, TransportError, OSError, asyncio.TimeoutError) as e:
                    self.counters["source_failed"] += 1
                    errors.append(f"{where}: {e}")
            if body is None:
                continue
            self._keep(blob_hash, body)
            self.counters["pulled"] += 1
            self.counters["bytes_pulled"] += len(body)
            logger.debug("pulled %s (%d B) from %s", blob_hash.hex()[:16], len(body), peer)
            return body, peer
        raise BulkError("no source served the blob: " + "; ".join(errors or ["no sources"]))

    async def _peer_hosts(self) -> dict[str, set[str]]:
        """For each connected peer, the IP hosts of its direct connections (cached for a second). One listing at a
        time: the pulls that start together (a round's chunks, as its announcements come) wait for the same one (a
        listing asked of the daemon for each pull costs 6% of a node's main thread in a round at N = 8)."""
        now = self._clock().monotonic()
        if self._hosts_cache is not None and now - self._hosts_cache[0] < 1.0:
            return self._hosts_cache[1]
        if self._hosts_listing is None or self._hosts_listing.done():
            self._hosts_listing = asyncio.get_running_loop().create_task(self._list_hosts())
        return await asyncio.shield(self._hosts_listing)

    async def _list_hosts(self) -> dict[str, set[str]]:
        hosts: dict[str, set[str]] = {}
        try:
            for p in await self._ctx.transport.peers():
                for addr in p.addrs:
                    parts = addr.split("/")
                    if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "/p2p-circuit" not in addr:
                        hosts.setdefault(p.peer_id, set()).add(parts[2])
        except (TransportError, OSError) as e:
            logger.debug("bulk: cannot list peers: %s", e)
        self._hosts_cache = (self._clock().monotonic(), hosts)
        return hosts

    # ------------------------------------------------------------------ serving
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection's requests, one after another: each read whole and answered whole before the next is read;
        the connection closed once none came for KEEPALIVE s (its first too), at
        the client's end, or at the first bad request."""
        self.counters["connections"] += 1
        peername = writer.get_extra_info("peername")
        host = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        cap = self.max_connections if self.max_connections is not None else max_served()  # (a limit may change)
        if len(self._connections) >= cap and not self._make_room():
            self.counters["connections_refused_full"] += 1
            self._log.log(logging.WARNING, ("full",), "bulk: %d connections served at once, every one mid-request: "
                          "a connection from %s closed unread", len(self._connections), host)
            writer.close()
            return
        served = 0
        self._connections[writer] = asyncio.current_task()
        try:
            while True:
                self._wait(writer, host)
                try:
                    header = await asyncio.wait_for(reader.readexactly(4), KEEPALIVE)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                    if writer in self._evicted or (served and (isinstance(e, asyncio.TimeoutError) or not e.partial)):
                        return  # between requests: the client is done with it, or let it idle out
                    raise
                (length,) = struct.unpack(">I", header)
                if length > MAX_REQUEST:
                    raise BulkError("request too large")
                request = unpack(await asyncio.wait_for(reader.readexactly(length), 10.0))
                self._unwait(writer)
                status, blob = self._check(request)
                writer.write(HEADER.pack(status, len(blob) if blob is not None else 0))
                if blob is not None:
                    peer = request["peer"]
                    self._begin_serving(peer, request["hash"])
                    try:
                        writer.write(memoryview(blob))
                        await writer.drain()
                    finally:
                        self._served(peer, request["hash"])
                    self.counters["served"] += 1
                    self.counters["bytes_served"] += len(blob)
                await writer.drain()
                if status != OK:
                    # a refusal ends the connection: a stream of refused requests costs the sender a connection
                    # each, as a connection that carries one request does (each costs us a signature check)
                    return
                served += 1
                if served > 1:
                    self.counters["served_on_kept_connections"] += 1
        except (BulkError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, TypeError,
                msgpack.UnpackException, MalformedMessage, ConnectionError) as e:
            if writer not in self._evicted:  # (one we closed to make room: not the client's fault)
                self.counters["bad_requests"] += 1
                logger.debug("bulk request refused: %s", e)
        finally:
            self._connections.pop(writer, None)
            self._unwait(writer)
            self._evicted.discard(writer)
            writer.close()

    def _make_room(self) -> bool:
        """(At a new connection to a full server.) Close one connection that waits for a request: of the host
        with the most connections waiting, the one waiting longest, so that a host flooding us closes its own, and an
        idle kept connection costs its client a new one at worst (a pooled connection closed before its reply is
        retried once). False if none waits (every connection is being served)."""
        if not self._waiting:
            return False
        host = max(self._waiting, key=lambda h: len(self._waiting[h]))  # (O(hosts): one flooding host is one)
        held = len(self._waiting[host])
        writer = next(iter(self._waiting[host]))
        self._unwait(writer)
        self._evicted.add(writer)
        self.counters["connections_evicted"] += 1
        self._log.log(logging.WARNING, ("evicted", host), "bulk: %d connections served at once: the one waiting "
                      "longest of the %d from %s closed to make room", len(self._connections), held, host)
        writer.close()
        return True

    def _wait(self, writer: asyncio.StreamWriter, host: str) -> None:
        self._waiting.setdefault(host, {})[writer] = None  # (at the end: the host's newest waiting)
        self._waiting_host[writer] = host

    def _unwait(self, writer: asyncio.StreamWriter) -> None:
        host = self._waiting_host.pop(writer, None)
        if host is not None:
            waiting = self._waiting[host]
            del waiting[writer]
            if not waiting:
                del self._waiting[host]

    async def _serve_stream(self, stream) -> None:
        """The stream flavour of ``_serve``, for peers that reach us on a direct or hole-punched connection."""
        request = await asyncio.wait_for(stream.read_required(), 10)
        if request.kind != REQUEST:
            raise MalformedMessage("bulk: expected REQUEST")
        if "/p2p-circuit" in (stream.remote_addr or ""):
            self.counters["refused_relayed"] += 1
            status, blob = REFUSED, None
        else:
            try:
                status, blob = self._check(request.body)
            except BulkError as e:
                raise MalformedMessage(f"bulk: {e}") from None
            if request.body["peer"] != stream.peer_id:
                status, blob = REFUSED, None  # a request signed by someone else: replayed or relayed on
        await stream.send(HEAD, {"status": status, "size": len(blob) if blob is not None else 0})
        if blob is not None:
            view = memoryview(blob)
            self._begin_serving(stream.peer_id, request.body["hash"])
            try:
                for offset in range(0, len(blob), CHUNK):
                    await stream.send(DATA, view[offset:offset + CHUNK])
            finally:
                self._served(stream.peer_id, request.body["hash"])
            self.counters["served"] += 1
            self.counters["served_over_stream"] += 1
            self.counters["bytes_served"] += len(blob)
        await stream.close(linger=10.0)

    def _begin_serving(self, peer: str, blob_hash: bytes) -> None:
        self._serving[peer] += 1
        self._serving_blobs[blob_hash] += 1

    def _served(self, peer: str, blob_hash: bytes) -> None:
        for counter, key in ((self._serving, peer), (self._serving_blobs, blob_hash)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]
        self._served_at = self._clock().monotonic()

    def serving_until(self, blobs) -> float | None:
        """None while we serve one of ``blobs`` (hashes: peers are still waiting for those bytes of ours), else
        when the last transfer we served ended (monotonic; 0.0: never)."""
        return None if any(h in self._serving_blobs for h in blobs) else self._served_at

    def _check(self, request: Any) -> tuple[int, bytearray | None]:
        if not isinstance(request, dict) or set(request) != {"hash", "peer", "ts", "sig"}:
            raise BulkError("malformed request")
        blob_hash, peer, ts, sig = request["hash"], request["peer"], request["ts"], request["sig"]
        if not isinstance(blob_hash, bytes) or not isinstance(peer, str) or type(ts) is not int:
            raise BulkError("malformed request")
        if abs(self._clock().time() * 1000 - ts) > 60_000 or not isinstance(sig, bytes):
            return REFUSED, None
        if not verify(peer, REQUEST_DOMAIN + blob_hash + str(ts).encode(), sig):
            return REFUSED, None
        if self._ctx.transport.penalties.is_banned(peer):
            return REFUSED, None
        if peer not in self._ctx.members():
            return self._refuse("refused_not_member", peer)
        if self._serving[peer] >= MAX_SERVING_PER_PEER or not self._rate.allow(peer):
            return self._refuse("refused_rate", peer)
        blob = self.blobs.get(blob_hash)
        return (OK, blob) if blob is not None else (UNKNOWN, None)

    def _refuse(self, why: str, peer: str) -> tuple[int, None]:
        self.counters[why] += 1
        self._log.log(logging.INFO, (why, peer), "bulk: request from %s refused (%s)", peer, why)
        return REFUSED, None

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        return {
            "addrs": self.addrs,
            "blobs": len(self.blobs),
            "bytes": self._held,
            "announcements": len(self.announcements),
            "idle_connections": self._pool.idle(),
            **{f"connections_{k}": v for k, v in sorted(self._pool.counters.items())},
            **dict(sorted(self.counters.items())),
        }

    def routes(self) -> list:
        return [
            web.post("/bulk", self._http_put),
            web.get("/bulk", self._http_list),
            web.post("/bulk/{hash}/pull", self._http_pull),
        ]

    async def _http_put(self, request: web.Request) -> web.Response:
        data = await request.read()
        blob_hash = self.put(data, codec=request.query.get("codec", "raw"), topic=request.query.get("topic", ""))
        return web.json_response({"hash": blob_hash.hex(), "size": len(data)})

    async def _http_list(self, request: web.Request) -> web.Response:
        return web.json_response({h.hex(): {"size": len(b), "verified": content_hash(b) == h}
                                  for h, b in self.blobs.items()})

    async def _http_pull(self, request: web.Request) -> web.Response:
        try:
            blob_hash = bytes.fromhex(request.match_info["hash"])
        except ValueError:
            return web.json_response({"error": "bad hash"}, status=400)
        start = time.perf_counter()
        try:
            body, source = await self.pull(blob_hash)
        except BulkError as e:
            return web.json_response({"error": str(e)}, status=502)
        return web.json_response({"size": len(body), "source": source, "seconds": time.perf_counter() - start})
