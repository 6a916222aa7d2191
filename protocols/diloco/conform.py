"""A scatter round's parts made the coordinator's: parts reduced from other chunks than its list says
are reduced again or pulled from the majority, and prefetching of the chunks we reduce."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

import torch
from swarmd.protocols import codecs, exchange, outer, rounds
from swarmd.protocols.bulk import BulkError
from swarmd.protocols.diloco.pending import Pending, StepEnd
from swarmd.protocols.diloco.wire import (
    PARTS,
    SERVING_POLL,
)

if TYPE_CHECKING:
    from swarmd.protocols.diloco.scatter import ScatterRound

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class ConformStep:
    """A scatter round's last step (``ScatterRound``): every peer ends on the round's coordinator's parts. A part
    whose reducer was late (or disputed) is reduced by each peer that gave up on it from the chunks that came to it
    by then, and the reducer's own part may lack a chunk that came too late to it: peers could end on different
    weights (at 16 peers on two cores most rounds would: 126 parts fall back in one). The coordinator (the member
    view we took) publishes each part's blob hash and the members whose chunks it combines; a peer whose part
    differs reduces it again from exactly those chunks (pulled from anyone who holds them), so the result is
    checked, not trusted: a coordinator can choose only among the honest reductions of a majority's chunks. The
    wait is one span at most; without the coordinator's list we keep our parts. It changes the exchange's parts
    (``parts``, ``used``) where it takes others."""

    def __init__(self, sr: ScatterRound) -> None:
        self.sr, self.loop, self.pending = sr, sr.loop, sr.pending
        self.coordinator: str | None = None  # whose member view the round took

    async def run(self) -> None:
        lp, sr, rnd = self.loop, self.sr, self.sr.rnd
        if lp.faults:
            await lp.faults.enter("conform", lp, r=rnd.r, p=rnd.p, info={"coordinator": self.pending.coordinator})
        self.coordinator = self.pending.coordinator
        if self.coordinator is None:
            return
        if self.coordinator == rnd.me:
            await self._as_coordinator()
            return
        held = await self._parts_list()
        if held is None:
            lp.counters["parts_coordinator_missing"] += 1
            return
        m, sets, hashes = held
        if m != sr.digest or len(hashes) != len(sr.used):
            lp.counters["parts_not_followed"] += 1
            return
        everyone = frozenset(sr.members)
        # part -> the chunks we take it from: those the coordinator names (from it first) where ours differs, or,
        # where it names a minority's, everyone's (from their owners), even where ours is the same as its part:
        # the coordinator reduces such a part from everyone's too (a peer whose part is the coordinator's minority
        # one would keep it, and end alone: the simulator, two uplinks falling mid-run, seed 15)
        # (a part over another view of the members, whose set is None: only where ours differs)
        followed, of_all = {}, {}
        for k, h in enumerate(hashes):
            whose = exchange.unpack_set(sr.ordered, sets[k])
            if exchange.names_majority(whose, sr.members):
                if h != sr.used[k][0]:
                    followed[k] = whose
            elif sr.used[k][1] != everyone and (h != sr.used[k][0] or whose is not None):
                of_all[k] = everyone
        wait = max(self._wait_for(followed, self.coordinator), self._wait_for(of_all, None))
        await asyncio.gather(*(self._conform(k, sets[k], hashes[k], wait) for k in sorted({*followed, *of_all})))

    async def _as_coordinator(self) -> None:
        """We coordinate: our parts list published, after our minority parts replaced where we can."""
        lp, sr, rnd = self.loop, self.sr, self.sr.rnd
        used = sr.used
        # the others follow only parts that combine a majority's chunks: half the wait they give us goes to
        # replacing ours that do not
        await self._majority_parts(sr.span / 2)
        lp._publish(PARTS, {"r": rnd.r, "p": rnd.p, "m": sr.digest,
                            "c": [b"" if used[k][1] is None else exchange.pack_set(sr.ordered, used[k][1])
                                  for k in range(len(used))],
                            "h": [used[k][0] for k in range(len(used))]})
        # a part we kept of a minority's chunks, the others do not follow: they reduce it from all the members'
        # chunks (below), and so do we. Keeping it, we ended alone on other weights and resynced (the
        # simulator: two uplinks of 4 falling mid-run, ours among them)
        everyone = frozenset(sr.members)
        # (a part over another view of the members, whose set is None, is taken as it is: its reducer, on
        # that view, kept it)
        kept = [k for k in range(len(used))
                if used[k][1] is not None and not exchange.names_majority(used[k][1], sr.members)]
        if kept:
            wait = self._wait_for({k: everyone for k in kept}, None)
            await asyncio.gather(*(self._of_all(k, wait) for k in kept))

    def _gone(self) -> bool:
        """Waiting on a coordinator that is gone (while we serve our bytes, or for a slow member) would cost us
        up to deadline_high."""
        return self.loop._gone(self.pending, self.coordinator)

    async def _parts_list(self) -> tuple | None:
        """The coordinator's parts list (digest, sets, hashes), waited for; None where it did not come."""
        lp, sr, pending, coordinator = self.loop, self.sr, self.pending, self.coordinator
        if not await lp._wait_serving(lambda: coordinator in pending.parts or self._gone(), sr.span,
                                      lp.book.blobs[sr.rnd.key]) and not self._gone():
            # a round with a member this round measured slow: the coordinator's own pulls may run to their cap
            # (deadline_high from the step's start) and its list come after that; we wait for it up to there.
            # With one span, a fast coordinator whose reduce step waits on the slow peer's chunks publishes its
            # list after two of the others have stopped waiting, and they resync (the simulator: one uplink of 4
            # falling mid-run, seeds 7 and 15). The price: a coordinator that hangs in such a round costs that
            # wait, deadline_high (plus a span) at most, instead of one span; one that is gone, nothing more
            typical = lp._transfer_rate()
            slow = any(exchange.slow_source(pending.meter.so_far(a), typical) for a in sr.members if a != sr.rnd.me)
            moving = lp.book.moving.get(sr.rnd.key)
            if slow and moving is not None:
                lp.counters["parts_wait_extended"] += 1
                # and one more span at least: a list published by then may still be behind a slow coordinator's
                # uploads (it comes 10 ms after a peer has stopped waiting: two uplinks falling, seed 2)
                until = max(moving.start + lp.cfg.deadline_high + sr.span / 2, lp.clock.monotonic() + sr.span)
                await outer.wait_until(lambda: coordinator in pending.parts or self._gone(), lp._event,
                                       until - lp.clock.monotonic(), poll=SERVING_POLL)
        if coordinator not in pending.parts and self._gone():
            lp.counters["parts_coordinator_gone"] += 1
            logger.info("diloco round %d/%d: coordinator %s left while we waited for its parts list", sr.rnd.r,
                        sr.rnd.p, coordinator[-8:])
        return pending.parts.get(coordinator)

    async def _conform(self, k: int, bits, h: bytes, wait: float) -> None:
        """Part k made the coordinator's (its hash ``h``, of the chunks ``bits`` names) where we can check it."""
        lp, sr = self.loop, self.sr
        whose = exchange.unpack_set(sr.ordered, bits)
        could = exchange.names_majority(whose, sr.members) \
            and await sr.compute(k, lp.clock.monotonic() + wait, only=whose, first=self.coordinator)
        action = exchange.conform_action(whose, sr.members, sr.computed[k][0] if could else None, h)
        if action == "not_followed":
            lp.counters["parts_not_followed"] += 1
            # the coordinator's part combines a minority's chunks (its own pulls came late: a congested
            # uplink delays a peer's requests too), and ours may combine other chunks than the other peers':
            # every peer that does not follow it reduces the part from all the members' chunks (from any
            # holder), the same bytes wherever all of them come in the span. Keeping ours, the peers end
            # on as many weights as there are peers (the simulator: a coordinator whose uplink fell to
            # 50 kB/s mid-round)
            await self._of_all(k, wait)
        elif action == "not_conformed":
            lp.counters["parts_not_conformed"] += 1  # a chunk it names did not come to us
        elif action == "mismatch":
            lp.counters["parts_coordinator_mismatch"] += 1  # its bytes are not what those chunks give
            logger.warning("diloco round %d/%d: coordinator %s's part %d is not the reduction of the chunks it "
                           "names; ours kept", sr.rnd.r, sr.rnd.p, self.coordinator[-8:], k)
        else:
            sr.parts[k], sr.used[k] = sr.computed[k][1], (h, whose)
            lp.counters["parts_conformed"] += 1

    async def _of_all(self, k: int, wait: float) -> None:
        """Part k reduced from all the members' chunks (from any holder) within ``wait``, where ours combines
        other chunks: what every peer does with a part the coordinator reduced from a minority's."""
        sr = self.sr
        everyone = frozenset(sr.members)
        if sr.used[k][1] != everyone and await sr.compute(k, self.loop.clock.monotonic() + wait, only=everyone):
            sr.parts[k], sr.used[k] = sr.computed[k][1], (sr.computed[k][0], everyone)
            self.loop.counters["parts_of_all_members"] += 1

    def _wait_for(self, needed: dict[int, frozenset[str]], first: str | None) -> float:
        """The time our pulls of the chunks of ``needed`` (part -> whose chunks) get, each from ``first`` or its
        owner, whichever is faster (``_chunk_source``), as ``compute`` pulls them: one span, or deadline_high where
        one of those sources sends slowly (``exchange.transfer_wait``). A peer whose uplink fell mid-round serves
        them slowly, all at once: with one span the others give up on its chunks while they come, keep their own
        parts, and the round splits (the simulator: two uplinks of 4 falling to 50 kB/s mid-run; 1 of 16 draws
        clean)."""
        lp, pending = self.loop, self.pending
        need: dict[str, int] = collections.Counter()
        for k, whose in needed.items():
            for a in whose:
                ann = pending.announced.get(a)
                if a == self.sr.rnd.me or ann is None or a in pending.updates or ann.parts[k] in lp.bulk.blobs:
                    continue
                need[lp._chunk_source(pending, a, first)] += ann.sizes[k]
        rates = {a: r for a in need if (r := pending.meter.so_far(a)) is not None}
        return exchange.transfer_wait(need, rates, lp._transfer_rate(), self.sr.span, lp.cfg.deadline_high)

    async def _majority_parts(self, wait: float) -> None:
        """The coordinator's parts reduced from fewer than a majority's chunks (its reducer's part came too late,
        and the chunks it had by then were few) are replaced, within ``wait``, by a reducer's part that combines a
        majority's, or else reduced again from the chunks that came since. The others never follow a minority part
        (``exchange.conform_action``): they reduce it from all the members' chunks (``run``), and a coordinator
        that keeps it would end alone on other weights and resync (the simulator, 4 peers on 200 kB/s links: round
        0's coordinator, a part of 1 or 2 chunks of 4). A reducer's part is taken as in the reduce step (its blob
        is the one the reducer signed; audits judge reducers); one reduced again is checked by the others against
        the chunks it names."""
        sr, used = self.sr, self.sr.used
        until = self.loop.clock.monotonic() + wait
        await asyncio.gather(*(self._replace(k, until) for k in range(len(used))
                               if used[k][1] is not None and not exchange.names_majority(used[k][1], sr.members)))

    async def _replace(self, k: int, until: float) -> None:
        lp, sr, pending = self.loop, self.sr, self.pending
        a, b = sr.bounds[k]
        for reducer, reduced in sorted(pending.reduced[k].items()):
            blob, _, m, _, bits = reduced
            whose = exchange.unpack_set(sr.ordered, bits) if m == sr.digest else None
            if reducer == sr.rnd.me or not exchange.names_majority(whose, sr.members):
                continue
            try:
                part = await lp._pull_reduced(sr.rnd.key, pending, sr.ordered, reducer, reduced, b - a, until)
            except (BulkError, asyncio.TimeoutError):
                break  # out of time
            if part is None:
                continue
            sr.parts[k], sr.used[k] = part, (blob, whose)
            lp.counters["minority_parts_replaced"] += 1
            return
        # no reducer's part of a majority (ours may be the part's own reduction, from the chunks that had come
        # by the deadline): reduced again from those that came since (the others check it against the chunks),
        # by a fixed end (arrivals must not move it: the others wait for our parts list only so long)
        if await sr.compute(k, StepEnd(until)) and exchange.names_majority(sr.computed[k][3], sr.members):
            sr.parts[k], sr.used[k] = sr.computed[k][1], (sr.computed[k][0], sr.computed[k][3])
            lp.counters["minority_parts_reduced_again"] += 1
            return
        lp.counters["minority_parts_kept"] += 1


