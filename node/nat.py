"""NAT traversal as a node service: reachability through AutoNAT probes, relays, and what ``swarmd doctor`` shows.

- Before anyone answered, a node *guesses* (``guess_private``): listening only on RFC 1918 / CGNAT / link-local
  addresses, with nothing announced, means it is behind a NAT. A node that guesses private starts its p2p daemon as a
  relay client: it reserves a slot on its relays (the bootstrap peers unless ``network.relays`` names others) and
  announces ``<relay>/p2p-circuit/p2p/<us>`` in its DHT record, so any peer can reach it through the relay. A node
  that guesses public serves as a circuit relay v2 for others (``network.relay_service``, limits in
  ``network.relay_limits``).
- Then it *measures*: every ``probe_interval`` seconds (sooner while unknown) it asks up to 3 directly connected
  peers to dial it back (``transport.nat``). One successful dial-back makes it public; dial-backs that all failed
  make it private. ``/status`` shows the result, the observed addresses, and each probe.
"""

from __future__ import annotations

import asyncio
import logging
import time

import psutil

from transport.base import PathType, Reachability
from transport.errors import ProtocolViolation, TransportError
from transport.multiaddrs import split_peer_addr
from transport.nat import (AUTONAT_SPEC, PUNCH_SPEC, REQUEST, AutoNATServer, ip_of, natted, open_nat, parse_addrs,
                           parse_reply)

logger = logging.getLogger(__name__)


def guess_private(listen: list[str], announce: list[str]) -> bool:
    """True if every address we could be reached at is one that only exists behind a NAT."""
    if announce:
        return False
    hosts = []
    for addr in listen:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            hosts.append(parts[2])
    specific = [h for h in hosts if h not in ("0.0.0.0", "::")]
    if len(specific) < len(hosts):  # a wildcard: look at the machine's interfaces
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family.name in ("AF_INET", "AF_INET6"):
                    specific.append(a.address.split("%")[0])
    candidates = [h for h in specific if not h.startswith("127.") and h != "::1"]
    if not candidates:
        return False  # loopback only: a local swarm, nothing to traverse
    return all(natted(h) for h in candidates)


