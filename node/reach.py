"""Split detection and healing: does this node still reach the swarm it knows, and if not, get back.

Swarms split: a partition, a flapping link or a restarted router leaves two groups of nodes that each still work,
and that never see each other again unless someone dials across (a known problem of hivemind's swarms). The DHT will
not do it: each half's routing tables drop the other half, and its records expire.

How a node knows
- every ``interval`` it asks up to ``per_round`` connected members (the least recently confirmed first) over
  ``/swarmd/reach/1.0.0`` which peers *they* reached within half the window (a list of 8-byte hashes of peer ids, at
  most ``MAX_REPORTED``). A member that answered, or asked us, is *reached* by us; a peer listed in an answer less
  than half a window old is reached *through* that neighbour (so a peer only a neighbour reached is lost within one
  window too, as one we stopped reaching ourselves);
- the window is ``window``, or twice the time it takes to ask every connected member once if that is longer;
- the swarm it knows is the replicated member set (``members``), less the peers never seen alive (not by us, not by
  a neighbour) in the last ``KNOWN_HORIZON``: a member that crashed long ago is not part of a split;
- a member is *lost* when neither we nor any neighbour reached it within the window. The node calls it a **split**
  when at least 2 members and at least ``SPLIT_FRACTION`` of the known swarm are lost at once; a few dead peers are
  not a split.

How it heals
- while split, it dials every lost member at its remembered addresses (the address book keeps the last addresses of
  every member it ever saw, in the data dir, so a restart remembers them too), every ``interval`` for the first
  ``FAST_REDIAL`` seconds of the split, then with backoff up to ``MAX_BACKOFF``; a member that our transport still
  lists as connected but that has not answered within the window is disconnected first (a connection through a
  partition can outlive it for minutes);
- each member it reaches again is re-bootstrapped through (``rejoin``: a DHT ping and a hello, so the DHT, the
  member records and the CRDT sync come back at once, not a poll later).

What it says: ``/status`` -> ``split``, ``swarmd doctor``'s hints, ``/metrics`` (``swarmd_split_*``). Neighbours'
answers are untrusted: bounded, rate-limited per peer, and at worst they make us think a lost peer is reached through
them (a split is then seen through the other neighbours, or later). The user's view: ``docs/guides/join-a-swarm.md``,
Splits.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Awaitable, Callable

from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.files import write_durably
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.penalties import RateLimitedLog, TokenBuckets
from swarmd.transport.wire import WIRE, Bytes, List, Nil

logger = logging.getLogger(__name__)

ASK, ANSWER = 1, 2
MAX_REPORTED = 1024
REACH_SPEC = ProtocolSpec("reach", "1.0.0", max_frame=16 + 9 * MAX_REPORTED + 64, kinds=frozenset({ASK, ANSWER}))
# the same frames, many asks a stream: an asker that asks every connected member each interval (a swarm of up to
# ``per_round`` + 1) keeps one stream to each. A stream opened per ask costs most of an idle node's CPU at 16 nodes
# (its p2p daemon's and its own: 54% of a core for the 16 against 25% with no asks)
REACH_KEPT_SPEC = ProtocolSpec("reach", "1.1.0", max_frame=REACH_SPEC.max_frame, kinds=REACH_SPEC.kinds)
KEPT_IDLE = 4.0  # seconds: an asker asks on a kept stream only this soon after its last ask (a server keeps it 5 s
# at least: ``Reach.keep_open``)
for _spec, _name in ((REACH_SPEC, "reach"), (REACH_KEPT_SPEC, "reach.kept")):
    WIRE.frame(_spec, ASK, f"{_name}.ask", Nil(), None, doc="whom did you reach lately?")
    WIRE.frame(_spec, ANSWER, f"{_name}.answer", List(Bytes(exact=8), MAX_REPORTED), [bytes(8)],
               doc="8-byte hashes of the peer ids it reached within half the split window")
SPLIT_FRACTION = 0.25
KNOWN_HORIZON = 3600.0  # seconds: members not seen alive for this long are not counted in the known swarm
FAST_REDIAL = 120.0  # seconds of a split during which lost members are re-dialled every interval
MAX_BACKOFF = 30.0
MAX_BOOK = 512  # members whose addresses the address book keeps
MAX_ADDRS = 8  # addresses kept per member
BOOK_FILE = "addrbook.json"


def short(peer_id: str) -> bytes:
    return hashlib.blake2b(peer_id.encode(), digest_size=8).digest()


class AddressBook:
    """The last known addresses of every member this node ever saw (bounded, most recently seen kept), saved in the
    data dir so a restarted node can re-bootstrap through any of them."""

    def __init__(self, data_dir: Path | None):
        self.path = data_dir / BOOK_FILE if data_dir is not None else None
        self.book: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._dirty = False
        if self.path is not None and self.path.exists():
            try:
                raw = json.loads(self.path.read_text())
                for peer_id, addrs in list(raw.items())[-MAX_BOOK:]:
                    if isinstance(peer_id, str) and isinstance(addrs, list):
                        self.book[peer_id] = [a for a in addrs if isinstance(a, str)][:MAX_ADDRS]
            except (OSError, ValueError) as e:
                logger.warning("address book %s unreadable (%s); starting an empty one", self.path, e)

    def note(self, peer_id: str, addrs) -> None:
        addrs = [a for a in addrs if isinstance(a, str) and "/p2p-circuit" not in a][:MAX_ADDRS]
        if not addrs:
            return
        if self.book.get(peer_id) != addrs:
            self._dirty = True
        self.book[peer_id] = addrs
        self.book.move_to_end(peer_id)
        while len(self.book) > MAX_BOOK:
            self.book.popitem(last=False)

    def get(self, peer_id: str) -> list[str]:
        return list(self.book.get(peer_id, ()))

    def save(self) -> None:
        if self.path is None or not self._dirty:
            return
        try:
            write_durably(self.path, json.dumps(self.book).encode())
            self._dirty = False
        except OSError as e:
            logger.warning("cannot save the address book: %s", e)


class Reach:
    def __init__(self, transport, me: str, *, members: Callable[[], set[str]],
                 connected: Callable[[], set[str]], book: AddressBook,
                 rejoin: Callable[[str], Awaitable[None]], interval: float = 2.0, window: float = 5.0,
                 per_round: int = 16, dial_timeout: float = 2.5, clock: Callable[[], float] = time.monotonic):
        self.transport = transport
        self.me = me
        self.members = members
        self.connected = connected
        self.book = book
        self.rejoin = rejoin
        self.interval, self.window, self.per_round = interval, window, per_round
        self.dial_timeout = dial_timeout
        self._clock = clock
        self.confirmed: dict[str, float] = {}  # peer -> when it last answered us
        self.reports: dict[str, tuple[float, frozenset[bytes]]] = {}  # neighbour -> (when, the peers it reached)
        self.alive: dict[str, float] = {}  # member -> when it was last seen alive (by us or through a neighbour)
        self.lost: set[str] = set()
        self.split_since: float | None = None
        self.split_wall: float | None = None
        self.last_split: dict | None = None  # the last split that healed: when, how long, how many were lost
        self._redial: dict[str, tuple[float, float]] = {}  # lost peer -> (next attempt, backoff)
        self._isolated_since: float | None = None
        self._dialing: dict[str, asyncio.Task] = {}
        self._links: dict[str, tuple[Stream, float]] = {}  # peer -> (our reach/1.1.0 stream to it, its last ask)
        self._one_shot: set[str] = set()  # connected peers that serve reach/1.0.0 only (an older node)
        self.counters: collections.Counter = collections.Counter()
        self._started = clock()
        self._asks = TokenBuckets(rate=2.0, burst=10.0, clock=clock)
        self._log = RateLimitedLog(logger, interval=30.0)

    def span(self) -> float:
        """The window in effect: ``window``, or twice the time it takes to ask every connected member once, if
        longer (each round asks ``per_round`` of them: in a large swarm a member is asked every few rounds)."""
        n = len(self.connected())
        return max(self.window, 2 * self.interval * -(-n // self.per_round))

    # ------------------------------------------------------------------ the protocol
    async def start(self) -> None:
        await self.transport.serve(REACH_SPEC, self._on_ask)
        await self.transport.serve(REACH_KEPT_SPEC, self._on_asks)

    def reached(self) -> list[bytes]:
        """The peers we reached within half the window, most recent first (at most MAX_REPORTED): the asker keeps
        our answer for the other half, so a peer reached only through us is lost within one window, as one we
        stopped reaching ourselves."""
        now = self._clock()
        half = self.span() / 2
        fresh = sorted(((t, p) for p, t in self.confirmed.items() if now - t <= half), reverse=True)
        return [short(p) for _, p in fresh[:MAX_REPORTED]]

    async def _on_ask(self, stream: Stream) -> None:
        await self._answer(stream, await asyncio.wait_for(stream.read_required(), 10.0))

    async def _on_asks(self, stream: Stream) -> None:
        """reach/1.1.0: asks on one stream until the asker closes it, or asks nothing for ``keep_open``."""
        await self._on_ask(stream)
        while True:
            try:
                message = await asyncio.wait_for(stream.read(), self.keep_open())
            except asyncio.TimeoutError:
                return
            if message is None:
                return
            await self._answer(stream, message)

    def keep_open(self) -> float:
        """How long a kept stream may go without an ask: a few of our intervals (an asker of ours asks each
        member every interval while it keeps streams)."""
        return max(5.0, 3 * self.interval)

    async def _answer(self, stream: Stream, message) -> None:
        if message.kind != ASK:
            raise MalformedMessage("reach: expected ASK")
        if not self._asks.allow(stream.peer_id):
            raise ProtocolViolation("reach: asked too often", kind="rate_limited")
        if stream.peer_id in self.members():  # it asked: it reaches us (strangers are answered, not remembered)
            self.confirmed[stream.peer_id] = self._clock()
        await stream.send(ANSWER, self.reached())

    async def _open(self, peer_id: str, keep: bool) -> Stream:
        """A stream to ask ``peer_id`` on: reach/1.1.0 where we keep it (the peer's node may predate it: then
        reach/1.0.0, one ask a stream, for as long as the peer stays connected)."""
        if keep and peer_id not in self._one_shot:
            try:
                return await self.transport.open_stream(peer_id, REACH_KEPT_SPEC, timeout=self.interval)
            except TransportError:
                stream = await self.transport.open_stream(peer_id, REACH_SPEC, timeout=self.interval)
                self._one_shot.add(peer_id)
                return stream
        return await self.transport.open_stream(peer_id, REACH_SPEC, timeout=self.interval)

    async def _ask(self, peer_id: str, keep: bool = False) -> None:
        """Ask ``peer_id`` whom it reached, on a new stream or (``keep``) on the one kept from our last ask, which
        we keep again. A kept stream the peer has closed meanwhile (it restarted, or we asked later than its
        ``keep_open``) is replaced by a new one within the same ask."""
        reply, (stream, used) = None, self._links.pop(peer_id, (None, 0.0))
        if stream is not None and self._clock() - used > KEPT_IDLE:
            await stream.close()  # its server may be closing it: not asked on while it ends
            stream = None
        try:
            async with asyncio.timeout(self.interval):
                if stream is not None:
                    try:
                        await stream.send(ASK, None)
                        reply = await stream.read_required()
                    except TransportError:
                        await stream.close()
                        stream = None
                        self.counters["kept_streams_reopened"] += 1
                if reply is None:
                    stream = await self._open(peer_id, keep)
                    await stream.send(ASK, None)
                    reply = await stream.read_required()
        except (TimeoutError, TransportError, ProtocolViolation) as e:
            if stream is not None:
                await stream.close()
            self.counters["asks_failed"] += 1
            logger.debug("reach: %s did not answer: %s", peer_id, e)
            return
        body = reply.body
        if reply.kind != ANSWER or not isinstance(body, list) or len(body) > MAX_REPORTED \
                or not all(isinstance(x, bytes) and len(x) == 8 for x in body):
            await stream.close()
            self.transport.penalties.penalize(peer_id, "malformed", "reach: a malformed answer")
            return
        if keep and stream.spec.id == REACH_KEPT_SPEC.id:
            self._links[peer_id] = (stream, self._clock())
        else:
            await stream.close()
        now = self._clock()
        self.confirmed[peer_id] = now
        self.reports[peer_id] = (now, frozenset(body))
        self.counters["asks_answered"] += 1

    # ------------------------------------------------------------------ the verdict
    def evaluate(self) -> None:
        now = self._clock()
        span = self.span()
        members = self.members() - {self.me}
        for p in [p for p in self.confirmed if p not in members and now - self.confirmed[p] > span]:
            del self.confirmed[p]
        for p in [p for p in self.reports if p not in self.confirmed]:
            del self.reports[p]
        through: set[bytes] = set()
        for neighbour, (t, peers) in self.reports.items():
            if now - t <= span / 2:
                through |= peers
        reached = set()
        for p in members:
            if now - self.confirmed.get(p, -1e18) <= span or short(p) in through:
                reached.add(p)
                self.alive[p] = now
        for p in [p for p in self.alive if p not in members or now - self.alive[p] > KNOWN_HORIZON]:
            del self.alive[p]
        known = set(self.alive)
        self.lost = known - reached
        split = (now - self._started > span and len(self.lost) >= 2
                 and len(self.lost) >= SPLIT_FRACTION * len(known))
        if split and self.split_since is None:
            self.split_since, self.split_wall = now, time.time()
            self.counters["splits"] += 1
            logger.warning("split: %d of the %d members this node knows are reached neither by it nor by its "
                           "neighbours; re-dialling them at their remembered addresses", len(self.lost), len(known))
        elif not split and self.split_since is not None:
            lasted = now - self.split_since
            self.last_split = {"at": self.split_wall, "seconds": round(lasted, 1), "healed_at": time.time()}
            self.counters["heals"] += 1
            logger.info("split healed after %.1f s: %d of %d members reached again", lasted,
                        len(known) - len(self.lost), len(known))
            self.split_since = self.split_wall = None
            self._redial.clear()

    # ------------------------------------------------------------------ healing
    async def _redial_lost(self) -> None:
        now = self._clock()
        todo = []
        for p in sorted(self.lost):
            nxt, backoff = self._redial.get(p, (0.0, self.interval))
            if now >= nxt and self.book.get(p):
                fast = self.split_since is not None and now - self.split_since < FAST_REDIAL
                backoff = self.interval if fast else min(backoff * 2, MAX_BACKOFF)
                self._redial[p] = (now + backoff, backoff)
                todo.append(p)
        for p in [p for p in self._redial if p not in self.lost]:
            del self._redial[p]
        for p in todo[:self.per_round]:
            self._spawn_redial(p)

    def _spawn_redial(self, peer_id: str) -> None:
        """Dial in the background: the asking goes on while a dial into a partition waits for its timeout, and a
        dial still in flight when the partition heals connects on its next SYN."""
        if peer_id in self._dialing:
            return
        self._dialing[peer_id] = asyncio.get_running_loop().create_task(self._redial_one(peer_id))
        self._dialing[peer_id].add_done_callback(lambda t: self._dialing.pop(peer_id, None))

    async def _redial_one(self, peer_id: str) -> None:
        self.counters["redials"] += 1
        try:
            if peer_id in self.connected() and self._clock() - self.confirmed.get(peer_id, -1e18) > self.span():
                await self.transport.disconnect(peer_id)  # a connection through the partition: start afresh
            await self.transport.connect_peer(peer_id, self.book.get(peer_id), timeout=self.dial_timeout)
            await self.rejoin(peer_id)
        except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
            self._log.log(logging.INFO, ("redial", peer_id), "split: %s still unreachable: %s", peer_id, e)
            return
        self.counters["redials_ok"] += 1
        self.confirmed[peer_id] = self._clock()
        logger.info("split: reached %s again at its remembered address; re-bootstrapped through it", peer_id)

    async def run(self) -> None:
        rounds = 0
        while True:
            started = self._clock()
            members = self.members()
            connected = self.connected()
            candidates = [p for p in connected if p in members and p != self.me]
            targets = sorted(candidates, key=lambda p: self.confirmed.get(p, 0.0))[:self.per_round]
            # each of them asked every interval: one stream each, kept between asks
            keep = len(candidates) <= self.per_round
            stale = [self._links.pop(p)[0] for p in [p for p in self._links if p not in targets or not keep]]
            await asyncio.gather(*(stream.close() for stream in stale))
            self._one_shot &= connected
            await asyncio.gather(*(self._ask(p, keep) for p in targets))
            if targets and self._isolated_since is not None:
                self._isolated_since = None
                self._redial.clear()
            self.evaluate()
            if self.split_since is not None:
                await self._redial_lost()
            elif not targets and self.book.book and started - self._started > self.window:
                await self._rebootstrap()
            rounds += 1
            if rounds % 30 == 0:
                await asyncio.to_thread(self.book.save)
            await asyncio.sleep(max(0.0, self.interval - (self._clock() - started)))

    async def _rebootstrap(self) -> None:
        """No member connected (our bootstrap gone, or a restart after the swarm moved on): dial the members of the
        address book, most recently seen first, with backoff; the first that answers is joined through."""
        now = self._clock()
        if self._isolated_since is None:
            self._isolated_since = now
            logger.warning("no member connected: re-bootstrapping through the %d members of the address book",
                           len(self.book.book))
        todo = []
        for p in reversed(self.book.book):
            nxt, backoff = self._redial.get(p, (0.0, self.interval))
            if now >= nxt:
                fast = now - self._isolated_since < FAST_REDIAL
                backoff = self.interval if fast else min(backoff * 2, MAX_BACKOFF)
                self._redial[p] = (now + backoff, backoff)
                todo.append(p)
            if len(todo) >= 4:
                break
        self.counters["rebootstraps"] += 1
        for p in todo:
            self._spawn_redial(p)

    def close(self) -> None:
        for task in list(self._dialing.values()):
            task.cancel()
        self._links.clear()  # (their streams end with the transport, closed before us)
        self.book.save()

    # ------------------------------------------------------------------ views
    def view(self) -> dict:
        now = self._clock()
        return {
            "suspected": self.split_since is not None,
            "since": self.split_wall,
            "seconds": round(now - self.split_since, 1) if self.split_since is not None else None,
            "lost": len(self.lost),
            "known": len(self.alive),
            "lost_peers": sorted(self.lost)[:16],
            "reached_directly": sum(1 for t in self.confirmed.values() if now - t <= self.span()),
            "window_s": self.span(),
            "last_split": self.last_split,
            "address_book": len(self.book.book),
            **dict(self.counters),
        }
