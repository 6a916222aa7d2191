"""BulkService: the store of blobs (``put``, ``keep``, ``drop``, its budget), their announcements (published, and
the others' validated and kept with their sources), pulls from those sources (``pull``, ``pull_from``: which ways to
a source are tried, and in which order), ``/status`` and the HTTP routes; serving is ``ServingMixin``'s.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable

import msgpack
from aiohttp import web

from swarmd.node.services import NodeContext
from swarmd.protocols.bulk.receive import ConnectionPool, fetch, fetch_stream
from swarmd.protocols.bulk.serve import SERVE_BURST, SERVE_RATE, ServingMixin
from swarmd.protocols.bulk.wire import (
    ANNOUNCE,
    ANNOUNCEMENT_TTL,
    HAVE,
    MAX_ANNOUNCEMENTS,
    MAX_BLOB,
    MAX_PER_AUTHOR,
    MAX_REQUEST,
    REQUEST_DOMAIN,
    STREAM_SPEC,
    TOPIC,
    Announcement,
    BadData,
    BulkError,
    content_hash,
)
from swarmd.protocols.gossip import Gossip, Message, Verdict
from swarmd.transport import clock
from swarmd.transport.clock import Clock
from swarmd.transport.errors import ProtocolViolation, TransportError
from swarmd.transport.penalties import RateLimitedLog, TokenBuckets
from swarmd.transport.wire import WIRE

logger = logging.getLogger("swarmd.protocols.bulk")  # one logger for the whole package

DEFAULT_MAX_BYTES = 2 << 30  # blobs held, in all, unless a service reserves more (``reserve``)


class BulkService(ServingMixin):
    """Holds blobs, serves them over TCP, announces them, pulls and verifies others'."""

    name = "bulk"

    def __init__(self, gossip: Gossip, *, host: str = "127.0.0.1", port: int = 0, max_bytes: int = DEFAULT_MAX_BYTES,
                 on_blob: Callable[[Announcement, bytearray], None] | None = None, tcp: bool = True):
        self.gossip = gossip
        self.tcp = tcp  # False: no TCP server, blobs are served and pulled over the transport's streams only
        self.host, self.port = host, port
        self.max_bytes = max_bytes
        self.blobs: collections.OrderedDict[bytes, bytearray] = collections.OrderedDict()
        self._held = 0  # bytes in blobs
        self.announcements: dict[bytes, Announcement] = {}  # in arrival order
        self.sources: dict[bytes, list[tuple[str, str]]] = collections.defaultdict(list)  # hash -> (peer, addr)
        self._announced_at: dict[bytes, float] = {}
        self._by_author_hashes: dict[str, collections.deque] = {}  # author -> its live announcements, oldest first
        self._rate = TokenBuckets(SERVE_RATE, SERVE_BURST)  # requests per requester
        self._serving: collections.Counter = collections.Counter()
        self._served_at = 0.0  # when the last transfer we served ended (monotonic)
        self._serving_blobs: collections.Counter = collections.Counter()  # blob hash -> transfers of it under way
        self._log = RateLimitedLog(logger, interval=30.0)
        self._hosts_cache: tuple[float, dict[str, set[str]]] | None = None
        self._hosts_listing: asyncio.Task | None = None  # the listing under way (``_peer_hosts``)
        self.counters: collections.Counter = collections.Counter()
        self.on_blob = on_blob
        self._server: asyncio.AbstractServer | None = None
        self._ctx: NodeContext | None = None
        self._addrs: list[str] = []
        self._pool = ConnectionPool()  # our idle connections to sources, for the next pulls from them
        # the connections we serve (idle ones included), and the task serving each
        self._connections: dict[asyncio.StreamWriter, asyncio.Task | None] = {}
        # of those, the ones waiting for a request (a first or a next one, until it is read whole), by the host
        # they came from, each host's longest waiting first: the ones a full server may close (``_make_room``)
        self._waiting: dict[str, dict[asyncio.StreamWriter, None]] = {}
        self._waiting_host: dict[asyncio.StreamWriter, str] = {}
        self._evicted: set[asyncio.StreamWriter] = set()
        self.max_connections: int | None = None  # None: max_served(), read at each new connection

    # ------------------------------------------------------------------ lifecycle
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self._rate = TokenBuckets(SERVE_RATE, SERVE_BURST, clock=ctx.clock.monotonic)
        self._pool = ConnectionPool(clock=ctx.clock.monotonic)
        self._log = RateLimitedLog(logger, interval=30.0, clock=ctx.clock.monotonic)
        if self.tcp:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_REQUEST + 16)
            self.port = self._server.sockets[0].getsockname()[1]
            hosts = [self.host]
            if self.host in ("0.0.0.0", "::", ""):  # announce the addresses peers already reach us on
                hosts = sorted({a.split("/")[2] for a in await ctx.transport.addresses() if a.startswith("/ip4/")})
            self._addrs = [f"{h}:{self.port}" for h in hosts][:8]
        self.gossip.subscribe(TOPIC, max_size=2048, validator=self._validate, queue_size=0)
        await ctx.transport.serve(STREAM_SPEC, self._serve_stream)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            self._expire(self._clock().monotonic())

    def _expire(self, now: float) -> None:
        for blob_hash in [h for h, t in self._announced_at.items() if now - t > ANNOUNCEMENT_TTL]:
            self._forget(blob_hash)
        self._rate.prune()
        self._pool.expire()

    def _forget(self, blob_hash: bytes) -> None:
        a = self.announcements.pop(blob_hash, None)
        self._announced_at.pop(blob_hash, None)
        self.sources.pop(blob_hash, None)
        if a is not None:
            mine = self._by_author_hashes.get(a.author)
            if mine is not None:
                try:
                    mine.remove(blob_hash)
                except ValueError:
                    pass
                if not mine:
                    del self._by_author_hashes[a.author]

    async def close(self) -> None:
        if self._hosts_listing is not None and not self._hosts_listing.done():
            self._hosts_listing.cancel()
        self._pool.close()
        if self._server is not None:
            self._server.close()
            serving = [t for t in self._connections.values() if t is not None]
            for writer in list(self._connections):  # idle ones wait for a next request: they end at their EOF
                writer.close()
            if serving:
                await asyncio.wait(serving, timeout=5.0)
            await self._server.wait_closed()

    def _clock(self) -> Clock:
        return self._ctx.clock if self._ctx is not None else clock.current()

    @property
    def addrs(self) -> list[str]:
        return self._addrs

    # ------------------------------------------------------------------ publishing
    def put(self, data: bytes | bytearray, *, codec: str = "raw", topic: str = "", round: int = 0,
            fragment: int = 0) -> bytes:
        """Store ``data`` and announce it; returns its hash."""
        blob_hash = content_hash(data)
        self._keep(blob_hash, bytearray(data))
        self._announce("announce", blob_hash, len(data), codec, topic, round, fragment)
        return blob_hash

    def keep(self, data: bytes | bytearray) -> bytes:
        """Store ``data`` to serve without announcing it (a protocol that names the hash in its own signed message,
        as the DiLoCo exchange's parts do); returns its hash."""
        blob_hash = content_hash(data)
        self._keep(blob_hash, bytearray(data))
        return blob_hash

    def keep_prepared(self, blob_hash: bytes, data: bytearray) -> bytes:
        """:meth:`keep` for our own bytes whose hash (``content_hash``) and copy were made off the event loop (in a
        worker thread, with the encoding): the loop only files them. ``data`` is handed over, not copied."""
        self._keep(blob_hash, data)
        return blob_hash

    def drop(self, hashes) -> None:
        """Stop holding (and serving) these blobs."""
        for blob_hash in hashes:
            blob = self.blobs.pop(blob_hash, None)
            if blob is not None:
                self._held -= len(blob)

    def _announce(self, kind, blob_hash, size, codec, topic, round, fragment) -> None:
        body = WIRE.pack(ANNOUNCE if kind == "announce" else HAVE, {
            "hash": blob_hash, "size": size, "codec": codec, "topic": topic, "round": round, "fragment": fragment,
            "addrs": self.addrs})
        self.gossip.publish(TOPIC, body)

    def reserve(self, nbytes: int) -> None:
        """Let the store hold at least ``nbytes`` beyond its default: a service whose blobs outgrow the default
        (a large model's updates, kept for a few rounds) says so when it knows their size."""
        self.max_bytes = max(self.max_bytes, DEFAULT_MAX_BYTES + nbytes)

    def _keep(self, blob_hash: bytes, data: bytearray) -> None:
        old = self.blobs.get(blob_hash)
        self._held += len(data) - (len(old) if old is not None else 0)
        self.blobs[blob_hash] = data
        self.blobs.move_to_end(blob_hash)
        while self._held > self.max_bytes and len(self.blobs) > 1:
            self._held -= len(self.blobs.popitem(last=False)[1])
            self.counters["blobs_evicted"] += 1  # the oldest first: a peer that still wants it gets "not held"
            self._log.log(logging.WARNING, "evicted", "bulk: over its %d bytes, the oldest blobs are dropped "
                          "before their service releases them", self.max_bytes)

    def _validate(self, message: Message) -> Verdict:
        a = Announcement.parse(message)
        if a is None:
            return Verdict.REJECT
        if a.hash not in self.announcements:
            mine = self._by_author_hashes.setdefault(a.author, collections.deque())
            if len(mine) >= MAX_PER_AUTHOR:  # the author's oldest announcement gives way to its newest
                self.counters["announcements_over_cap"] += 1
                self._forget(mine[0])
            while len(self.announcements) >= MAX_ANNOUNCEMENTS:
                self._forget(next(iter(self.announcements)))
                self.counters["announcements_evicted"] += 1
            self.announcements[a.hash] = a
            self._announced_at[a.hash] = self._clock().monotonic()
            self._by_author_hashes.setdefault(a.author, collections.deque()).append(a.hash)
        sources = self.sources[a.hash]
        for addr in a.addrs or ("",):  # no TCP address: a holder served over its streams only
            if (a.author, addr) not in sources and len(sources) < 64:
                sources.append((a.author, addr))
        return Verdict.ACCEPT

    # ------------------------------------------------------------------ pulling
    async def pull(self, blob_hash: bytes, *, timeout: float = 300.0,
                   progress: Callable[[int], None] | None = None) -> tuple[bytearray, str]:
        """The verified bytes of an announced blob, from the first source that serves them right (``progress``:
        called with the bytes received so far, as they come)."""
        if blob_hash in self.blobs:
            return self.blobs[blob_hash], "local"
        a = self.announcements.get(blob_hash)
        if a is None:
            raise BulkError("no announcement for this hash")
        body, peer = await self._fetch(blob_hash, a.size, self.sources[blob_hash], timeout, progress)
        self._announce("have", blob_hash, a.size, a.codec, a.topic, a.round, a.fragment)
        if self.on_blob is not None:
            self.on_blob(a, body)
        return body, peer

    async def pull_from(self, blob_hash: bytes, size: int, peer: str, addrs: list[str], *,
                        timeout: float = 300.0, progress: Callable[[int], None] | None = None) -> bytearray:
        """The verified bytes of a blob that ``peer`` named (hash and size) in a message it signed, from that peer:
        over its TCP address on a host we already reach it on, or over a direct libp2p stream; never a relay
        (``progress`` as for ``pull``)."""
        if blob_hash in self.blobs:
            return self.blobs[blob_hash]
        if not 0 < size <= MAX_BLOB:
            raise BulkError(f"size {size} out of range")
        body, _ = await self._fetch(blob_hash, size, [(peer, a) for a in addrs[:8]] or [(peer, "")], timeout,
                                    progress)
        self._keep(blob_hash, body)  # others of the round may ask us for it (its first holder may be gone)
        return body

    async def _fetch(self, blob_hash: bytes, size: int, sources: list[tuple[str, str]],
                     timeout: float, progress: Callable[[int], None] | None = None) -> tuple[bytearray, str]:
        ctx = self._ctx
        errors = []
        hosts = await self._peer_hosts()
        # bulk bytes never cross a relay: sources we reach directly first; one we only reach through a relay is
        # tried last (its TCP address may still answer) and said so, while holders with a direct path serve it
        sources = sorted(sources, key=lambda s: not ctx.direct(s[0]))
        tried_streams = set()
        for peer, addr in sources:
            if ctx.transport.penalties.is_banned(peer):
                continue
            # a hole-punched peer's TCP address is behind its NAT: ask over the punched connection instead; and we
            # dial a TCP address only on a host we already reach that peer on (an announcement cannot make us
            # connect to any other host: loopback, the LAN, a third party)
            ways = []
            if not ctx.punched(peer) and addr:
                if addr.rsplit(":", 1)[0].strip("[]") in hosts.get(peer, ()):
                    ways.append(addr)
                else:
                    self.counters["refused_addr"] += 1
                    self._log.log(logging.INFO, ("addr", peer), "bulk: not dialing %s announced by %s: not a host "
                                  "we reach that peer on", addr, peer)
            if ctx.direct(peer) and peer not in tried_streams:
                ways.append("stream")
                tried_streams.add(peer)
            elif not ctx.direct(peer):
                self.counters["relayed_sources"] += 1
                logger.info("bulk %s: no direct path to %s (relayed or not connected); bulk transfers never go "
                            "through a relay, so trying its TCP address %s last", blob_hash.hex()[:16], peer, addr)
            body = None
            for way in ways:
                ts = int(self._clock().time() * 1000)
                request = {"hash": blob_hash, "peer": ctx.identity.peer_id, "ts": ts,
                           "sig": ctx.identity.sign(REQUEST_DOMAIN + blob_hash + str(ts).encode())}
                where = f"{peer[-8:]}@{way}"
                try:
                    if way == "stream":
                        body = await fetch_stream(ctx.transport, peer, blob_hash, size, request, timeout=timeout,
                                                  progress=progress)
                        self.counters["pulled_over_stream"] += 1
                    else:
                        body = await fetch(way, blob_hash, size, msgpack.packb(request, use_bin_type=True),
                                           timeout=timeout, progress=progress, pool=self._pool)
                    break
                except (BadData, ProtocolViolation) as e:
                    ctx.transport.penalties.penalize(peer, "bad_data", str(e))
                    self.counters["bad_data"] += 1
                    errors.append(f"{where}: {e}")
                    break
                except (BulkError, TransportError, OSError, asyncio.TimeoutError) as e:
                    self.counters["source_failed"] += 1
                    errors.append(f"{where}: {e}")
            if body is None:
                continue
            self._keep(blob_hash, body)
            self.counters["pulled"] += 1
            self.counters["bytes_pulled"] += len(body)
            logger.debug("pulled %s (%d B) from %s", blob_hash.hex()[:16], len(body), peer)
            return body, peer
        raise BulkError("no source served the blob: " + "; ".join(errors or ["no sources"]))

    async def _peer_hosts(self) -> dict[str, set[str]]:
        """For each connected peer, the IP hosts of its direct connections (cached for a second). One listing at a
        time: the pulls that start together (a round's chunks, as its announcements come) wait for the same one (a
        listing asked of the daemon for each pull costs 6% of a node's main thread in a round at N = 8)."""
        now = self._clock().monotonic()
        if self._hosts_cache is not None and now - self._hosts_cache[0] < 1.0:
            return self._hosts_cache[1]
        if self._hosts_listing is None or self._hosts_listing.done():
            self._hosts_listing = asyncio.get_running_loop().create_task(self._list_hosts())
        return await asyncio.shield(self._hosts_listing)

    async def _list_hosts(self) -> dict[str, set[str]]:
        hosts: dict[str, set[str]] = {}
        try:
            for p in await self._ctx.transport.peers():
                for addr in p.addrs:
                    parts = addr.split("/")
                    if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "/p2p-circuit" not in addr:
                        hosts.setdefault(p.peer_id, set()).add(parts[2])
        except (TransportError, OSError) as e:
            logger.debug("bulk: cannot list peers: %s", e)
        self._hosts_cache = (self._clock().monotonic(), hosts)
        return hosts

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        return {
            "addrs": self.addrs,
            "blobs": len(self.blobs),
            "bytes": self._held,
            "announcements": len(self.announcements),
            "idle_connections": self._pool.idle(),
            **{f"connections_{k}": v for k, v in sorted(self._pool.counters.items())},
            **dict(sorted(self.counters.items())),
        }

    def routes(self) -> list:
        return [
            web.post("/bulk", self._http_put),
            web.get("/bulk", self._http_list),
            web.post("/bulk/{hash}/pull", self._http_pull),
        ]

    async def _http_put(self, request: web.Request) -> web.Response:
        data = await request.read()
        blob_hash = self.put(data, codec=request.query.get("codec", "raw"), topic=request.query.get("topic", ""))
        return web.json_response({"hash": blob_hash.hex(), "size": len(data)})

    async def _http_list(self, request: web.Request) -> web.Response:
        return web.json_response({h.hex(): {"size": len(b), "verified": content_hash(b) == h}
                                  for h, b in self.blobs.items()})

    async def _http_pull(self, request: web.Request) -> web.Response:
        try:
            blob_hash = bytes.fromhex(request.match_info["hash"])
        except ValueError:
            return web.json_response({"error": "bad hash"}, status=400)
        start = time.perf_counter()
        try:
            body, source = await self.pull(blob_hash)
        except BulkError as e:
            return web.json_response({"error": str(e)}, status=502)
        return web.json_response({"size": len(body), "source": source, "seconds": time.perf_counter() - start})
