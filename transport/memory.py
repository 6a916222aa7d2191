"""An in-memory transport: many hosts in one process, on simulated links, under virtual time.

:class:`MemoryNetwork` is the wire: each host has an access link (uplink and downlink rates, as a namespace capped
with ``tc ... tbf`` has) and every pair a one-way latency; a link may also lose packets (modelled as TCP sees loss:
a segment is late by a retransmission timeout, never missing or reordered), and the network may be partitioned into
groups that cannot reach each other. :class:`MemoryTransport` implements :class:`transport.base.Transport` on it,
with the same :class:`~transport.base.Stream`, framing, :class:`~transport.base.HandlerRunner` and penalties as the
p2p daemon backend, so gossip, CRDT replication and the training loops run on it unchanged.

Semantics, chosen to match what the real backend shows:

- ``connect``/``open_stream`` cost one round trip; to an unknown, stopped or partitioned-away host they fail with
  :class:`~transport.errors.PeerUnreachable` after ``timeout`` (a dial into a partition hangs, it is not refused).
- Bytes written on a stream arrive in order after the sender's uplink, the latency and the receiver's downlink. A
  partition does not close streams: what crosses it is held and delivered when it heals (a TCP connection retransmits
  through a short cut); the node's idle timeouts see the silence, as they would.
- Stopping a host closes every stream it had (the peer reads an end of stream), as a killed process does.

:class:`VirtualTimeLoop` is an asyncio event loop whose clock is virtual: when nothing is ready to run and no worker
thread is busy, it jumps to the next timer instead of sleeping, so a minute of a simulated swarm takes the CPU time
its code needs, not a minute, and a run with the same seed takes the same steps. Code that reads the time must read
``loop.time()`` (or a :class:`transport.clock.Clock` over it), not ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import random
import selectors
import threading
from collections import Counter
from dataclasses import dataclass, field

from swarmd.transport import clock
from swarmd.transport.base import (ConnectedPeer, HandlerRunner, InboundBudget, PathType, Reachability, Stream,
                            StreamHandler, TransportStats)
from swarmd.transport.clock import LoopClock
from swarmd.transport.errors import PeerUnreachable, TransportError
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import Identity
from swarmd.transport.penalties import PeerPenalties

logger = logging.getLogger(__name__)

READ_LIMIT = 1 << 20  # a stream's read buffer, as asyncio's default transports keep it bounded
SEND_BUFFER = 0.25  # seconds of queued uplink a writer may run ahead before drain() waits
RTO = 0.2  # what a lost segment costs: one retransmission timeout (Linux's minimum)
DEADLOCK_WAIT = 10.0  # real seconds an idle virtual loop waits for another thread before calling it a deadlock


# ---------------------------------------------------------------------------------------------------- virtual time
class _VirtualSelector(selectors.BaseSelector):
    """The loop's selector: the real one for the loop's own wake-up pipe (worker threads finishing), and for
    waits, a jump of the virtual clock instead of a sleep whenever no worker thread is busy."""

    def __init__(self, loop: VirtualTimeLoop):
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout=None):
        # a worker thread is computing: virtual time stands still, and nothing else runs until every thread has
        # finished; then the finished work's results are handed over, in the order it was started (so they land at
        # the same point of the schedule in every run, also work that finished while the loop ran callbacks), and
        # their callbacks run before the clock moves
        waited = bool(self._loop.threads_in_flight())
        events = {}
        while self._loop.threads_in_flight():
            events.update((key.fd, (key, mask)) for key, mask in self._real.select(None))
            self._loop._read_from_self()  # the wake-up pipe, drained (else the wait spins until the last)
        if self._loop.deliver() or waited:
            events.update((key.fd, (key, mask)) for key, mask in self._real.select(0))
            return list(events.values())
        if timeout is not None and timeout <= 0:
            return self._real.select(0)
        if timeout is None:
            # nothing is scheduled: only another thread (one not started through run_in_executor, such as the
            # executor's shutdown) can still wake us; wait a while for it, then call it what it is
            events = self._real.select(DEADLOCK_WAIT)
            if not events:
                raise RuntimeError("simulation deadlock: nothing is scheduled and nothing is running")
            return events
        self._loop.advance(timeout)
        return self._real.select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (see the module's docstring). ``epoch`` is the wall-clock time (seconds since
    1970) that virtual time 0 stands for: the loop's :attr:`clock` reads ``epoch + time()`` as the wall clock.

    Worker threads (``asyncio.to_thread``, ``run_in_executor``) still run for real, and the loop waits for them:
    virtual time does not move and no other callback runs while one is busy, so what they compute is free in
    simulated time and lands at the same point of the schedule in every run."""

    def __init__(self, epoch: float = 1_800_000_000.0):
        self._now = 0.0
        self.epoch = epoch
        # work handed to worker threads through run_in_executor, in the order it was started: token -> its asyncio
        # future, until the loop hands it its result; and the work finished (token -> its concurrent future)
        self._in_flight: dict[object, asyncio.Future] = {}
        self._finished: dict[object, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.clock = LoopClock(self, epoch)  # what transport.clock.current() hands to code on this loop
        super().__init__(selector=_VirtualSelector(self))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds

    def threads_in_flight(self) -> int:
        """Work the loop waits for: not finished, and still awaited. A cancelled one is not (its task was cancelled,
        as a killed simulated node's are): if it had not started it never will, and its result is dropped anyway."""
        with self._lock:
            return sum(1 for token, f in self._in_flight.items() if token not in self._finished and not f.cancelled())

    def run_in_executor(self, executor, func, *args):
        """asyncio's, but the result is handed to its future by the loop itself, at its next wait (``select``),
        in the order the work was started: not by the worker thread as soon as it is done, which would put it among
        the callbacks of the current step when it is fast and after them when it is slow (a run under load would
        replay another schedule than the same run alone)."""
        self._check_closed()
        if executor is None:
            executor = self._default_executor
            if executor is None:
                executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmd-sim")
                self.set_default_executor(executor)
        fut = self.create_future()
        token = object()
        with self._lock:
            self._in_flight[token] = fut
        try:
            work = executor.submit(func, *args)
        except BaseException:
            self._forget(token)
            raise

        def finished(done: concurrent.futures.Future) -> None:  # in the worker thread (or here, if already done)
            with self._lock:
                if token in self._in_flight:  # (not cancelled meanwhile)
                    self._finished[token] = done
            self._write_to_self()  # wake the loop's wait

        work.add_done_callback(finished)
        fut.add_done_callback(lambda f: (work.cancel(), self._forget(token)) if f.cancelled() else None)
        return fut

    def _forget(self, token: object) -> None:
        with self._lock:
            self._in_flight.pop(token, None)
            self._finished.pop(token, None)

    def deliver(self) -> int:
        """Finished work's results into their futures, in the order it was started (on the loop's thread); how
        many were handed over."""
        if not self._finished:  # (every select asks: nothing to lock for in the usual case)
            return 0
        with self._lock:
            done = [(self._in_flight.pop(token), self._finished.pop(token)) for token in list(self._in_flight)
                    if token in self._finished]
        handed = 0
        for fut, work in done:
            if fut.cancelled() or work.cancelled():
                continue
            exc = work.exception()
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(work.result())
            handed += 1
        return handed


def run_virtual(main, *, epoch: float = 1_800_000_000.0, workers: int = 1):
    """Run coroutine ``main`` to completion on a fresh :class:`VirtualTimeLoop` (like ``asyncio.run``). One worker
    thread by default: threads finish in the order they were started, so a run is the same every time."""
    loop = VirtualTimeLoop(epoch)
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                                    thread_name_prefix="swarmd-sim"))
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


