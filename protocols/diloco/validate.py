"""The validator of the run's pubsub messages: every message is judged before it is relayed."""

from __future__ import annotations

from swarmd.protocols import rounds
from swarmd.protocols.diloco.pending import Announced
from swarmd.protocols.diloco.wire import (
    AUDIT,
    CARRIER,
    JOIN,
    MAX_NEWCOMER_PULLS,
    MAX_PART_BYTES,
    MAX_PARTS_LISTS,
    MAX_PEER_ENTRIES,
    MAX_REDUCED_ENTRIES,
    MEMBERS,
    PART_SLACK,
    PARTS,
    READY,
    READY_UNLISTED,
    REDUCED,
    ROUND_HASH,
    UPDATE,
)
from swarmd.protocols.gossip import Message, Verdict
from swarmd.protocols.standing import FRESH_EVERY


class ValidateMixin:
    """DilocoLoop's validate methods (the loop composes them; they share its state)."""

    # ------------------------------------------------------------------ validation
    def _answer_waiting_founder(self, author: str, ready: str) -> None:
        """A founder still says it is ready with our start: it is at its barrier without our "ready"
        (``rounds.FounderAnswers``). We say ours again, once: it starts in our first round instead of waiting it
        out and joining late from a checkpoint."""
        start = self.start_state
        if start.answers.due(author, ready, start.hash, start.initial, self.clock.monotonic()):
            self._publish(READY, {"r": 0, "p": 0, "ready": start.hash})

    def _validate(self, message: Message) -> Verdict:
        unpacked = self._unpack(CARRIER, message)
        if isinstance(unpacked, Verdict):
            return unpacked
        kind, body = unpacked
        if self.faults and self.faults.drops("message", self, r=body.get("r"), p=body.get("p"),
                                             source=message.author, kind=kind):
            return Verdict.IGNORE
        if (refused := self._refusal(message.author, body)) is not None:
            return refused
        r, p = body["r"], body["p"]
        if not 0 <= p < self.cfg.fragments or not 0 <= r <= (self.cfg.rounds + 1 if self.cfg.rounds else 2**31):
            return Verdict.REJECT
        author = message.author
        if self.standing.counts(author) and not (kind is ROUND_HASH and self.cfg.rounds and r >= self.cfg.rounds):
            # still in the run (a peer that ended it says so every 5 s: not one to wait for). Bounded: only peers
            # whose word counts
            self.links.heard[author] = self.clock.monotonic()
        if kind is READY:
            # only connected peers (``_linked``) can found a run with us, so only theirs are kept (first come,
            # capped); one not listed yet waits for our next look at the list (``rounds.count_listed``)
            if self.state == "running":
                self._answer_waiting_founder(author, body["ready"])
            else:
                start = self.start_state
                rounds.hear_ready(start.ready, start.ready_unlisted, author, body["ready"], self._linked()(author),
                                  MAX_PEER_ENTRIES, READY_UNLISTED)
            return Verdict.ACCEPT
        done = self.fragments[p].rounds_done if self.fragments.built else 0
        if kind is JOIN:
            return self._on_join(author, r, p, done)
        if kind is ROUND_HASH:
            return self._on_round_hash(author, r, p, body)
        if kind is UPDATE:
            return self._on_update(message, body, r, p, done)
        if (kind is MEMBERS or kind is PARTS or kind is REDUCED or kind is AUDIT) and self.fragments.built \
                and not done <= r <= done + 2:
            return Verdict.IGNORE  # a round's exchange messages: kept for the rounds we are at or about to close
        if kind is MEMBERS:
            return self._on_view(author, r, p, body)
        if kind is PARTS:
            return self._on_parts(author, r, p, body)
        if kind is REDUCED or kind is AUDIT:
            return self._on_part(kind, author, r, p, body)
        return Verdict.REJECT

    def _on_join(self, author: str, r: int, p: int, done: int) -> Verdict:
        """A peer asks to be waited for from round r (a joiner, or one left out of a round)."""
        horizon = done + 2 + FRESH_EVERY
        joins = self.book.joins[(r, p)] if done <= r <= horizon else set()
        if done <= r <= horizon and (len(joins) < MAX_PEER_ENTRIES or self.standing.counts(author)):
            joins.add(author)  # a newcomer among them gets a slot only if picked (see Round._gather)
        else:
            self.counters["joins_ignored"] += 1
        return Verdict.ACCEPT

    def _on_round_hash(self, author: str, r: int, p: int, body: dict) -> Verdict:
        """A peer's global weights' hash after it closed round r (the checks, the swarm's round)."""
        hashes = self.book.hashes[(r, p)]
        if author in hashes or len(hashes) < MAX_PEER_ENTRIES or self.standing.counts(author):
            hashes[author] = body["h"]
        # (r = cfg.rounds says "the run ended here"; cfg.rounds 0 is a run without end)
        if self.standing.counts(author) and (r < self.cfg.rounds or not self.cfg.rounds):
            closed = self.fragments[p].closed_by
            if r > closed.get(author, -1) and (author in closed or len(closed) < MAX_PEER_ENTRIES):
                closed[author] = r
        return Verdict.ACCEPT

    def _on_update(self, message: Message, body: dict, r: int, p: int, done: int) -> Verdict:
        """A peer's update announced: held for its round (and pulled or prefetched) where it may count."""
        author = message.author
        ann = self._announced(body, p)
        if ann is None:
            return Verdict.REJECT
        # an update computed from other global weights than ours is kept (we may be the one that drifted and
        # resync before we close that round) but not forwarded; every update's base is checked when we close
        # its round
        other_base = self.fragments.built and r == done \
            and ann.base != self._base_hash(p)
        if self.fragments.built and r < done:
            self.counters["late_updates"] += 1
            self._record_late(r, message.author, p)
            self._pull_late(r, p, message.author, ann)
            return Verdict.IGNORE  # that round is closed here
        if r > max(done, self._swarm_round(p) + 1) + 2:  # (a joiner's done may be rounds old)
            self.counters["early_updates"] += 1
            return Verdict.IGNORE  # rounds we are nowhere near: not held, not pulled
        pending = self.book.pending[(r, p)]
        if message.author in pending.announced:
            return Verdict.IGNORE
        if not self.standing.counts(author) and self.state == "running":
            # a newcomer: taken only if it can hold a slot this round
            candidates = self.fragments[p].last_members(self.start_state.initial) \
                | self.book.joins.get((r, p), set())
            if author not in candidates or \
                    sum(not self.standing.counts(a) for a in pending.announced) >= MAX_NEWCOMER_PULLS:
                self.counters["newcomer_updates_not_pulled"] += 1
                return Verdict.IGNORE
        pending.announced[author] = ann
        pending.signed[author] = message.wire()  # for a peer whose gossip did not bring it (a member view's)
        self._event.set()  # (a member view may be waiting for it)
        if not self.fragments.built or self._mode(p) == "all-to-all":
            self._start_pull((r, p), pending, author)
        else:
            pending.arrivals[author] = self.clock.monotonic()
            self._event.set()
            if not other_base:
                self._prefetch((r, p), pending, author)
        if other_base:
            self.counters["other_base_held"] += 1
            return Verdict.IGNORE
        return Verdict.ACCEPT

    def _on_view(self, author: str, r: int, p: int, body: dict) -> Verdict:
        """A counted peer's member view of round r (``Round._agree``)."""
        if not self.standing.counts(author):
            self.counters["views_ignored"] += 1  # only a counted peer coordinates a round
            return Verdict.IGNORE
        pending = self.book.pending[(r, p)]
        if author not in pending.views and len(pending.views) >= MAX_PEER_ENTRIES:
            return Verdict.IGNORE
        verdict = self._once(pending.views, author, frozenset(body["m"]), "views_conflicting", "member views")
        if verdict is Verdict.ACCEPT:
            pending.view_at[author] = self.clock.monotonic()
        return verdict

    def _on_parts(self, author: str, r: int, p: int, body: dict) -> Verdict:
        """A coordinator's parts list of round r (``ConformStep``)."""
        # a round's coordinator is one of the last round's counted members (whose set we may not know yet
        # when a message for the next round comes): counted peers' only, the others' capped
        if len(body["c"]) != len(body["h"]):
            return Verdict.REJECT  # a malformed list, signed by its author: counts against it
        pending = self.book.pending[(r, p)]
        if not self.standing.counts(author) or (
                author not in self.fragments[p].last_members(self.start_state.initial)
                and len(pending.parts) >= MAX_PARTS_LISTS):
            self.counters["parts_ignored"] += 1
            return Verdict.IGNORE
        return self._once(pending.parts, author, (body["m"], tuple(body["c"]), tuple(body["h"])),
                          "parts_conflicting", "part lists")

    def _on_part(self, kind, author: str, r: int, p: int, body: dict) -> Verdict:
        """A reducer's part or an auditor's verdict of round r (``ScatterRound``)."""
        k = body["red"] if kind is REDUCED else body["aud"]
        pending = self.book.pending[(r, p)]
        if kind is REDUCED:
            # the round's count once it closed; before, any count "auto" may give it (ours may not be the
            # round's: an honest reducer's part must not be refused, and its author penalised, for that)
            counts = [pending.count] if pending.count is not None else self._part_counts(p)
            if body["size"] > max(self._max_part(p, k, c, reduced=True) for c in counts):
                return Verdict.REJECT
            held, value = pending.reduced[k], (body["blob"], body["size"], body["m"], tuple(body["addrs"]),
                                               body["c"])
        else:
            held, value = pending.audits[k], body["ok"]
        if author in held:
            return Verdict.IGNORE
        if pending.entries >= MAX_REDUCED_ENTRIES:
            self.counters["exchange_messages_over_cap"] += 1
            return Verdict.IGNORE
        held[author] = value
        pending.entries += 1
        pending.part_events[k].set()
        self._event.set()
        return Verdict.ACCEPT

    def _once(self, held: dict, author: str, value, counter: str, what: str) -> Verdict:
        """Keep an author's one signed answer for a round; a second, different one is the author's doing, whoever
        forwarded it (penalised as suspect)."""
        if author in held:
            if held[author] != value:
                self.counters[counter] += 1
                self._ctx.transport.penalties.penalize(author, "suspect", f"two {what} of one round")
            return Verdict.IGNORE
        held[author] = value
        self._event.set()
        return Verdict.ACCEPT

    def _max_part(self, p: int, k: int, count: int, reduced: bool = False) -> int:
        """The most bytes part k of fragment p cut into ``count`` parts may claim (checked before anything is
        pulled, so a peer cannot make us allocate for a size it made up); ``reduced``: a combined part's."""
        if not self.fragments.built:  # not built yet: only the absolute cap
            return MAX_PART_BYTES
        sizes = self._part_bytes(p, reduced, count)
        return sizes[k] + PART_SLACK if k < len(sizes) else 0

    def _announced(self, body: dict, p: int) -> Announced | None:
        """An update announcement's parts, checked against the run (the schema checked types): every peer cuts an
        update the same way, no part may claim more bytes than the codec makes of it, a norm is not negative."""
        parts, sizes, norm = body["parts"], body["sizes"], body["norm"]
        if not (len(parts) == len(sizes) and len(parts) in self._part_counts(p)
                and all(x <= self._max_part(p, k, len(parts)) for k, x in enumerate(sizes)) and norm >= 0):
            return None
        return Announced(tuple(parts), tuple(sizes), body["base"], norm, tuple(body["addrs"]),
                         tuple((bytes(sid), int(rate)) for sid, rate in body.get("bw", ())),
                         tuple(bytes(sid) for sid in body.get("nd", ())))

