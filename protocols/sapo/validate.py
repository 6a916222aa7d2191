"""The SAPO loop's pubsub validator: every message is judged before it is relayed, and what is kept of it."""

from __future__ import annotations

import logging

from swarmd.protocols import rounds
from swarmd.protocols.gossip import Message, Verdict
from swarmd.protocols.sapo.items import CARRIER, ITEM_RATE, MAX_AUTHORS, READY, parse_items

logger = logging.getLogger("swarmd.protocols.sapo")  # one logger for the whole package


class ValidateMixin:
    """SapoLoop's validator (the loop composes it; they share its state)."""

    def _validate(self, message: Message) -> Verdict:
        unpacked = self._unpack(CARRIER, message)
        if isinstance(unpacked, Verdict):
            if unpacked is Verdict.REJECT:
                self.counters["rejected_malformed"] += 1
            return unpacked
        kind, body = unpacked
        if (refused := self._refusal(message.author, body)) is not None:
            return refused
        author = message.author
        if kind is READY:
            if self.state != "running" and rounds.linked(self._ctx)(author) and len(self.ready) < MAX_AUTHORS:
                self.ready.add(author)
            return Verdict.ACCEPT
        try:
            r, items = parse_items(body, run=self.cfg.run, seed=self.cfg.seed, author=message.author,
                                   rules=self.rules)
        except ValueError as e:
            self.counters["rejected_malformed"] += 1
            logger.debug("sapo: rejected items from %s: %s", message.author, e)
            return Verdict.REJECT
        if self.cfg.rounds and r >= self.cfg.rounds:
            self.counters["rejected_future"] += 1
            return Verdict.REJECT  # a round the run does not have
        held = self.inbox.get(author)
        if held is not None and r <= held[0]:
            if r == held[0]:
                self.counters["equivocation"] += 1
                return Verdict.REJECT  # a second, different set of items for one round
            self.counters["stale"] += 1
            return Verdict.IGNORE  # older than what we hold from that peer: not forwarded
        if not self._rate.allow(author):
            # rounds faster than anyone computes them: not used, not forwarded, and the author's fault (its
            # signature is on them; an honest relay forwards only what it accepted, at the same rate)
            self.counters["ignored_rate"] += 1
            self._ctx.transport.penalties.penalize(author, "rate_limited", f"sapo: items faster than "
                                                   f"{ITEM_RATE:g} rounds per second")
            return Verdict.IGNORE
        if held is None and len(self.inbox) >= MAX_AUTHORS:  # make room: the oldest entry of a peer without standing
            victim = next((a for a in self.inbox if not self.standing.counts(a)), None)
            if victim is None:
                return Verdict.IGNORE
            del self.inbox[victim]
            self.used.pop(victim, None)
            self.counters["inbox_evicted"] += 1
        self.inbox[author] = (r, items)
        self.inbox.move_to_end(author)
        comps = [c for _, _, cs in items for c in cs]
        self.counters["completions_received"] += len(comps)
        self.counters["completion_bytes_received"] += sum(len(c.encode()) for c in comps)
        self._arrived.set()
        return Verdict.ACCEPT
