"""After a close: the previous round's hashes judged against the majority's, a close redone without a
contested update (all-to-all), and whether we are still counted."""

from __future__ import annotations

import asyncio
import collections
import logging

import torch
from swarmd.protocols import exchange, outer, rounds
from swarmd.protocols.diloco.pending import Pending, Redo
from swarmd.protocols.diloco.wire import (
    MAX_PEER_ENTRIES,
    MAX_REMEMBERED_UPDATES,
)
from swarmd.protocols.standing import EARN

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class RedoMixin:
    """DilocoLoop's redo methods (the loop composes them; they share its state)."""

    def _chain(self, r: int, p: int) -> tuple[str, ...]:
        """Round r's chain of coordinators (``rounds.MemberAgreement``). It comes from the last round's members
        (agreed: the same set at every peer), so a peer that was late here and in time elsewhere is not first at
        some peers and skipped at others; members the others measured slow in the last round come last (stable:
        the round's order otherwise): a slow coordinator's own pulls, and so its parts list, wait behind its
        uploads."""
        me = self._ctx.identity.peer_id
        last = self.fragments[p].last_members(self.start_state.initial)
        chain = tuple(a for a in exchange.order(self.cfg.run, r, p, last) if a == me or self.standing.counts(a))
        return exchange.slow_last(chain, self.links.chain_weights.get(p, {}))

    async def _redo_last_close(self, p: int, r: int, pending: Pending, have: set[str]) -> None:
        """Before closing round r: if most counted peers' updates for it were computed from other weights than
        ours, and closing round r - 1 without our update, without the last one to arrive, or without both gives
        those weights, take them instead of pulling a checkpoint next round. The usual case: our update reached the
        others after their deadline (a far peer) but counted at ours, or one arrived just in time here and just too
        late there."""
        redo = self.fragments[p].redo
        me = self._ctx.identity.peer_id
        if redo is None or redo.round != r - 1:
            return
        bases = collections.Counter(ann.base for a, ann in pending.announced.items()
                                    if a != me and a in have and self.standing.vouched(a))
        if not bases:
            return
        base, votes = bases.most_common(1)[0]
        if 2 * votes > sum(bases.values()) and base != self._base_hash(p):
            await self._redo_with(p, redo, lambda fixed: outer.params_hash([fixed]) == base)

    def _drop_redo(self, p: int) -> Redo | None:
        """Forget fragment p's redo (its late pulls cancelled); returns it, its tensors still usable."""
        f = self.fragments[p]
        redo, f.redo = f.redo, None
        if redo is not None:
            redo.drop()
        return redo

    async def _redo_with(self, p: int, redo: Redo, matches) -> bool:
        """Close ``redo``'s round again with each of its variants' member sets (in a worker thread, on copies of
        the momentum: up to five combinations of a fragment); the first whose weights ``matches`` accepts replaces
        ours (global weights and momentum; our local weights move by the same difference, so our training goes on
        from them). The hash we published for that round goes: it is not ours any more."""
        me = self._ctx.identity.peer_id

        def search() -> tuple[frozenset[str], torch.Tensor, torch.Tensor] | None:
            steps = self.replica.outer_opt
            opt = outer.OuterNesterov([], steps.lr, steps.momentum)  # the same step, bit for bit
            for members in redo.variants(me):
                combined, _ = outer.combine({a: redo.update(a) for a in members}, redo.global_before.numel(),
                                            senders=self.cfg.senders())
                opt.buffers = {p: redo.momentum.clone()}
                fixed = redo.global_before if combined is None else opt.step(p, redo.global_before, combined)
                if matches(fixed):
                    return members, fixed, opt.buffers[p]
            return None

        found = await asyncio.to_thread(search)
        if found is None:
            return False
        members, fixed, self.replica.outer_opt.buffers[p] = found
        frag = self.replica.of(self.fragments[p])
        with torch.no_grad():
            outer.unflatten_into(outer.flatten(frag) + (fixed - self.fragments[p].weights), frag)
        self.fragments.replace(p, fixed)
        self.book.published.pop((redo.round, p), None)
        self.counters["redone"] += 1
        logger.warning("diloco: the others closed round %d/%d without %s; redone so, no checkpoint needed",
                       redo.round, p, sorted(redo.members - members))
        return True

    def _check_previous(self, p: int, r: int) -> None:
        """Compare the global hash we published for round r-1 with what the others published for it; where none
        of them has (we are ahead of them: our deadlines passed before their updates came, and we close rounds
        without them, faster than they do), the newest of our rounds not yet compared that they published a hash
        for. Without that, a peer that ran ahead alone was never compared with anyone and ended the run on its own
        weights (the simulator: one peer's uplink down to 50 kB/s mid-run, another peer ahead from then on)."""
        for rr in sorted((k[0] for k in self.book.published if k[1] == p and k[0] < r), reverse=True):
            if (rr, p) in self.book.checked:
                return
            verdict = rounds.hash_verdict(self.book.published[(rr, p)], self.book.hashes.get((rr, p), {}),
                                          self.standing.vouched, me=self._ctx.identity.peer_id,
                                          salt=f"{self.cfg.run}/{rr}/{p}")
            if verdict is not None:
                self.book.checked.add((rr, p))
                if rr < r - 1:
                    self.counters["checked_behind_us"] += 1
                self._judge_previous(p, r, rr, verdict)
                return

    def _judge_previous(self, p: int, r: int, rr: int, verdict: rounds.HashVerdict) -> None:
        """Our hash for round rr (before r, the round we close) against the others': in the minority, resync."""
        if verdict.agrees and self._ctx.identity.peer_id in self.book.contributed.pop((rr, p), ()):
            self.resyncs.included += 1  # the others combined our update too: our word counts there
        if not verdict.agrees:
            # do the others still count us? yes if we started the run with them (unless a rejoin just failed to
            # take), or if the majority's weights contained our update in EARN rounds since
            self.resyncs.counted_before_resync = self._still_counted(r)
            self.resyncs.rejoined_at = r
            self.resyncs.included = 0
            self.counters["diverged"] += 1
            logger.error("diloco: our global weights left the majority at round %d/%d; resyncing", rr, p)
            self.resyncs.resync_from = list(verdict.holders)
            self._left_majority()

    def _left_majority(self) -> None:
        """Our weights left the majority's: the peer whose checkpoint we joined from is asked after the others."""
        if self.resyncs.checkpoint_from is not None:
            rounds.keep_latest(self.resyncs.led_off, self.resyncs.checkpoint_from, None, MAX_PEER_ENTRIES)

    def _still_counted(self, r: int | None = None) -> bool:
        """Do the others still count us when we resync at round r? Yes if we started the run with them (unless a
        rejoin just failed to take), or if the majority's weights contained our update in EARN rounds since."""
        r = min(self.rounds_done) if r is None else r
        return (self.start_state.founder and r - self.resyncs.rejoined_at > EARN) or self.resyncs.included >= EARN

    def _replays(self, p: int, pending: Pending, members: set[str]) -> dict[str, str]:
        """Members whose update for this round is the very one they sent for an earlier round of the fragment (the
        same encoded parts: an honest peer's next update always differs): refused as "replayed". Remembers the
        members' parts for the next round (at most MAX_REMEMBERED_UPDATES peers x fragments)."""
        out = {}
        for a in sorted(members):
            ann = pending.announced.get(a)
            if ann is None:
                continue
            if a != self._ctx.identity.peer_id and self.book.last_parts.get((a, p)) == ann.parts:
                out[a] = "replayed"
            self.book.last_parts[(a, p)] = ann.parts
            self.book.last_parts.move_to_end((a, p))
        while len(self.book.last_parts) > MAX_REMEMBERED_UPDATES:
            self.book.last_parts.popitem(last=False)
        return out

