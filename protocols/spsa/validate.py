"""The validator of the run's pubsub messages: every message is judged before it is relayed."""

from __future__ import annotations

from swarmd.protocols import rounds
from swarmd.protocols.gossip import Message, Verdict
from swarmd.protocols.spsa.wire import CARRIER, HASH, JOIN, MAX_PEER_ENTRIES, READY, READY_UNLISTED
from swarmd.protocols.standing import FRESH_EVERY


class ValidateMixin:
    """SPSALoop's pubsub validator."""

    def _validate(self, message: Message) -> Verdict:
        unpacked = self._unpack(CARRIER, message)
        if isinstance(unpacked, Verdict):
            return unpacked
        kind, body = unpacked
        if self.faults and self.faults.drops("message", self, r=body.get("w"), source=message.author, kind=kind):
            return Verdict.IGNORE
        if (refused := self._refusal(message.author, body)) is not None:
            return refused
        author = message.author
        w = body["w"]
        if self.state == "running" and w > self.window + 4 + FRESH_EVERY and not self.standing.counts(author):
            # far ahead of the swarm we run with: flooding steps. Not from a peer whose word counts: that we are
            # behind it is the likelier story (a restart's log replay, a slow machine), and rejecting would
            # penalise honest peers and leave us without the windows we need to catch up (the backlog is bounded)
            self.counters["rejected_future"] += 1
            return Verdict.REJECT
        if len(self.book.open) > 256 and w not in self.book.open:
            self.counters["ignored_backlog"] += 1
            return Verdict.IGNORE  # while we are not running yet, hold a bounded backlog only
        # a message that says again what its author said already (new gossip id, same content) is taken but not
        # forwarded: honest peers say each thing once (a ready is repeated only to direct peers, which keep it),
        # and 100 fresh keys repeating their junk every second would have every honest node verify and relay it again
        if kind is HASH:
            return self._take_hash(message, w, body)
        if kind is READY:
            return self._take_ready(message, w, body)
        if kind is JOIN:
            return self._take_join(message, w, body)
        return self._take_batch(message, w, body)

    def _take_hash(self, message: Message, w: int, body: dict) -> Verdict:
        if self.book.hashes.get(w, {}).get(message.author) == body["h"][:16]:
            return self._repeated()
        self._vote(w, message.author, body["h"][:16])
        return Verdict.ACCEPT

    def _take_ready(self, message: Message, w: int, body: dict) -> Verdict:
        author = message.author
        if self.start_state.ready.get(author) == body["ready"]:
            return self._repeated()
        if self.state == "running":
            self._answer_waiting_founder(author, body["ready"])
        else:
            # only peers we are connected to (directly or through a relay) can found a run with us, so only theirs
            # are kept (first come, capped); one not listed yet waits for our next look at the list (the barrier's)
            start = self.start_state
            linked = rounds.linked(self._ctx)(author)
            rounds.hear_ready(start.ready, start.ready_unlisted, author, body["ready"], linked, MAX_PEER_ENTRIES,
                              READY_UNLISTED)
        return Verdict.ACCEPT

    def _answer_waiting_founder(self, author: str, ready: str) -> None:
        """A founder still says it is ready with our start: it is at its barrier without our "ready"
        (``rounds.FounderAnswers``). We say ours again, once: it starts in our first window instead of waiting it
        out and joining late by a replay."""
        start = self.start_state
        if start.answers.due(author, ready, start.hash, start.initial, self.clock.monotonic()):
            self._publish(READY, {"w": self.window, "ready": start.hash})

    def _take_join(self, message: Message, w: int, body: dict) -> Verdict:
        joins = self.book.open[w].joins
        if message.author in joins:
            return self._repeated()
        if len(joins) < MAX_PEER_ENTRIES or self.standing.counts(message.author):
            joins.add(message.author)  # a newcomer among them gets a slot only if picked (see _close_window)
        return Verdict.ACCEPT

    def _take_batch(self, message: Message, w: int, body: dict) -> Verdict:
        author = message.author
        if len(body["b"]) != self.cfg.window:
            self.counters["rejected_malformed"] += 1
            return Verdict.REJECT
        if max(b & 0x7F for b in body["b"]) > self._max_code:
            self.counters["rejected_out_of_range"] += 1
            return Verdict.REJECT  # a projected gradient beyond the run's clip
        if self.book.closed(w):
            # a byte for a window already closed: not forwarded, lightly scored (an honest peer can be slow once)
            self.counters["late"] += 1
            self._record_late(w, author)
            self._ctx.transport.penalties.penalize(message.received_from or message.author, "stale",
                                                   "spsa batch for a closed window")
            return Verdict.IGNORE
        batches = self.book.open[w].batches
        existing = batches.get(author)
        if existing is not None and existing.data != message.data:
            self.counters["equivocation"] += 1
            return Verdict.REJECT
        if existing is not None:
            return self._repeated()
        if len(batches) >= MAX_PEER_ENTRIES and not self.standing.counts(author):
            self.counters["ignored_batches"] += 1
            return Verdict.IGNORE
        batches[author] = message
        self._vote(w, author, body["h"].hex())
        self.book.arrived.set()
        return Verdict.ACCEPT

    def _repeated(self) -> Verdict:
        self.counters["repeated"] += 1
        return Verdict.IGNORE

    def _vote(self, w: int, author: str, h: str) -> None:
        """A peer's weights hash for window w (the first 16 hex digits): its vote in the hash check."""
        hashes = self.book.hashes[w]
        if author in hashes or len(hashes) < MAX_PEER_ENTRIES or self.standing.counts(author):
            hashes[author] = h