# ---------------------------------------------------------------------------------------------------- the network
@dataclass
class LinkSpec:
    """What links to and from one host look like. Rates in bytes per second (None: unlimited)."""

    latency: float = 0.005  # one way, seconds (a pair's latency is the mean of its two hosts')
    up: float | None = None
    down: float | None = None
    loss: float = 0.0  # probability that a write's segment is lost once (and is late by RTO)


class Downlink:
    """A host's downlink on virtual time: the spans it is busy taking bytes, in arrival order.

    Writes are timed when they are sent, not when they arrive, so a write from a far peer (arriving late) may be
    timed before a write from a near one (arriving early). Each write takes the first free span of its length at or
    after its arrival: the near one is not queued behind the far one, which arrives later (a single "busy until"
    time would queue it: one peer with a slow link would hold every other peer's bytes to a host until its own
    arrived, and the simulator's DiLoCo peers would miss each other's updates). Adjacent spans merge, and spans in
    the past are dropped, so a saturated link holds one span."""

    def __init__(self) -> None:
        self.spans: list[list[float]] = []  # [start, end], sorted, disjoint

    def take(self, arrival: float, length: float, now: float) -> float:
        """Reserve ``length`` seconds from the first free moment at or after ``arrival``; returns its end."""
        spans = self.spans
        drop = 0
        while drop < len(spans) and spans[drop][1] <= now:
            drop += 1
        if drop:
            del spans[:drop]
        if length <= 0:
            return arrival
        start, i = arrival, 0
        while i < len(spans) and spans[i][1] <= start:
            i += 1
        while i < len(spans) and spans[i][0] < start + length:  # overlaps: start after it
            start = max(start, spans[i][1])
            i += 1
        end = start + length
        spans.insert(i, [start, end])
        if i + 1 < len(spans) and spans[i + 1][0] <= end:  # touches the next one
            spans[i][1] = spans[i + 1][1]
            del spans[i + 1]
        if i > 0 and spans[i - 1][1] >= start:  # touches the previous one
            spans[i - 1][1] = spans[i][1]
            del spans[i]
        return end


