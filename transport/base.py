"""The transport interface the rest of swarmd is written against, and the pieces every backend shares.

A backend (today: :class:`transport.p2pd.P2PDaemonTransport`, the go-libp2p daemon driven through hivemind's
``P2P``) provides connections, versioned protocol streams, peer listing, addresses and reachability. Handlers that
serve a protocol receive a :class:`Stream`; whatever they raise is contained by :class:`HandlerRunner`: a
:class:`~transport.errors.ProtocolViolation` penalises the remote peer, nothing reaches the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import logging
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from swarmd.transport.errors import FrameTooLarge, ProtocolViolation, StreamClosed, TransportError
from swarmd.transport.framing import HEADER, ProtocolSpec, decode, frame, read_body, read_header
from swarmd.transport.penalties import PeerPenalties, RateLimitedLog
from swarmd.transport.wire import WIRE

logger = logging.getLogger(__name__)

YIELD_EVERY = 16  # a stream read yields to the event loop once per this many frames
THREAD_DECODE = 1 << 20  # frames over this many bytes are decoded in a worker thread
BUDGETED = 64 << 10  # frames over this many bytes reserve from the transport's InboundBudget before they are read
DECODE_FACTOR = 5  # what a frame may cost while it is read and decoded: itself plus 4x (the decode budget's worst)


# Large frames are decoded one at a time, in one thread: its memory comes from one malloc arena (every thread of a
# pool would keep its own), and with the InboundBudget at most one frame is ever being decoded anyway.
_DECODER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmd-decode")


def _decode(payload: bytes | bytearray, spec: ProtocolSpec):
    """(message, None) or (None, the refusal, stripped of its traceback and context). The message's body has been
    checked against its kind's schema in the wire registry.

    A refusal's traceback (and the context of the error it was raised from) holds the decoder's frames and so the
    payload; raised on through ``asyncio.wait_for`` it joins a reference cycle with the waiting task that only a
    full collection frees: 24 refused 8 MiB frames kept 183 MB alive that way. Stripped, the payload goes as soon
    as the stream's read returns."""
    try:
        message = decode(payload, spec)
        if WIRE.declared(spec):  # every protocol of ours is: the frame's body checked against its kind's schema
            WIRE.check_frame(spec, message.kind, message.body)
        return message, None
    except ProtocolViolation as e:
        refusal = e
    refusal.__traceback__ = refusal.__context__ = refusal.__cause__ = None
    return None, refusal


class InboundBudget:
    """Bytes that large inbound frames may hold at once, reserved before a frame's body is read: a frame waits
    (its stream is not read, so the sender is held back) until the others have been decoded. So 64 streams each
    sending an 8 MiB frame of empty maps cost at most ``capacity``, not 64 x (8 MiB + 4 x 8 MiB).

    ``capacity`` is a ceiling, not a promise: one frame larger than it still runs alone. Frames are served in the
    order they asked (FIFO): a frame that fits is still queued behind one that waits, so a peer's large frame is
    not held back for good by other streams' small ones that would each fit beside what is being decoded."""

    def __init__(self, capacity: int = 48 << 20):
        self.capacity = capacity
        self.used = 0
        self.waits = 0  # frames that had to wait their turn
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    async def acquire(self, n: int) -> int:
        n = min(n, self.capacity)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
            return n
        self.waits += 1
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((n, waiter))
        try:
            await waiter  # resolved when granted: its share is counted in ``used`` by then
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.used -= n  # granted as we were cancelled: give it back
            else:
                waiter.cancel()  # still queued: skipped when its turn comes
            self._grant()
            raise
        return n

    def release(self, n: int) -> None:
        """Synchronous, so a cancelled reader's ``finally`` always gives its share back."""
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        """Serve the queue from its head while the head fits (strict order: the head that does not fit waits for
        more releases, and everything behind it with it)."""
        while self._waiters:
            n, waiter = self._waiters[0]
            if waiter.done():  # cancelled while queued
                self._waiters.popleft()
                continue
            if self.used + n > self.capacity:
                return
            self._waiters.popleft()
            self.used += n
            waiter.set_result(None)


