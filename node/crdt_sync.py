"""Anti-entropy for the replicated state (a part of ``node.replication.Replicator``).

Every ``sync_interval``, with a random connected member (and at once with a peer named by ``sync_soon``: one just
greeted, one that pushed ops whose author we lack), we page through the buckets where its state differs from ours
(``node.crdt_wire``): we pull what we lack and push what it lacks, so a node that was offline or just joined catches
up from any peer. The same loop rewrites the op log when restated ops outnumber the live ones and drops held ops
past their time.
"""

from __future__ import annotations

import asyncio
import logging

from swarmd.node.crdt_wire import (
    CRDT_SPEC, ENTRIES, MAX_PAGES, MAX_WANTS, OPS, PUSH_BYTES, SYNC, SYNC_BATCH, WANT, parse_entries,
)
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError


class Syncing:
    """The anti-entropy half of ``Replicator`` (a mixin: it uses the replicator's store, transport, clock, counters,
    peers and logs, and its ``_sync_soon`` and ``last_sync``)."""

    async def sync_with(self, peer_id: str) -> None:
        """Page through the buckets where ``peer_id``'s state differs from ours: pull what we lack, push what it
        lacks."""
        if self._private_from(peer_id):
            self._refuse_outsider(peer_id, "outbound")
            return
        async with await self.transport.open_stream(peer_id, CRDT_SPEC, timeout=10.0) as stream:
            after = None
            for _ in range(MAX_PAGES):
                digests = [[b, d] for b, d in self.store.digests().items()]
                await stream.send(SYNC, {"d": digests, "after": None if after is None else list(after)})
                reply = await asyncio.wait_for(stream.read_required(), 30.0)
                body = reply.body
                if reply.kind != ENTRIES:
                    raise MalformedMessage("crdt: expected ENTRIES")
                buckets, theirs, nxt = parse_entries(body)
                if nxt is not None and after is not None and nxt <= after:
                    raise MalformedMessage("crdt: ENTRIES paging went backwards")
                if not buckets:
                    break
                want, lacking = self.store.page_diff(theirs, buckets, after, nxt)
                if want:
                    self.store.fetching.update(want)  # their op #1 is on its way: later ops wait for it
                    try:
                        await self._pull_page(stream, peer_id, theirs)
                    finally:
                        self.store.fetching.difference_update(want)
                ops, _ = self.store.ops_after(lacking, 10 * SYNC_BATCH, 10 * PUSH_BYTES)
                if ops:
                    await self._push_on(stream, ops)
                if nxt is None:
                    break
                after = nxt
        self.last_sync[peer_id] = self.clock.time()
        self.counters["syncs"] += 1

    async def _pull_page(self, stream: Stream, peer_id: str, theirs: dict[str, int]) -> None:
        """WANT the ops of the authors where the peer is ahead, until it has sent everything up to its page."""
        def known(author: str) -> int:
            return max(self.store.last_seq(author), seen.get(author, 0))

        seen: dict[str, int] = {}
        for _ in range(MAX_WANTS):
            want = {a: known(a) for a, seq in theirs.items() if seq > known(a)}
            if not want:
                return
            await stream.send(WANT, {"have": want})
            reply = await asyncio.wait_for(stream.read_required(), 30.0)
            body = reply.body
            if reply.kind != OPS or not isinstance(body, dict) or set(body) != {"ops", "more"}:
                raise MalformedMessage("crdt: expected OPS {ops, more}")
            before = dict(seen)
            await self._ingest(peer_id, body["ops"], seen)
            if body["more"] is not True or seen == before:
                return

    def sync_soon(self, peer_id: str) -> None:
        self._sync_soon.add(peer_id)
        self._sync_event.set()

    async def _anti_entropy_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._sync_event.wait(), self.sync_interval * self._rng.uniform(0.8, 1.2))
            except asyncio.TimeoutError:
                pass
            self._sync_event.clear()
            try:
                await self.compact_log()
            except OSError as e:
                self._log.log(logging.WARNING, "compact", "crdt: could not rewrite the op log: %s", e)
            dropped = dict(self.store.pending_dropped)
            self.store.expire_pending(self._now_ms())
            if dict(self.store.pending_dropped) != dropped:
                self._log.log(logging.WARNING, "pending", "crdt: held ops waiting for unknown parents dropped so "
                              "far: %s (anti-entropy re-delivers honest ones)", dict(self.store.pending_dropped))
            peers = self._peers()
            await self._close_idle(peers)
            targets = [p for p in sorted(self._sync_soon) if p in peers]
            self._sync_soon.clear()
            if not targets and peers:
                targets = [self._rng.choice(peers)]
            for peer_id in targets:
                try:
                    await self.sync_with(peer_id)
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    self.counters["sync_failures"] += 1
                    if isinstance(e, ProtocolViolation):
                        self.transport.penalties.penalize(peer_id, e.kind, str(e))
                    self._log.log(logging.DEBUG, ("sync", peer_id), "sync with %s failed: %s", peer_id, e)