@dataclass
class _Host:
    transport: MemoryTransport
    link: LinkSpec
    up_busy: float = 0.0  # virtual time at which the uplink is free again
    down: Downlink = field(default_factory=Downlink)
    running: bool = True


@dataclass
class NetworkStats:
    bytes_sent: Counter = field(default_factory=Counter)  # per host
    bytes_received: Counter = field(default_factory=Counter)
    held_by_partition: int = 0  # segments delivered late because a partition held them
    dials_failed: int = 0


class MemoryNetwork:
    """Hosts, links and partitions, all in memory. ``seed`` drives packet loss (the only randomness)."""

    def __init__(self, *, link: LinkSpec | None = None, seed: int = 0):
        self.default_link = link or LinkSpec()
        self.hosts: dict[str, _Host] = {}
        self.stats = NetworkStats()
        self._rng = random.Random(seed)
        self._group: dict[str, int] = {}  # peer -> partition group (absent: group 0)
        self._held: list[_Pipe] = []  # pipes holding segments until a partition heals
        self._relayed: set[tuple[str, str]] = set()  # (a, b): a reaches b through a relay only, as a lists it
        self._ports = itertools.count(10_000)

    # -------------------------------------------------------------- hosts
    def add(self, identity: Identity, link: LinkSpec | None = None) -> MemoryTransport:
        """A new host (its transport is not started yet)."""
        transport = MemoryTransport(self, identity)
        self.hosts[identity.peer_id] = _Host(transport, link or self.default_link)
        return transport

    def set_link(self, peer_id: str, link: LinkSpec) -> None:
        self.hosts[peer_id].link = link

    def address_of(self, peer_id: str) -> str:
        return f"/memory/{peer_id}/p2p/{peer_id}"

    # -------------------------------------------------------------- partitions
    def partition(self, *groups: set[str] | list[str]) -> None:
        """Cut the network into ``groups`` (peers in none of them form one more group): a peer reaches only the
        peers of its own group until :meth:`heal`."""
        self._group = {peer: i + 1 for i, group in enumerate(groups) for peer in group}

    def heal(self) -> None:
        self._group = {}
        held, self._held = self._held, []
        loop = asyncio.get_running_loop()
        for pipe in held:
            loop.call_later(self.latency(pipe.src, pipe.dst) if pipe.src in self.hosts and pipe.dst in self.hosts
                            else 0.0, pipe.flush)

    def reachable(self, a: str, b: str) -> bool:
        ha, hb = self.hosts.get(a), self.hosts.get(b)
        return (ha is not None and hb is not None and ha.running and hb.running
                and self._group.get(a, 0) == self._group.get(b, 0))

    def relay(self, a: str, b: str) -> None:
        """``a`` lists its connection to ``b`` as a relayed one (a circuit, as between two peers behind NATs): their
        streams still flow, but to ``a``, ``b`` is not directly connected (:meth:`direct`). Each end lists its own
        connections: ``relay(b, a)`` too for both ends (one end alone: its list has not seen the link turn direct)."""
        self._relayed.add((a, b))

    def direct(self, a: str, b: str) -> bool:
        """Whether ``a`` lists ``b`` as directly connected."""
        return self.reachable(a, b) and (a, b) not in self._relayed

    def latency(self, a: str, b: str) -> float:
        return (self.hosts[a].link.latency + self.hosts[b].link.latency) / 2

    def rtt(self, a: str, b: str) -> float:
        return 2 * self.latency(a, b)

    # -------------------------------------------------------------- timing of one write
    def arrival(self, src: str, dst: str, n: int, now: float) -> float:
        """When ``n`` bytes written now by ``src`` have all reached ``dst`` (access links are shared by all of a
        host's streams, as a capped link is)."""
        s, d = self.hosts[src], self.hosts[dst]
        latency = self.latency(src, dst)
        start = max(now, s.up_busy)
        s.up_busy = start + (n / s.link.up if s.link.up else 0.0)
        loss = max(s.link.loss, d.link.loss)
        if loss and self._rng.random() < loss:
            latency += max(RTO, 3 * self.rtt(src, dst))
        # cut-through: the receiver's downlink takes bytes as they arrive, and cannot finish before the last is sent
        taken = d.down.take(start + latency, n / d.link.down if d.link.down else 0.0, now)
        self.stats.bytes_sent[src] += n
        self.stats.bytes_received[dst] += n
        return max(taken, s.up_busy + latency)

    def uplink_backlog(self, peer_id: str, now: float) -> float:
        host = self.hosts.get(peer_id)
        return 0.0 if host is None else max(0.0, host.up_busy - now)