class ConformMixin:
    """DilocoLoop's scatter helpers that outlive a round: whether a member is gone, the wait while we serve, pulling
    a reducer's part, prefetching the chunks we will reduce, and judging a liar."""

    def _gone(self, pending: Pending, peer: str) -> bool:
        """``peer`` was connected to us when the round's step began and is not now (killed, or cut off): it
        publishes nothing more this round. One we reach only through others (its messages come by gossip) is
        waited for."""
        return peer in pending.linked and peer not in self._ctx.members()

    async def _wait_serving(self, done, span: float, blobs) -> bool:
        """Wait until ``done()`` holds for ``span``, and while we are still serving one of ``blobs`` (the round's:
        our chunks and parts, the chunks we pulled), and ``span`` after the last transfer ended, up to
        deadline_high: the others cannot be done before those bytes reached them. A peer whose uplink is the
        round's bottleneck finishes its own pulls long before the others, and without this its wait for the
        coordinator's parts list runs out while the coordinator is still pulling from it: it keeps its own parts and
        resyncs (the simulator: one uplink down to 50 kB/s mid-run)."""
        now = self.clock.monotonic()
        end, cap = now + span, now + max(span, self.cfg.deadline_high)
        while not done():
            now = self.clock.monotonic()
            if end - now <= rounds.TICK:
                until = self.bulk.serving_until(blobs)
                end = min(cap, now + SERVING_POLL if until is None else until + span)
                if end - now <= rounds.TICK:
                    return False
            await outer.wait_event(self._event, min(end - now, SERVING_POLL))  # (``done`` may not set the event)
        return True

    async def _pull_reduced(self, key: tuple[int, int], pending: Pending, ordered: list[str], reducer: str,
                            reduced: tuple, elements: int, until: float | StepEnd,
                            out: torch.Tensor | None = None) -> torch.Tensor | None:
        """A reducer's part (``reduced``: its entry in ``pending.reduced``), pulled from the reducer, else from a
        member that pulled it already (the reducer may have died after serving some of us: the others must end with
        the same bytes), by ``until``, and decoded (into ``out`` where given). None: its bytes, which match the
        reducer's hash, are not a part (the wrong shape, non-finite values): the reducer is penalised. Raises
        BulkError or TimeoutError when no member could give it to us in time."""
        me = self._ctx.identity.peer_id
        blob, size, _, addrs, _ = reduced
        try:
            part = await self._fetch_part(key, reducer, blob, size, addrs, elements,
                                          until if isinstance(until, StepEnd) else until - self.clock.monotonic(),
                                          holders=[(x, pending.announced[x].addrs) for x in ordered
                                                   if x not in (me, reducer)],
                                          counter="parts_from_other_holders", out=out)
            # (decoded by codecs.decode, which refuses non-finite values)
            if part.dim() != 1 or part.numel() != elements:
                raise codecs.CodecError("a reduced part of the wrong shape")
        except codecs.CodecError as e:  # the bytes match the reducer's hash: the reducer's fault
            self._ctx.transport.penalties.penalize(reducer, "invalid_message", f"diloco reduced part: {e}")
            self.counters["reduced_parts_rejected"] += 1
            return None
        return part

    def _prefetch(self, key: tuple[int, int], pending: Pending, peer: str) -> None:
        """Scatter: pull at once the chunks of the parts we will likely reduce (our place in the round's order over
        the last round's participants, which a round usually keeps), so the transfer overlaps the wait for the
        others and Streaming DiLoCo's overlap steps; a wrong guess costs those chunks' bytes, never the result.
        Who reduces how many parts goes by the rates the members' announcements report (``_owners``), and those
        come one by one, so the guess is made again as each comes, and only parts that stay ours whatever the
        reports still to come say of others are pulled: ours in the plain round robin and under the weights so far
        (``exchange.reducers`` takes parts from the round robin only from a member over its share, and gives them
        to those under theirs; a part we would gain from a slow member is pulled at the close). The pulls of parts
        no longer ours stop where they have not ended. (Each guess from the reports so far, the parts placed by a
        smooth weighted round robin, 50 of 442 chunks prefetched in a run at N = 8 go unused: 0.1 x S a round
        for nothing, and the busiest peer takes in 2.36 x S.)"""
        r, p = key
        me = self._ctx.identity.peer_id
        likely = self.fragments[p].last_members(self.start_state.initial) | {me}
        if peer == me or peer not in likely or len(likely) < 2:
            return
        pending.prefetchable.add(peer)
        bounds = self._bounds(p, self._round_parts(key))
        ordered = exchange.order(self.cfg.run, r, p, likely)
        owners = self._owners(ordered, len(bounds), pending.announced)
        mine = [k for k, owner in enumerate(owners) if owner == me and exchange.reducer_of(ordered, k) == me]
        for (source, k), task in list(pending.prefetched.items()):
            if k not in mine and not task.done():
                task.cancel()
                del pending.prefetched[(source, k)]
                self.counters["chunks_prefetch_dropped"] += 1
        for source in sorted(pending.prefetchable):
            ann = pending.announced[source]
            if len(ann.parts) != len(bounds):
                continue
            for k in mine:
                if (source, k) in pending.prefetched:
                    continue
                a, b = bounds[k]
                # the bytes only: decoded when the part is reduced (a decoded chunk held from its announcement
                # to the close was 4 bytes a value, 7.5 x its bytes with e3m0)
                task = asyncio.get_running_loop().create_task(
                    self._fetch_part(key, source, ann.parts[k], ann.sizes[k], ann.addrs, b - a, 300.0,
                                     decode=False))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is seen at the close
                pending.prefetched[(source, k)] = task
                self.counters["chunks_prefetched"] += 1

    def _liar(self, peer: str, k: int, r: int, p: int, role: str = "reducer") -> None:
        self.counters[f"lying_{role}s"] += 1
        self._ctx.transport.penalties.penalize(peer, "bad_data", f"diloco: a wrong {role} result for part {k}")
        logger.warning("diloco: %s %s gave a wrong result for part %d of round %d/%d; we use our own", role, peer,
                       k, r, p)

    def _log_missing(self, peer: str, what: str) -> None:
        now = self.clock.monotonic()
        if now - self.links.missing_logged.get(peer, 0.0) > 30.0:
            if len(self.links.missing_logged) > 4096:
                self.links.missing_logged.clear()
            self.links.missing_logged[peer] = now
            logger.warning("diloco: %s: %s", peer, what)

