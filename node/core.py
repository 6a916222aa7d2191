"""The Node: wires transport, discovery and the HTTP endpoint, and owns their lifecycle.

Lifecycle: :meth:`Node.run` starts the parts in order (p2p daemon, ping, DHT, HTTP), signals readiness once through
``on_ready``, then runs the background loops (``run_loops``) until it is cancelled; teardown runs in reverse order
whatever happened. Cancellation is the only way to stop it (the CLI cancels it on SIGINT/SIGTERM).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from swarmd.crdt.admission import Admission, RecordTicket
from swarmd.dht.discovery import Discovery, DiscoveryConfig
from swarmd.node import __version__, allocator, datadir
from swarmd.node.config import Config, parse_host_port
from swarmd.node.dashboard import Recorder
from swarmd.node.http import StatusServer
from swarmd.node.nat import NatService, guess_private
from swarmd.node.reach import AddressBook, Reach
from swarmd.node.replication import Replicator
from swarmd.node.services import NodeContext, Service
from swarmd.transport.base import ConnectedPeer, PathType
from swarmd.transport.errors import ProtocolViolation, TransportError
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport, RelayLimits
from swarmd.transport.ping import ping, serve_ping

logger = logging.getLogger(__name__)

MAX_PEERS_VIEW = 512  # peers /status lists one by one (the counts cover all)


class LoopLag:
    """How late the event loop runs a timer: a 100 ms sleep measured against the clock, kept for a minute. What
    a peer's burst, a big decode or a slow handler costs everyone else on the node shows here (``/status`` ->
    ``event_loop``, ``swarmd_event_loop_lag_seconds``)."""

    INTERVAL = 0.1
    WINDOW = 60.0
    STALL = 0.1  # a lag over this is counted as a stall

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.samples: collections.deque = collections.deque()  # (when, lag seconds)
        self.stalls = 0

    def record(self, when: float, lag: float) -> None:
        self.samples.append((when, lag))
        if lag > self.STALL:
            self.stalls += 1
        while self.samples and self.samples[0][0] < when - self.WINDOW:
            self.samples.popleft()

    async def run(self) -> None:
        while True:
            start = self._clock()
            await asyncio.sleep(self.INTERVAL)
            now = self._clock()
            self.record(now, max(0.0, now - start - self.INTERVAL))

    def view(self) -> dict:
        lags = sorted(lag for _, lag in self.samples) or [0.0]
        now = self._clock()
        by_second = [0.0] * int(self.WINDOW)  # the largest lag in each of the last 60 seconds, oldest first
        for when, lag in self.samples:
            i = int(self.WINDOW) - 1 - int(now - when)
            if 0 <= i < len(by_second):
                by_second[i] = max(by_second[i], round(lag * 1e3, 1))
        return {"lag_ms_p50": round(lags[len(lags) // 2] * 1e3, 2),
                "lag_ms_p99": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))] * 1e3, 2),
                "lag_ms_max": round(lags[-1] * 1e3, 2), "window_s": self.WINDOW, "stalls": self.stalls,
                "lag_ms_by_second": by_second}


@dataclass
class PeerState:
    latency_ms: float | None = None
    last_seen: float | None = None  # wall clock of the last successful ping or hello
    path: str = PathType.NONE.value
    path_since: float | None = None
    relay: str | None = None
    ping_failures: int = 0


class Node:
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

    # ------------------------------------------------------------------ views
    def uptime(self) -> float:
        return 0.0 if self._started_mono is None else time.monotonic() - self._started_mono

    def _known_peers(self) -> tuple[set[str], set[str]]:
        """(the other members of the replicated set, the peers discovered or connected), ourselves excluded."""
        me = self.identity.peer_id
        return (set(self.replicator.store.value("members")) - {me},
                (set(self.discovery.members) | set(self.connected)) - {me})

    def peers_view(self, known: tuple[set[str], set[str]] | None = None) -> list[dict]:
        """Connected and discovered peers first, then members of the replicated set, at most MAX_PEERS_VIEW."""
        crdt_members, near = known or self._known_peers()
        ids = sorted(near)[:MAX_PEERS_VIEW]
        ids += sorted(crdt_members - near)[: MAX_PEERS_VIEW - len(ids)]
        out = []
        for peer_id in sorted(ids):
            member = self.discovery.members.get(peer_id)
            conn = self.connected.get(peer_id)
            state = self.peer_state.get(peer_id, PeerState())
            last_seen = max(filter(None, [state.last_seen, member.last_seen if member else None]), default=None)
            out.append(
                {
                    "peer_id": peer_id,
                    "member": peer_id in crdt_members,  # membership comes from the replicated member set
                    "discovered": member is not None,  # has a live record in the DHT or sent us a hello
                    "connected": conn is not None,
                    "path": conn.path.value if conn else PathType.NONE.value,
                    "relay": conn.relay if conn else None,
                    "path_since": state.path_since,
                    "addrs": list(member.record.addrs) if member else list(conn.addrs if conn else ()),
                    "conn_addrs": list(conn.addrs) if conn else [],
                    "latency_ms": None if state.latency_ms is None else round(state.latency_ms, 3),
                    "last_seen": last_seen,
                    "version": member.record.version if member else None,
                    "loops": list(member.record.loops) if member else [],
                    "source": member.source if member else "connection",
                    "penalty_score": round(self.transport.penalties.score(peer_id), 1),
                }
            )
        return out

    def status(self) -> dict:
        stats = self.transport.stats
        known = self._known_peers()  # the member set is sorted once per status, not three times
        peers = self.peers_view(known)
        services = {svc.name: svc.status() for svc in self.services}
        return {
            "peer_id": self.identity.peer_id,
            "version": __version__,
            "swarm": self.config.node.swarm,
            "uptime_s": round(self.uptime(), 3),
            "started_at": self.started_at,
            "listen": list(self.config.network.listen),
            "addresses": self.addresses,
            "announce": list(self.config.network.announce),
            "reachability": self.transport.reachability.value,
            "joined": self.discovery.joined,
            "bootstrap": [b.to_json() for b in self.discovery.bootstrap],
            "dht": {
                "routing_table_size": self.discovery.routing_table_size(),
                "members_key": self.discovery.members_key,
                "poll_every_s": round(self.discovery.poll_every(), 2),
                **self.discovery.counters,
                "admission_rule": self.discovery.policy,
                "other_rule": self.discovery.policy_mismatch()[:16],
                "records_refused": dict(self.discovery.validator.refused) if self.discovery.validator else {},
                "records_checked": dict(self.discovery.validator.checks) if self.discovery.validator else {},
            },
            "members": len(known[0]),  # others
            "peers_omitted": len(known[0] | known[1]) - len(peers),
            "connected": len(self.connected),
            "split": self.reach.view(),
            "peers": peers,
            "crdt": self.replicator.summary(),
            "services": services,
            "loops": {svc.loop_key: {"service": svc.name, **{k: st.get(k) for k in ("state", "round", "step")}}
                      for svc in self.training_loops() for st in [services[svc.name]]},
            "traffic": {
                "bytes_in": stats.bytes_in,
                "bytes_out": stats.bytes_out,
                "messages_in": sum(stats.messages_in.values()),
                "messages_out": sum(stats.messages_out.values()),
                "bytes_in_by_protocol": dict(stats.bytes_in_by_protocol),
                "bytes_out_by_protocol": dict(stats.bytes_out_by_protocol),
                "note": "swarmd protocol streams; DHT RPCs are counted under dht",
            },
            "errors": dict(stats.errors),
            "event_loop": {**self.loop_lag.view(), "inbound_frames_waited": self.transport.inbound.waits},
            "allocator": allocator.applied(),  # node.memory as applied (mode None: not set in this process)
            "penalties": dict(self.transport.penalties.totals),
            "banned": self.transport.penalties.banned(),
            "http": self.http.url,
            "data_dir": str(self.data_dir),
        }


async def supervise(name: str, run: Callable[[], Awaitable[None]], *, max_delay: float = 30.0) -> None:
    """Run a background loop forever; if it crashes (a bug), log it and restart it with backoff.

    A bug in one loop must not take the node down; cancellation passes through."""
    delay = 1.0
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s loop crashed; restarting in %.0f s", name, delay)
        if time.monotonic() - started > 60:
            delay = 1.0
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


async def run_loops(loops: list[tuple[str, Callable[[], Awaitable[None]]]], added: asyncio.Queue | None = None) -> None:
    """Run the node's background loops (each supervised) until they all end or this is cancelled; then end them all.
    Loops put on ``added`` join them as they come (while ``added`` is given, this runs until cancelled).

    One cancellation is not always enough: on Python 3.11 ``asyncio.wait_for`` swallows a cancellation that lands
    just as the awaited future completes (fixed in 3.12), and a loop around it runs on, so a TaskGroup, which cancels
    its tasks once, could wait for it forever (seen: a node given SIGTERM that never exited). Here each loop still
    running is cancelled again every half second, up to SHUTDOWN_STEP_S; one still running then is named in a
    warning and abandoned."""
    tasks = {asyncio.create_task(supervise(name, run), name=f"loop: {name}"): name for name, run in loops}
    arriving = None if added is None else asyncio.ensure_future(added.get())
    try:
        while True:
            running = [t for t in tasks if not t.done()]
            if not running and arriving is None:
                return
            done, _ = await asyncio.wait([*running, *([arriving] if arriving else [])],
                                         return_when=asyncio.FIRST_COMPLETED)
            if arriving in done:
                name, run = arriving.result()
                tasks[asyncio.create_task(supervise(name, run), name=f"loop: {name}")] = name
                arriving = asyncio.ensure_future(added.get())
    finally:
        if arriving is not None:
            arriving.cancel()
        await end_tasks(tasks)


async def end_tasks(tasks: dict[asyncio.Task, str]) -> None:
    """Cancel these tasks until they end (again every half second, since one cancellation can be swallowed), up to
    SHUTDOWN_STEP_S; those still running then are named in a warning and abandoned."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHUTDOWN_STEP_S
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            logger.warning("shutdown: %s did not end within %.0f s of being cancelled; abandoned (%s)",
                           ", ".join(sorted(tasks[t] for t in pending)), SHUTDOWN_STEP_S,
                           "; ".join(sorted(f"{tasks[t]} at {where(t)}" for t in pending)))
            others = [t for t in asyncio.all_tasks() - set(tasks) - {asyncio.current_task()} if not t.done()]
            if others:  # a stuck task is often waiting for one of these (a TaskGroup's children, a stream's reader)
                logger.warning("shutdown: tasks still running then: %s%s",
                               "; ".join(sorted(f"{t.get_name()} at {where(t)}" for t in others)[:MAX_STUCK_SHOWN]),
                               f" (and {len(others) - MAX_STUCK_SHOWN} more)" if len(others) > MAX_STUCK_SHOWN else "")
            return
        _, pending = await asyncio.wait(pending, timeout=min(0.5, left))


