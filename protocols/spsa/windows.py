"""A window's life: publishing our batch, closing the window (who is in it), the bytes a step applies, the hash
check."""

from __future__ import annotations

import logging

import msgpack

from swarmd.protocols import rounds
from swarmd.protocols.gossip import Message
from swarmd.protocols.spsa.book import Window
from swarmd.protocols.spsa.codes import capped, screen_window
from swarmd.protocols.spsa.wire import JOIN, MAX_PEER_ENTRIES, NEWCOMER_GRACE, _batch_bytes
from swarmd.protocols.standing import fresh_round
from swarmd.transport.wire import WIRE

logger = logging.getLogger("swarmd.protocols.spsa")  # one logger for the package


class WindowsMixin:
    """SPSALoop's windows: publishing, closing, applying, the hash check."""

    def _publish(self, kind, body: dict) -> None:
        if self.faults:  # a message a test has us say otherwise
            body = self.faults.altered("publish", self, body, r=body["w"], kind=kind)
        payload = WIRE.pack(kind, self._tag(body))
        mid = self.gossip.publish(self.topic, payload)
        # what went on the wire for it: the signed message, framed (counted once, as its author sends it);
        # the one-off start-up messages (ready, join) are counted apart from the per-step traffic
        wire = len(msgpack.packb([3, self.gossip.cache[mid].wire()], use_bin_type=True)) + 4
        kind = "setup" if ("ready" in body or "join" in body) else "step"
        self.counters[f"{kind}_messages"] += 1
        self.counters[f"{kind}_wire_bytes"] += wire
        if "b" in body:
            self.book.open[body["w"]].batches[self._ctx.identity.peer_id] = self.gossip.cache[mid]
            self._sent_up_to = max(self._sent_up_to, body["w"])
        if "join" in body:
            self.book.open[body["w"]].joins.add(self._ctx.identity.peer_id)

    async def _close_window(self, ours: Window) -> None:
        """Wait for the peers whose word counts (``protocols.standing``) and a few newcomers (picked the same way
        everywhere; brand-new ones only in fresh windows), at most the deadline; apply their batches."""
        w = ours.w
        arrivals = self.book.open[w]
        opened = self.clock.monotonic()
        # a newcomer holding a slot gets NEWCOMER_GRACE once every counting peer is in, not the whole deadline (a
        # fresh key that joined and went quiet would stall every fresh window by the deadline). Our own batch is in
        # the window like anyone's: we wait for it too
        wait = rounds.plan_wait(self.standing, self._expected(w), f"{self.cfg.run}/{w}", fresh=fresh_round(w),
                                now=opened, deadline=self.cfg.deadline, grace=NEWCOMER_GRACE)
        expected, slots, waited = wait.expected, wait.slots, wait.waited
        await self._wait_round(wait, self.book.arrived, lambda: set(arrivals.batches))
        self.counters["newcomers_not_waited"] += wait.newcomers_not_waited(set(arrivals.batches))
        if not waited <= set(arrivals.batches):
            self.counters["deadline_missed"] += 1
            logger.warning("spsa window %d closed without %s", w, sorted(waited - set(arrivals.batches)))
        # the window's batches, as we apply them (the closed window's entry in the book)
        taken = self.book.applied[w] = {a: m for a, m in arrivals.batches.items()
                                        if (a in expected or a in slots) and a not in self.audits.convicted}
        audited, extreme = self._refuse(ours, taken)
        self._record_round(w, waited_s=self.clock.monotonic() - opened, deadline_s=self.cfg.deadline,
                           participants=set(taken) - extreme, missing=waited - set(arrivals.batches),
                           rejected={**{a: "extreme" for a in extreme}, **{a: "audit" for a in audited}})
        self.standing.record(set(taken) - extreme)
        self.counters["unexpected_batches"] += len(arrivals.batches) - len(taken)
        me = self._ctx.identity.peer_id
        self.reach.took(set(taken) - extreme, me, self._ctx.direct)
        if me in arrivals.batches and me not in taken:
            # we sent a batch that no one takes (we were cut off, or rejoined after a resync, and the others stopped
            # expecting us; standing judges us as them): ask to be expected again, two windows on
            self.counters["joins_repeated"] += 1
            self._publish(JOIN, {"w": w + 2, "join": True})
        self.book.log.append([w, [m.wire() for _, m in sorted(taken.items())]])
        self.book.close(w, self.cfg.hash_every)

    def _refuse(self, ours: Window, taken: dict[str, Message]) -> tuple[set[str], set[str]]:
        """Window ``ours``'s batches that are refused: those that failed an audit (taken out of ``taken``: out of the
        window, like a batch that never came, and not in our log either), and those out of scale with the others'
        (left in: still in the log, every replaying peer refuses them the same way)."""
        w = ours.w
        # a batch probed at weights other than ours (its hash says so: its author, or we, diverged, and the hash
        # check sends whoever is off to resync) is applied like the others, but cannot be audited. An author that stays
        # off the majority's weights, window after window past any hash check, is not resyncing: it is claiming
        # other weights so as not to be audited, and is convicted
        other = self.audits.other_weights(self.book.my_hashes[w], taken)
        audited = self.audits.judge(ours, {a: m for a, m in taken.items() if a not in other})
        for peer in self.audits.dodging(other):
            self.audits.convict(peer, w, f"spsa window {w}: {self.audits.off_weights[peer]} windows in a row probed "
                                "at weights other than the majority's, without resyncing")
            audited.add(peer)
        for peer in audited:
            del taken[peer]
        extreme, _ = self._screen(w, {a: _batch_bytes(m) for a, m in taken.items()})
        for peer in extreme:
            self.counters["rejected_extreme"] += 1
            self._ctx.transport.penalties.penalize(peer, "invalid_message",
                                                   f"spsa window {w}: gradients out of scale with the others'")
        return audited, extreme

    def _audit_plan(self, w: int) -> dict[int, list[str]]:
        """Which of window w's steps we re-probe, and whose (``Auditor.plan``): of the peers the window will take
        batches from (those whose word counts and the newcomers holding its slots, as _close_window picks them), not
        every key that announced a join: a hundred fresh keys that join and never deliver would take our
        re-probes."""
        if not self.per_step or not self.cfg.audit_peers:
            return {}
        wait = rounds.plan_wait(self.standing, self._expected(w), f"{self.cfg.run}/{w}", fresh=fresh_round(w),
                                now=0.0, deadline=self.cfg.deadline, grace=NEWCOMER_GRACE)
        return self.audits.plan(sorted((wait.expected | wait.slots) - {self._ctx.identity.peer_id}))

    def _expected(self, w: int) -> set[str]:
        joins = self.book.open[w].joins - set(self.audits.convicted)
        if w == 0:
            return set(self.start_state.initial) | joins
        return set(self.book.applied.get(w - 1, {})) | joins

    def _bytes_for(self, w: int, i: int) -> dict[str, int]:
        """Step i of window w: every applied peer's byte, capped, less the peers whose bytes are out of scale."""
        batches = {author: _batch_bytes(m) for author, m in self.book.applied.get(w, {}).items()}
        out, cap = self._screen(w, batches)
        return {author: capped(b[i], cap) for author, b in batches.items() if author not in out}

    def _screen(self, w: int, batches: dict[str, bytes]) -> tuple[set[str], int]:
        """screen_window, computed once per window's set of batches (a resync may replace a window's batches)."""
        key = tuple(sorted(batches.items()))
        hit = self.book.screened.get(w)
        if hit is None or hit[0] != key:
            self.book.screened[w] = (key, screen_window(batches))
            for old in [x for x in self.book.screened if x < w - 2 or x > w + 2]:
                del self.book.screened[old]
        return self.book.screened[w][1]

    def _check_hashes(self, w: int) -> list[str]:
        """The hash check of window w: the peers to resync from, in order, where our weights are not the
        majority's (empty: they are, or nothing to tell)."""
        verdict = rounds.hash_verdict(self.book.my_hashes[w][:16], self.book.hashes.get(w, {}), self.standing.vouched,
                                      me=self._ctx.identity.peer_id, salt=f"{self.cfg.run}/{w}")
        if verdict is not None and not verdict.agrees:
            self.counters["diverged"] += 1
            logger.error("spsa: our weights differ from the majority at window %d; resyncing", w)
            # every counting peer that holds the majority's weights, the directly connected ones first (a log is
            # pulled over a stream: one we only know through others may be unreachable), and the peers whose base
            # and log we had replayed when our weights left the majority's after all the others: they led us here
            # (a base need not be the one its server's weights came from, and nothing in the bytes tells; no
            # penalty, an honest peer a moment off the run serves that too). Asked first again, as the smallest id
            # among the holders, one could send us round for the whole run; with only the last of them put last,
            # two could take turns
            if self.resyncs.replayed_from is not None:
                rounds.keep_latest(self.resyncs.led_off, self.resyncs.replayed_from, None, MAX_PEER_ENTRIES)
            return sorted(verdict.holders, key=lambda a: (a in self.resyncs.led_off, not self._ctx.direct(a)))
        return []
