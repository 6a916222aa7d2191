"""Hello (``/swarmd/hello/1.0.0``): its wire messages, and both sides of the exchange that swaps sealed node records
over a direct stream, so a newcomer is visible to every member it greets at once, not a poll later; a member passes a
newcomer's record on one hop (INTRODUCE) over the connections it already has.

:class:`HelloExchange` is a part of :class:`~dht.discovery.Discovery` (its methods run on the Discovery, whose
transport, identity, config, counters, member table and task set they use); what a received record must pass to
become a member is the member table's (``dht/members.py``)."""

from __future__ import annotations

import asyncio
import logging

from swarmd.dht.records import seal
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, PeerUnreachable, ProtocolViolation, TransportError
from swarmd.transport.framing import ProtocolSpec, unpack_record
from swarmd.transport.wire import WIRE, Bytes, Map, Nil, OneOf

logger = logging.getLogger("swarmd.dht.discovery")  # one log name for all of discovery, whichever part writes

HELLO, HELLO_ACK, INTRODUCE = 1, 2, 3
HELLO_SPEC = ProtocolSpec("hello", "1.0.0", max_frame=16 * 1024, kinds=frozenset({HELLO, HELLO_ACK, INTRODUCE}))
MAX_RECORD = 8 * 1024
_ENVELOPE = Map.of(p=Bytes(MAX_RECORD), s=Bytes(exact=64))  # a record sealed by its peer (dht.records.seal)
_EXAMPLE_ENVELOPE = {"p": b"\x81\xa4peer\xa4(id)", "s": bytes(64)}
WIRE.frame(HELLO_SPEC, HELLO, "hello.hello", _ENVELOPE, _EXAMPLE_ENVELOPE, signed="swarmd/envelope/v1",
           doc="the greeter's own sealed node record")
WIRE.frame(HELLO_SPEC, HELLO_ACK, "hello.ack", OneOf((_ENVELOPE, Nil())), _EXAMPLE_ENVELOPE,
           signed="swarmd/envelope/v1", doc="the greeted node's sealed record (nil after an INTRODUCE)")
WIRE.frame(HELLO_SPEC, INTRODUCE, "hello.introduce", _ENVELOPE, _EXAMPLE_ENVELOPE, signed="swarmd/envelope/v1",
           doc="a newcomer's own sealed record, passed on one hop by a member it greeted")


class HelloExchange:
    """Both sides of hello and introduce (a part of ``Discovery``, on its state)."""

    async def _hello(self, peer_id: str) -> None:
        envelope = seal(self.identity, (await self.my_record()).to_wire())
        async with await self.transport.open_stream(peer_id, HELLO_SPEC, timeout=self.config.dial_timeout) as stream:
            await stream.send(HELLO, envelope)
            try:
                reply = await asyncio.wait_for(stream.read_required(), self.config.dial_timeout)
            except asyncio.TimeoutError:  # a TransportError like any unreachable peer's (it escaped the callers)
                raise PeerUnreachable(f"{peer_id} did not answer our hello within "
                                      f"{self.config.dial_timeout:.0f} s") from None
            if reply.kind != HELLO_ACK:
                raise MalformedMessage("hello: expected HELLO_ACK")
            try:
                self._accept_envelope(peer_id, reply.body)
            except ProtocolViolation as e:
                self.transport.penalties.penalize(peer_id, e.kind, str(e))
                self.transport.stats.errors[e.kind] += 1
                raise
        self._greeted.add(peer_id)
        self.counters["hello_out"] += 1
        self._on_greeted(peer_id)

    async def _on_hello(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10.0)
        if message.kind == INTRODUCE:
            # honest members introduce every newcomer they meet: a generous allowance, and no penalty past it
            if self._introduce_rate.allow(stream.peer_id):
                await self._on_introduce(stream, message.body)
            else:
                self.counters["introduced_dropped"] = self.counters.get("introduced_dropped", 0) + 1
            return
        if not self._hello_rate.allow(stream.peer_id):
            raise ProtocolViolation("hello: too many hellos", kind="rate_limited")
        if message.kind != HELLO:
            raise MalformedMessage("hello: expected HELLO")
        is_new = self._accept_envelope(stream.peer_id, message.body)
        self._greeted.add(stream.peer_id)  # they know us: they just got our record in the reply
        self.counters["hello_in"] += 1
        self._on_greeted(stream.peer_id)
        await stream.send(HELLO_ACK, seal(self.identity, (await self.my_record()).to_wire()))
        if is_new:
            self._spawn(self._introduce(message.body, exclude=stream.peer_id))

    async def _on_introduce(self, stream: Stream, envelope) -> None:
        """A member tells us about a newcomer it has just met: the newcomer's own sealed record (one hop only)."""
        if not isinstance(envelope, dict) or not isinstance(envelope.get("p"), bytes):
            raise MalformedMessage("introduce: body must be a sealed record")
        claimed = unpack_record(envelope["p"], max_size=MAX_RECORD)
        peer_id = claimed.get("peer") if isinstance(claimed, dict) else None
        if not isinstance(peer_id, str):
            raise MalformedMessage("introduce: record without a peer id")
        self._accept_envelope(peer_id, envelope, source="introduced")  # verified against the newcomer's own key
        self.counters["introduced_in"] += 1
        await stream.send(HELLO_ACK, None)

    async def _introduce(self, envelope, exclude: str) -> None:
        """Pass a newcomer's record to the members we are connected to, so it is visible everywhere at once
        (over connections that already exist, instead of the newcomer dialing every member first)."""
        connected = {p.peer_id for p in await self.transport.peers()}
        targets = [p for p in self._greeted if p != exclude and p in connected]
        sem = asyncio.Semaphore(16)

        async def one(peer_id: str) -> None:
            async with sem:
                try:
                    async with await self.transport.open_stream(peer_id, HELLO_SPEC, timeout=5.0) as stream:
                        await stream.send(INTRODUCE, envelope)
                        await asyncio.wait_for(stream.read_required(), 5.0)
                    self.counters["introduced_out"] += 1
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    logger.debug("could not introduce a newcomer to %s: %s", peer_id, e)

        await asyncio.gather(*(one(p) for p in targets))