SHUTDOWN_STEP_S = 5.0  # the most one step of a shutdown may take before it is abandoned (and named in the log)
MAX_STUCK_SHOWN = 8  # tasks named, with where each waits, when a shutdown step is abandoned


def where(task: asyncio.Task, depth: int = 3) -> str:
    """Where a pending task waits: the innermost ``depth`` coroutine frames of its await chain, outer to inner
    (``file:line function > ...``), the line that says what a stuck shutdown was waiting for."""
    coro, frames = task.get_coro(), []
    while coro is not None:
        f = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if f is None:
            break
        frames.append(f)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(f"{_short(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}" for f in frames[-depth:]) or "?"


def _short(path: str) -> str:
    """A path relative to the sys.path entry it was imported from, where there is one."""
    for root in sys.path:
        root = root.rstrip("/")
        if root and path.startswith(root + "/"):
            return path[len(root) + 1:]
    return path


async def _bounded(what: str, step: Awaitable) -> None:
    """One shutdown step, abandoned after SHUTDOWN_STEP_S with a warning naming it, so a stuck step neither keeps
    the node from exiting nor goes unnoticed."""
    try:
        await asyncio.wait_for(step, SHUTDOWN_STEP_S)
    except asyncio.TimeoutError:
        logger.warning("shutdown: %s took more than %.0f s; abandoned", what, SHUTDOWN_STEP_S)
