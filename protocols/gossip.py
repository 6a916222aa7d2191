"""Topic publish/subscribe across the mesh: a validated epidemic broadcast over our own streams.

Why not the p2p daemon's gossipsub (measured; ``docs/design/architecture.md``, Gossip): it forwards every
message before our code can validate it, drops silently when its 32-slot queues overflow, and drops payloads of
1 MiB or more. In a permissionless mesh we must not forward what we have not validated, and a drop must be
visible. py-libp2p's gossipsub would need the py-libp2p backend (NAT issue). So this module implements the
gossipsub ideas itself on ``/swarmd/pubsub/1.0.0``, one long-lived stream per direction per peer:

- **Signed messages**: ``{"b": [1, topic, author, seq, ts_ms, data], "s": Ed25519 sig}``, id = BLAKE2b-128 of the
  body. Receivers verify the author's signature before anything else.
- **Bounded mesh per topic** (D=6, D_lo=4, D_hi=12): messages are pushed eagerly to mesh peers; each heartbeat
  (1 s) we send IHAVE with recent ids to a few non-mesh subscribers, who IWANT what they miss.
- **Validate, then forward**: a message is forwarded only after the signature, the size limit of its topic, the
  freshness window and the topic's validator (registered by a loop: ACCEPT, REJECT or IGNORE) all pass. REJECT and
  bad signatures count against the peer that sent it (penalties, then a ban); banned peers drop out of every mesh
  and their streams are closed.
- **Dedup** by message id: an id stays in the seen cache until its timestamp leaves the freshness window (so a
  verbatim replay is either a duplicate or stale, never delivered twice), and only messages we accepted are cached,
  advertised (IHAVE) and served (IWANT): a relay never hands out what its own validator refused. IWANT ids are
  de-duplicated per peer and heartbeat.
- **Backpressure**: each peer has a bounded send queue and each subscription a bounded receive queue; overflow
  drops the oldest (send) or the newest (receive) message *and counts it* in status and metrics.

The message, its signature and id, and the kinds on the wire are :mod:`protocols.gossip_message`; the per-topic
and per-peer queues are :mod:`protocols.gossip_queues`. Both are importable from here too.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import inspect
import logging
import random
from typing import Any

from aiohttp import web

from swarmd.node.services import NodeContext
from swarmd.protocols.gossip_message import (GRAFT, IHAVE, IWANT, MAX_IDS, MAX_MESSAGE, MAX_TOPIC,
                                             MAX_TOPICS_PER_PEER, MSG, PRUNE, PUBSUB_SPEC, SUB, UNSUB, Message,
                                             Validator, Verdict, _mid, decode_message, sign_message, signed_by_author)
from swarmd.protocols.gossip_message import SIGN_DOMAIN  # noqa: F401  (re-exported: loops that check signed pubsub messages)
from swarmd.protocols.gossip_queues import KEEPALIVE  # noqa: F401  (re-exported)
from swarmd.protocols.gossip_queues import PeerLink, Subscription, Topic
from swarmd.transport.base import Stream
from swarmd.transport.clock import Clock
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.penalties import RateLimitedLog

logger = logging.getLogger(__name__)


class Gossip:
    name = "gossip"

    def __init__(
        self,
        *,
        d: int = 6,
        d_lo: int = 4,
        d_hi: int = 12,
        d_lazy: int = 6,
        heartbeat: float = 1.0,
        max_age: float = 120.0,
        max_skew: float = 30.0,
        send_queue: int = 4096,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ):
        self.d, self.d_lo, self.d_hi, self.d_lazy = d, d_lo, d_hi, d_lazy
        self.heartbeat = heartbeat
        self.max_age_ms = int(max_age * 1000)
        self.max_skew_ms = int(max_skew * 1000)
        self.send_queue = send_queue
        self.topics: dict[str, Topic] = {}
        self.peer_topics: dict[str, set[str]] = {}
        self.links: dict[str, PeerLink] = {}
        self.seen: dict[bytes, int] = {}  # id -> wall ms after which the freshness window refuses it anyway
        self._served: dict[str, set[bytes]] = {}  # per peer: ids served on IWANT since the last heartbeat
        self.cache: dict[bytes, Message] = {}  # recent messages, for IWANT
        self.history: collections.deque = collections.deque(maxlen=3)  # ids per heartbeat, for IHAVE
        self.history.append([])
        self.counters: collections.Counter = collections.Counter()
        self.latency_ms: collections.deque = collections.deque(maxlen=4096)  # publish -> delivery, ours
        self._seq = 0
        self._ctx: NodeContext | None = None
        self._link_tasks: set[asyncio.Task] = set()
        self._clock = clock  # None: the node's (ctx.clock), set at start
        self._rng = rng or random.Random()  # mesh and lazy-gossip choices: seeded in a simulation
        self._log = RateLimitedLog(logger, interval=10.0)

    def _now_ms(self) -> int:
        return int(self._clock.time() * 1000)

    # ------------------------------------------------------------------ service lifecycle
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        if self._clock is None:
            self._clock = ctx.clock
        self._log = RateLimitedLog(logger, interval=10.0, clock=self._clock.monotonic)
        self._seq = self._now_ms() << 10  # monotonic across restarts of the same identity
        await ctx.transport.serve(PUBSUB_SPEC, self._on_stream)

    async def run(self) -> None:
        while True:
            try:
                await self._heartbeat()
            except (TransportError, ProtocolViolation) as e:
                self._log.log(logging.DEBUG, "heartbeat", "pubsub heartbeat: %s", e)
            await asyncio.sleep(self.heartbeat)

    async def close(self) -> None:
        for link in self.links.values():
            if link.task is not None:
                link.task.cancel()
        tasks = [link.task for link in self.links.values() if link.task is not None]
        tasks += list(self._link_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.links.clear()

    # ------------------------------------------------------------------ API
    def subscribe(self, topic: str, *, max_size: int = 64 * 1024, validator: Validator | None = None,
                  queue_size: int = 1024) -> Subscription:
        """Receive accepted messages of ``topic`` (at most ``max_size`` bytes each). ``validator`` decides, before
        anything is forwarded, whether a message is valid; ``queue_size`` bounds what waits for the reader (0: no
        queue, the last 256 messages are kept for HTTP readers only)."""
        if not topic or len(topic) > MAX_TOPIC:
            raise ValueError("topic must be 1-128 characters")
        if not 0 < max_size <= MAX_MESSAGE:
            raise ValueError(f"max_size must be in (0, {MAX_MESSAGE}]")
        if topic in self.topics:
            raise ValueError(f"already subscribed to {topic!r}")
        t = self.topics[topic] = Topic(topic, max_size, validator, asyncio.Queue(queue_size) if queue_size else None)
        for link in self.links.values():
            link.send(SUB, [topic])
        return Subscription(t)

    def unsubscribe(self, topic: str) -> None:
        if self.topics.pop(topic, None) is not None:
            for link in self.links.values():
                link.send(UNSUB, [topic])

    def publish(self, topic: str, data: bytes) -> bytes:
        """Sign and send ``data`` on ``topic`` (we must be subscribed: it sets the size limit). Returns the id."""
        t = self.topics.get(topic)
        if t is None:
            raise ValueError(f"subscribe to {topic!r} before publishing on it")
        if len(data) > t.max_size:
            raise ValueError(f"{len(data)} B exceeds {topic!r}'s limit of {t.max_size} B")
        self._seq += 1
        message = sign_message(self._ctx.identity, topic, self._seq, self._now_ms(), data)
        self._remember(message)
        self.counters["published"] += 1
        self._forward(message, exclude=None)
        return message.id

    # ------------------------------------------------------------------ links
    async def _heartbeat(self) -> None:
        ctx = self._ctx
        members = set(ctx.members())
        penalties = ctx.transport.penalties
        # open links to members we have none to; drop links to banned peers
        for peer_id in list(self.links):
            link = self.links[peer_id]
            if not link.alive or peer_id not in members or penalties.is_banned(peer_id):
                if link.task is not None:
                    link.task.cancel()
                del self.links[peer_id]
        for peer_id in sorted(members - set(self.links)):
            if not penalties.is_banned(peer_id):
                task = asyncio.create_task(self._open_link(peer_id))
                self._link_tasks.add(task)
                task.add_done_callback(self._link_tasks.discard)
        # mesh maintenance per topic
        for t in self.topics.values():
            subscribers = {p for p, topics in self.peer_topics.items() if t.name in topics and p in self.links
                           and not penalties.is_banned(p)}
            t.mesh &= subscribers
            if len(t.mesh) < self.d_lo:
                candidates = sorted(subscribers - t.mesh)
                extra = self._rng.sample(candidates, min(self.d - len(t.mesh), len(candidates)))
                for p in extra:
                    t.mesh.add(p)
                    self.links[p].send(GRAFT, [t.name])
            elif len(t.mesh) > self.d_hi:
                worst = sorted(t.mesh, key=lambda p: -penalties.score(p))[: len(t.mesh) - self.d]
                for p in worst:
                    t.mesh.discard(p)
                    self.links[p].send(PRUNE, [t.name])
            # lazy gossip: recent ids to a few subscribers outside the mesh
            ids = [i for batch in self.history for i in batch if i in self.cache and self.cache[i].topic == t.name]
            if ids:
                others = sorted(subscribers - t.mesh)
                for p in self._rng.sample(others, min(self.d_lazy, len(others))):
                    self.links[p].send(IHAVE, {"topic": t.name, "ids": ids[-MAX_IDS:]})
        self.history.append([])
        now = self._now_ms()
        for mid in [m for m, until in self.seen.items() if until < now]:
            del self.seen[mid]
            self.cache.pop(mid, None)
        self._served.clear()
        live = {i for batch in self.history for i in batch}
        for mid in [m for m in self.cache if m not in live]:
            del self.cache[mid]

    async def _open_link(self, peer_id: str) -> None:
        try:
            stream = await self._ctx.transport.open_stream(peer_id, PUBSUB_SPEC, timeout=10.0)
        except (TransportError, ProtocolViolation) as e:
            logger.debug("no pubsub link to %s: %s", peer_id, e)
            return
        if peer_id in self.links:  # raced with another heartbeat
            await stream.close()
            return
        link = PeerLink(peer_id, stream, self.send_queue, self.counters)
        self.links[peer_id] = link
        if self.topics:
            link.send(SUB, sorted(self.topics))
        link.task = asyncio.create_task(link.run())

    # ------------------------------------------------------------------ inbound
    async def _on_stream(self, stream: Stream) -> None:
        peer = stream.peer_id
        penalties = self._ctx.transport.penalties
        admission = getattr(self._ctx.replicator, "admission", None)
        if admission is not None and admission.closed and peer not in admission.allow:
            # a closed swarm's messages are for its members: an outsider neither reads nor writes them
            self.counters["refused_not_member"] += 1
            self._ctx.transport.stats.errors["pubsub_not_member"] += 1
            self._log.log(logging.WARNING, ("outsider", "pubsub"), "pubsub: stream from %s refused: not on this "
                          "closed swarm's allowlist (state.allow)", peer)
            return
        try:
            while True:
                message = await stream.read()
                if message is None:
                    return
                if penalties.is_banned(peer):
                    self.counters["dropped_banned"] += 1
                    return
                await self._on_frame(peer, message.kind, message.body)
        finally:
            self.peer_topics.pop(peer, None)
            for t in self.topics.values():
                t.mesh.discard(peer)

    async def _on_frame(self, peer: str, kind: int, body: Any) -> None:
        if kind in (SUB, UNSUB, GRAFT, PRUNE):
            if not isinstance(body, list) or not all(isinstance(t, str) and 0 < len(t) <= MAX_TOPIC for t in body):
                raise MalformedMessage("pubsub: topic list expected")
            topics = self.peer_topics.setdefault(peer, set())
            if kind == SUB:
                topics.update(body)
                if len(topics) > MAX_TOPICS_PER_PEER:
                    raise ProtocolViolation("pubsub: too many topics", kind="malformed")
            elif kind == UNSUB:
                topics.difference_update(body)
            for name in body:
                t = self.topics.get(name)
                if t is None:
                    continue
                if kind == GRAFT and peer in self.links:
                    t.mesh.add(peer)
                    topics.add(name)
                elif kind in (PRUNE, UNSUB):
                    t.mesh.discard(peer)
        elif kind == MSG:
            await self._on_message(peer, body)
        elif kind == IHAVE:
            if not isinstance(body, dict) or not isinstance(body.get("ids"), list) or len(body["ids"]) > MAX_IDS:
                raise MalformedMessage("pubsub: bad IHAVE")
            if body.get("topic") in self.topics:
                want = list(dict.fromkeys(i for i in body["ids"]
                                          if isinstance(i, bytes) and len(i) == 16 and i not in self.seen))
                if want and peer in self.links:
                    self.links[peer].send(IWANT, want)
                    self.counters["iwant_sent"] += len(want)
        elif kind == IWANT:
            if not isinstance(body, list) or len(body) > MAX_IDS:
                raise MalformedMessage("pubsub: bad IWANT")
            link = self.links.get(peer)
            served = self._served.setdefault(peer, set())
            for mid in body:
                message = self.cache.get(mid) if isinstance(mid, bytes) else None
                if message is None or link is None:
                    continue
                if mid in served:
                    self.counters["iwant_duplicates"] += 1
                    continue
                served.add(mid)
                link.send(MSG, message.wire())
                self.counters["iwant_served"] += 1

    async def _on_message(self, peer: str, wire: Any) -> None:
        penalties = self._ctx.transport.penalties
        if isinstance(wire, dict) and isinstance(wire.get("b"), bytes) and _mid(wire["b"]) in self.seen:
            # a copy of one we have judged (its id is its body's hash): its body is not decoded again. At 8 nodes
            # each node gets every message about 6 times over the mesh, 5 of them copies (the exchange bench)
            self.counters["duplicates"] += 1
            return
        message = decode_message(wire)
        t = self.topics.get(message.topic)
        if t is None:
            self.counters["unsubscribed_topic"] += 1
            return  # not ours to judge or forward
        if not self._checked(message, t):
            self.counters["stale"] += 1
            penalties.penalize(peer, "stale", "pubsub message outside the freshness window")
            return
        self._remember(message, cache=False)  # seen from here on, whatever the verdict: no re-validation of replays
        verdict = Verdict.ACCEPT
        if t.validator is not None:
            try:
                verdict = t.validator(message)
                if inspect.isawaitable(verdict):
                    verdict = await verdict
            except Exception:
                self._log.log(logging.ERROR, ("validator", t.name), "validator of %s crashed", t.name, exc_info=True)
                verdict = Verdict.IGNORE
        if verdict is Verdict.REJECT:
            t.rejected += 1
            self.counters["rejected"] += 1
            penalties.penalize(peer, "invalid_message", f"rejected by the {t.name} validator")
            return
        if verdict is Verdict.IGNORE:
            t.ignored += 1
            return
        self._remember(message)  # accepted: cached, advertised and served on IWANT
        delivered = Message(message.id, message.topic, message.author, message.seq, message.ts_ms, message.data,
                            message.body, message.sig, received_from=peer)
        self._deliver(t, delivered)
        self._forward(message, exclude=peer)

    def check_signed(self, wire: Any, topic: str) -> Message:
        """A message of ``topic`` that came another way than the mesh (a loop fetched it from a peer that held
        it), checked as the mesh checks one: its form, its size, its author's signature and the freshness window.
        Raises MalformedMessage or ProtocolViolation. Not delivered, forwarded or remembered: the caller judges it
        (its topic's validator)."""
        message = decode_message(wire)
        t = self.topics.get(topic)
        if message.topic != topic or t is None:
            raise ProtocolViolation(f"pubsub: a fetched message of {message.topic!r}, not {topic!r}")
        if not self._checked(message, t):
            raise ProtocolViolation("pubsub: a fetched message outside the freshness window", kind="stale")
        return message

    def _checked(self, message: Message, t: Topic) -> bool:
        """A message's size and its author's signature (ProtocolViolation if either is wrong), then whether it is
        inside the freshness window."""
        if len(message.data) > t.max_size:
            raise ProtocolViolation(f"pubsub: {len(message.data)} B on {t.name} exceeds {t.max_size} B",
                                    kind="oversized")
        if not signed_by_author(message):
            raise ProtocolViolation(f"pubsub: bad signature on a message claiming {message.author}",
                                    kind="bad_signature")
        now = self._now_ms()
        return now - self.max_age_ms <= message.ts_ms <= now + self.max_skew_ms

    # ------------------------------------------------------------------ internals
    def _remember(self, message: Message, *, cache: bool = True) -> None:
        self.seen[message.id] = message.ts_ms + self.max_age_ms + 1000
        if cache:
            self.cache[message.id] = message
            self.history[-1].append(message.id)

    def _deliver(self, t: Topic, message: Message) -> None:
        try:
            if t.queue is not None:
                t.queue.put_nowait(message)
        except asyncio.QueueFull:
            t.dropped_full += 1
            self.counters["subscriber_dropped"] += 1
            self._log.log(logging.WARNING, ("full", t.name), "subscriber of %s is too slow; message dropped", t.name)
        t.delivered += 1
        t.recent_seq += 1
        t.recent.append((t.recent_seq, message))
        self.latency_ms.append(max(0, self._now_ms() - message.ts_ms))

    def _forward(self, message: Message, exclude: str | None) -> None:
        t = self.topics.get(message.topic)
        if t is None:
            return
        targets = set(t.mesh)
        if len(targets) < self.d_lo:  # a young mesh: fall back to every known subscriber
            targets |= {p for p, topics in self.peer_topics.items() if message.topic in topics}
        for peer in sorted(targets):  # a fixed order: a simulation replays the same schedule
            if peer != exclude and peer != message.author and peer in self.links:
                self.links[peer].send(MSG, message.wire())
                self.counters["forwarded"] += 1

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        lat = sorted(self.latency_ms)
        return {
            "topics": {
                name: {"mesh": len(t.mesh), "delivered": t.delivered, "rejected": t.rejected, "ignored": t.ignored,
                       "dropped_full": t.dropped_full, "max_size": t.max_size}
                for name, t in sorted(self.topics.items())
            },
            "links": len(self.links),
            "latency_ms_p50": lat[len(lat) // 2] if lat else None,
            "latency_ms_p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            **dict(sorted(self.counters.items())),
        }

    def routes(self) -> list:
        return [
            web.post("/topics/{topic}/subscribe", self._http_subscribe),
            web.post("/topics/{topic}", self._http_publish),
            web.get("/topics/{topic}", self._http_read),
        ]

    async def _http_subscribe(self, request: web.Request) -> web.Response:
        topic = request.match_info["topic"]
        if topic not in self.topics:
            max_size = int(request.query.get("max_size", 64 * 1024))
            try:
                self.subscribe(topic, max_size=max_size, queue_size=0)
            except ValueError as e:
                return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"topic": topic, "subscribed": True})

    async def _http_publish(self, request: web.Request) -> web.Response:
        topic = request.match_info["topic"]
        data = await request.read()
        try:
            mid = self.publish(topic, data)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"id": mid.hex()})

    async def _http_read(self, request: web.Request) -> web.Response:
        """Messages received on a topic after ``?after=N`` (the last ``seq`` you saw), oldest first."""
        t = self.topics.get(request.match_info["topic"])
        if t is None:
            return web.json_response({"error": "not subscribed"}, status=404)
        after = int(request.query.get("after", 0))
        items = [
            {"seq": seq, "id": m.id.hex(), "author": m.author, "from": m.received_from, "ts_ms": m.ts_ms,
             "data": base64.b64encode(m.data).decode()}
            for seq, m in t.recent if seq > after
        ]
        return web.json_response({"topic": t.name, "delivered": t.delivered, "messages": items})