class NatService:
    name = "nat"
    PUNCH_AFTER = 3.0  # seconds a relayed connection runs before we try to upgrade it
    PUNCH_BACKOFF = 15.0  # after a failure, wait this long, doubling up to 10 minutes
    PUNCH_DIAL_TIMEOUT = 2.0  # the relayed connection is down while the direct dial runs: keep it short

    def __init__(self, transport, *, relays: list[str], relay_client: bool, relay_service: bool,
                 probe_interval: float = 300.0):
        self.transport = transport
        self.relays = list(relays)
        self.relay_client = relay_client
        self.relay_service = relay_service
        self.probe_interval = probe_interval
        self.server = AutoNATServer()
        self.observed: dict[str, float] = {}  # observed address -> when last reported
        self.probes: list[dict] = []  # latest first
        self.counters: dict[str, int] = {"probes": 0, "dialbacks_ok": 0, "dialbacks_failed": 0,
                                         "punch_attempts": 0, "punch_successes": 0, "punch_served": 0}
        self.last_probe: float | None = None
        self.punch_backoff: dict[str, tuple[float, float]] = {}  # peer -> (next attempt at, current backoff)
        self.punches: list[dict] = []  # latest first
        self._punch_served_at: dict[str, float] = {}
        self._relayed_since: dict[str, float] = {}

    async def start(self, ctx) -> None:
        await self.transport.serve(AUTONAT_SPEC, self.server.handle)
        await self.transport.serve(PUNCH_SPEC, self._serve_punch)

    async def close(self) -> None:
        pass

    async def run(self) -> None:
        await asyncio.gather(self._probe_loop(), self._punch_loop())

    async def _probe_loop(self) -> None:
        while True:
            try:
                direct = [p.peer_id for p in await self.transport.peers() if p.path is PathType.DIRECT]
            except TransportError as e:
                logger.debug("AutoNAT: cannot list peers: %s", e)
                direct = []
            if direct:
                await self.probe(direct)
                wait = self.probe_interval if self.transport.detected_reachability != Reachability.UNKNOWN else 5.0
            else:
                wait = 1.0
            await asyncio.sleep(wait)

    # ------------------------------------------------------------------ hole punching
    async def _punch_loop(self) -> None:
        """Try to upgrade relayed connections to direct ones, in the background, with backoff per peer. Of two
        peers the one with the smaller peer id starts, so they do not both punch at once."""
        while True:
            await asyncio.sleep(1.0)
            if not self.relay_client or not self._predicted():
                continue
            now = time.monotonic()
            try:
                conns = await self.transport.peers()
            except TransportError as e:
                logger.debug("hole punching: cannot list peers: %s", e)
                continue
            relayed = {c.peer_id for c in conns if c.path is PathType.RELAYED}
            self._relayed_since = {p: self._relayed_since.get(p, now) for p in relayed}
            for conn in conns:
                if conn.path is not PathType.RELAYED or self.transport.peer_id > conn.peer_id:
                    continue
                if now - self._relayed_since[conn.peer_id] < self.PUNCH_AFTER:
                    continue  # let the relayed connection settle (and serve its first calls) first
                due, backoff = self.punch_backoff.get(conn.peer_id, (0.0, self.PUNCH_BACKOFF))
                if now < due:
                    continue
                ok = await self.punch(conn)
                if ok is None:  # the peer has not learned its own address yet: not an attempt, ask again soon
                    self.punch_backoff[conn.peer_id] = (time.monotonic() + 2.0, backoff)
                    continue
                backoff = self.PUNCH_BACKOFF if ok else min(backoff * 2, 600.0)
                self.punch_backoff[conn.peer_id] = (time.monotonic() + backoff, backoff)

    def _listen_port(self) -> int | None:
        ports = self._ports(self.transport.config.listen)
        return ports[0] if ports and ports[0] else None

    def _predicted(self) -> list[str]:
        """Where peers can reach us through our NAT if it keeps ports: each observed IP, at our listen port."""
        port = self._listen_port()
        if port is None:
            return []
        ips = sorted({ip_of(o)[0] for o in self.observed})
        return [f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}" for ip in ips][:4]

    async def punch(self, conn) -> bool | None:
        """DCUtR-style: exchange predicted addresses over the relayed connection; the responder opens its NAT
        towards ours; we drop the relayed connection and dial it directly. On failure, back through the relay."""
        peer = conn.peer_id
        started = time.monotonic()
        entry = {"peer": peer, "at": time.time()}
        try:
            async with await self.transport.open_stream(peer, PUNCH_SPEC, timeout=5) as stream:
                await stream.send(1, {"addrs": self._predicted()})
                reply = await asyncio.wait_for(stream.read_required(), 10)
            theirs = parse_addrs(reply.body)
        except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
            logger.debug("hole punch to %s: no answer over the relay: %s", peer, e)
            return None
        if not theirs:
            return None
        self.counters["punch_attempts"] += 1
        try:
            await self.transport.disconnect(peer)
            await self.transport.connect_peer(peer, [f"/ip4/{ip}/tcp/{port}" for ip, port in theirs],
                                              timeout=self.PUNCH_DIAL_TIMEOUT)
            now = {p.peer_id: p for p in await self.transport.peers()}.get(peer)
            if now is None or now.path is not PathType.DIRECT:
                raise TransportError("the new connection is not direct")
        except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
            self.punches = [{**entry, "ok": False, "error": str(e)[:160] or type(e).__name__}] + self.punches[:11]
            logger.info("hole punch to %s failed (%s); staying on the relay", peer, e)
            try:
                await self.transport.connect_peer(peer, list(conn.addrs), timeout=10)
            except TransportError as e2:
                logger.warning("could not reconnect to %s through the relay: %s", peer, e2)
            return False
        self.counters["punch_successes"] += 1
        seconds = time.monotonic() - started
        self.punches = [{**entry, "ok": True, "seconds": round(seconds, 3)}] + self.punches[:11]
        logger.info("hole punch to %s succeeded in %.2f s: direct connection", peer, seconds)
        return True

    async def _serve_punch(self, stream) -> None:
        """The responder's side. A peer can make us send at most 4 low-TTL SYNs per 5 s this way."""
        request = await asyncio.wait_for(stream.read_required(), 10)
        theirs = parse_addrs(request.body)
        now = time.monotonic()
        if now - self._punch_served_at.get(stream.peer_id, -1e9) < 5.0:
            await stream.send(2, {"addrs": []})
            return
        self._punch_served_at[stream.peer_id] = now
        if len(self._punch_served_at) > 1024:
            self._punch_served_at = {p: t for p, t in self._punch_served_at.items() if now - t < 5.0}
        port = self._listen_port()
        if port is not None and self.relay_client:
            for remote in theirs[:4]:
                try:
                    open_nat(port, remote)
                except OSError as e:
                    logger.info("could not open our NAT towards %s:%d: %s", remote[0], remote[1], e)
        self.counters["punch_served"] += 1
        await stream.send(2, {"addrs": self._predicted()})

    def _ports(self, addrs: list[str]) -> list[int]:
        ports = []
        for a in addrs:
            found = ip_of(a.split("/p2p/")[0])
            if found and found[1] not in ports:
                ports.append(found[1])
        return ports[:4]

    async def probe(self, peers: list[str]) -> Reachability:
        """Ask up to 3 peers (relays first) to dial us back; update the transport's reachability."""
        relay_ids = {split_peer_addr(r)[0] for r in self.relays}
        peers = sorted(peers, key=lambda p: p not in relay_ids)[:3]
        ports = self._ports(await self.transport.addresses(refresh=False))
        if not ports:
            return self.transport.detected_reachability
        results = await asyncio.gather(*(self._ask(p, ports) for p in peers))
        answered = [r for r in results if "ok" in r]
        self.counters["probes"] += 1
        self.last_probe = time.time()
        self.probes = (results + self.probes)[:12]
        if any(r["ok"] for r in answered):
            found = Reachability.PUBLIC
        elif answered:
            found = Reachability.PRIVATE
        else:
            return self.transport.detected_reachability
        if found != self.transport.detected_reachability:
            logger.info("reachability: %s (AutoNAT: %d of %d peers dialed us back; observed %s)", found.value,
                        sum(bool(r["ok"]) for r in answered), len(answered),
                        ", ".join(sorted({r["observed"] for r in answered})))
        self.transport.detected_reachability = found
        return found

    async def _ask(self, peer: str, ports: list[int]) -> dict:
        entry = {"peer": peer, "at": time.time()}
        try:
            async with await self.transport.open_stream(peer, AUTONAT_SPEC, timeout=5) as stream:
                await stream.send(REQUEST, {"ports": ports})
                reply = await asyncio.wait_for(stream.read_required(), 10)
            parsed = parse_reply(reply.body)
        except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
            return {**entry, "error": str(e)[:200] or type(e).__name__}
        if isinstance(parsed, str):
            return {**entry, "error": parsed}
        observed, ok = parsed
        self.observed[observed] = time.time()
        if len(self.observed) > 16:
            del self.observed[min(self.observed, key=self.observed.get)]
        self.counters["dialbacks_ok" if ok else "dialbacks_failed"] += 1
        return {**entry, "observed": observed, "ok": ok}

    def status(self) -> dict:
        return {
            "reachability": self.transport.reachability.value,
            "detected": self.transport.detected_reachability.value,
            "observed_addrs": sorted(self.observed),
            "relay_client": self.relay_client,
            "relay_service": self.relay_service,
            "relays": self.relays,
            "last_probe": self.last_probe,
            "probes": self.probes[:6],
            "punches": self.punches[:6],
            "autonat_served": self.server.served,
            "autonat_refused": self.server.refused,
            **self.counters,
        }

    def routes(self) -> list:
        return []
