"""The node's views: ``/status``, its list of peers and its uptime, assembled from the parts :class:`~node.core.Node`
wires; and the state they read that the node's loops keep: each peer's latency and path (:class:`PeerState`) and
the event loop's lag (:class:`LoopLag`).

:class:`NodeViews` is a base of ``Node``: its methods read the node's attributes (``identity``, ``config``,
``transport``, ``discovery``, ``replicator``, ``reach``, ``http``, ``services``, ``connected``, ``peer_state``,
``loop_lag``, ...). ``/status``'s fields reference is generated from :meth:`NodeViews.status`
(``docs/hooks/reference.py``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Callable

from swarmd.node import __version__, allocator
from swarmd.transport.base import PathType

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


class NodeViews:
    """What the node shows of itself: ``/status``, the peer list and the uptime (a base of ``Node``)."""

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
