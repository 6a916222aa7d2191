"""Closing a round of one fragment: the wait for its members' updates, the member agreement, the
combination and outer step, and what the round keeps after (its blobs, its history)."""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics

import torch
from swarmd.protocols import exchange, outer, rounds
from swarmd.protocols.diloco.pending import Pending, Received, Redo
from swarmd.protocols.diloco.wire import (
    FETCH_AFTER,
    FETCH_WAIT,
    JOIN,
    MAX_LATE_PULLS,
    MAX_NEWCOMER_PULLS,
    MAX_VIEW,
    MEMBERS,
    ROUND_HASH,
)
from swarmd.protocols.inner import SwarmAdamW
from swarmd.protocols.standing import fresh_round

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class CloseMixin:
    """DilocoLoop's close methods (the loop composes them; they share its state)."""

    async def _close_round(self, p: int, r: int) -> None:
        key = (r, p)
        pending = self.book.pending[key]
        me = self._ctx.identity.peer_id
        # the peers whose word counts are waited for, and a few newcomers (peers that announced a join, or
        # contributed last round without standing yet; brand-new ones only in fresh rounds), picked the same way
        # everywhere: a fresh key can neither add itself to the set every round waits for nor stall many rounds
        # (a round's joins are popped once it closes)
        base = self.participants.get(p, self.start_state.initial) | self.book.joins.get(key, set())
        blocked_from = self.clock.monotonic()
        # a newcomer holding a slot gets half of deadline_low once every counting peer is in (then the deadline
        # only if its update is on its way). Half: a peer that did not see the join (gossip is not instant) goes
        # on at once and is that much ahead in the next round, whose deadline is deadline_low at least: the
        # others still make it in time
        # plus the time our last exchange took: the peers ended it at different times (a slow uplink serves its
        # receivers one after another), and so announce this round that much apart; with the deadline alone, a
        # round after a slow exchange closes with whoever is first, and the swarm splits (the simulator: one
        # peer's uplink down to 50 kB/s mid-run, rounds of 1-2 members after it)
        spread = min(self.timings.close[-1], self.cfg.deadline_high) if self.timings.close else 0.0
        wait = rounds.plan_wait(self.standing, base, f"{self.cfg.run}/{r}/{p}", fresh=fresh_round(r), now=blocked_from,
                                deadline=self.deadline.value() + spread, grace=self.cfg.deadline_low / 2, me=me)
        expected, slots, waited = wait.expected, wait.slots, wait.waited
        mode = self._mode(p)
        if mode == "scatter":  # an announcement is all a round waits for: the bytes move after the close
            def have() -> set[str]:
                return set(pending.announced)
        else:
            if me in pending.announced and me not in pending.updates:  # announced when the round was to scatter
                own = await asyncio.to_thread(self._own_update, pending)
                if own is not None:
                    pending.updates[me] = own
                else:
                    self.counters["own_update_dropped"] += 1
                    logger.warning("diloco round %d/%d: our update's bytes were dropped by the bulk store; the "
                                   "round closes without it", r, p)

            def have() -> set[str]:
                return set(pending.updates)
            for peer in sorted(set(pending.announced) - pending.pulling - set(pending.updates)):
                self._start_pull(key, pending, peer)  # announced while we were in the other mode

        def coming() -> set[str]:
            return set(pending.announced) - pending.failed

        coordinator = self._chain(r, p)[:1] if self.cfg.agree else ()

        def covered() -> bool:
            """The round's coordinator's member view is here and names only peers whose contribution we hold: we
            take its view (``_agree``), so waiting on for anyone else changes nothing. Without this, a joiner (its
            deadline deadline_high, before it has measured one) waits that long for a peer killed meanwhile,
            which the coordinator left out, and falls behind the others (the simulator shows it)."""
            if not coordinator or coordinator[0] == me or coordinator[0] not in pending.views:
                return False
            return not rounds.resolve_view(pending.views[coordinator[0]], {rounds.short_id(a): a for a in have()})[1]

        await self._wait_asking(key, pending, wait, have, coming, covered)
        # closing with our own update alone while the others are behind (a slow exchange, a checkpoint on its way)
        # would leave them nothing to follow: wait on for them, up to deadline_high (rounds.RoundWait.hold_alone)
        if alive := wait.hold_alone(have(), self.links.heard, now=self.clock.monotonic(), began=blocked_from,
                                    longest=self.cfg.deadline_high):
            self.counters["held_alone"] += 1
            logger.info("diloco round %d/%d: no one else's update yet while %d peer(s) we wait for are still in the "
                        "run; waiting up to deadline_high (%.0f s)", r, p, alive, self.cfg.deadline_high)
            await self._wait_round(wait, self._event, have, coming, covered)
        if covered() and not wait.waited <= have():
            self.counters["closed_on_coordinator_view"] += 1
        self.counters["newcomers_not_waited"] += wait.newcomers_not_waited(have(), coming())
        if not waited <= have():
            self.counters["deadline_missed"] += 1
            logger.warning("diloco round %d/%d closed without %s", r, p, sorted(waited - have()))
        for peer, t in pending.arrivals.items():
            self.deadline.observe(t - pending.opened)
        missing = waited - have()
        waited_s = self.clock.monotonic() - blocked_from
        await self._redo_last_close(p, r, pending, have())
        base_now = self._base_hash(p)
        other_base = {}
        for peer in [a for a, ann in pending.announced.items() if ann.base != base_now and a in have()]:
            # announced ahead of us, from other weights than the ones we close with
            pending.updates.pop(peer, None)
            del pending.announced[peer]
            self.counters["rejected_base"] += 1
            other_base[peer] = "base"
        if mode == "scatter":
            # the round's part count: the one most of its updates from our weights have (each peer cut its update
            # as the last round's members call for: the same count wherever that round closed with the same
            # members); ours first on a tie. An update cut otherwise is not counted here, ours included: its
            # author closed the last round with other members, and follows this one
            ours, present = self._round_parts(key), have()
            counts = collections.Counter(len(ann.parts) for a, ann in pending.announced.items() if a in present)
            pending.count = max(counts, key=lambda c: (counts[c], c == ours), default=ours)
            for peer in [a for a, ann in pending.announced.items() if a in present and len(ann.parts) != pending.count]:
                del pending.announced[peer]
                self.counters["rejected_part_count"] += 1
                other_base[peer] = "part_count"
        contributing = r >= self.join_round.get(p, 0)
        self.counters["newcomer_updates"] += len(slots & have())
        members = {peer for peer in have() if peer in expected or peer in slots or (peer == me and contributing)}
        agreeing = self.clock.monotonic()
        if pending.sent_at is not None:
            self.timings.phases["wait"].append(agreeing - max(pending.sent_at, blocked_from))
        members = await self._agree(key, pending, members, base_now, mode)
        replayed = self._replays(p, pending, members)
        members -= set(replayed)
        started = self.clock.monotonic()
        self.timings.phases["agree"].append(started - agreeing)
        self._drop_redo(p)
        if mode == "scatter":
            self.book.moving[key] = Received(started, last=started)
            pending.linked = frozenset(self._ctx.members())
            try:
                combined, rejected = await self._scatter(key, pending, members)
            finally:
                self._measure_rate(self.book.moving.pop(key))
        else:
            updates = {a: pending.updates[a] for a in members}
            if self.faults:
                await self.faults.enter("reduce", self, r=r, p=p)
            combined, rejected = await asyncio.to_thread(outer.combine, updates, self.global_flat[p].numel())
            self.timings.phases["combine"].append(self.clock.monotonic() - started)
            if (len(updates) + 2 + MAX_LATE_PULLS) * 4 * self.global_flat[p].numel() <= self.cfg.redo_bytes:
                late = sorted((pending.arrivals[a], a) for a in members if a != me and a in pending.arrivals)
                redo = self._redo[p] = Redo(r, frozenset(members), updates, self.global_flat[p], base_now,
                                            self.outer_opt.buffers[p].clone(), late[-1][1] if late else None)
                # counted peers' updates still being pulled: kept for a redo when they come
                on_way = sorted(a for a in pending.pulling - set(pending.updates) - pending.failed
                                if pending.announced.get(a) and pending.announced[a].base == base_now
                                and self.standing.counts(a))
                redo.pulling.update(dict.fromkeys(on_way[:MAX_LATE_PULLS]))
        rejected.update(replayed)
        rejected.update({a: why for a, why in pending.refused.items() if a not in rejected})
        if pending.sent_at is not None:  # our update announced -> the round's combined update in hand
            self.timings.exchange.append(self.clock.monotonic() - pending.sent_at)
        self.timings.close.append(self.clock.monotonic() - started)  # every update announced -> combined update in hand
        self.exchange_view = {"mode": mode, "round": r, "fragment": p, "members": len(members),
                              "parts": self._round_parts(key),
                              **(self.links.assignment if mode == "scatter" else {}),
                              "close_seconds": round(self.timings.close[-1], 3),
                              "close_seconds_median": round(statistics.median(self.timings.close), 3),
                              "round_seconds_median": round(statistics.median(self.timings.exchange), 3)
                              if self.timings.exchange else None,
                              "phase_seconds_median": {k: round(statistics.median(v), 3)
                                                       for k, v in self.timings.phases.items() if v}}
        self.timings.blocked += self.clock.monotonic() - blocked_from
        for peer, reason in rejected.items():
            self.counters[f"rejected_{reason}"] += 1
            # "uncorrelated" is a statistical judgement (near convergence an honest update can be mostly its
            # shard's noise: 5 of 16 honest peers got it in one simulated round), so it costs a suspect's weight,
            # not a malformed message's; the update is refused either way
            kind = "suspect" if reason == "uncorrelated" else "invalid_message"
            self._ctx.transport.penalties.penalize(peer, kind, f"diloco update {reason}")
        participants = members - set(rejected)
        self._record_round(r, fragment=p, waited_s=waited_s, deadline_s=self.deadline.value(),
                           participants=participants, missing=missing, rejected={**other_base, **rejected})
        self.standing.record(participants)
        self.book.closed_contributed(r, p, participants)
        self.counters["rounds_with_our_update" if me in participants else "rounds_without_our_update"] += 1
        broken = bool(self.skipped.pop(p, None))

        def apply() -> tuple[torch.Tensor, str, str]:
            """The outer step, the merge into our parameters and the new global hashes: passes over the whole
            fragment (seconds for a large model) that held the event loop, so they run in a worker thread; the
            training loop waits for it here, so nothing else changes the weights meanwhile."""
            # in scatter the combined update is a buffer of ours, used by nothing else: the new weights take its place
            new = self.global_flat[p] if combined is None else self.outer_opt.step(p, self.global_flat[p], combined,
                                                                                 consume=mode == "scatter")
            # a peer whose training went wrong (non-finite loss or weights) takes the global weights as they are
            outer.merge_into([self.params[i] for i in self.frag_index[p]], new, self.cfg.alpha, broken=broken)
            if combined is None:
                return new, self.global_hash(), ""  # unchanged: the cached hash
            flat = [*self.global_flat[:p], new, *self.global_flat[p + 1:]]
            return new, outer.params_hash(flat), outer.params_hash([new]) if len(flat) > 1 else ""

        new, h, hp = await asyncio.to_thread(apply)
        if new is not self.global_flat[p]:
            # the new weights and their hashes become visible together, here on the event loop: an announcement
            # checked meanwhile sees the old ones and their cached hashes (never a version bumped by the worker
            # thread, whose new weights it would hash itself, on the loop)
            before, self.global_flat[p] = self.global_flat[p], new
            self._global_version += 1
            self._hashes[None] = (self._global_version, h)
            if hp:
                self._hashes[p] = (self._global_version, hp)
            # the old weights, where nothing holds them any more (a redo's inputs or a checkpoint being written
            # would): the buffer of the next round's combined update
            self._buffers.give(before)
            del before
        # the next round's candidates are this round's members, refused or not: a refusal judges one update, not
        # the peer (an honest update near convergence can be mostly its shard's noise, and in scatter only the
        # reducers of a part see its chunks), and every peer agrees on the members, the refused one included, so
        # it counts itself in next round exactly when the others do (were the others to drop a refused peer that
        # counts itself in, it would combine another set of updates and resync; the simulator shows it).
        # A refused peer earns no standing (below), so one refused round after round stops counting and is waited
        # for only as a newcomer, and the penalties ban a sender of garbage
        if members - {me}:
            self.participants[p] = set(members)
            # their weights by the rates their announcements report: the next round's chain of coordinators puts
            # the slow ones last (every peer that closed this round with these members computes the same)
            self.links.chain_weights[p] = exchange.rate_weights(
                members, {a: dict(pending.announced[a].rates) for a in members if a in pending.announced},
                rounds.short_id)
        else:
            # a round that had no one else's update (every other one late or from other weights) says nothing
            # about who is in the run: the next round waits for the same peers as this one did, or each peer would
            # go on alone, waiting for no one, and the run would split into solo runs for good (found by the
            # simulator). Peers that are really gone stop counting after a few missed rounds (protocols.standing),
            # so this costs at most those rounds' deadlines
            self.participants[p] = self.participants.get(p, self.start_state.initial) | members
        if isinstance(self.inner_opt, SwarmAdamW) and participants:
            self.inner_opt.set_peers(len(participants))  # the next round averages about as many peers' steps
        self._check_previous(p, r)
        self.history.append({"round": r, "fragment": p, "participants": len(participants), "global_hash": h})
        self._publish(ROUND_HASH, {"r": r, "p": p, "h": h})
        self.book.closed_published(r, p, h)
        for (peer, k), task in pending.prefetched.items():
            if (peer, k) not in pending.prefetch_used and task.done() and not task.cancelled() \
                    and task.exception() is None:
                self.counters["chunks_prefetched_unused"] += 1  # a wrong guess of our parts: its bytes for nothing
            task.cancel()
        closed = self.book.pending.pop(key, None)
        if closed is not None:
            self._fold_rates(closed.meter)
        self.book.closed_signed(r, p, closed)
        self._drop_round_blobs(p, r)
        self.book.closed_joins(r, p)
        if r + 1 < self.join_round.get(p, 0):
            # still following: say again from which round we contribute (a peer that missed the join, or started
            # since, must wait for us then); a set at the receivers, so a repeat costs a small message a round
            self._publish(JOIN, {"r": self.join_round[p], "p": p, "join": True})
        self.counters["rounds"] += 1
        if self.links.probe_blobs:  # the others probed us before their first update
            self.bulk.drop(self.links.probe_blobs)
            self.links.probe_blobs = []

    def _drop_round_blobs(self, p: int, r: int) -> None:
        if (going := self.book.blobs_going(r, p)) is not None:
            self.bulk.drop(going)

    async def _wait_asking(self, key: tuple[int, int], pending: Pending, wait: rounds.RoundWait, have, coming,
                           covered=lambda: False) -> None:
        """The round's wait (``_wait_round``), and meanwhile: an update announcement we wait for that a counted
        peer's member view names (it closed the round holding it) and gossip has not brought us a little after that
        view came (FETCH_AFTER, or a quarter of deadline_low if less) is asked of that peer (one peer at a time,
        each once; checked as any fetched announcement). Without it, a peer whose gossip lost one announcement
        waits to its deadline every round, closes after the others have stopped waiting for it, and is left out,
        round after round (the simulator: a peer blind to another's announcements). Ends early once ``covered()``
        (the coordinator's view is here and we hold everything it names)."""
        r, p = key
        if self.faults and self.faults.drops("ask-early", self, r=r, p=p):
            await self._wait_round(wait, self._event, have, coming)
            return
        after = min(FETCH_AFTER, self.cfg.deadline_low / 4)  # the wait may be no longer than deadline_low
        asked: set[str] = set()
        fetch: asyncio.Task | None = None
        try:
            while not covered() and (left := wait.remaining(self.clock.monotonic(), have(), coming())) is not None:
                now = self.clock.monotonic()
                if fetch is None or fetch.done():
                    lacking = {rounds.short_id(a) for a in wait.waited if a not in pending.announced}
                    due = [(t, a) for a, t in pending.view_at.items()
                           if a not in asked and lacking & pending.views[a]]
                    ready = min(((t, a) for t, a in due if now >= t + after), default=None)
                    if ready is not None:
                        author = ready[1]  # the view that came first
                        asked.add(author)
                        self.counters["announcements_asked_early"] += 1
                        fetch = asyncio.get_running_loop().create_task(
                            self._fetch_announcements(author, r, p, sorted(lacking & pending.views[author])))
                        continue
                    if due:
                        left = min(left, max(min(t for t, _ in due) + after - now, rounds.TICK))
                await outer.wait_event(self._event, left)
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()

    async def _agree(self, key: tuple[int, int], pending: Pending, members: set[str], base: str,
                     mode: str) -> set[str]:
        """The round's members, the same at every peer (``rounds.MemberAgreement``): we publish our view and take
        the view of the round's coordinator. The peers it names must have announced an update from our weights
        (an announcement still on its way is waited for), and in all-to-all their updates are pulled: all within
        one span (``_span``), after which what is missing is left out (we may then end on other weights than the
        others, and resync or redo after the close: ``_check_previous``). A coordinator's view naming more newcomers
        than a round takes is not followed (ours is)."""
        r, p = key
        me = self._ctx.identity.peer_id
        if not self.cfg.agree or len(members) > MAX_VIEW:
            return members
        mine = sorted(rounds.short_id(a) for a in members)
        self._publish(MEMBERS, {"r": r, "p": p, "m": mine})
        chain = self._chain(r, p)
        # one span: the coordinator's view and the announcements it names come over gossip, which a loaded peer
        # (16 nodes on 2 cores) delivers seconds late: a deadline alone split views there
        now, span = self.clock.monotonic(), self._span(p)
        end = now + span
        agreement = rounds.MemberAgreement(me, chain, end)
        late = chain and chain[0] == me and rounds.too_late_to_coordinate(me, chain, now, pending.view_at, span)
        if late:
            agreement = agreement.after(now)
            self.counters["coordinator_too_late"] += 1
            logger.info("diloco round %d/%d: we coordinate it, but most of the chain stopped waiting for our view "
                        "a span ago; taking the next coordinator's, as they did", r, p)
        while (left := agreement.remaining(self.clock.monotonic(), pending.views)) is not None:
            await outer.wait_event(self._event, left)
        chosen = agreement.coordinator(pending.views)
        if chosen is not None and chosen != chain[0] and not late:
            self.counters["coordinator_missing"] += 1
            logger.info("diloco round %d/%d: no member view from its coordinator %s; %s's taken", r, p,
                        chain[0][-8:], chosen[-8:])
        if chosen is None or chosen == me or pending.views[chosen] == frozenset(mine):
            pending.coordinator = chosen
            return members
        view = pending.views[chosen]

        def named() -> tuple[set[str], int]:
            return rounds.resolve_view(view, {rounds.short_id(a): a for a, ann in pending.announced.items()
                                              if ann.base == base and a not in pending.failed})

        fetch, fetch_end = None, end
        asked_at = self.clock.monotonic() + min(FETCH_AFTER, max(end - self.clock.monotonic(), 0.0) / 4)
        try:
            while (agreed := named())[1] and (self.clock.monotonic() < end - rounds.TICK or (
                    fetch is not None and not fetch.done() and self.clock.monotonic() < fetch_end)):
                if fetch is None and self.clock.monotonic() >= asked_at:
                    # gossip has not brought some of the updates it names: ask the coordinator, which holds them
                    # (a request and its answers: given FETCH_WAIT past the span if it needs it)
                    known = {rounds.short_id(a) for a in pending.announced}
                    fetch = asyncio.get_running_loop().create_task(
                        self._fetch_announcements(chosen, r, p, sorted(set(view) - known)))
                    fetch_end = max(end, self.clock.monotonic() + FETCH_WAIT)
                wait = (fetch_end if fetch is not None else asked_at) - self.clock.monotonic()
                await outer.wait_event(self._event, max(wait, rounds.TICK))
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()
        agreed, unknown = agreed
        if unknown:
            self.counters["view_peers_unknown"] += unknown
            logger.warning("diloco round %d/%d: %d peer(s) of %s's member view never announced an update here", r,
                           p, unknown, chosen[-8:])
        if sum(not self.standing.counts(a) for a in agreed - members) > MAX_NEWCOMER_PULLS:
            self.counters["views_not_followed"] += 1
            return members
        if mode != "scatter":  # the updates themselves, pulled (most are already)
            for peer in sorted(agreed - set(pending.updates) - pending.pulling):
                self._start_pull(key, pending, peer)
            await outer.wait_until(lambda: agreed - pending.failed <= set(pending.updates), self._event,
                                   end - self.clock.monotonic())
            if missing := agreed - set(pending.updates):  # we combine without them: the others may not
                self.counters["view_updates_missing"] += len(missing)
                logger.warning("diloco round %d/%d: the update of %s, which %s's member view names, did not come "
                               "within the span; combined without it", r, p, sorted(a[-8:] for a in missing),
                               chosen[-8:])
            agreed &= set(pending.updates)
        self.counters["members_from_coordinator"] += 1
        pending.coordinator = chosen
        if me in members and me not in agreed:
            # our update reached the coordinator after its deadline: we are behind the others in time, and the
            # next rounds, whose candidates are this round's members, would not wait for us either (we would be
            # left out round after round). Ask to be waited for, as a joiner does: the next rounds then wait for
            # us (a deadline at most) and we are back in step
            self.counters["own_update_left_out"] += 1
            for ahead in (r + 1, r + 2):
                self._publish(JOIN, {"r": ahead, "p": p, "join": True})
        return agreed

