"""Who counts in a training run's decisions, when identities are free.

Anyone can create a million keys, so no decision of a loop may be swung by how many keys say something: not when the
run starts, not who a round waits for, not which global hash is the majority, not where a peer resyncs from. A peer's
word counts once it has *earned standing*:

- in a **closed run** (the loop's ``peers`` list: peer ids chosen by whoever set the run up), the listed peers
  count and every other key is ignored (its messages are neither used nor forwarded);
- in an **open run** (the default) a peer counts if it is one of our bootstrap peers (the user chose them), one of
  the run's founders (directly connected and ready at our start), or it has earned credit: +1 for each round in
  which it contributed a verified update (an update that was combined, a batch that was applied, items that were
  scored), up to ``2 * earn``, and -2 for each round it missed; its word counts from ``earn`` credits. A founder can
  miss two rounds in a row and still count; a key that just earned standing and goes silent loses it at once.

Newcomers still take part: a few per round get a slot (picked deterministically, so every peer picks the same ones;
those that already contributed first) and are waited for like the others; a brand-new key gets a slot only in every
``FRESH_EVERY``-th round (a joiner announces its join for such a round), so a stream of fresh keys that join and
never deliver can delay at most one round in ``FRESH_EVERY``. Their round hashes, ready messages and join requests
carry no weight until they have earned standing.

A peer whose word counted once and that then missed rounds (a partition, a long stall) loses its standing but is
remembered (``vouched``): its round hashes still weigh in choosing which weights the run holds (so two sides of a
healed partition, each of which saw the other miss every round, still agree on one side's weights instead of
rounding apart for good), and it is first in line for a newcomer slot in any round. A fresh key is never vouched
for: only a key that earned standing, founded the run with us, or is listed. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable

def check_peer_ids(ids: list[str]) -> list[str]:
    """A loop config's ``peers``: valid peer ids (a pydantic field validator)."""
    from swarmd.transport.identity import is_valid_peer_id

    bad = [p for p in ids if not is_valid_peer_id(p)]
    if bad:
        raise ValueError(f"not a peer id: {bad[0]!r}")
    return ids


FRESH_EVERY = 4  # brand-new peers are let in (waited for) only in rounds r with r % FRESH_EVERY == 0


def fresh_round(r: int) -> bool:
    return r % FRESH_EVERY == 0


def next_fresh_round(r: int) -> int:
    """The first round >= r in which a brand-new peer is let in (a joiner announces its join for it)."""
    return -(-r // FRESH_EVERY) * FRESH_EVERY


EARN = 4  # credits (rounds with a verified contribution) before a newcomer's word counts
MISS = 2  # credits a peer loses for each round it missed
MAX_TRACKED = 4096  # peers with a streak we remember (the longest streaks are kept)


class Standing:
    def __init__(self, me: str, allow: Iterable[str] = (), anchors: Callable[[], set[str]] = set, *,
                 earn: int = EARN):
        self.me = me
        self.allow = frozenset(allow)
        self._anchors = anchors
        self.earn = earn
        self.streak: dict[str, int] = {}  # credit: +1 per round with a verified contribution, -MISS per round missed
        self.known: dict[str, None] = {}  # peers whose word counted once (insertion order: the oldest go first)
        # judge ourselves by the same rule as everyone else (our own credit), not as always counting: a loop whose
        # rounds take our contribution only as the others would (SPSA: a peer that rejoins, or joins late, is a
        # newcomer in the others' eyes, and takes its own batch only where they do)
        self.judge_self = False

    @property
    def closed(self) -> bool:
        return bool(self.allow)

    def admitted(self, peer: str) -> bool:
        """May this peer take part at all? (Everyone, in an open run.)"""
        return not self.allow or peer in self.allow or peer == self.me

    def counts(self, peer: str) -> bool:
        """Does this peer's word count (quorum, majority, waited for, resync source)?"""
        if peer == self.me and not self.judge_self:
            return True
        if self.allow:
            return peer in self.allow
        return self.streak.get(peer, 0) >= self.earn or peer in self._anchors()

    def vouched(self, peer: str) -> bool:
        """Does this peer's round hash weigh in choosing the run's weights? It counts now, or it did once (a
        founder or a peer that earned standing, since gone quiet: the other side of a partition)."""
        return self.counts(peer) or (self.admitted(peer) and peer in self.known)

    def _remember(self, peers: Iterable[str]) -> None:
        for peer in peers:
            if (peer != self.me or self.judge_self) and self.admitted(peer):
                self.known.pop(peer, None)
                self.known[peer] = None
        while len(self.known) > MAX_TRACKED:
            del self.known[next(iter(self.known))]

    def counting(self, peers: Iterable[str]) -> set[str]:
        return {p for p in peers if self.counts(p)}

    def found(self, founders: Iterable[str]) -> None:
        """The peers we start the run with (or took a checkpoint from): full credit."""
        for peer in founders:
            if self.admitted(peer):
                self.streak[peer] = 2 * self.earn
                self._remember((peer,))

    def rebuild(self, founders: Iterable[str], rounds: Iterable[Iterable[str]]) -> None:
        """Our credits as the run's history gives them: the founders, then each round's contributors in order (a
        peer that replayed the others' log takes their view of who counts, its own place included)."""
        self.streak = {}
        self.found(founders)
        for contributors in rounds:
            self.record(contributors)

    def record(self, contributors: Iterable[str]) -> None:
        """After a round closed: its verified contributors gain a credit, everyone else loses ``MISS``."""
        contributors = {p for p in contributors if self.admitted(p)}
        credit = {p: c - MISS for p, c in self.streak.items() if p not in contributors and c > MISS}
        credit.update({p: min(2 * self.earn, self.streak.get(p, 0) + 1) for p in contributors})
        self.streak = credit
        self._remember(p for p, c in credit.items() if c >= self.earn)
        if len(self.streak) > MAX_TRACKED:
            keep = sorted(self.streak, key=lambda p: -self.streak[p])[:MAX_TRACKED]
            self.streak = {p: self.streak[p] for p in keep}

    def newcomers(self, candidates: Iterable[str], round_key: str, slots: int, *, fresh_ok: bool = True) -> list[str]:
        """Up to ``slots`` of the candidates that do not count yet, the longest streaks first, ties broken by a hash
        of (peer, round) so every peer of the run picks the same ones. ``fresh_ok`` False: only peers that already
        contributed (a streak), so brand-new keys get slots only in some rounds (see ``fresh_round``)."""
        fresh = [p for p in candidates if self.admitted(p) and not self.counts(p)
                 and (fresh_ok or self.streak.get(p, 0) > 0 or p in self.known)]

        def rank(p: str) -> tuple:
            tie = hashlib.blake2b(f"{p}/{round_key}".encode(), digest_size=8).digest()
            return (p not in self.known, -self.streak.get(p, 0), tie)

        return sorted(fresh, key=rank)[:max(0, slots)]

    def status(self) -> dict:
        counting = sorted(p for p in self.streak if self.counts(p) and p != self.me)
        return {"closed": self.closed, "counting": len(counting),
                "earning": sum(1 for p in self.streak if not self.counts(p))}