class PathType(str, enum.Enum):
    DIRECT = "direct"
    PUNCHED = "hole-punched"  # direct, through NATs, on a connection opened by hole punching
    RELAYED = "relayed"
    NONE = "none"

    @property
    def direct(self) -> bool:
        return self in (PathType.DIRECT, PathType.PUNCHED)


class Reachability(str, enum.Enum):
    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ConnectedPeer:
    peer_id: str
    addrs: tuple[str, ...]
    path: PathType
    relay: str | None = None  # peer id of the relay when path is RELAYED


@dataclass
class TransportStats:
    """Traffic on swarmd's own protocol streams (the DHT's RPCs are counted separately, by the DHT)."""

    bytes_in: int = 0
    bytes_out: int = 0
    messages_in: Counter = field(default_factory=Counter)  # by protocol id
    messages_out: Counter = field(default_factory=Counter)
    bytes_in_by_protocol: Counter = field(default_factory=Counter)
    bytes_out_by_protocol: Counter = field(default_factory=Counter)
    streams_in: int = 0
    streams_out: int = 0
    errors: Counter = field(default_factory=Counter)  # by kind


class Stream:
    """A bidirectional stream to one peer on one protocol, speaking framed msgpack messages."""

    def __init__(
        self,
        peer_id: str,
        spec: ProtocolSpec,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stats: TransportStats,
        *,
        remote_addr: str | None = None,
        budget: InboundBudget | None = None,
    ):
        self.peer_id = peer_id
        self._budget = budget  # the transport's, shared by its streams (None: large frames are not budgeted)
        self.spec = spec
        self.remote_addr = remote_addr  # the connection's remote multiaddr, where the backend knows it
        self._reads = 0
        self._reader = reader
        self._writer = writer
        self._stats = stats

    async def read(self):
        """The next message, or None at a clean end of stream. Raises ProtocolViolation / StreamClosed, and
        asyncio.TimeoutError if the peer sends nothing for the protocol's ``idle_timeout``.

        Fair to everything else on the event loop: reading frames already buffered does not yield, so every
        ``YIELD_EVERY``-th read yields once, and a frame over ``THREAD_DECODE`` bytes is decoded in a worker thread
        (the interpreter hands the loop its turn every few milliseconds while a big frame decodes)."""
        self._reads += 1
        if self._reads % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        async with asyncio.timeout(self.spec.idle_timeout):
            length = await read_header(self._reader, self.spec)
        if length is None:
            return None
        reserved = 0
        if length > BUDGETED and self._budget is not None:
            reserved = await self._budget.acquire(length * DECODE_FACTOR)
        try:
            async with asyncio.timeout(self.spec.idle_timeout):
                payload = await read_body(self._reader, length, self.spec)
            self._stats.bytes_in += HEADER.size + len(payload)
            self._stats.bytes_in_by_protocol[self.spec.id] += HEADER.size + len(payload)
            self._stats.messages_in[self.spec.id] += 1
            if len(payload) <= THREAD_DECODE:
                message, refusal = _decode(payload, self.spec)
            else:
                message, refusal = await asyncio.get_running_loop().run_in_executor(_DECODER, _decode, payload,
                                                                                   self.spec)
            del payload  # not held by the traceback of the refusal raised below
            if refusal is not None:
                raise refusal
            return message
        finally:
            if reserved:
                self._budget.release(reserved)

    async def read_required(self):
        message = await self.read()
        if message is None:
            raise StreamClosed(f"{self.spec.id}: peer closed the stream before replying")
        return message

    async def send(self, kind: int, body: Any) -> None:
        data = frame(kind, body, self.spec)
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as e:
            raise StreamClosed(f"{self.spec.id}: write failed: {e}") from None
        self._stats.bytes_out += len(data)
        self._stats.bytes_out_by_protocol[self.spec.id] += len(data)
        self._stats.messages_out[self.spec.id] += 1

    async def close(self, linger: float = 0.0) -> None:
        """Always closes; an error here only means the close was not graceful.

        Close protocol (measured, see tests/test_transport.py): the p2p daemon may drop the last bytes written on a
        stream whose socket is half-closed or closed before the peer has read them (over QUIC 8 of 40 replies were
        lost). So the side that writes last (the server, after its reply) lingers: it waits up to ``linger``
        seconds for the peer to close first, and the requester closes as soon as it has read the reply. Never
        write a final message and close without waiting for an answer."""
        if linger > 0:
            try:
                async with asyncio.timeout(linger):
                    while await self._reader.read(65536):
                        pass  # discard: nothing more was asked of the peer
            except (OSError, TimeoutError, RuntimeError, asyncio.IncompleteReadError):
                pass
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (OSError, asyncio.TimeoutError, RuntimeError):
            pass

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


