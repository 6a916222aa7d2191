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

from swarmd.node import datadir
from swarmd.node.bursts import Bursts
from swarmd.transport.base import PathType, Reachability
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.multiaddrs import split_peer_addr, validate_peer_addr
from swarmd.transport.nat import (AUTONAT_SPEC, CONNECT, PUNCH_SPEC, REQUEST, SYNC, AutoNATServer, ip_of, natted,
                           parse_addrs, parse_reply, public)
from swarmd.transport.birthday import burst_open
from swarmd.transport.penalties import TokenBuckets
from swarmd.transport.punch import PairTaken, simultaneous_open

logger = logging.getLogger(__name__)


def relays_in(addrs, ours: str) -> list[str]:
    """Relays other members use, from the relayed addresses in their DHT records (``<relay addr>/p2p/<relay>/
    p2p-circuit/...``): each relay's direct address where it is public, with /p2p/<relay>; not ourselves."""
    found = []
    for addr in addrs:
        if "/p2p-circuit" not in addr:
            continue
        head = addr.split("/p2p-circuit")[0]
        if "/p2p/" not in head:
            continue
        transport_addr, relay = head.rsplit("/p2p/", 1)
        where = ip_of(transport_addr)
        if where is None or relay == ours or not public(where[0]):
            continue
        try:
            found.append(validate_peer_addr(head))
        except ValueError:
            continue
    return list(dict.fromkeys(found))


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
    PUNCH_BACKOFF = 15.0  # after a failure, wait this long, doubling up to 10 minutes
    PUNCH_DIAL_TIMEOUT = 4.0  # covers the kernel's SYN retransmissions at 1 s and 3 s
    MAX_RESPONDING = 4  # punches we answer at once
    PUNCH_TRIES = 3  # attempts in a row when the first fails in a way a retry can fix (see punch)
    PUNCH_BURST = 4  # punches a peer may start with us at once (a retry comes right after a failure), 1 per 5 s more

    def __init__(self, transport, *, relays: list[str], relay_client: bool, relay_service: bool,
                 probe_interval: float = 300.0, member_addrs=None, data_dir=None, hole_punching: bool = True,
                 punch_delay: float = 1.0):
        self.transport = transport
        self.relays = list(relays)
        self.member_addrs = member_addrs  # () -> addresses in the members' DHT records
        self.data_dir = data_dir
        self.relays_found: list[str] = datadir.read_relays(data_dir) if data_dir is not None else []
        self.relay_client = relay_client
        self.relay_service = relay_service
        self.probe_interval = probe_interval
        self.hole_punching = hole_punching
        self.punch_delay = punch_delay  # seconds a relayed connection runs before we try to upgrade it
        self.server = AutoNATServer()
        self.observed: dict[str, float] = {}  # observed address -> when last reported
        self.probes: list[dict] = []  # latest first
        self.counters: dict[str, int] = {"probes": 0, "dialbacks_ok": 0, "dialbacks_failed": 0,
                                         "punch_attempts": 0, "punch_successes": 0, "punch_served": 0,
                                         "punch_served_ok": 0, "punch_failed_closed": 0,
                                         "punch_failed_our_mapping": 0, "punch_failed_their_mapping": 0,
                                         "punch_failed_timeout": 0, "punch_bursts": 0, "punch_burst_successes": 0,
                                         "punch_bursts_refused": 0}
        self.last_probe: float | None = None
        self.punch_backoff: dict[str, tuple[float, float]] = {}  # peer -> (next attempt at, current backoff)
        self.punches: list[dict] = []  # latest first
        self._punch_budget = TokenBuckets(0.2, self.PUNCH_BURST)
        self._relayed_since: dict[str, float] = {}
        self._responding: set[asyncio.Task] = set()
        self._responding_to: dict[str, asyncio.Task] = {}  # peer -> its hole punch we are answering
        self.bursts = Bursts()  # when a burst of many flows is made (peers' mappings, budgets)

    async def start(self, ctx) -> None:
        await self.transport.serve(AUTONAT_SPEC, self.server.handle)
        await self.transport.serve(PUNCH_SPEC, self._serve_punch)

    async def close(self) -> None:
        for task in list(self._responding):
            task.cancel()
        await asyncio.gather(*self._responding, return_exceptions=True)

    async def run(self) -> None:
        await asyncio.gather(self._probe_loop(), self._punch_loop(), self._relay_finder())

    async def _relay_finder(self, interval: float = 10.0) -> None:
        """Remember the relays other members use (from their DHT records) in the data dir: the p2p daemon takes
        its relay list when it starts, so a relay found here is reserved on at the next start (with the
        configured or bootstrap relays), which keeps a NATed node reachable when its bootstrap is gone."""
        while self.member_addrs is not None and self.data_dir is not None:
            found = relays_in(self.member_addrs(), self.transport.peer_id)
            merged = list(dict.fromkeys(found + self.relays_found))[:datadir.MAX_RELAYS]
            if merged != self.relays_found:
                new = [r for r in merged if r not in self.relays_found]
                self.relays_found = merged
                try:
                    datadir.write_relays(self.data_dir, merged)
                except OSError as e:
                    logger.warning("cannot remember relays in %s: %s", self.data_dir, e)
                if new:
                    logger.info("relays found through the DHT (reserved on at the next start): %s", ", ".join(new))
            await asyncio.sleep(interval)

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
            if not self.hole_punching or not self.relay_client or not self._predicted():
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
                if now - self._relayed_since[conn.peer_id] < self.punch_delay:
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

    def _candidates(self) -> list[str]:
        """What we send a peer to punch to: the predicted addresses (our listen port), then the addresses peers
        observed us at where the NAT changed the port (it may keep that mapping for other destinations too)."""
        seen = [o for o in sorted(self.observed, key=self.observed.get, reverse=True) if ip_of(o)]
        return list(dict.fromkeys(self._predicted() + seen))[:4]

    def mapping(self) -> str:
        """Our NAT's mapping as AutoNAT answers show it: "kept" (peers see our listen port), "changed" (one other
        port), "varies" (a different port for different peers: a symmetric NAT), or "unknown"."""
        port = self._listen_port()
        ports = {ip_of(o)[1] for o in self.observed if ip_of(o)}
        if not ports or port is None:
            return "unknown"
        if ports == {port}:
            return "kept"
        return "changed" if len(ports) == 1 else "varies"

    async def punch(self, conn) -> bool | None:
        """DCUtR-style, over the relayed connection: exchange candidate addresses (measuring the round trip),
        SYNC, then both sides connect to each other at once (``transport.punch``) and hand the socket to their
        daemon, this side as the dialer. The relayed connection stays up until the direct one exists.

        A hand-over whose punched connection closed (the NATs let us through) is retried at once, from the same
        ports, as is a first simultaneous open that timed out (the peer's SYNs may have left late); up to
        ``PUNCH_TRIES`` attempts. None: the peer did not take part (no attempt made)."""
        peer = conn.peer_id
        started = time.monotonic()
        entry = {"peer": peer, "at": time.time()}
        outcome, burst, made = None, False, False
        for tries in range(1, self.PUNCH_TRIES + 1):
            again = await self._punch_once(conn, burst)
            if again is None:  # the peer did not take part (this time)
                if outcome is None:
                    return None
                tries -= 1
                break
            outcome, made = again, burst
            ok, cause, detail = outcome
            if ok or tries == self.PUNCH_TRIES:
                break
            mapping_cause = cause in ("our-mapping", "their-mapping")
            if mapping_cause and not burst and self.bursts.may(self.mapping(), peer, time.monotonic()):
                burst = True  # one side symmetric, the other keeping its port: many flows at once can meet
            elif burst or cause not in ("closed", "timeout") or (cause == "timeout" and tries > 1):
                break
            logger.info("hole punch to %s: attempt %d failed (%s: %s); trying again at once", peer, tries, cause,
                        detail)
            await self._back_to_relay(peer, conn)  # the next attempt is asked for over the relay
        ok, cause, detail = outcome
        seconds = round(time.monotonic() - started, 3)
        if not ok:
            self.counters["punch_failed_" + cause.replace("-", "_")] += 1
            self.punches = [{**entry, "ok": False, "cause": cause, "error": detail[:160], "tries": tries,
                             "seconds": seconds, "burst": made}] + self.punches[:11]
            logger.info("hole punch to %s failed after %d attempt(s) (%s: %s); staying on the relay", peer, tries,
                        cause, detail)
            await self._back_to_relay(peer, conn)
            return False
        self.counters["punch_successes"] += 1
        self.punches = [{**entry, "ok": True, "seconds": seconds, "tries": tries, "burst": made}] + self.punches[:11]
        logger.info("hole punch to %s succeeded in %.2f s (attempt %d): direct connection %s", peer, seconds, tries,
                    detail)
        return True

    async def _punch_once(self, conn, burst: bool = False) -> tuple[bool, str, str] | None:
        """One attempt: (True, "", the direct address) or (False, cause, what failed); None if the peer did not
        take part (or refused the burst asked for). A burst (``transport.birthday``) is one attempt whose
        simultaneous open is many flows, the roles set by the two mappings. Causes: "closed" (the punched
        connection closed in the hand-over), "our-mapping" / "their-mapping" (no SYN got through, and our / the
        peer's NAT changes the port), "timeout" (no SYN got through, the ports kept: a firewall or filtering NAT,
        or SYNs lost)."""
        peer = conn.peer_id
        port = self._listen_port()
        try:
            stream = await self.transport.open_stream(peer, PUNCH_SPEC, timeout=5)
        except TransportError as e:
            logger.debug("hole punch to %s: cannot open a stream over the relay: %s", peer, e)
            return None
        closing, role = None, None
        try:
            sent = time.monotonic()
            ask = {"addrs": self._candidates()}
            if burst:
                ask.update(mapping=self.mapping(), burst=True)
            await stream.send(CONNECT, ask)
            reply = await asyncio.wait_for(stream.read_required(), 10)
            rtt = time.monotonic() - sent
            theirs = parse_addrs(reply.body)
            if reply.kind != CONNECT or not theirs:
                return None  # the peer does not know its own address yet, or is busy: ask again soon
            self.bursts.note_mapping(peer, reply.body, theirs)
            if burst:
                role = self.bursts.role(self.mapping(), peer) if reply.body.get("burst") is True else None
                if role is None or not self.bursts.free(peer, time.monotonic()):
                    return None
                self.bursts.take(peer, time.monotonic())
            await stream.send(SYNC, {})
            closing = asyncio.ensure_future(stream.close(linger=self.PUNCH_DIAL_TIMEOUT))  # the peer closes first
        except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
            logger.debug("hole punch to %s: no answer over the relay: %s", peer, e)
            return None
        finally:
            if closing is None:
                await stream.close()
        self.counters["punch_attempts"] += 1
        try:
            await asyncio.sleep(rtt / 2)
            try:
                if role is not None:
                    sock = await self._burst(peer, role, port, theirs[0])
                else:
                    sock = await simultaneous_open(port, theirs[:4], self.PUNCH_DIAL_TIMEOUT)
            except PairTaken:  # the NATs let new connections in: an ordinary dial is enough
                return await self._dial_direct(peer, theirs)
            except OSError as e:  # TimeoutError is an OSError
                return False, self._no_syn_cause(theirs), str(e) or type(e).__name__
            try:
                await self.transport.adopt(peer, sock, dialer=True, timeout=10)
                now = {p.peer_id: p for p in await self.transport.peers()}.get(peer)
                if now is None or not now.path.direct:
                    raise TransportError("the new connection is not the punched one")
            except (TransportError, ProtocolViolation, OSError) as e:
                return False, "closed", str(e) or type(e).__name__
        finally:
            await closing
        if role is not None:
            self.counters["punch_burst_successes"] += 1
        return True, "", now.addrs[0]

    async def _burst(self, peer: str, role: str, port: int, remote: tuple[str, int]):
        """The many-flow simultaneous open (``transport.birthday``), counted against the per-peer and global
        budgets: the keeper aims at random ports of ``remote``'s IP, the scatterer at ``remote`` (the kept port)."""
        self.counters["punch_bursts"] += 1
        logger.info("hole punch with %s: a burst of many flows (we %s the port; the peer's NAT %s)", peer,
                    "keep" if role == "keep" else "change", "changes it" if role == "keep" else "keeps it")
        with self.bursts.flowing():
            return await burst_open(role, port, remote, self.PUNCH_DIAL_TIMEOUT)

    async def _dial_direct(self, peer: str, theirs: list[tuple[str, int]]) -> tuple[bool, str, str]:
        """The peer's SYN reached our listener, so new connections pass the NATs: replace the relayed connection
        with an ordinary dial to the peer's addresses (the p2p daemon dials from another port)."""
        addrs = [f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{p}" for ip, p in theirs[:4]]
        try:
            await self.transport.redial(peer, addrs, timeout=10.0)
            now = {p.peer_id: p for p in await self.transport.peers()}.get(peer)
            if now is None or not now.path.direct:
                raise TransportError("the new connection is not a direct one")
        except TransportError as e:
            return False, "closed", f"direct dial: {e}"
        return True, "", now.addrs[0]

    def _no_syn_cause(self, theirs: list[tuple[str, int]]) -> str:
        if self.mapping() in ("changed", "varies"):
            return "our-mapping"
        ports: dict[str, set] = {}
        for ip, p in theirs:
            ports.setdefault(ip, set()).add(p)
        if any(len(v) > 1 for v in ports.values()):  # the peer was seen at another port than it listens on
            return "their-mapping"
        return "timeout"

    async def _back_to_relay(self, peer: str, conn) -> None:
        """A failed hand-over may have closed the relayed connection (the dialer's daemon drops it first)."""
        try:
            if any(p.peer_id == peer for p in await self.transport.peers()):
                return
            await self.transport.connect_peer(peer, list(conn.addrs), timeout=10)
        except TransportError as e:
            logger.warning("could not reconnect to %s through the relay: %s", peer, e)

    async def _serve_punch(self, stream) -> None:
        """The responder's side: answer with our candidate addresses, wait for SYNC, then connect (in a task of its
        own: the relayed connection carrying this stream may close when the direct one takes over). At most
        ``PUNCH_BURST`` attempts per peer, one more every 5 s (a retry follows a failed attempt at once), and
        ``MAX_RESPONDING`` at once, so a peer cannot make us send many SYNs."""
        request = await asyncio.wait_for(stream.read_required(), 10)
        if request.kind != CONNECT:
            raise MalformedMessage("punch: expected CONNECT")
        theirs = parse_addrs(request.body)
        port = self._listen_port()
        refuse = (port is None or not self.hole_punching or not self.relay_client or not theirs
                  or not self._predicted() or len(self._responding) >= self.MAX_RESPONDING)
        role = None
        if request.body.get("burst") is True:  # asked for a burst: granted when the two mappings make roles
            self.bursts.note_mapping(stream.peer_id, request.body, theirs)
            role = self.bursts.role(self.mapping(), stream.peer_id)
            if not refuse and (role is None or not self.bursts.free(stream.peer_id, time.monotonic())):
                self.counters["punch_bursts_refused"] += 1
                logger.debug("hole punch from %s: burst refused (%s)", stream.peer_id, "no roles: mappings "
                             f"{self.mapping()} / {self.bursts.mapping_of(stream.peer_id)}" if role is None else
                             "one burst per peer every 5 minutes, one every 30 s in all")
                refuse = True
        if refuse or not self._punch_budget.allow(stream.peer_id):
            await stream.send(CONNECT, {"addrs": []} if role is None else
                              {"addrs": [], "mapping": self.mapping(), "burst": False})
            await stream.close(linger=2.0)
            return
        stale = self._responding_to.get(stream.peer_id)
        if stale is not None and not stale.done():  # the peer gave up on that one: free its ports for this one
            stale.cancel()
            await asyncio.gather(stale, return_exceptions=True)
        if role is not None:
            self.bursts.take(stream.peer_id, time.monotonic())
        await stream.send(CONNECT, {"addrs": self._candidates()} if role is None else
                          {"addrs": self._candidates(), "mapping": self.mapping(), "burst": True})
        sync = await asyncio.wait_for(stream.read_required(), 10)
        if sync.kind != SYNC:
            raise MalformedMessage("punch: expected SYNC")
        self.counters["punch_served"] += 1
        task = asyncio.ensure_future(self._respond(stream.peer_id, port, theirs[:4], role))
        self._responding.add(task)
        self._responding_to[stream.peer_id] = task
        task.add_done_callback(self._responding.discard)
        task.add_done_callback(lambda t, p=stream.peer_id: self._responding_to.get(p) is t
                               and self._responding_to.pop(p))

    async def _respond(self, peer: str, port: int, theirs: list[tuple[str, int]], role: str | None = None) -> None:
        try:
            if role is not None:
                sock = await self._burst(peer, role, port, theirs[0])
            else:
                sock = await simultaneous_open(port, theirs, self.PUNCH_DIAL_TIMEOUT)
            await self.transport.adopt(peer, sock, dialer=False, timeout=10)
        except (TransportError, OSError) as e:
            logger.info("hole punch from %s: no direct connection (%s)", peer, e)
            return
        self.counters["punch_served_ok"] += 1
        if role is not None:
            self.counters["punch_burst_successes"] += 1
        logger.info("hole punch from %s: connected directly, handed to the p2p daemon", peer)

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
            "mapping": self.mapping(),
            "relay_client": self.relay_client,
            "relay_service": self.relay_service,
            "relays": self.relays,
            "relays_found": self.relays_found,
            "last_probe": self.last_probe,
            "probes": self.probes[:6],
            "punches": self.punches[:6],
            "autonat_served": self.server.served,
            "autonat_refused": self.server.refused,
            **self.counters,
        }

    def routes(self) -> list:
        return []