# ---------------------------------------------------------------------------------------------------- streams
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


# ---------------------------------------------------------------------------------------------------- the transport
class MemoryTransport:
    """Implements :class:`transport.base.Transport` on a :class:`MemoryNetwork` (see the module's docstring)."""

    def __init__(self, net: MemoryNetwork, identity: Identity, *, penalties: PeerPenalties | None = None):
        self.net = net
        self.identity = identity
        self.peer_id = identity.peer_id
        self.stats = TransportStats()
        self.inbound = InboundBudget()
        self.penalties = penalties or PeerPenalties(clock=lambda: clock.current().monotonic())
        self._runner = HandlerRunner(self.penalties, self.stats)
        self._handlers: dict[str, tuple[ProtocolSpec, StreamHandler]] = {}
        self._connected: set[str] = set()
        self._streams: set[_Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self.detected_reachability = Reachability.PUBLIC

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.net.hosts[self.peer_id].running = True

    async def close(self) -> None:
        """Stop the host: every stream it had ends, as a killed process's do."""
        host = self.net.hosts.get(self.peer_id)
        if host is not None:
            host.running = False
        for conn in list(self._streams):
            conn.break_()
        self._streams.clear()
        for peer in list(self._connected):
            other = self.net.hosts.get(peer)
            if other is not None:
                other.transport._connected.discard(self.peer_id)
        self._connected.clear()
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def reachability(self) -> Reachability:
        return self.detected_reachability

    # -------------------------------------------------------------- connections
    async def _dial(self, peer_id: str, timeout: float) -> None:
        if peer_id == self.peer_id:
            raise PeerUnreachable("refusing to dial ourselves")
        if self.penalties.is_banned(peer_id):
            raise PeerUnreachable(f"peer {peer_id} is banned")
        if peer_id not in self.net.hosts:
            raise PeerUnreachable(f"no route to {peer_id}")
        rtt = self.net.rtt(self.peer_id, peer_id)
        if not self.net.reachable(self.peer_id, peer_id) or rtt > timeout:
            self.net.stats.dials_failed += 1
            await asyncio.sleep(timeout)
            raise PeerUnreachable(f"dialing {peer_id} timed out after {timeout:.0f} s")
        if peer_id not in self._connected:
            await asyncio.sleep(rtt)
            if not self.net.reachable(self.peer_id, peer_id):
                self.net.stats.dials_failed += 1
                raise PeerUnreachable(f"dialing {peer_id} failed: connection lost")
            self._connected.add(peer_id)
            self.net.hosts[peer_id].transport._connected.add(self.peer_id)

    async def connect(self, maddr: str, *, timeout: float = 10.0) -> str:
        peer_id = maddr.rsplit("/p2p/", 1)[-1]
        await self._dial(peer_id, timeout)
        return peer_id

    async def connect_peer(self, peer_id: str, addrs: list[str], *, timeout: float = 10.0) -> None:
        await self._dial(peer_id, timeout)

    async def disconnect(self, peer_id: str) -> None:
        self._connected.discard(peer_id)
        other = self.net.hosts.get(peer_id)
        if other is not None:
            other.transport._connected.discard(self.peer_id)

    async def adopt(self, peer_id, sock, *, dialer: bool, timeout: float = 10.0) -> None:
        sock.close()
        raise TransportError("the in-memory transport has no sockets to adopt")

    async def redial(self, peer_id: str, addrs: list[str], *, timeout: float = 10.0) -> None:
        await self.disconnect(peer_id)
        await self.connect_peer(peer_id, addrs, timeout=timeout)

    async def peers(self) -> list[ConnectedPeer]:
        return [ConnectedPeer(p, (self.net.address_of(p),), PathType.DIRECT) for p in sorted(self._connected)
                if self.net.reachable(self.peer_id, p)]

    async def addresses(self, *, refresh: bool = True) -> list[str]:
        return [self.net.address_of(self.peer_id)]

    # -------------------------------------------------------------- streams
    async def open_stream(self, peer_id: str, spec: ProtocolSpec, *, timeout: float = 10.0) -> Stream:
        await self._dial(peer_id, timeout)
        other = self.net.hosts[peer_id].transport
        await asyncio.sleep(self.net.latency(self.peer_id, peer_id))  # the stream's opening, one way
        served = other._handlers.get(spec.id)
        if served is None or not self.net.reachable(self.peer_id, peer_id):
            raise PeerUnreachable(f"opening {spec.id} to {peer_id} failed: protocol not supported")
        ours = asyncio.StreamReader(limit=READ_LIMIT)
        theirs = asyncio.StreamReader(limit=READ_LIMIT)
        out, back = _Pipe(self.net, self.peer_id, peer_id, theirs), _Pipe(self.net, peer_id, self.peer_id, ours)
        conn = _Connection(out, back, (self, other))
        self._streams.add(conn)
        other._streams.add(conn)
        self.stats.streams_out += 1
        mine = Stream(peer_id, spec, ours, _Writer(out, conn), self.stats, budget=self.inbound,
                      remote_addr=self.net.address_of(peer_id))
        remote = Stream(self.peer_id, served[0], theirs, _Writer(back, conn), other.stats, budget=other.inbound,
                        remote_addr=self.net.address_of(self.peer_id))
        other._start_handler(served[1], remote, conn)
        return mine

    def _start_handler(self, handler: StreamHandler, stream: Stream, conn: _Connection) -> None:
        async def run() -> None:
            try:
                await self._runner.run(handler, stream)
            except asyncio.CancelledError:
                pass
            finally:
                self._streams.discard(conn)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def set_standing(self, has_standing) -> None:
        self._runner.has_standing = has_standing

    async def serve(self, spec: ProtocolSpec, handler: StreamHandler) -> None:
        if spec.id in self._handlers:
            raise ValueError(f"{spec.id} is already served")
        self._handlers[spec.id] = (spec, handler)
