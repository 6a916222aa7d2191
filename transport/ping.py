"""``/swarmd/ping/1.0.0``: round-trip time to a peer over a fresh stream (what `swarmd peers` shows as latency)."""

from __future__ import annotations

import asyncio
import os

from swarmd.transport import clock
from swarmd.transport.base import Stream, Transport
from swarmd.transport.errors import MalformedMessage, PeerUnreachable, ProtocolViolation
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.wire import WIRE, Bytes

PING, PONG = 1, 2
PING_SPEC = ProtocolSpec("ping", "1.0.0", max_frame=64, kinds=frozenset({PING, PONG}))
NONCE_SIZE = 8
WIRE.frame(PING_SPEC, PING, "ping.ping", Bytes(exact=NONCE_SIZE), bytes(range(NONCE_SIZE)), doc="a random nonce")
WIRE.frame(PING_SPEC, PONG, "ping.pong", Bytes(exact=NONCE_SIZE), bytes(range(NONCE_SIZE)), doc="the same nonce")


async def serve_ping(transport: Transport) -> None:
    async def handler(stream: Stream) -> None:
        message = await stream.read_required()
        if message.kind != PING or not isinstance(message.body, bytes) or len(message.body) != NONCE_SIZE:
            raise MalformedMessage("ping: body must be an 8-byte nonce")
        await stream.send(PONG, message.body)

    await transport.serve(PING_SPEC, handler)


async def ping(transport: Transport, peer_id: str, *, timeout: float = 5.0) -> float:
    """Seconds for one PING/PONG exchange on an open stream (stream setup not included).

    Raises PeerUnreachable if the whole exchange takes longer than ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            async with await transport.open_stream(peer_id, PING_SPEC, timeout=timeout) as stream:
                nonce = os.urandom(NONCE_SIZE)
                now = clock.current().monotonic  # the system's clock, or virtual time in a simulation
                start = now()
                await stream.send(PING, nonce)
                reply = await stream.read_required()
                rtt = now() - start
    except TimeoutError:
        raise PeerUnreachable(f"ping to {peer_id} timed out after {timeout:.0f} s") from None
    if reply.kind != PONG or reply.body != nonce:
        raise ProtocolViolation("ping: wrong pong", kind="malformed")
    return rtt
