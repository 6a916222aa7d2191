"""The client side of a pull: a request and its reply over a TCP connection (``fetch``; ``_Receiver`` reads the
body straight into its buffer), the idle connections kept for the next pulls (``ConnectionPool``), and the same
request over a ``/swarmd/bulk`` stream (``fetch_stream``). Every body is checked against its hash before it is
returned.
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import socket
import struct
import time
from typing import Callable

from swarmd.protocols.bulk.wire import (
    DATA,
    HEAD,
    HEADER,
    OK,
    REQUEST,
    STREAM_SPEC,
    BadData,
    BulkError,
    content_hash,
)
from swarmd.transport.errors import MalformedMessage

INLINE_HASH = 1 << 20  # bytes: a pulled blob up to this size is hashed on the event loop (0.2 ms at most)
GROW = 16 << 20  # a body up to this size is read into a bytearray of its size; a larger one into ``_large_buffer``
LOWAT = 256 << 10  # a body's socket wakes us when this much has come at most (SO_RCVLOWAT), not at every packet
WAKE_EVERY = 0.05  # s: ... or what the transfer's rate brings in that long, whichever is less
HOLD = 4 * WAKE_EVERY  # s: bytes held in the kernel this long without a read (a source that paused) are read then
IDLE_TIMEOUT = 30.0  # a source that sends nothing for this long is dropped
POOL_IDLE = 5.0  # s a client keeps an idle connection (under the server's KEEPALIVE: it closes it after the client)
POOL_PER_ADDR = 4  # idle connections kept to one source (a round pulls a few chunks of one source at once)
POOL_MAX = 64  # ... and to all sources together


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
