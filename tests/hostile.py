"""A hostile peer for the loops' untrusted-input tests: our own transport and gossip in the test process, linked to
one node, publishing on a loop's topic whatever the test hands it (junk, forgeries, replays)."""

from __future__ import annotations

import asyncio

import msgpack

from swarmd.node.services import NodeContext
from swarmd.protocols.gossip import MSG, Gossip
from swarmproc import NodeProc, wait_for
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport


class HostilePeer:
    def __init__(self, tmp_path):
        self.transport = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
        self.peer_id = self.transport.peer_id
        self.gossip = Gossip(heartbeat=0.2)
        self._tmp = tmp_path
        self._heartbeat: asyncio.Task | None = None
        self._target: NodeProc | None = None
        self._topic = ""

    async def start(self, target: NodeProc, topic: str, max_size: int) -> None:
        await self.transport.start()
        await self.transport.connect(target.tcp_addr)
        await self.gossip.start(NodeContext(self.transport.identity, self.transport, self._tmp,
                                            lambda: [target.peer_id], None, lambda p: True))
        self._heartbeat = asyncio.create_task(self.gossip.run())
        self.gossip.subscribe(topic, max_size=max_size)
        self._target, self._topic = target, topic

    async def send(self, body, kind=None) -> None:
        """Sign ``body`` (bytes as they are, anything else msgpack-packed; with ``kind``, a wire registry kind, as a
        message of that kind, its schema not checked: junk of a known kind) as a message on the topic and push it
        down the link to the target node, past the validation our own gossip would apply before forwarding."""
        target = self._target.peer_id
        await asyncio.to_thread(wait_for, lambda: target in self.gossip.links, 20, "the hostile peer's link")
        data = as_message(body, kind)
        self.gossip.links[target].send(MSG, self.gossip.cache[self.gossip.publish(self._topic, data)].wire())

    async def send_as(self, author: Identity, body, kind=None) -> None:
        """Push a message on the topic authored and signed by ``author`` (a key that never connects: we relay it),
        past our own validation."""
        import time

        from swarmd.protocols.gossip import SIGN_DOMAIN, Message, _mid

        target = self._target.peer_id
        if target not in self.gossip.links:
            await asyncio.to_thread(wait_for, lambda: target in self.gossip.links, 20, "the hostile peer's link")
        data = as_message(body, kind)
        self._seq = getattr(self, "_seq", 0) + 1
        now = int(time.time() * 1000)
        raw = msgpack.packb([1, self._topic, author.peer_id, self._seq, now, data], use_bin_type=True)
        message = Message(_mid(raw), self._topic, author.peer_id, self._seq, now, data, raw,
                          author.sign(SIGN_DOMAIN + raw))
        link = self.gossip.links.get(target)
        if link is None:
            raise ConnectionError("the target dropped our link (banned?)")
        link.send(MSG, message.wire())

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            # a link with thousands of messages queued for a node that stopped reading them may not end at once:
            # an attacker leaves, it does not wait for its junk to drain
            await asyncio.wait_for(self.gossip.close(), 10)
        except asyncio.TimeoutError:
            pass
        await self.transport.close()


def as_message(body, kind=None) -> bytes:
    """A topic message's bytes: ``body`` as it is (bytes), or packed, as ``kind`` ({"k", "v", **body}) if given."""
    if isinstance(body, bytes):
        return body
    if kind is not None:
        body = {"k": kind.code, "v": kind.version, **body}
    return msgpack.packb(body)


def empty_map_bomb() -> bytes:
    """One CRDT frame just under 8 MiB of nested empty maps: as many as the decode budget lets through before it
    refuses the frame."""
    from swarmd.node.crdt_wire import PUSH
    from swarmd.transport.framing import HEADER, encode

    payload = encode(PUSH, {"ops": [[{}] * 1000] * 8000})
    return HEADER.pack(len(payload)) + payload


async def send_raw_frames(transport, peer_id: str, spec, frame: bytes, n: int, timeout: float = 60) -> None:
    """Write ``frame`` as it is on ``n`` streams at once and wait for the node to answer or reset each."""
    async def one() -> None:
        try:
            stream = await transport.open_stream(peer_id, spec, timeout=10)
            stream._writer.write(frame)
            await stream._writer.drain()
            await asyncio.wait_for(stream._reader.read(), timeout)
        except Exception:  # noqa: BLE001 - the node resets the stream: refused
            pass

    await asyncio.gather(*(one() for _ in range(n)))

