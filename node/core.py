"""The Node: wires transport, discovery and the HTTP endpoint, and owns their lifecycle.

Lifecycle: :meth:`Node.run` starts the parts in order (p2p daemon, ping, DHT, HTTP), signals readiness once through
``on_ready``, then runs the background loops (``run_loops``) until it is cancelled; teardown runs in reverse order
whatever happened. Cancellation is the only way to stop it (the CLI cancels it on SIGINT/SIGTERM).

The node's views (``/status``, the peer list) are ``node/status.py``; the supervision of its background loops and
the bounds on each shutdown step are ``node/supervise.py``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from pathlib import Path
from typing import Callable

from swarmd.crdt.admission import Admission, RecordTicket
from swarmd.dht.discovery import Discovery, DiscoveryConfig
from swarmd.node import __version__, datadir
from swarmd.node.config import Config, parse_host_port
from swarmd.node.dashboard import Recorder
from swarmd.node.http import StatusServer
from swarmd.node.nat import NatService, guess_private
from swarmd.node.reach import AddressBook, Reach
from swarmd.node.replication import Replicator
from swarmd.node.services import NodeContext, Service
from swarmd.node.status import MAX_PEERS_VIEW, LoopLag, NodeViews, PeerState  # noqa: F401 (importable from here)
from swarmd.node.supervise import _bounded, end_tasks, run_loops, supervise, where  # noqa: F401 (importable here)
from swarmd.transport.base import ConnectedPeer, PathType
from swarmd.transport.errors import ProtocolViolation, TransportError
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport, RelayLimits
from swarmd.transport.ping import ping, serve_ping

logger = logging.getLogger(__name__)


class Node(NodeViews):
    PINGS_PER_ROUND = 8

    def __init__(self, config: Config, identity: Identity, data_dir: Path, services: list[Service] = ()):
        self.config = config
        self.services = list(services)
        self.identity = identity
        self.data_dir = data_dir
        net = config.network
        behind_nat = net.reachability == "private" or (
            net.reachability == "auto" and guess_private(list(net.listen), list(net.announce)))
        relays = []
        if behind_nat:  # ours first, then up to 4 found through the DHT by an earlier run (node.nat)
            relays = list(net.relays or net.bootstrap)
            relays += [r for r in datadir.read_relays(data_dir) if r not in relays][:4]
        relay_service = net.relay_service == "on" or (net.relay_service == "auto" and not behind_nat)
        limits = net.relay_limits
        self.transport = P2PDaemonTransport(
            identity,
            P2PDaemonConfig(
                listen=list(net.listen),
                announce=list(net.announce),
                port_mapping=net.port_mapping,
                force_reachability=None if net.reachability == "auto" else net.reachability,
                relay_client=behind_nat,
                dht_mode=net.dht_mode,
                startup_timeout=net.startup_timeout,
                relay_service=relay_service,
                relay_limits=RelayLimits(limits.data_mb << 20, limits.seconds, limits.max_circuits,
                                         limits.max_reservations),
                static_relays=relays,
            ),
        )
        self.nat = NatService(self.transport, relays=relays, relay_client=behind_nat, relay_service=relay_service,
                              probe_interval=net.probe_interval, data_dir=data_dir,
                              hole_punching=net.hole_punching, punch_delay=net.punch_delay,
                              member_addrs=lambda: [a for m in self.discovery.members.values() for a in m.record.addrs])
        self.services.insert(0, self.nat)
        d = config.discovery
        admission = Admission(config.node.swarm, config.state.admission_bits, config.state.allow)
        self.discovery = Discovery(
            self.transport,
            identity,
            DiscoveryConfig(
                swarm=config.node.swarm,
                bootstrap=list(net.bootstrap),
                record_ttl=d.record_ttl,
                refresh_interval=d.refresh_interval,
                poll_interval=d.poll_interval,
                max_peers=d.max_peers,
                backoff_initial=d.backoff_initial,
                backoff_max=d.backoff_max,
                dht_timeout=d.dht_timeout,
            ),
            version=__version__,
            loops=self.loop_names,
            on_greeted=lambda peer_id: self.discovery.policy_ok(peer_id) and self.replicator.sync_soon(peer_id),
            policy=admission.policy(),
            # the members key asks for the same price of an identity as the replicated state, paid again in each
            # time window: a record with a ticket of this window or the last (or from the allowlist)
            admitted=lambda record: admission.record_refusal(record.peer_id, record.ticket, time.time()) or True,
            ticket=self._record_ticket,
            window=lambda: admission.epoch(time.time()),
        )
        self.replicator = Replicator(
            identity,
            self.transport,
            data_dir,
            peers=self._replication_peers,
            sync_interval=config.state.sync_interval,
            max_skew_ms=int(config.state.max_clock_skew * 1000),
            admission=admission,
            max_authors=config.state.max_authors,
            relay_fanout=config.state.relay_fanout,
            compatible=self.discovery.policy_ok,
        )
        self.book = AddressBook(data_dir)
        self.transport.set_standing(self.has_standing)
        self.reach = Reach(self.transport, identity.peer_id,
                           members=lambda: set(self.replicator.store.value("members")) | set(self.discovery.members),
                           connected=lambda: set(self.connected), book=self.book,
                           rejoin=self.discovery.rejoin_through, interval=d.reach_interval,
                           window=d.split_window)
        self.http = StatusServer(self, *parse_host_port(config.http.listen),
                                 extra_routes=[r for svc in self.services for r in svc.routes()],
                                 token=datadir.http_token(data_dir), allowed_hosts=config.http.allowed_hosts)
        self.recorder = Recorder(self)
        self.started_at: float | None = None
        self._started_mono: float | None = None
        self.loop_lag = LoopLag()
        self.addresses: list[str] = []
        self.connected: dict[str, ConnectedPeer] = {}
        self._list_failures = 0
        self.peer_state: dict[str, PeerState] = {}
        self._ctx: NodeContext | None = None  # the services' context, once the node runs
        self._added: asyncio.Queue = asyncio.Queue()  # services started on the running node (add_service)
        self._record_tickets = RecordTicket(admission, identity.peer_id)
        self._record_ticket_lock = asyncio.Lock()

    def _replication_peers(self) -> list[str]:
        """Connected peers that are swarm members (discovered or in the CRDT member set) and judge authors by the
        same admission rule as we do (their member record says so)."""
        crdt_members = set(self.replicator.store.value("members"))
        return [p for p in self.connected if (p in self.discovery.members or p in crdt_members)
                and self.discovery.policy_ok(p)]

    async def _record_ticket(self) -> int | None:
        """Our record's ticket for the current time window, minted off the event loop as a window begins: the
        record published with it is then renewed."""
        async with self._record_ticket_lock:
            started, minted = time.monotonic(), self._record_tickets.minted
            nonce = await asyncio.to_thread(self._record_tickets.at, time.time())
            if self._record_tickets.minted != minted:
                logger.info("record ticket for time window %d minted in %.1f s", self._record_tickets.epoch,
                            time.monotonic() - started)
        return nonce

    def has_standing(self, peer_id: str) -> bool:
        """A peer the inbound stream budget keeps room for: a swarm member (its record or its members op came
        with an admission ticket, or the allowlist names it) or one of our bootstrap peers. Called per inbound
        stream: lookups only."""
        if peer_id in self.discovery.members:
            return True
        adds, removed = self.replicator.store.states.get("members", {}).get(peer_id, ((), ()))
        if set(adds) - set(removed):
            return True
        return any(b.peer_id == peer_id for b in self.discovery.bootstrap)

    def is_direct(self, peer_id: str) -> bool:
        conn = self.connected.get(peer_id)
        return conn is not None and conn.path.direct

    def is_punched(self, peer_id: str) -> bool:
        conn = self.connected.get(peer_id)
        return conn is not None and conn.path is PathType.PUNCHED

    def training_loops(self) -> list[Service]:
        """The services that are training loops (they name themselves with a ``loop_key``: ``<loop>/<run>``)."""
        return [svc for svc in self.services if getattr(svc, "loop_key", None)]

    def loop_names(self) -> list[str]:
        return sorted(svc.loop_key for svc in self.training_loops())

    # ------------------------------------------------------------------ lifecycle
    async def run(self, on_ready: Callable[[Node], None] | None = None) -> None:
        self.started_at, self._started_mono = time.time(), time.monotonic()
        for name in datadir.remove_stale_sockets(self.data_dir):
            logger.info("removed %s, left by this data dir's last run (it was killed before it could close)", name)
        await self.transport.start()
        datadir.write_sockets(self.data_dir, self.transport.unix_sockets)
        try:
            await serve_ping(self.transport)
            await self.reach.start()
            await self.discovery.start()
            try:
                await self.replicator.start()
                ctx = NodeContext(
                    identity=self.identity,
                    transport=self.transport,
                    data_dir=self.data_dir,
                    members=self._replication_peers,
                    replicator=self.replicator,
                    direct=self.is_direct,
                    punched=self.is_punched,
                    anchors=lambda: {b.peer_id for b in self.discovery.bootstrap},
                )
                self._ctx = ctx
                for svc in self.services:
                    await svc.start(ctx)
                await self.http.start()
                try:
                    self.addresses = await self.transport.addresses()
                    datadir.write_runtime(self.data_dir, self.runtime_info())
                    # what start-up made (modules, torch, the config, ~200k objects) lives as long as the node: a
                    # full collection that scans it holds the event loop ~130 ms, and a peer's burst of objects
                    # triggers one. Frozen, later collections scan only what came after.
                    gc.collect()
                    gc.freeze()
                    try:
                        if on_ready is not None:
                            on_ready(self)
                        await run_loops([
                            ("discovery", self.discovery.run),
                            ("connection monitor", self._connection_monitor),
                            ("ping", self._ping_loop),
                            ("split detection", self.reach.run),
                            ("event loop lag", self.loop_lag.run),
                            ("dashboard recorder", self.recorder.run),
                            ("replication", self.replicator.run),
                            *((svc.name, svc.run) for svc in self.services),
                        ], self._added)
                    finally:
                        datadir.remove_runtime(self.data_dir)
                finally:
                    await _bounded("the HTTP endpoint's close", self.http.close())
                    for svc in reversed(self.services):
                        await _bounded(f"{svc.name}'s close", svc.close())
                    await _bounded("leaving the member set", self.replicator.leave())
            finally:
                await _bounded("discovery's close", self.discovery.close())
        finally:
            # ends inbound handlers, which may still be writing to the op log
            await _bounded("the transport's close", self.transport.close())
            datadir.remove_stale_sockets(self.data_dir)  # closed: any socket a close did not remove
            self.replicator.close()
            self.reach.close()

    async def add_service(self, svc: Service) -> None:
        """Start a service (a training loop) on the running node: what a script does that attaches a run to a node
        it started before (``swarmd.DiLoCo``). It shows in /status, /metrics and the dashboard like the others, and
        the endpoint serves its HTTP routes from now on."""
        if self._ctx is None:
            raise RuntimeError("the node is not running: attach the service before it starts")
        taken = self.http.add_routes(svc.routes())
        if taken:
            logger.warning("%s: %s already served by another service; not served for this one", svc.name,
                           ", ".join(taken))
        self.services.append(svc)
        await svc.start(self._ctx)
        self._added.put_nowait((svc.name, svc.run))

    def runtime_info(self) -> dict:
        return {
            "pid": os.getpid(),
            "peer_id": self.identity.peer_id,
            "addresses": self.addresses,
            "http": self.http.url,
            "swarm": self.config.node.swarm,
            "started_at": self.started_at,
        }

    # ------------------------------------------------------------------ background loops
    LIST_FAILURES_KEPT = 3  # failed peer listings in a row after which our connections read as none

    async def _connection_monitor(self, interval: float = 2.0) -> None:
        while True:
            await self._refresh_connections()
            await asyncio.sleep(interval)

    async def _refresh_connections(self) -> None:
        """The connected peers and their paths, from the daemon's listing. A listing that fails keeps the last
        one, up to ``LIST_FAILURES_KEPT`` in a row: read as "no one connected", one failed call made every peer
        look gone at once (a round's coordinator no longer waited for, replication and pings stopped)."""
        try:
            peers = {p.peer_id: p for p in await self.transport.peers()}
            self._list_failures = 0
        except TransportError as e:
            self._list_failures += 1
            logger.warning("cannot list peers (%d in a row): %s", self._list_failures, e)
            if self._list_failures < self.LIST_FAILURES_KEPT:
                return
            peers = {}
        now = time.time()
        for peer_id, conn in peers.items():
            state = self.peer_state.setdefault(peer_id, PeerState())
            if state.path != conn.path.value:
                if state.path != PathType.NONE.value or state.path_since is not None:
                    logger.info("peer %s: path %s -> %s", peer_id, state.path, conn.path.value)
                state.path, state.path_since, state.relay = conn.path.value, now, conn.relay
        for peer_id in set(self.connected) - set(peers):
            state = self.peer_state.get(peer_id)
            if state is not None:
                state.path, state.path_since, state.relay = PathType.NONE.value, now, None
        self.connected = peers
        for peer_id, member in self.discovery.members.items():  # remembered for re-dialling after a split
            self.book.note(peer_id, member.record.addrs)
        # forget state of peers that are neither connected nor members
        for peer_id in [p for p in self.peer_state if p not in peers and p not in self.discovery.members]:
            del self.peer_state[peer_id]
        if self.addresses != (addrs := await self._safe_addresses()):
            self.addresses = addrs
            datadir.write_runtime(self.data_dir, self.runtime_info())

    async def _safe_addresses(self) -> list[str]:
        try:
            return await self.transport.addresses(refresh=False)
        except (TransportError, ValueError):
            return self.addresses

    async def _ping_loop(self) -> None:
        sem = asyncio.Semaphore(16)

        async def ping_one(peer_id: str) -> None:
            async with sem:
                state = self.peer_state.setdefault(peer_id, PeerState())
                try:
                    rtt = await ping(self.transport, peer_id, timeout=5.0)
                except (TransportError, ProtocolViolation) as e:
                    state.ping_failures += 1
                    logger.debug("ping %s failed: %s", peer_id, e)
                    return
                state.latency_ms = rtt * 1000.0
                state.last_seen = time.time()
                state.ping_failures = 0
                self.discovery.touch(peer_id)

        while True:
            # a bounded number of peers per round, least recently measured first: the cost per node stays flat
            # as the swarm grows (32 nodes on 2 cores pinging all-to-all every 2 s saturated the machine)
            targets = sorted(
                (p for p in self.connected if p in self.discovery.members),
                key=lambda p: self.peer_state.get(p, PeerState()).last_seen or 0.0,
            )[: self.PINGS_PER_ROUND]
            if targets:
                await asyncio.gather(*(ping_one(p) for p in targets))
            await asyncio.sleep(self.config.discovery.ping_interval)
