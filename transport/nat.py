"""Reachability: an AutoNAT-style dial-back protocol, and the guess a node makes before anyone answered.

AutoNAT (libp2p spec, v1 semantics) over our own framed streams, ``/swarmd/autonat/1.0.0``:

- the client sends ``{"ports": [tcp ports it listens on]}`` (at most 4);
- the server takes the IP it sees the client's connection come from (never an address the client names, so it
  cannot be used to make us dial third parties), opens a fresh TCP connection to that IP on each port, from a new
  socket (not the existing connection), and answers ``{"observed": "/ip4/<ip>/tcp/<port>", "ok": [ports that
  accepted]}``, or ``{"error": "..."}`` (e.g. the request came through a relay, so no IP is known);
- a port that accepts means inbound connections reach the client: it is public. A server that could not dial any
  port is evidence of a NAT or firewall: private.

Servers rate-limit per peer and bound concurrent dial-backs. Everything else (when to probe, whom to ask, how to
combine answers) is in ``node.nat``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time

from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.wire import WIRE, Bool, Int, List, Map, OneOf, Str

logger = logging.getLogger(__name__)

AUTONAT_SPEC = ProtocolSpec("autonat", "1.0.0", max_frame=1024, kinds=frozenset({1, 2}))
REQUEST, REPLY = 1, 2
MAX_PORTS = 4
WIRE.frame(AUTONAT_SPEC, REQUEST, "autonat.request", Map.of(ports=List(Int(0, 65535), MAX_PORTS)),
           {"ports": [4001]}, doc="the TCP ports the asker listens on")
WIRE.frame(AUTONAT_SPEC, REPLY, "autonat.reply",
           OneOf((Map.of(observed=Str(128), ok=List(Int(0, 65535), MAX_PORTS)), Map.of(error=Str(200)))),
           {"observed": "/ip4/203.0.113.7/tcp/4001", "ok": [4001]},
           doc="the address the server saw and the ports that accepted its dial-back, or an error")
DIAL_TIMEOUT = 2.0

# addresses that are never directly reachable from the internet: a node listening only on these is behind a NAT
_NATTED = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                                             "169.254.0.0/16", "fc00::/7", "fe80::/10")]


def natted(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return any(addr in net for net in _NATTED)


def public(ip: str) -> bool:
    """An address a NAT could map a peer to: not private, loopback, link-local, multicast or unspecified."""
    addr = ipaddress.ip_address(ip)
    return not (natted(ip) or addr.is_loopback or addr.is_multicast or addr.is_unspecified or addr.is_link_local)


def ip_of(maddr: str) -> tuple[str, int] | None:
    """(ip, tcp port) of a direct /ip4|ip6/.../tcp/... multiaddr; None for relayed or other addresses."""
    parts = maddr.split("/")
    if "p2p-circuit" in parts or len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        return str(ipaddress.ip_address(parts[2])), int(parts[4])
    except ValueError:
        return None


class AutoNATServer:
    """Answers dial-back requests. ``per_peer_interval`` seconds between two requests of one peer."""

    def __init__(self, per_peer_interval: float = 5.0, concurrency: int = 4):
        self.per_peer_interval = per_peer_interval
        self._last: dict[str, float] = {}
        self._slots = asyncio.Semaphore(concurrency)
        self.served = 0
        self.refused = 0

    async def handle(self, stream: Stream) -> None:
        request = await asyncio.wait_for(stream.read_required(), 10)
        body = request.body
        if request.kind != REQUEST or not isinstance(body, dict) or set(body) != {"ports"}:
            raise MalformedMessage("autonat: expected {ports}")
        ports = body["ports"]
        if not isinstance(ports, list) or not 0 < len(ports) <= MAX_PORTS \
                or not all(type(p) is int and 0 < p < 65536 for p in ports):
            raise MalformedMessage("autonat: ports must be 1..4 TCP ports")
        now = time.monotonic()
        if now - self._last.get(stream.peer_id, -1e9) < self.per_peer_interval or self._slots.locked():
            self.refused += 1
            await stream.send(REPLY, {"error": "rate limited"})
            return
        self._last[stream.peer_id] = now
        if len(self._last) > 4096:
            self._last = {p: t for p, t in self._last.items() if now - t < self.per_peer_interval}
        observed = ip_of(stream.remote_addr or "")
        if observed is None:
            await stream.send(REPLY, {"error": "no direct connection to observe (relayed?)"})
            return
        ip, port = observed
        async with self._slots:
            results = await asyncio.gather(*(_dial(ip, p) for p in ports))
        self.served += 1
        family = "ip6" if ":" in ip else "ip4"
        await stream.send(REPLY, {"observed": f"/{family}/{ip}/tcp/{port}",
                                  "ok": [p for p, ok in zip(ports, results) if ok]})


async def _dial(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def parse_reply(body: object) -> tuple[str, list[int]] | str:
    """A server's reply: (observed address, ports that accepted), or an error string."""
    if isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str):
        return body["error"][:200]
    if (isinstance(body, dict) and set(body) == {"observed", "ok"} and isinstance(body["observed"], str)
            and ip_of(body["observed"]) is not None and isinstance(body["ok"], list)
            and len(body["ok"]) <= MAX_PORTS and all(type(p) is int for p in body["ok"])):
        return body["observed"], body["ok"]
    raise MalformedMessage("autonat: malformed reply")


# ---------------------------------------------------------------------- hole punching (DCUtR-style, over a relay)
# initiator -> responder CONNECT {"addrs": [its predicted addresses]}; responder -> initiator CONNECT {"addrs": [...]}
# (empty: not now); initiator -> responder SYNC {}. The responder dials when SYNC arrives, the initiator half a round
# trip after sending it, so the two SYNs cross (transport.punch); then both hand the socket to their daemon.
PUNCH_SPEC = ProtocolSpec("punch", "2.0.0", max_frame=2048, kinds=frozenset({1, 2}))
CONNECT, SYNC = 1, 2
WIRE.frame(PUNCH_SPEC, CONNECT, "punch.connect",
           Map.of(("mapping", "burst"), addrs=List(Str(128), 8), mapping=Str(8), burst=Bool()),
           {"addrs": ["/ip4/203.0.113.7/tcp/4001"], "mapping": "kept", "burst": False},
           doc="the sender's predicted public addresses (empty: not now), its NAT's mapping (kept, changed, varies, "
           "unknown), and whether this attempt is a burst of many flows (transport.birthday): asked by the "
           "initiator, granted by the responder's reply")
WIRE.frame(PUNCH_SPEC, SYNC, "punch.sync", Map.of(), {}, doc="dial now")


def parse_addrs(body: object, key: str = "addrs") -> list[tuple[str, int]]:
    """The addresses in a punch message. Only addresses a NAT could map us to count: private, loopback, link-local,
    multicast or unspecified ones are dropped, so a peer cannot make us connect into our own network."""
    if not isinstance(body, dict) or not isinstance(body.get(key), list) or len(body[key]) > 8:
        raise MalformedMessage("punch: expected a list of at most 8 addresses")
    out = []
    for a in body[key]:
        found = ip_of(a) if isinstance(a, str) else None
        if found is None or found[1] == 0:
            raise MalformedMessage("punch: not a direct TCP address")
        if public(found[0]):
            out.append(found)
    return out
