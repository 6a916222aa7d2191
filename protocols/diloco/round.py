"""One round of one fragment (hivemind's ``AllReduceRunner``: one object per round, dropped with ``finalize``):
our update announced, then its close: the wait for its members' updates, the member agreement, the exchange that
combines them, the outer step, and what the round leaves behind (its history, its hash, its book entries and blobs
given back)."""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
from typing import TYPE_CHECKING

import torch
from swarmd.protocols import exchange, outer, rounds
from swarmd.protocols.diloco.alltoall import EXCHANGES, Exchange
from swarmd.protocols.diloco.scatter import ScatterRound
from swarmd.protocols.diloco.pending import Pending
from swarmd.protocols.diloco.wire import (
    FETCH_AFTER,
    FETCH_WAIT,
    JOIN,
    MAX_NEWCOMER_PULLS,
    MAX_VIEW,
    MEMBERS,
    ROUND_HASH,
)
from swarmd.protocols.inner import SwarmAdamW
from swarmd.protocols.standing import fresh_round

if TYPE_CHECKING:
    from swarmd.protocols.diloco.loop import DilocoLoop

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class Round:
    """Round r of fragment p, from our update's announcement (the schedule makes it when the round's inner steps
    are done, or when a joiner starts to follow a round under way) to the end of its close. What the round gathers
    while it is open (its ``Pending``: the others' messages come before we make it) is the loop's book entry until
    ``finalize`` gives it back; what the close decides (the members, the combined update, the refusals) goes from
    one step to the next by argument."""

    def __init__(self, loop: DilocoLoop, p: int, r: int) -> None:
        self.loop = loop
        self.r, self.p, self.key = r, p, (r, p)
        self.frag = loop.fragments[p]
        self.pending: Pending | None = None  # the book's entry, taken when the close starts
        self.me = loop._ctx.identity.peer_id
        self.mode = "all-to-all"  # (the exchange's, decided when the wait starts)
        self.wait: rounds.RoundWait | None = None  # whom the round waits for, and how long
        self.chain_head: tuple[str, ...] = ()  # the first of the round's chain of coordinators (none: no agreement)
        self.blocked_from = 0.0  # when the training loop started waiting for this close
        self.exchange: Exchange | None = None  # the close's exchange, once it runs

    async def announce(self) -> None:
        """Our update for the round, announced (``UpdateMixin._send_update``)."""
        await self.loop._send_update(self.p, self.r)

    async def close(self) -> None:
        """Close the round: its members waited for and agreed, their updates combined, the outer step taken, the
        round recorded and published, and its book entries given back (``finalize``)."""
        lp = self.loop
        self.pending = lp.book.pending[self.key]
        missing, waited_s = await self._gather()
        base_now, other_base = await self._screen()
        members, replayed, started = await self._members(base_now)
        lp._drop_redo(self.p)
        combined, rejected = await self._combine(members, base_now, started)
        rejected.update(replayed)
        rejected.update({a: why for a, why in self.pending.refused.items() if a not in rejected})
        self._time(members, started)
        participants = self._judge(members, rejected, other_base, missing, waited_s)
        h = await self._apply(combined)
        self._next_candidates(members, participants)
        lp._check_previous(self.p, self.r)
        lp.record.history.append({"round": self.r, "fragment": self.p, "participants": len(participants),
                                  "global_hash": h})
        lp._publish(ROUND_HASH, {"r": self.r, "p": self.p, "h": h})
        lp.book.closed_published(self.r, self.p, h)
        self.finalize()

    # ------------------------------------------------------------------ the wait
    def have(self) -> set[str]:
        """Whose contribution we hold: in scatter an announcement (the bytes move after the close), else the
        pulled update."""
        return set(self.pending.announced) if self.mode == "scatter" else set(self.pending.updates)

    def coming(self) -> set[str]:
        return set(self.pending.announced) - self.pending.failed

    def covered(self) -> bool:
        """The round's coordinator's member view is here and names only peers whose contribution we hold: we
        take its view (``Round._agree``), so waiting on for anyone else changes nothing. Without this, a joiner (its
        deadline deadline_high, before it has measured one) waits that long for a peer killed meanwhile,
        which the coordinator left out, and falls behind the others (the simulator shows it)."""
        coordinator, pending = self.chain_head, self.pending
        if not coordinator or coordinator[0] == self.me or coordinator[0] not in pending.views:
            return False
        return not rounds.resolve_view(pending.views[coordinator[0]],
                                       {rounds.short_id(a): a for a in self.have()})[1]

    async def _gather(self) -> tuple[set[str], float]:
        """Wait for the round's members (by its deadline); returns whom we waited for in vain and for how long."""
        lp, r, p, key, pending, me = self.loop, self.r, self.p, self.key, self.pending, self.me
        # the peers whose word counts are waited for, and a few newcomers (peers that announced a join, or
        # contributed last round without standing yet; brand-new ones only in fresh rounds), picked the same way
        # everywhere: a fresh key can neither add itself to the set every round waits for nor stall many rounds
        # (a round's joins are popped once it closes)
        base = self.frag.last_members(lp.start_state.initial) | lp.book.joins.get(key, set())
        self.blocked_from = blocked_from = lp.clock.monotonic()
        # a newcomer holding a slot gets half of deadline_low once every counting peer is in (then the deadline
        # only if its update is on its way). Half: a peer that did not see the join (gossip is not instant) goes
        # on at once and is that much ahead in the next round, whose deadline is deadline_low at least: the
        # others still make it in time
        # plus the time our last exchange took: the peers ended it at different times (a slow uplink serves its
        # receivers one after another), and so announce this round that much apart; with the deadline alone, a
        # round after a slow exchange closes with whoever is first, and the swarm splits (the simulator: one
        # peer's uplink down to 50 kB/s mid-run, rounds of 1-2 members after it)
        spread = min(lp.timings.close[-1], lp.cfg.deadline_high) if lp.timings.close else 0.0
        wait = self.wait = rounds.plan_wait(
            lp.standing, base, f"{lp.cfg.run}/{r}/{p}", fresh=fresh_round(r), now=blocked_from,
            deadline=lp.deadline.value() + spread, grace=lp.cfg.deadline_low / 2, me=me)
        self.mode = lp._mode(p)
        if self.mode != "scatter":
            if me in pending.announced and me not in pending.updates:  # announced when the round was to scatter
                own = await asyncio.to_thread(lp._own_update, pending)
                if own is not None:
                    pending.updates[me] = own
                else:
                    lp.counters["own_update_dropped"] += 1
                    logger.warning("diloco round %d/%d: our update's bytes were dropped by the bulk store; the "
                                   "round closes without it", r, p)
            for peer in sorted(set(pending.announced) - pending.pulling - set(pending.updates)):
                lp._start_pull(key, pending, peer)  # announced while we were in the other mode
        self.chain_head = lp._chain(r, p)[:1] if lp.cfg.agree else ()
        await self._wait_asking(wait)
        # closing with our own update alone while the others are behind (a slow exchange, a checkpoint on its way)
        # would leave them nothing to follow: wait on for them, up to deadline_high (rounds.RoundWait.hold_alone)
        if alive := wait.hold_alone(self.have(), lp.links.heard, now=lp.clock.monotonic(), began=blocked_from,
                                    longest=lp.cfg.deadline_high):
            lp.counters["held_alone"] += 1
            logger.info("diloco round %d/%d: no one else's update yet while %d peer(s) we wait for are still in the "
                        "run; waiting up to deadline_high (%.0f s)", r, p, alive, lp.cfg.deadline_high)
            await lp._wait_round(wait, lp._event, self.have, self.coming, self.covered)
        if self.covered() and not wait.waited <= self.have():
            lp.counters["closed_on_coordinator_view"] += 1
        lp.counters["newcomers_not_waited"] += wait.newcomers_not_waited(self.have(), self.coming())
        if not wait.waited <= self.have():
            lp.counters["deadline_missed"] += 1
            logger.warning("diloco round %d/%d closed without %s", r, p, sorted(wait.waited - self.have()))
        for peer, t in pending.arrivals.items():
            lp.deadline.observe(t - pending.opened)
        return wait.waited - self.have(), lp.clock.monotonic() - blocked_from

    async def _wait_asking(self, wait: rounds.RoundWait) -> None:
        """The round's wait (``_wait_round``), and meanwhile: an update announcement we wait for that a counted
        peer's member view names (it closed the round holding it) and gossip has not brought us a little after that
        view came (FETCH_AFTER, or a quarter of deadline_low if less) is asked of that peer (one peer at a time,
        each once; checked as any fetched announcement). Without it, a peer whose gossip lost one announcement
        waits to its deadline every round, closes after the others have stopped waiting for it, and is left out,
        round after round (the simulator: a peer blind to another's announcements). Ends early once ``covered()``
        (the coordinator's view is here and we hold everything it names)."""
        lp, r, p, pending = self.loop, self.r, self.p, self.pending
        if lp.faults and lp.faults.drops("ask-early", lp, r=r, p=p):
            await lp._wait_round(wait, lp._event, self.have, self.coming)
            return
        after = min(FETCH_AFTER, lp.cfg.deadline_low / 4)  # the wait may be no longer than deadline_low
        asked: set[str] = set()
        fetch: asyncio.Task | None = None
        try:
            while not self.covered() and (left := wait.remaining(lp.clock.monotonic(), self.have(),
                                                                 self.coming())) is not None:
                now = lp.clock.monotonic()
                if fetch is None or fetch.done():
                    lacking = {rounds.short_id(a) for a in wait.waited if a not in pending.announced}
                    due = [(t, a) for a, t in pending.view_at.items()
                           if a not in asked and lacking & pending.views[a]]
                    ready = min(((t, a) for t, a in due if now >= t + after), default=None)
                    if ready is not None:
                        author = ready[1]  # the view that came first
                        asked.add(author)
                        lp.counters["announcements_asked_early"] += 1
                        fetch = asyncio.get_running_loop().create_task(
                            lp._fetch_announcements(author, r, p, sorted(lacking & pending.views[author])))
                        continue
                    if due:
                        left = min(left, max(min(t for t, _ in due) + after - now, rounds.TICK))
                await outer.wait_event(lp._event, left)
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()

    # ------------------------------------------------------------------ the members
    async def _screen(self) -> tuple[str, dict[str, str]]:
        """After the wait: the last close redone if this round's updates say so, then the updates from other
        weights than ours (and, in scatter, cut into another part count) left out. Returns the base hash we close
        with and who was left out why."""
        lp, pending = self.loop, self.pending
        await lp._redo_last_close(self.p, self.r, pending, self.have())
        base_now = lp._base_hash(self.p)
        other_base = {}
        for peer in [a for a, ann in pending.announced.items() if ann.base != base_now and a in self.have()]:
            # announced ahead of us, from other weights than the ones we close with
            pending.updates.pop(peer, None)
            del pending.announced[peer]
            lp.counters["rejected_base"] += 1
            other_base[peer] = "base"
        if self.mode == "scatter":
            # the round's part count: the one most of its updates from our weights have (each peer cut its update
            # as the last round's members call for: the same count wherever that round closed with the same
            # members); ours first on a tie. An update cut otherwise is not counted here, ours included: its
            # author closed the last round with other members, and follows this one
            ours, present = lp._round_parts(self.key), self.have()
            counts = collections.Counter(len(ann.parts) for a, ann in pending.announced.items() if a in present)
            pending.count = max(counts, key=lambda c: (counts[c], c == ours), default=ours)
            for peer in [a for a, ann in pending.announced.items() if a in present and len(ann.parts) != pending.count]:
                del pending.announced[peer]
                lp.counters["rejected_part_count"] += 1
                other_base[peer] = "part_count"
        return base_now, other_base

    async def _members(self, base_now: str) -> tuple[set[str], dict[str, str], float]:
        """The round's members as the swarm agrees them, less replayed updates (returned apart, refused), and when
        the exchange started."""
        lp, pending, wait = self.loop, self.pending, self.wait
        contributing = self.r >= self.frag.join_round
        have = self.have()
        lp.counters["newcomer_updates"] += len(wait.slots & have)
        members = {peer for peer in have
                   if peer in wait.expected or peer in wait.slots or (peer == self.me and contributing)}
        agreeing = lp.clock.monotonic()
        if pending.sent_at is not None:
            lp.timings.phases["wait"].append(agreeing - max(pending.sent_at, self.blocked_from))
        members = await self._agree(members, base_now)
        replayed = lp._replays(self.p, pending, members)
        members -= set(replayed)
        started = lp.clock.monotonic()
        lp.timings.phases["agree"].append(started - agreeing)
        return members, replayed, started

    async def _agree(self, members: set[str], base: str) -> set[str]:
        """The round's members, the same at every peer (``rounds.MemberAgreement``): we publish our view and take
        the view of the round's coordinator. The peers it names must have announced an update from our weights
        (an announcement still on its way is waited for), and in all-to-all their updates are pulled: all within
        one span (``_span``), after which what is missing is left out (we may then end on other weights than the
        others, and resync or redo after the close: ``_check_previous``). A coordinator's view naming more newcomers
        than a round takes is not followed (ours is)."""
        lp, r, p, pending, me = self.loop, self.r, self.p, self.pending, self.me
        if not lp.cfg.agree or len(members) > MAX_VIEW:
            return members
        mine = sorted(rounds.short_id(a) for a in members)
        lp._publish(MEMBERS, {"r": r, "p": p, "m": mine})
        chain = lp._chain(r, p)
        # one span: the coordinator's view and the announcements it names come over gossip, which a loaded peer
        # (16 nodes on 2 cores) delivers seconds late: a deadline alone split views there
        now, span = lp.clock.monotonic(), lp._span(p)
        end = now + span
        agreement = rounds.MemberAgreement(me, chain, end)
        late = chain and chain[0] == me and rounds.too_late_to_coordinate(me, chain, now, pending.view_at, span)
        if late:
            agreement = agreement.after(now)
            lp.counters["coordinator_too_late"] += 1
            logger.info("diloco round %d/%d: we coordinate it, but most of the chain stopped waiting for our view "
                        "a span ago; taking the next coordinator's, as they did", r, p)
        while (left := agreement.remaining(lp.clock.monotonic(), pending.views)) is not None:
            await outer.wait_event(lp._event, left)
        chosen = agreement.coordinator(pending.views)
        if chosen is not None and chosen != chain[0] and not late:
            lp.counters["coordinator_missing"] += 1
            logger.info("diloco round %d/%d: no member view from its coordinator %s; %s's taken", r, p,
                        chain[0][-8:], chosen[-8:])
        if chosen is None or chosen == me or pending.views[chosen] == frozenset(mine):
            pending.coordinator = chosen
            return members
        agreed = await self._named_by(chosen, base, end)
        if sum(not lp.standing.counts(a) for a in agreed - members) > MAX_NEWCOMER_PULLS:
            lp.counters["views_not_followed"] += 1
            return members
        if self.mode != "scatter":  # the updates themselves, pulled (most are already)
            agreed = await self._pulled(agreed, chosen, end)
        lp.counters["members_from_coordinator"] += 1
        pending.coordinator = chosen
        if me in members and me not in agreed:
            # our update reached the coordinator after its deadline: we are behind the others in time, and the
            # next rounds, whose candidates are this round's members, would not wait for us either (we would be
            # left out round after round). Ask to be waited for, as a joiner does: the next rounds then wait for
            # us (a deadline at most) and we are back in step
            lp.counters["own_update_left_out"] += 1
            for ahead in (r + 1, r + 2):
                lp._publish(JOIN, {"r": ahead, "p": p, "join": True})
        return agreed

    async def _named_by(self, chosen: str, base: str, end: float) -> set[str]:
        """The peers ``chosen``'s member view names whose announcement (from ``base``) we hold, waited for up to
        ``end`` (and asked of the coordinator when gossip has not brought them)."""
        lp, r, p, pending = self.loop, self.r, self.p, self.pending
        view = pending.views[chosen]

        def named() -> tuple[set[str], int]:
            return rounds.resolve_view(view, {rounds.short_id(a): a for a, ann in pending.announced.items()
                                              if ann.base == base and a not in pending.failed})

        fetch, fetch_end = None, end
        asked_at = lp.clock.monotonic() + min(FETCH_AFTER, max(end - lp.clock.monotonic(), 0.0) / 4)
        try:
            while (agreed := named())[1] and (lp.clock.monotonic() < end - rounds.TICK or (
                    fetch is not None and not fetch.done() and lp.clock.monotonic() < fetch_end)):
                if fetch is None and lp.clock.monotonic() >= asked_at:
                    # gossip has not brought some of the updates it names: ask the coordinator, which holds them
                    # (a request and its answers: given FETCH_WAIT past the span if it needs it)
                    known = {rounds.short_id(a) for a in pending.announced}
                    fetch = asyncio.get_running_loop().create_task(
                        lp._fetch_announcements(chosen, r, p, sorted(set(view) - known)))
                    fetch_end = max(end, lp.clock.monotonic() + FETCH_WAIT)
                wait = (fetch_end if fetch is not None else asked_at) - lp.clock.monotonic()
                await outer.wait_event(lp._event, max(wait, rounds.TICK))
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()
        agreed, unknown = agreed
        if unknown:
            lp.counters["view_peers_unknown"] += unknown
            logger.warning("diloco round %d/%d: %d peer(s) of %s's member view never announced an update here", r,
                           p, unknown, chosen[-8:])
        return agreed

    async def _pulled(self, agreed: set[str], chosen: str, end: float) -> set[str]:
        """All-to-all: the agreed members whose updates came by ``end`` (their pulls started where they were not)."""
        lp, pending = self.loop, self.pending
        for peer in sorted(agreed - set(pending.updates) - pending.pulling):
            lp._start_pull(self.key, pending, peer)
        await outer.wait_until(lambda: agreed - pending.failed <= set(pending.updates), lp._event,
                               end - lp.clock.monotonic())
        if missing := agreed - set(pending.updates):  # we combine without them: the others may not
            lp.counters["view_updates_missing"] += len(missing)
            logger.warning("diloco round %d/%d: the update of %s, which %s's member view names, did not come "
                           "within the span; combined without it", self.r, self.p, sorted(a[-8:] for a in missing),
                           chosen[-8:])
        return agreed & set(pending.updates)

    # ------------------------------------------------------------------ the exchange and the outer step
    async def _combine(self, members: set[str], base_now: str,
                       started: float) -> tuple[torch.Tensor | None, dict[str, str]]:
        """The members' updates combined (None: nothing to combine), and the refused ones with why."""
        self.exchange = EXCHANGES[self.mode](self, members, base_now, started)
        return await self.exchange.combine()

    def _time(self, members: set[str], started: float) -> None:
        """Where the round's time went (``/status``: timings, the exchange's view)."""
        lp, pending = self.loop, self.pending
        if pending.sent_at is not None:  # our update announced -> the round's combined update in hand
            lp.timings.exchange.append(lp.clock.monotonic() - pending.sent_at)
        lp.timings.close.append(lp.clock.monotonic() - started)  # every update announced -> combined update in hand
        lp.record.exchange = {"mode": self.mode, "round": self.r, "fragment": self.p, "members": len(members),
                            "parts": lp._round_parts(self.key),
                            **(lp.links.assignment if self.mode == "scatter" else {}),
                            "close_seconds": round(lp.timings.close[-1], 3),
                            "close_seconds_median": round(statistics.median(lp.timings.close), 3),
                            "round_seconds_median": round(statistics.median(lp.timings.exchange), 3)
                            if lp.timings.exchange else None,
                            "phase_seconds_median": {k: round(statistics.median(v), 3)
                                                     for k, v in lp.timings.phases.items() if v}}
        lp.timings.blocked += lp.clock.monotonic() - self.blocked_from

    def _judge(self, members: set[str], rejected: dict[str, str], other_base: dict[str, str], missing: set[str],
               waited_s: float) -> set[str]:
        """The refused updates' senders penalised, the round recorded; returns its participants (the members
        whose update was combined)."""
        lp = self.loop
        for peer, reason in rejected.items():
            lp.counters[f"rejected_{reason}"] += 1
            # "uncorrelated" is a statistical judgement (near convergence an honest update can be mostly its
            # shard's noise: 5 of 16 honest peers got it in one simulated round), so it costs a suspect's weight,
            # not a malformed message's; the update is refused either way
            kind = "suspect" if reason == "uncorrelated" else "invalid_message"
            lp._ctx.transport.penalties.penalize(peer, kind, f"diloco update {reason}")
        participants = members - set(rejected)
        lp._record_round(self.r, fragment=self.p, waited_s=waited_s, deadline_s=lp.deadline.value(),
                         participants=participants, missing=missing, rejected={**other_base, **rejected})
        lp.standing.record(participants)
        lp.book.closed_contributed(self.r, self.p, participants)
        # in scatter our update is in the round where every part we ended on combines our chunk
        without = self.exchange.without() if isinstance(self.exchange, ScatterRound) else set()
        lp.counters["members_missing_from_parts"] += len(without & participants)
        ours = self.me in participants and self.me not in without
        lp.counters["rounds_with_our_update" if ours else "rounds_without_our_update"] += 1
        return participants

    async def _apply(self, combined: torch.Tensor | None) -> str:
        """The outer step and the merge into our parameters; returns the new global hash."""
        lp, p, frag = self.loop, self.p, self.frag
        broken, frag.skipped = bool(frag.skipped), None
        scatter = self.mode == "scatter"

        def apply() -> tuple[torch.Tensor, str, str]:
            """The outer step, the merge into our parameters and the new global hashes: passes over the whole
            fragment (seconds for a large model) that held the event loop, so they run in a worker thread; the
            training loop waits for it here, so nothing else changes the weights meanwhile."""
            # in scatter the combined update is a buffer of ours, used by nothing else: the new weights take its place
            new = frag.weights if combined is None else lp.replica.outer_opt.step(p, frag.weights, combined,
                                                                                consume=scatter)
            # a peer whose training went wrong (non-finite loss or weights) takes the global weights as they are
            outer.merge_into(lp.replica.of(frag), new, lp.cfg.alpha, broken=broken)
            if combined is None:
                return new, lp.global_hash(), ""  # unchanged: the cached hash
            flat = [*(w := lp.fragments.weights())[:p], new, *w[p + 1:]]
            return new, outer.params_hash(flat), outer.params_hash([new]) if len(flat) > 1 else ""

        new, h, hp = await asyncio.to_thread(apply)
        if new is not frag.weights:
            # the new weights and their hashes become visible together, here on the event loop: an announcement
            # checked meanwhile sees the old ones and their cached hashes (never a version bumped by the worker
            # thread, whose new weights it would hash itself, on the loop)
            before = lp.fragments.replace(p, new, h, hp)
            # the old weights, where nothing holds them any more (a redo's inputs or a checkpoint being written
            # would): the buffer of the next round's combined update
            lp._buffers.give(before)
            del before
        return h

    def _next_candidates(self, members: set[str], participants: set[str]) -> None:
        """Whom the fragment's next round waits for, in which order its coordinators come, and how many peers'
        steps the inner optimizer averages."""
        lp, frag = self.loop, self.frag
        # the next round's candidates are this round's members, refused or not: a refusal judges one update, not
        # the peer (an honest update near convergence can be mostly its shard's noise, and in scatter only the
        # reducers of a part see its chunks), and every peer agrees on the members, the refused one included, so
        # it counts itself in next round exactly when the others do (were the others to drop a refused peer that
        # counts itself in, it would combine another set of updates and resync; the simulator shows it).
        # A refused peer earns no standing (below), so one refused round after round stops counting and is waited
        # for only as a newcomer, and the penalties ban a sender of garbage
        if members - {self.me}:
            frag.participants = set(members)
            # their weights by the rates their announcements report: the next round's chain of coordinators puts
            # the slow ones last (every peer that closed this round with these members computes the same)
            lp.links.chain_weights[self.p] = exchange.rate_weights(
                members, {a: dict(self.pending.announced[a].rates) for a in members if a in self.pending.announced},
                rounds.short_id)
        else:
            # a round that had no one else's update (every other one late or from other weights) says nothing
            # about who is in the run: the next round waits for the same peers as this one did, or each peer would
            # go on alone, waiting for no one, and the run would split into solo runs for good (found by the
            # simulator). Peers that are really gone stop counting after a few missed rounds (protocols.standing),
            # so this costs at most those rounds' deadlines
            frag.participants = frag.last_members(lp.start_state.initial) | members
        if isinstance(lp.replica.inner_opt, SwarmAdamW) and participants:
            lp.replica.inner_opt.set_peers(len(participants))  # the next round averages about as many peers' steps

    def finalize(self) -> None:
        """The round's end: its prefetches cancelled, its book entry and the blobs no round keeps given back."""
        lp, r, p, pending = self.loop, self.r, self.p, self.pending
        for (peer, k), task in pending.prefetched.items():
            if (peer, k) not in pending.prefetch_used and task.done() and not task.cancelled() \
                    and task.exception() is None:
                lp.counters["chunks_prefetched_unused"] += 1  # a wrong guess of our parts: its bytes for nothing
            task.cancel()
        closed = lp.book.pending.pop(self.key, None)
        if closed is not None:
            lp._fold_rates(closed.meter)
        lp.book.closed_signed(r, p, closed)
        if (going := lp.book.blobs_going(r, p)) is not None:
            lp.bulk.drop(going)
        lp.book.closed_joins(r, p)
        if r + 1 < self.frag.join_round:
            # still following: say again from which round we contribute (a peer that missed the join, or started
            # since, must wait for us then); a set at the receivers, so a repeat costs a small message a round
            lp._publish(JOIN, {"r": self.frag.join_round, "p": p, "join": True})
        lp.counters["rounds"] += 1
        if lp.links.probe_blobs:  # the others probed us before their first update
            lp.bulk.drop(lp.links.probe_blobs)
            lp.links.probe_blobs = []
