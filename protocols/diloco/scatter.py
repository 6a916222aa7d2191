"""The reduce-scatter + all-gather exchange of one round (``ScatterRound``): each peer reduces its parts of the
members' updates and takes the others' reduced parts, auditing some."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch
from swarmd.protocols import codecs, exchange, outer
from swarmd.protocols.bulk import BulkError, content_hash
from swarmd.protocols.diloco.conform import ConformStep
from swarmd.protocols.diloco.pending import Received, StepEnd, _decode_part
from swarmd.protocols.diloco.pulls import THROUGH_MEMBERS_AGAIN
from swarmd.protocols.diloco.wire import (
    AUDIT,
    CLIP,
    MAX_PEER_ENTRIES,
    REDUCED,
    SERVING_POLL,
)

if TYPE_CHECKING:
    from swarmd.protocols.diloco.round import Round


class ScatterRound:
    """Combine a round's members' updates by reduce-scatter + all-gather (``protocols/exchange.py``): we reduce the
    parts the round's order gives us and publish them (with the members whose chunks each combines), audit a part
    when the round draws it for us, and take every other part from its reducer; a part whose reducer fails us by
    the deadline, or that its auditor disputes, we reduce ourselves from the members' chunks. Then every peer takes
    the round's coordinator's parts (``ConformStep``): peers that reduced a late part themselves, from other chunks
    than its reducer (a chunk that did not come in time somewhere), end on the same weights.

    What the exchange fills as it goes lives on it: the combined update (a part taken from its reducer is decoded
    straight into its place: no second copy of the update; one we reduced is copied in at the end), the part we
    take of each (``parts``, ``used``: its blob hash and whose chunks), our reductions (``computed``), and the
    members refused on the way (``rejected``, ``screened``)."""

    def __init__(self, rnd: Round, members: set[str], base: str, started: float) -> None:
        self.rnd, self.loop, self.pending = rnd, rnd.loop, rnd.pending
        self.members = members
        self.started = started  # when the round's exchange began (its rate is measured from it)
        self.bounds: list[tuple[int, int]] = []
        self.ordered: list[str] = []
        self.digest = ""
        self.factors: dict[str, float] = {}
        self.span = 0.0
        self.end = 0.0
        self.pulls: StepEnd | None = None  # the pulls' end, which moves while parts still come
        self.combined: torch.Tensor | None = None
        self.parts: dict[int, torch.Tensor] = {}
        self.used: dict[int, tuple[bytes, frozenset[str] | None]] = {}  # the part we take: (blob hash, whose chunks)
        self.screened: dict[str, str] = {}
        self.rejected: dict[str, str] = {}
        self.computed: dict[int, tuple[bytes, torch.Tensor, int, frozenset[str]]] = {}  # our reductions (and whose)
        self.owners: list[str] = []  # part -> its reducer
        self.plan: dict[int, str] = {}  # part -> its auditor
        self.barred: set[str] = set()  # members without a direct path to another member: they reduce and audit none
        self._slowest: int | None = None  # the slowest member's rate (kB/s) the span took into account

    async def combine(self) -> tuple[torch.Tensor | None, dict[str, str]]:
        lp, rnd = self.loop, self.rnd
        lp.book.moving[rnd.key] = Received(self.started, last=self.started)
        self.pending.linked = frozenset(lp._ctx.members())
        try:
            return await self._exchange()
        finally:
            lp._measure_rate(lp.book.moving.pop(rnd.key))

    async def _exchange(self) -> tuple[torch.Tensor | None, dict[str, str]]:
        lp, rnd = self.loop, self.rnd
        if lp.faults:
            await lp.faults.enter("scatter", lp, r=rnd.r, p=rnd.p)
        if not self._plan():
            return None, self.rejected
        me = rnd.me
        mine = [k for k in range(len(self.bounds)) if self.owners[k] == me]
        # what the round's steps wait: the span, and the slowest member's rate (kB/s, as the others measured it) it
        # took into account
        lp.links.assignment = {"parts_reducing": len(mine), "members_reducing": len(set(self.owners)),
                               "span_seconds": round(self.span, 3), "slowest_member_kBps": self._slowest}
        self.plan = exchange.audit_plan(lp.cfg.run, rnd.r, rnd.p, self.ordered, len(self.bounds), lp.cfg.audit,
                                        self.owners, self.barred)
        self._note_reach()
        auditing = {k for k, auditor in self.plan.items() if auditor == me}
        started = lp.clock.monotonic()
        await asyncio.gather(*(self._reduce_mine(k) for k in mine),
                             *(self._take(k, k in auditing) for k in range(len(self.bounds)) if k not in mine))
        reduced = lp.clock.monotonic()
        lp.timings.phases["reduce"].append(reduced - started)
        await ConformStep(self).run()
        lp.timings.phases["conform"].append(lp.clock.monotonic() - reduced)
        return await asyncio.to_thread(self._assemble), {**self.screened, **self.rejected}

    def _plan(self) -> bool:
        """The round's parts, members (screened: every peer refuses the same updates from the same announcements,
        before the digest), order, clip factors and time; False if no member is left."""
        lp, rnd, announced = self.loop, self.rnd, self.pending.announced
        self.bounds = lp._bounds(rnd.p, lp._round_parts(rnd.key))
        self.members, self.rejected = exchange.screen_members(
            {a: (len(announced[a].parts), announced[a].norm) for a in self.members}, len(self.bounds))
        if not self.members:
            return False
        self.ordered = exchange.order(lp.cfg.run, rnd.r, rnd.p, self.members)
        self.digest = exchange.members_digest(self.members)
        self.factors = exchange.clip_factors({a: announced[a].norm for a in self.members}, CLIP)
        # time for the transfers: each peer moves about 2 x one update; a peer that stalls costs one such span
        self._slowest = lp._slowest_rate(self.ordered, announced)
        self.span = lp._span(rnd.p, self._slowest, len(self.ordered))
        self.end = lp.clock.monotonic() + self.span
        # the pulls' end moves while parts still come: the span's transfer time is a guess before the first
        # measurement (on a slower link than min_bandwidth, a fixed end gives round 0 1 s for ~11 s of transfers, and
        # every peer ends it on its own weights: the simulator at 100 kB/s)
        self.pulls = lp._pulls_end(rnd.key, self.end, self.span)
        self.combined = lp._buffers.take(rnd.frag.numel())  # (the last global weights' buffer, where given back)
        self.owners = lp._owners(self.ordered, len(self.bounds), announced)
        self.barred = lp._barred(self.ordered, announced)
        return True

    def _note_reach(self) -> None:
        """``/status`` reach: the members we lack a direct path to whose chunks members that reach both reduced
        this round (no part went to us or them), and whether we reduced nothing for lack of a path."""
        lp, me = self.loop, self.rnd.me
        if me not in self.barred:
            return
        lp.counters["rounds_not_reducing"] += 1
        around = lp.links.reduced_by_members
        for peer in sorted(self.barred - {me}):
            if not lp._ctx.direct(peer) and (peer in around or len(around) < MAX_PEER_ENTRIES):
                around[peer] = around.get(peer, 0) + 1

    def without(self) -> set[str]:
        """The members whose chunk some part we ended on does not combine (a chunk that never came to its
        reducer). A part over another member view names no members of ours: it says nothing either way."""
        out: set[str] = set()
        for _, whose in self.used.values():
            if whose is not None:
                out |= self.members - whose
        return out

    # ------------------------------------------------------------------ reducing a part
    async def compute(self, k: int, until: float | StepEnd, only: frozenset[str] | None = None,
                      first: str | None = None) -> bool:
        """Reduce part k from the members' chunks (``only`` those: False if one of them did not come) by ``until``.
        The chunks are pulled as bytes and decoded only when the part is reduced, a few parts at a time
        (``_reducing``): decoded on arrival, a round's chunks would be a copy of the update held at once.
        ``first``: a member that holds them all (the coordinator whose part we follow), asked before each chunk's
        owner."""
        lp, rnd = self.loop, self.rnd
        if not isinstance(until, StepEnd):
            until = lp._pulls_end(rnd.key, until, self.span)
        got: dict[str, torch.Tensor | bytearray] = {}  # peer -> its chunk, decoded (whole) or as bytes
        await asyncio.gather(*(self._chunk(k, peer, until, first, got)
                               for peer in sorted(self.members if only is None else self.members & only)))
        async with lp._reducing:
            chunks, bad = await asyncio.to_thread(self._decode_and_check, k, got)
            got.clear()
            for peer, why in bad.items():
                self.rejected.setdefault(peer, why)
            chunks = {peer: c for peer, c in chunks.items() if peer not in self.rejected}
            if only is not None and set(chunks) != only:
                self._drop(chunks)
                return False
            whose = frozenset(chunks)
            # the same rule wherever this part is reduced (its reducer, its auditor, a fallback): its chunks only
            noise = await asyncio.to_thread(exchange.uncorrelated, chunks)
            for peer in noise:
                self.screened[peer] = "uncorrelated"  # from this part only: each part is judged on its own chunks
                lp._buffers.give(chunks.pop(peer))
            if self.loop.faults:
                await self.loop.faults.enter("reduce", self.loop, r=self.rnd.r, p=self.rnd.p, info={"part": k})
            payload, blob_hash, decoded = await asyncio.to_thread(self._reduce_and_encode, k, chunks)
            self._drop(chunks)
        self.computed[k] = (lp.bulk.keep_prepared(blob_hash, payload), decoded, len(payload), whose)
        lp.book.blobs[rnd.key].add(self.computed[k][0])
        lp.book.own_blobs[rnd.key].add(self.computed[k][0])
        return True

    async def _chunk(self, k: int, peer: str, until: StepEnd, first: str | None,
                     got: dict[str, torch.Tensor | bytearray]) -> None:
        """Member ``peer``'s chunk of part k into ``got``: from its whole update where we hold it, our own from the
        bulk store, else pulled (prefetched as its announcement came, or now)."""
        lp, rnd, pending = self.loop, self.rnd, self.pending
        a, b = self.bounds[k]
        ann = pending.announced[peer]
        whole = pending.updates.get(peer)
        early = pending.prefetched.get((peer, k))
        if early is not None and early.done() and (early.cancelled() or early.exception() is not None):
            early = None  # that pull failed: try again now
        if whole is not None:  # ours, or an update pulled whole already
            got[peer] = whole[a:b]
            return
        if peer == rnd.me:  # ours: the bytes of the part we serve
            if (held := lp.bulk.blobs.get(ann.parts[k])) is not None:
                got[peer] = held
            else:  # dropped by the bulk store, over its budget (``blobs_evicted``): left out, as a late one
                lp.counters["chunks_missing"] += 1
            return
        if early is not None and (first is None or early.done()):  # pulled as its announcement came
            pending.prefetch_used.add((peer, k))
            pull = lp._by(until, asyncio.shield(early))
        else:
            # from its owner, then any member that holds it; or first from ``first``: the coordinator reduced its
            # part from this chunk, so it holds it (the hash is the one the owner signed), and when we follow its
            # part the owner is the slow source, its uplink the one the round waits on (the simulator: one uplink
            # down to 50 kB/s, and the others could not check the coordinator's parts in time and kept theirs). Of
            # the two, the faster as measured (``_rates_now``): when the coordinator is the slow one, its chunks of
            # the fast peers' went through its uplink too, and the others gave up on parts their owners could have
            # sent at once (the simulator: two uplinks of 4 falling mid-round, the coordinator's among them)
            source = lp._chunk_source(pending, peer, first)
            # a member we reach only through a relay: its chunk from the members that hold it (a part's reducer or
            # auditor pulled it), asked again until the end, as they may pull it only after we first ask (one that
            # is gone is not waited for: the others reduce its parts at once, ``_from_reducer``)
            again = THROUGH_MEMBERS_AGAIN if lp._relayed(source) else 0.0
            pull = lp._fetch_part(rnd.key, source, ann.parts[k], ann.sizes[k], pending.announced[source].addrs,
                                  b - a, until, holders=[(x, pending.announced[x].addrs)
                                                         for x in dict.fromkeys([peer, *self.ordered])
                                                         if x not in (rnd.me, source)],
                                  counter="chunks_from_other_holders" if source == peer
                                  else "chunks_not_from_coordinator", decode=False, again=again)
        try:
            got[peer] = await pull
        except (BulkError, asyncio.TimeoutError) as e:
            lp.counters["chunks_missing"] += 1
            lp._log_missing(peer, f"part {k} of its update for round {rnd.r}/{rnd.p} did not arrive: {e}")

    def _decode_and_check(self, k: int, got: dict[str, torch.Tensor | bytearray]) \
            -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(In a worker thread.) Part k's chunks decoded (each into a buffer a part decoded before gave back:
        ``_drop``) and checked."""
        lp = self.loop
        a, b = self.bounds[k]
        chunks, bad = {}, {}
        for peer in sorted(got):
            chunk = got[peer]
            if not isinstance(chunk, torch.Tensor):
                buf = lp._buffers.take(b - a)
                try:
                    chunk = _decode_part(chunk, b - a, buf)
                except codecs.CodecError:
                    lp._buffers.give(buf)
                    bad[peer] = "undecodable"
                    continue
                if chunk.dtype == torch.float32 and chunk.data_ptr() == buf.data_ptr():
                    chunk = buf  # the same values (a view of it, shaped as sent: one dimension)
            # (decoded: codecs.decode refused non-finite values; a whole update was decoded so too)
            why = exchange.chunk_ok(chunk, b - a, self.pending.announced[peer].norm, checked=True)
            if why is not None:
                bad[peer] = why
                lp._buffers.give(chunk)
            else:
                chunks[peer] = chunk
        return chunks, bad

    def _drop(self, held: dict[str, torch.Tensor]) -> None:
        """The decoded chunks in ``held`` given back for the next part's (one that is a view of a whole update is
        not ours to give: ``Buffers.give`` leaves it), ``held`` emptied."""
        while held:
            self.loop._buffers.give(held.popitem()[1])

    def _reduce_and_encode(self, k: int, chunks: dict[str, torch.Tensor]) -> tuple[bytearray, bytes, torch.Tensor]:
        """(In a worker thread.) Part k reduced and encoded: its payload, the payload's hash, and its values."""
        a, b = self.bounds[k]
        codec = self.loop.reduced_codec
        combined = exchange.reduce_part(chunks, self.factors, b - a, self.loop.cfg.senders())
        if self.loop.faults:
            combined = self.loop.faults.altered("reduced", self.loop, combined, r=self.rnd.r, p=self.rnd.p,
                                                info={"part": k})
        payload = codec.encode_wire(combined)
        if codec.lossless:  # its values are the payload's, bit for bit
            return payload, content_hash(payload), combined
        # decoded into the reduction's own buffer, its values now in the payload
        return payload, content_hash(payload), codecs.decode(payload, out=combined)

    def _own(self, k: int) -> None:
        blob, decoded, _, whose = self.computed[k]
        self.parts[k], self.used[k] = decoded, (blob, whose)

    # ------------------------------------------------------------------ our parts and the others'
    async def _reduce_mine(self, k: int) -> None:
        lp, rnd = self.loop, self.rnd
        await self.compute(k, self.pulls)
        blob, _, size, whose = self.computed[k]
        self._own(k)
        lp._publish(REDUCED, {"r": rnd.r, "p": rnd.p, "red": k, "blob": blob, "size": size, "m": self.digest,
                              "c": exchange.pack_set(self.ordered, whose), "addrs": list(lp.bulk.addrs)})
        lp.counters["parts_reduced"] += 1

    async def _take(self, k: int, auditing: bool) -> None:
        """Part k from its reducer (audited where the round draws us for it, or its audit awaited); reduced
        ourselves where its reducer fails us or is judged wrong."""
        audit = asyncio.get_running_loop().create_task(self.compute(k, self.pulls)) if auditing else None
        got = await self._from_reducer(k)  # (blob, digest, part, whose chunks)
        if audit is not None:
            await audit
            got = await self._audit(k, got) if got is not None else None
            if got is None:
                self._own(k)  # (the audit's reduction: a failed one from exactly the reducer's chunks keeps it)
                return
        elif got is not None and k in self.plan:
            got = await self._audited(k, got)
        if got is None:
            if k not in self.computed:  # its reducer failed us: reduce it ourselves (we pull its chunks)
                self.loop.counters["parts_fallback"] += 1
                await self.compute(k, self.loop.clock.monotonic() + self.span)
            self._own(k)
        else:
            self.parts[k], self.used[k] = got[2], (got[0], got[3])

    async def _from_reducer(self, k: int) -> tuple | None:
        """Part k as its reducer published it, pulled into its place in the combined update: (blob, digest, part,
        whose chunks), or None where it did not come or is not one to take."""
        lp, pending, reducer = self.loop, self.pending, self.owners[k]
        a, b = self.bounds[k]
        # a reducer gone (killed, or cut off) publishes nothing more: we reduce its part ourselves at once, not
        # at the span's end (the kill bench: a reducer killed mid-round cost the others the span, then the
        # fallback's pulls, 2 deadlines and more on a loaded machine)
        if not await outer.wait_until(lambda: reducer in pending.reduced[k] or lp._gone(pending, reducer),
                                      pending.part_events[k], self.end - lp.clock.monotonic(), poll=SERVING_POLL) \
                or reducer not in pending.reduced[k]:
            return None
        blob, _, m, _, bits = pending.reduced[k][reducer]
        whose = exchange.unpack_set(self.ordered, bits) if m == self.digest else None
        if not exchange.take_reduced(m, self.digest, whose, self.members):
            # the reducer lacked most chunks (or named no members of ours): not a part to take
            lp.counters["reduced_parts_partial"] += 1
            return None
        try:
            part = await lp._pull_reduced(self.rnd.key, pending, self.ordered, reducer, pending.reduced[k][reducer],
                                          b - a, self.pulls, out=self.combined[a:b])
        except (BulkError, asyncio.TimeoutError):
            return None  # no member could give it to us in time: we reduce it ourselves
        return (blob, m, part, whose) if part is not None else None

    async def _audit(self, k: int, got: tuple) -> tuple | None:
        """We audit part k: judged on the chunks the reducer says it combined (one that did not come in time at the
        reducer is no lie): our own reduction, or another from exactly those chunks. Other members than ours, or a
        chunk it names that did not come to us: nothing to compare, no dispute. None where we find it wrong."""
        lp, rnd = self.loop, self.rnd
        ours = None
        if got[1] == self.digest:
            if self.computed[k][3] == got[3] or await self.compute(k, lp.clock.monotonic() + self.span, only=got[3]):
                ours = self.computed[k][0]
            else:
                lp.counters["audits_incomplete"] += 1
        ok = exchange.audit_verdict(got[1], self.digest, got[0], ours)
        lp._publish(AUDIT, {"r": rnd.r, "p": rnd.p, "aud": k, "ok": ok})
        lp.counters["parts_audited"] += 1
        if not ok:
            lp._liar(self.owners[k], k, rnd.r, rnd.p)
            return None
        return got

    async def _audited(self, k: int, got: tuple) -> tuple | None:
        """Part k's auditor's verdict, awaited; a disputed part we check ourselves. None where it is not to take."""
        lp, rnd, pending, auditor = self.loop, self.rnd, self.pending, self.plan[k]
        await outer.wait_until(lambda: auditor in pending.audits[k] or lp._gone(pending, auditor),
                               pending.part_events[k], self.end - lp.clock.monotonic(), poll=SERVING_POLL)
        if pending.audits[k].get(auditor) is not False:
            return got
        lp.counters["parts_disputed"] += 1  # disputed: see for ourselves
        could = got[3] is not None and await self.compute(k, lp.clock.monotonic() + self.span, only=got[3])
        liar = exchange.settle_dispute(got[0], self.computed[k][0] if could else None)
        if liar == "auditor":
            lp._liar(auditor, k, rnd.r, rnd.p, role="auditor")
            return got
        if liar == "reducer":
            lp._liar(self.owners[k], k, rnd.r, rnd.p)
        return None  # (or we cannot tell who is right: our own reduction)

    def _assemble(self) -> torch.Tensor:
        """(In a worker thread.) The parts not decoded in place, copied into the combined update."""
        combined = self.combined
        for k, (a, b) in enumerate(self.bounds):
            part = self.parts.pop(k)
            if part.data_ptr() != combined[a:b].data_ptr():
                combined[a:b] = part
        return combined
