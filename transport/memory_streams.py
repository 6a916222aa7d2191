"""The streams of the in-memory transport: bytes written on one host, read on another, on the network's timing.

A :class:`_Pipe` is one direction of a stream: it asks :meth:`transport.memory.MemoryNetwork.arrival` when each
write lands, delivers writes in order, holds what a partition cuts off until it heals, and ends when a host stops.
:class:`_Writer` is the writer half a :class:`~transport.base.Stream` needs, with the backpressure of a bounded send
buffer; :class:`_Connection` is both directions of one stream, so a host that stops can break them.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmd.transport.memory import MemoryNetwork, MemoryTransport

SEND_BUFFER = 0.25  # seconds of queued uplink a writer may run ahead before drain() waits


class _Pipe:
    """One direction of a connection: bytes from ``src`` to ``dst``'s reader, in order, on the network's timing."""

    def __init__(self, net: MemoryNetwork, src: str, dst: str, reader: asyncio.StreamReader):
        self.net, self.src, self.dst, self.reader = net, src, dst, reader
        self.last = 0.0  # arrival time of the last segment: later writes never overtake it
        self.closed = False  # the writer closed (eof sent)
        self.broken = False  # an end (host) went away: nothing more is delivered
        self.held: collections.deque = collections.deque()  # segments a partition holds, in order
        self.inflight: collections.deque = collections.deque()  # (arrival time, segment), in order

    def schedule(self, data: bytes | None) -> None:
        loop = asyncio.get_running_loop()
        n = len(data) if data else 0
        when = max(self.net.arrival(self.src, self.dst, n, loop.time()), self.last)
        self.last = when
        self.inflight.append((when, data))
        if len(self.inflight) == 1:  # one timer per pipe, for its head: the loop's timers are not FIFO on ties
            loop.call_at(when, self._pump)

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.inflight and self.inflight[0][0] <= now:
            self._deliver(self.inflight.popleft()[1])
        if self.inflight:
            loop.call_at(self.inflight[0][0], self._pump)

    def _deliver(self, data: bytes | None) -> None:
        if self.broken:
            return
        if self.held or not self.net.reachable(self.src, self.dst):
            if not self.held:
                self.net._held.append(self)
            self.held.append(data)
            self.net.stats.held_by_partition += 1
            return
        self._feed(data)

    def _feed(self, data: bytes | None) -> None:
        if data is None:
            self.reader.feed_eof()
        else:
            self.reader.feed_data(data)

    def flush(self) -> None:
        """After a heal: what the partition held, in order (or keep holding it if cut again meanwhile)."""
        if self.broken:
            self.held.clear()
            return
        if not self.net.reachable(self.src, self.dst):
            if self.held:
                self.net._held.append(self)
            return
        while self.held:
            self._feed(self.held.popleft())

    def break_(self) -> None:
        if not self.broken:
            self.broken = True
            self.held.clear()
            self.inflight.clear()
            if not self.reader.at_eof():
                self.reader.feed_eof()


class _Writer:
    """The writer half a :class:`~transport.base.Stream` needs (write, drain, close, wait_closed)."""

    def __init__(self, pipe: _Pipe, conn: _Connection):
        self._pipe = pipe
        self._conn = conn
        self._closing = False

    def write(self, data) -> None:
        if self._pipe.closed or self._pipe.broken:
            raise ConnectionResetError("stream closed")
        if data:
            self._pipe.schedule(bytes(data))

    async def drain(self) -> None:
        if self._pipe.broken:
            raise ConnectionResetError("stream reset")
        loop = asyncio.get_running_loop()
        backlog = self._pipe.net.uplink_backlog(self._pipe.src, loop.time())
        if backlog > SEND_BUFFER:
            await asyncio.sleep(backlog - SEND_BUFFER)
        if self._pipe.broken:
            raise ConnectionResetError("stream reset")

    def is_closing(self) -> bool:
        return self._pipe.closed or self._pipe.broken

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if not self._pipe.closed and not self._pipe.broken:
            self._pipe.closed = True
            self._pipe.schedule(None)
        self._conn.closed_half()

    async def wait_closed(self) -> None:
        return None

    def get_extra_info(self, name, default=None):
        return default


class _Connection:
    """Both directions of one stream, so a host that stops can break them; forgotten by both hosts once both ends
    have closed."""

    def __init__(self, a_to_b: _Pipe, b_to_a: _Pipe, hosts: tuple[MemoryTransport, MemoryTransport]):
        self.pipes = (a_to_b, b_to_a)
        self.hosts = hosts
        self._closed = 0

    def closed_half(self) -> None:
        self._closed += 1
        if self._closed >= 2:
            for host in self.hosts:
                host._streams.discard(self)

    def break_(self) -> None:
        for pipe in self.pipes:
            pipe.break_()