StreamHandler = Callable[[Stream], Awaitable[None]]


class HandlerRunner:
    """Runs a protocol handler for one inbound stream and contains every failure.

    Error handling: a ProtocolViolation penalises the peer and is logged (rate limited); a TransportError (peer went
    away) is counted and logged at debug level; any other exception is our bug: logged with its traceback, rate
    limited, and the stream is closed. Nothing propagates to the caller.

    Stream budget: ``max_streams`` inbound streams at once, ``max_streams_per_peer`` per peer. ``has_standing``
    (set by the node: a swarm member, a bootstrap peer) splits it: peers without standing (fresh keys cost
    nothing) hold at most ``max_streams - reserved`` together and ``max_streams_per_stranger`` each, so the
    ``reserved`` part is always there for the swarm's members; when the whole budget is full, a member's stream
    evicts a stranger's (the oldest of the stranger holding the most). A peer over its own cap is at fault:
    refused and penalised; one refused because the budget is full is not (others filled it): refused, counted.
    """

    def __init__(self, penalties: PeerPenalties, stats: TransportStats, linger: float = 5.0, *,
                 max_streams: int = 512, max_streams_per_peer: int = 64, reserved: int = 256,
                 max_streams_per_stranger: int = 16):
        self.linger = linger
        self.penalties = penalties
        self.stats = stats
        self.max_streams = max_streams
        self.max_streams_per_peer = max_streams_per_peer
        self.reserved = reserved
        self.max_streams_per_stranger = max_streams_per_stranger
        self.has_standing: Callable[[str], bool] = lambda peer: True  # without a node: everyone, one budget
        self.open: Counter = Counter()  # inbound streams being handled, per peer
        self.total_open = 0
        self.strangers_open = 0
        # the handler tasks of strangers' streams, per stranger, oldest first (what a member's stream evicts)
        self._strangers: dict[str, dict[asyncio.Task, None]] = {}
        self._bug_log = RateLimitedLog(logger, interval=30.0)
        self._limit_log = RateLimitedLog(logger, interval=30.0)

    def _admit(self, peer: str, standing: bool, spec_id: str) -> bool:
        cap = self.max_streams_per_peer if standing else self.max_streams_per_stranger
        if self.open[peer] >= cap:
            self.stats.errors["stream_limit"] += 1
            self.penalties.penalize(peer, "rate_limited", f"too many inbound streams at once (over {cap})")
            self._limit_log.log(logging.WARNING, ("peer", peer), "refused a %s stream from %s: %d open from it "
                                "(at most %d)", spec_id, peer, self.open[peer], cap)
            return False
        if not standing and self.strangers_open >= self.max_streams - self.reserved:
            self.stats.errors["stream_limit_strangers"] += 1
            self._limit_log.log(logging.WARNING, "strangers", "refused a %s stream from %s: peers without standing "
                                "hold %d streams, their share", spec_id, peer, self.strangers_open)
            return False
        if self.total_open >= self.max_streams and not (standing and self._evict()):
            self.stats.errors["stream_limit"] += 1
            self._limit_log.log(logging.WARNING, "all", "refused a %s stream from %s: %d open in all", spec_id,
                                peer, self.total_open)
            return False
        return True

    def _evict(self) -> bool:
        """Close the oldest stream of the stranger holding the most, to make room for a member's."""
        if not self._strangers:
            return False
        peer = max(self._strangers, key=lambda p: len(self._strangers[p]))
        task = next(iter(self._strangers[peer]))
        self._release(task, peer, False)
        task.cancel()
        self.stats.errors["stream_evicted"] += 1
        self._limit_log.log(logging.INFO, "evict", "closed a stream of %s (no standing) to make room for a "
                            "member's", peer)
        return True

    def _hold(self, task: asyncio.Task | None, peer: str, standing: bool) -> None:
        self.open[peer] += 1
        self.total_open += 1
        if not standing:
            self.strangers_open += 1
            self._strangers.setdefault(peer, {})[task] = None

    def _release(self, task: asyncio.Task | None, peer: str, standing: bool) -> None:
        if not standing:
            held = self._strangers.get(peer)
            if held is None or task not in held:
                return  # evicted: released then
            del held[task]
            if not held:
                del self._strangers[peer]
            self.strangers_open -= 1
        self.total_open -= 1
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]

    async def run(self, handler: StreamHandler, stream: Stream) -> None:
        self.stats.streams_in += 1
        linger = 0.0  # an offender or a failed stream is closed at once; a served one lingers for the reply
        peer = stream.peer_id
        task = asyncio.current_task()
        standing = counted = False
        try:
            if self.penalties.is_banned(peer):
                self.stats.errors["banned_peer"] += 1
                return
            standing = bool(self.has_standing(peer))
            if not self._admit(peer, standing, stream.spec.id):
                return
            self._hold(task, peer, standing)
            counted = True
            await handler(stream)
            linger = self.linger
        except ProtocolViolation as e:
            self.stats.errors[e.kind] += 1
            self.penalties.penalize(stream.peer_id, e.kind, str(e))
        except (TransportError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            self.stats.errors["stream_failed"] += 1
            logger.debug("%s from %s failed: %r", stream.spec.id, stream.peer_id, e)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.errors["handler_bug"] += 1
            self._bug_log.log(logging.ERROR, stream.spec.id, "handler for %s crashed", stream.spec.id, exc_info=True)
        finally:
            if counted:
                self._release(task, peer, standing)
            await stream.close(linger=linger)


class Transport(Protocol):
    """What the node, the DHT and the protocols need from a libp2p host."""

    peer_id: str
    stats: TransportStats
    penalties: PeerPenalties
    inbound: InboundBudget  # shared by the host's streams: large frames being read and decoded

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def connect(self, maddr: str, *, timeout: float) -> str:
        """Dial a multiaddr ending in /p2p/<id>; returns the peer id. Raises PeerUnreachable."""

    async def connect_peer(self, peer_id: str, addrs: list[str], *, timeout: float) -> None: ...

    async def disconnect(self, peer_id: str) -> None: ...

    async def adopt(self, peer_id: str, sock: socket.socket, *, dialer: bool, timeout: float) -> None:
        """Make a TCP socket already connected to the peer's machine (hole-punched) our connection to the peer;
        both sides call it, one as dialer. The peer's identity is checked as on any dial."""

    async def redial(self, peer_id: str, addrs: list[str], *, timeout: float) -> None:
        """Replace our connections to the peer with a new one to ``addrs``."""

    async def open_stream(self, peer_id: str, spec: ProtocolSpec, *, timeout: float) -> Stream: ...

    async def serve(self, spec: ProtocolSpec, handler: StreamHandler) -> None: ...

    def set_standing(self, has_standing: Callable[[str], bool]) -> None:
        """Which peers the inbound stream budget reserves room for (see :class:`HandlerRunner`)."""

    async def peers(self) -> list[ConnectedPeer]: ...

    async def addresses(self) -> list[str]:
        """Multiaddrs other peers can dial, each ending in /p2p/<our id>."""

    @property
    def reachability(self) -> Reachability: ...


def path_of(addrs: list[str] | tuple[str, ...]) -> tuple[PathType, str | None]:
    """Direct unless every address the connection uses goes through a circuit relay."""
    if not addrs:
        return PathType.DIRECT, None
    relayed = [a for a in addrs if "/p2p-circuit" in a]
    if len(relayed) < len(addrs):
        return PathType.DIRECT, None
    relay = None
    head = relayed[0].split("/p2p-circuit")[0]
    if "/p2p/" in head:
        relay = head.rsplit("/p2p/", 1)[1]
    return PathType.RELAYED, relay


__all__ = [
    "ConnectedPeer",
    "FrameTooLarge",
    "HandlerRunner",
    "PathType",
    "Reachability",
    "Stream",
    "StreamHandler",
    "Transport",
    "TransportStats",
    "path_of",
]
