"""Where pubsub messages wait: a topic's state and its subscriber's bounded receive queue (:class:`Topic`,
:class:`Subscription`), and a peer's outbound link with its bounded send queue, drained by one writer task
(:class:`PeerLink`). What overflows either queue is dropped and counted, never silently lost; the mesh that fills
them is :mod:`protocols.gossip`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Any

from swarmd.protocols.gossip_message import SUB, Message, Validator
from swarmd.transport.base import Stream
from swarmd.transport.errors import ProtocolViolation, TransportError

# pubsub's one logger, under the name operators already filter on (protocols.gossip's)
logger = logging.getLogger("swarmd.protocols.gossip")

KEEPALIVE = 30.0  # a link with nothing to send says SUB [] this often, so the peer's idle timeout never closes it


@dataclass
class Topic:
    name: str
    max_size: int
    validator: Validator | None
    queue: asyncio.Queue | None  # None: read over HTTP only (the ring buffer below)
    mesh: set[str] = field(default_factory=set)
    delivered: int = 0
    dropped_full: int = 0
    rejected: int = 0
    ignored: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # for HTTP readers
    recent_seq: int = 0


class Subscription:
    """Async iterator over accepted messages of one topic."""

    def __init__(self, topic: Topic):
        self._topic = topic

    def __aiter__(self):
        return self

    async def __anext__(self) -> Message:
        return await self._topic.queue.get()

    def get_nowait(self) -> Message:
        return self._topic.queue.get_nowait()


class PeerLink:
    """Our outbound stream to one peer, with a bounded send queue drained by one writer task."""

    def __init__(self, peer_id: str, stream: Stream, limit: int, counters: collections.Counter):
        self.peer_id = peer_id
        self.stream = stream
        self.queue: collections.deque = collections.deque()
        self.limit = limit
        self.counters = counters
        self.event = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.alive = True

    def send(self, kind: int, body: Any) -> None:
        if len(self.queue) >= self.limit:
            self.queue.popleft()
            self.counters["send_queue_dropped"] += 1
        self.queue.append((kind, body))
        self.event.set()

    async def run(self) -> None:
        try:
            while True:
                try:
                    await asyncio.wait_for(self.event.wait(), KEEPALIVE)
                except asyncio.TimeoutError:
                    self.queue.append((SUB, []))
                self.event.clear()
                while self.queue:
                    kind, body = self.queue.popleft()
                    await self.stream.send(kind, body)
        except (TransportError, ProtocolViolation, ConnectionError) as e:
            logger.debug("pubsub link to %s closed: %s", self.peer_id, e)
        finally:
            self.alive = False
            await self.stream.close()

