"""Pushing the replicated state's ops to peers (a part of ``node.replication.Replicator``).

A local write is pushed at once to every connected member; an op new to us that a peer pushed goes on to a few
random peers (``relay_fanout``), an epidemic push. Small pushes go over a stream kept to each peer. An ACK that
counts ops of ours as refused tells the writer that its writes do not spread (``refused_by``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from swarmd.crdt import Op
from swarmd.node.crdt_wire import ACK, CRDT_SPEC, MAX_PUSH_OPS, PUSH, PUSH_BYTES
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError

logger = logging.getLogger("swarmd.node.replication")  # the replicator's one logger, whichever part logs

# a push of few bytes (a node's progress record, a member op, their relays) goes over a stream kept to that peer, not
# a new one: a p2p stream opened, used for one PUSH and ACK and closed costs both nodes and their p2p daemons 3.0 ms
# of CPU against 0.37 ms on a kept stream (loopback, 2-core machine), and an 8-node DiLoCo swarm pushes about 20
# times a node a round (each node's progress record, to everyone and relayed on), which its p2p daemon and event loop
# carry as a fixed cost of every round (``docs/benchmarks/crdt.md``, Kept push streams)
KEPT_PUSH_BYTES = 64 << 10  # op bodies: a larger push (a joiner's catch-up, a base) gets a stream of its own
KEPT_REPLY = 5.0  # s: an ACK later than this on a kept stream: the stream is taken for broken (a partition, a peer
# restarted), closed, and the push goes over a new stream, with the usual timeouts
KEPT_IDLE = 20.0  # s: a kept stream unused this long is closed (the responder stops waiting for the next at 30 s)


class Pushing:
    """The push half of ``Replicator`` (a mixin: it uses the replicator's transport, clock, counters, peers and
    logs, and its ``_kept``, ``_outbox``, ``_relays``, ``refused_by`` and ``last_sync``)."""

    async def _push(self, peer_id: str, ops: list[Op]) -> None:
        """Push ``ops`` to ``peer_id``: a few bytes over the stream kept to it (``KEPT_PUSH_BYTES``), opened on the
        first push; a kept stream that fails or answers late is closed and the push goes over a new one (the ops
        are idempotent: one the peer got twice is acked as known)."""
        if self._private_from(peer_id):
            self._refuse_outsider(peer_id, "outbound")
            return
        small = sum(len(op.body) for op in ops) <= KEPT_PUSH_BYTES
        kept = self._kept.pop(peer_id, None) if small else None
        if kept is not None:
            stream, used = kept
            if self.clock.monotonic() - used < KEPT_IDLE:  # else its responder may be ending it: not used
                try:
                    await self._push_on(stream, ops, reply_timeout=KEPT_REPLY)
                    await self._keep(peer_id, stream)
                    return
                except (TransportError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                    self.counters["kept_push_failed"] += 1
                    logger.debug("push to %s over the kept stream failed: %r; over a new one", peer_id, e)
                except BaseException:
                    await stream.close()
                    raise
            await stream.close()
        stream = await self.transport.open_stream(peer_id, CRDT_SPEC, timeout=10.0)
        self.counters["push_streams_opened"] += 1
        keep = False
        try:
            await self._push_on(stream, ops)
            keep = small
        finally:
            if keep:
                await self._keep(peer_id, stream)
            else:
                await stream.close()

    async def _keep(self, peer_id: str, stream: Stream) -> None:
        """``stream`` becomes the one kept to ``peer_id``, unless another push to it kept one meanwhile."""
        if peer_id in self._kept:
            await stream.close()
        else:
            self._kept[peer_id] = (stream, self.clock.monotonic())

    async def _close_idle(self, peers: list[str]) -> None:
        """Close the kept streams unused for ``KEPT_IDLE`` and those to peers no longer among ``peers``."""
        now, connected = self.clock.monotonic(), set(peers)
        for peer_id, (stream, used) in list(self._kept.items()):
            if now - used >= KEPT_IDLE or peer_id not in connected:
                del self._kept[peer_id]
                await stream.close()

    async def _push_on(self, stream: Stream, ops: list[Op], reply_timeout: float = 30.0) -> None:
        batches, size = [[]], 0
        for op in ops:  # at most MAX_PUSH_OPS ops and PUSH_BYTES of bodies a frame (bases are up to 64 KiB)
            if batches[-1] and (len(batches[-1]) == MAX_PUSH_OPS or size + len(op.body) > PUSH_BYTES):
                batches.append([])
                size = 0
            batches[-1].append(op)
            size += len(op.body)
        for batch in batches if ops else []:
            await stream.send(PUSH, {"ops": [o.wire() for o in batch]})
            reply = await asyncio.wait_for(stream.read_required(), reply_timeout)
            if reply.kind != ACK:
                raise MalformedMessage("crdt: expected ACK")
            self.counters["ops_sent"] += len(batch)
            self._note_ack(stream.peer_id, batch, reply.body)

    def _note_ack(self, peer_id: str, batch: list[Op], ack: Any) -> None:
        """What a peer refused of a batch that carried our own ops: the writer learns that its writes do not spread
        (``refused_by`` in /status, ``swarmd doctor``). An ACK counts the whole batch; ops of ours that a peer had
        already are acked as applied or known, never as refused, so a refusal of a batch of ours alone is ours."""
        if not isinstance(ack, dict) or type(ack.get("rejected")) is not int or ack["rejected"] <= 0:
            return
        me = self.identity.peer_id
        ours = sum(op.author == me for op in batch)
        if not ours:
            return
        n = min(ours, ack["rejected"])
        if peer_id not in self.last_sync:
            # a peer we never synced with may lack our earlier ops (it refuses a later one as unknown_author): a
            # sync brings them, and only what it refuses after one counts
            self.counters["own_ops_refused_before_sync"] += n
            self.sync_soon(peer_id)
            return
        entry = self.refused_by.setdefault(peer_id, {"ops": 0, "at": 0.0})
        entry["ops"] += n
        entry["at"] = self.clock.time()
        self.counters["own_ops_refused"] += n
        self._log.log(logging.WARNING, ("refused_by", peer_id), "crdt: %s refused %d of our op(s) (it refused %d "
                      "so far): our writes may not reach the swarm; see its log and `swarmd doctor`", peer_id, n,
                      entry["ops"])
        if len(self.refused_by) > 256:
            self.refused_by.pop(min(self.refused_by, key=lambda p: self.refused_by[p]["at"]))

    async def _push_loop(self) -> None:
        sem = asyncio.Semaphore(16)

        async def push_one(peer_id: str, ops: list[Op]) -> None:
            async with sem:
                try:
                    await self._push(peer_id, ops)
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    self.counters["push_failures"] += 1
                    logger.debug("push to %s failed: %s (anti-entropy will repair)", peer_id, e)

        while True:
            await self._outbox_event.wait()
            self._outbox_event.clear()
            ops, self._outbox = self._outbox, []
            relays, self._relays = self._relays, []
            peers = self._peers()
            batches: dict[str, list[Op]] = {p: list(ops) for p in peers} if ops else {}
            if ops:
                self.counters["pushes"] += 1
            for op, came_from in relays:
                # an epidemic push: each new op goes on to a few random peers other than the one it came from and
                # its author, so in a swarm too large for everyone to be connected it crosses the graph in hops of
                # one round trip, not of one anti-entropy interval (a peer that has it already acks it as known)
                others = [p for p in peers if p != came_from and p != op.author]
                for p in self._rng.sample(others, min(self.relay_fanout, len(others))):
                    batches.setdefault(p, []).append(op)
                self.counters["ops_relayed"] += 1
            if batches:
                await asyncio.gather(*(push_one(p, batch) for p, batch in batches.items()))
