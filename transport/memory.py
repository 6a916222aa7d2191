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

The virtual-time loop they run on lives in :mod:`transport.virtual_time` (:class:`VirtualTimeLoop`,
:func:`run_virtual`), the streams' pipes in :mod:`transport.memory_streams`; both are importable from here too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections import Counter
from dataclasses import dataclass, field

from swarmd.transport import clock
from swarmd.transport.base import (ConnectedPeer, HandlerRunner, InboundBudget, PathType, Reachability, Stream,
                            StreamHandler, TransportStats)
from swarmd.transport.errors import PeerUnreachable, TransportError
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import Identity
from swarmd.transport.memory_streams import SEND_BUFFER  # noqa: F401  (re-exported)
from swarmd.transport.memory_streams import _Connection, _Pipe, _Writer
from swarmd.transport.penalties import PeerPenalties
from swarmd.transport.virtual_time import DEADLOCK_WAIT, VirtualTimeLoop, run_virtual  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

READ_LIMIT = 1 << 20  # a stream's read buffer, as asyncio's default transports keep it bounded
RTO = 0.2  # what a lost segment costs: one retransmission timeout (Linux's minimum)


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
