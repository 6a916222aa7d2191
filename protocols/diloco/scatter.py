"""The reduce-scatter + all-gather exchange: each peer reduces its parts of the members' updates and
takes the others' reduced parts, auditing some."""

from __future__ import annotations

import asyncio

import torch
from swarmd.protocols import codecs, exchange, outer
from swarmd.protocols.bulk import BulkError, content_hash
from swarmd.protocols.diloco.pending import Pending, StepEnd, _decode_part
from swarmd.protocols.diloco.wire import (
    AUDIT,
    CLIP,
    REDUCED,
    SERVING_POLL,
)


class ScatterMixin:
    """DilocoLoop's scatter methods (the loop composes them; they share its state)."""

    # ------------------------------------------------------------------ the reduce-scatter + all-gather exchange
    async def _scatter(self, key: tuple[int, int], pending: Pending,
                       members: set[str]) -> tuple[torch.Tensor | None, dict[str, str]]:
        """Combine the members' updates by reduce-scatter + all-gather (``protocols/exchange.py``): we reduce the
        parts the round's order gives us and publish them (with the members whose chunks each combines), audit a
        part when the round draws it for us, and take every other part from its reducer; a part whose reducer fails
        us by the deadline, or that its auditor disputes, we reduce ourselves from the members' chunks. Then every
        peer takes the round's coordinator's parts (``_conform``): peers that reduced a late part themselves, from
        other chunks than its reducer (a chunk that did not come in time somewhere), end on the same weights."""
        if self.faults:
            await self.faults.enter("scatter", self, r=key[0], p=key[1])
        r, p = key
        me = self._ctx.identity.peer_id
        n = self.fragments[p].numel()
        bounds = self._bounds(p, self._round_parts(key))
        # before the digest: every peer refuses the same updates from the same announcements
        members, rejected = exchange.screen_members(
            {a: (len(pending.announced[a].parts), pending.announced[a].norm) for a in members}, len(bounds))
        if not members:
            return None, rejected
        ordered = exchange.order(self.cfg.run, r, p, members)
        digest = exchange.members_digest(members)
        factors = exchange.clip_factors({a: pending.announced[a].norm for a in members}, CLIP)
        # time for the transfers: each peer moves about 2 x one update; a peer that stalls costs one such span
        slowest = self._slowest_rate(ordered, pending.announced)
        span = self._span(p, slowest, len(ordered))
        end = self.clock.monotonic() + span
        # the pulls' end moves while parts still come: the span's transfer time is a guess before the first
        # measurement (on a slower link than min_bandwidth, a fixed end gives round 0 1 s for ~11 s of transfers, and
        # every peer ends it on its own weights: the simulator at 100 kB/s)
        pulls = self._pulls_end(key, end, span)
        # the combined update, filled as parts come: a part taken from its reducer is decoded straight into its
        # place (no second copy of the update); one we reduced is copied in at the end (``parts`` -> our tensor)
        combined = self._buffers.take(n)  # (the last global weights' buffer, where it was given back)
        parts: dict[int, torch.Tensor] = {}
        used: dict[int, tuple[bytes, frozenset[str] | None]] = {}  # the part we take: (blob hash, whose chunks)
        screened: dict[str, str] = {}
        computed: dict[int, tuple[bytes, torch.Tensor, int, frozenset[str]]] = {}  # our reductions (and whose)

        async def compute(k: int, until: float | StepEnd, only: frozenset[str] | None = None,
                          first: str | None = None) -> bool:
            """Reduce part k from the members' chunks (``only`` those: False if one of them did not come) by
            ``until``. The chunks are pulled as bytes and decoded only when the part is reduced, a few parts at a
            time (``_reducing``): decoded on arrival, a round's chunks would be a copy of the update held at once.
            ``first``: a member that holds them all (the coordinator whose part we follow), asked before each chunk's
            owner."""
            a, b = bounds[k]
            if not isinstance(until, StepEnd):
                until = self._pulls_end(key, until, span)
            got: dict[str, torch.Tensor | bytearray] = {}  # peer -> its chunk, decoded (whole) or as bytes

            async def one(peer: str) -> None:
                ann = pending.announced[peer]
                whole = pending.updates.get(peer)
                early = pending.prefetched.get((peer, k))
                if early is not None and early.done() and (early.cancelled() or early.exception() is not None):
                    early = None  # that pull failed: try again now
                if whole is not None:  # ours, or an update pulled whole already
                    got[peer] = whole[a:b]
                elif peer == me:  # ours: the bytes of the part we serve
                    if (held := self.bulk.blobs.get(ann.parts[k])) is not None:
                        got[peer] = held
                    else:  # dropped by the bulk store, over its budget (``blobs_evicted``): left out, as a late one
                        self.counters["chunks_missing"] += 1
                else:
                    if early is not None and (first is None or early.done()):  # pulled as its announcement came
                        pending.prefetch_used.add((peer, k))
                        pull = self._by(until, asyncio.shield(early))
                    else:
                        # from its owner, then any member that holds it; or first from ``first``: the coordinator
                        # reduced its part from this chunk, so it holds it (the hash is the one the owner signed),
                        # and when we follow its part the owner is the slow source, its uplink the one the round
                        # waits on (the simulator: one uplink down to 50 kB/s, and the others could not check the
                        # coordinator's parts in time and kept theirs). Of the two, the faster as measured
                        # (``_rates_now``): when the coordinator is the slow one, its chunks of the fast peers' went
                        # through its uplink too, and the others gave up on parts their owners could have sent at
                        # once (the simulator: two uplinks of 4 falling mid-round, the coordinator's among them)
                        source = self._chunk_source(pending, peer, first)
                        pull = self._fetch_part(key, source, ann.parts[k], ann.sizes[k],
                                                pending.announced[source].addrs, b - a, until, holders=[
                                                    (x, pending.announced[x].addrs)
                                                    for x in dict.fromkeys([peer, *ordered]) if x not in (me, source)],
                                                counter="chunks_from_other_holders" if source == peer
                                                else "chunks_not_from_coordinator", decode=False)
                    try:
                        got[peer] = await pull
                    except (BulkError, asyncio.TimeoutError) as e:
                        self.counters["chunks_missing"] += 1
                        self._log_missing(peer, f"part {k} of its update for round {r}/{p} did not arrive: {e}")

            await asyncio.gather(*(one(peer) for peer in sorted(members if only is None else members & only)))

            def decode_and_check() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
                """The chunks decoded (each into a buffer a part decoded before gave back: ``drop``) and checked."""
                chunks, bad = {}, {}
                for peer in sorted(got):
                    chunk = got[peer]
                    if not isinstance(chunk, torch.Tensor):
                        buf = self._buffers.take(b - a)
                        try:
                            chunk = _decode_part(chunk, b - a, buf)
                        except codecs.CodecError:
                            self._buffers.give(buf)
                            bad[peer] = "undecodable"
                            continue
                        if chunk.dtype == torch.float32 and chunk.data_ptr() == buf.data_ptr():
                            chunk = buf  # the same values (a view of it, shaped as sent: one dimension)
                    # (decoded: codecs.decode refused non-finite values; a whole update was decoded so too)
                    why = exchange.chunk_ok(chunk, b - a, pending.announced[peer].norm, checked=True)
                    if why is not None:
                        bad[peer] = why
                        self._buffers.give(chunk)
                    else:
                        chunks[peer] = chunk
                return chunks, bad

            def drop(held: dict[str, torch.Tensor]) -> None:
                """The decoded chunks in ``held`` given back for the next part's (one that is a view of a whole
                update is not ours to give: ``Buffers.give`` leaves it), ``held`` emptied."""
                while held:
                    self._buffers.give(held.popitem()[1])

            async with self._reducing:
                chunks, bad = await asyncio.to_thread(decode_and_check)
                got.clear()
                for peer, why in bad.items():
                    rejected.setdefault(peer, why)
                chunks = {peer: c for peer, c in chunks.items() if peer not in rejected}
                if only is not None and set(chunks) != only:
                    drop(chunks)
                    return False
                whose = frozenset(chunks)
                # the same rule wherever this part is reduced (its reducer, its auditor, a fallback): its chunks only
                noise = await asyncio.to_thread(exchange.uncorrelated, chunks)
                for peer in noise:
                    screened[peer] = "uncorrelated"  # from this part only: each part is judged on its own chunks
                    self._buffers.give(chunks.pop(peer))

                def reduce_and_encode() -> tuple[bytearray, bytes, torch.Tensor]:
                    combined = exchange.reduce_part(chunks, factors, b - a)
                    payload = self.reduced_codec.encode_wire(combined)
                    if self.reduced_codec.lossless:  # its values are the payload's, bit for bit
                        return payload, content_hash(payload), combined
                    # decoded into the reduction's own buffer, its values now in the payload
                    return payload, content_hash(payload), codecs.decode(payload, out=combined)

                payload, blob_hash, decoded = await asyncio.to_thread(reduce_and_encode)
                drop(chunks)
            computed[k] = (self.bulk.keep_prepared(blob_hash, payload), decoded, len(payload), whose)
            self.book.blobs[key].add(computed[k][0])
            self.book.own_blobs[key].add(computed[k][0])
            return True

        def own(k: int) -> None:
            blob, decoded, _, whose = computed[k]
            parts[k], used[k] = decoded, (blob, whose)

        owners = self._owners(ordered, len(bounds), pending.announced)  # part -> its reducer
        mine = [k for k in range(len(bounds)) if owners[k] == me]
        # what the round's steps wait: the span, and the slowest member's rate (kB/s, as the others measured it) it
        # took into account
        self.links.assignment = {"parts_reducing": len(mine), "members_reducing": len(set(owners)),
                            "span_seconds": round(span, 3), "slowest_member_kBps": slowest}
        plan = exchange.audit_plan(self.cfg.run, r, p, ordered, len(bounds), self.cfg.audit, owners)  # -> auditor
        auditing = [k for k, auditor in plan.items() if auditor == me]

        async def reduce_mine(k: int) -> None:
            await compute(k, pulls)
            blob, _, size, whose = computed[k]
            own(k)
            self._publish(REDUCED, {"r": r, "p": p, "red": k, "blob": blob, "size": size, "m": digest,
                                    "c": exchange.pack_set(ordered, whose), "addrs": list(self.bulk.addrs)})
            self.counters["parts_reduced"] += 1

        async def take(k: int) -> None:
            reducer = owners[k]
            a, b = bounds[k]
            audit = asyncio.get_running_loop().create_task(compute(k, pulls)) if k in auditing else None
            got = None  # (blob, digest, part, whose chunks)
            # a reducer gone (killed, or cut off) publishes nothing more: we reduce its part ourselves at once, not
            # at the span's end (the kill bench: a reducer killed mid-round cost the others the span, then the
            # fallback's pulls, 2 deadlines and more on a loaded machine)
            if await outer.wait_until(lambda: reducer in pending.reduced[k] or self._gone(pending, reducer),
                                      pending.part_events[k], end - self.clock.monotonic(), poll=SERVING_POLL) \
                    and reducer in pending.reduced[k]:
                blob, _, m, _, bits = pending.reduced[k][reducer]
                whose = exchange.unpack_set(ordered, bits) if m == digest else None
                if not exchange.take_reduced(m, digest, whose, members):
                    # the reducer lacked most chunks (or named no members of ours): not a part to take
                    self.counters["reduced_parts_partial"] += 1
                else:
                    try:
                        part = await self._pull_reduced(key, pending, ordered, reducer, pending.reduced[k][reducer],
                                                        b - a, pulls, out=combined[a:b])
                        if part is not None:
                            got = (blob, m, part, whose)
                    except (BulkError, asyncio.TimeoutError):
                        pass  # no member could give it to us in time: we reduce it ourselves below
            if audit is not None:
                await audit
                if got is not None:
                    # judged on the chunks the reducer says it combined (one that did not come in time at the
                    # reducer is no lie): our own reduction, or another from exactly those chunks. Other members
                    # than ours, or a chunk it names that did not come to us: nothing to compare, no dispute
                    ours = None
                    if got[1] == digest:
                        if computed[k][3] == got[3] or await compute(k, self.clock.monotonic() + span, only=got[3]):
                            ours = computed[k][0]
                        else:
                            self.counters["audits_incomplete"] += 1
                    ok = exchange.audit_verdict(got[1], digest, got[0], ours)
                    self._publish(AUDIT, {"r": r, "p": p, "aud": k, "ok": ok})
                    self.counters["parts_audited"] += 1
                    if not ok:
                        self._liar(reducer, k, r, p)
                        got = None
                if got is None:
                    own(k)  # (the audit's reduction: a failed one from exactly the reducer's chunks keeps it)
                    return
            elif got is not None and k in plan:
                auditor = plan[k]
                await outer.wait_until(lambda: auditor in pending.audits[k] or self._gone(pending, auditor),
                                       pending.part_events[k], end - self.clock.monotonic(), poll=SERVING_POLL)
                if pending.audits[k].get(auditor) is False:  # disputed: see for ourselves
                    self.counters["parts_disputed"] += 1
                    could = got[3] is not None and await compute(k, self.clock.monotonic() + span, only=got[3])
                    liar = exchange.settle_dispute(got[0], computed[k][0] if could else None)
                    if liar == "auditor":
                        self._liar(auditor, k, r, p, role="auditor")
                    elif liar == "reducer":
                        self._liar(reducer, k, r, p)
                        got = None
                    else:
                        got = None  # we cannot tell who is right: our own reduction
            if got is None:
                if k not in computed:  # its reducer failed us: reduce it ourselves (we pull its chunks)
                    self.counters["parts_fallback"] += 1
                    await compute(k, self.clock.monotonic() + span)
                own(k)
            else:
                parts[k], used[k] = got[2], (got[0], got[3])

        started = self.clock.monotonic()
        await asyncio.gather(*(reduce_mine(k) for k in mine), *(take(k) for k in range(len(bounds)) if k not in mine))
        reduced = self.clock.monotonic()
        self.timings.phases["reduce"].append(reduced - started)
        await self._conform(key, pending, members, ordered, digest, parts, used, compute, computed, span)
        self.timings.phases["conform"].append(self.clock.monotonic() - reduced)

        def assemble() -> torch.Tensor:  # the parts not decoded in place, copied in: off the event loop
            for k, (a, b) in enumerate(bounds):
                part = parts.pop(k)
                if part.data_ptr() != combined[a:b].data_ptr():
                    combined[a:b] = part
            return combined

        return await asyncio.to_thread(assemble), {**screened, **rejected}

