"""Round logic the three loops share, as plain state machines: no I/O, no asyncio, no clock of their own.

Each loop is a thin shell around these: it feeds them what arrived and the time (``now``, from its injected clock),
and does what they answer (publish, wait so long, close the round, resync from these peers). So the rules can be
read in one place and tested with a fake clock in microseconds (tests/test_rounds.py); the loops' own tests and the
simulator (node/sim.py) drive the same code through the shells.

- :class:`StartBarrier`: when to announce readiness and when to start, together with the peers that are ready.
- :class:`RoundWait` and :func:`plan_wait`: whom a round waits for (the peers whose word counts, and a few newcomers
  in slots drawn the same way everywhere), and how long (the deadline; a newcomer only a grace, unless its
  contribution is on its way).
- :func:`hash_verdict`: after a round, do our weights agree with the majority of the counted peers', and if not,
  whom to resync from.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from protocols.standing import Standing


def majority(votes: Iterable[str]) -> str:
    """The weight hash most peers report; a tie goes to the larger hash, so every peer picks the same side."""
    counts = collections.Counter(votes)
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


class StartBarrier:
    """Start together with the peers that are ready.

    Readiness is announced every ``repeat`` s while waiting (peers whose links form later must hear it too). Once
    ``min_peers`` (us included) are ready, the start comes ``grace`` s later, so peers that became ready at the same
    moment are in everyone's first round; the grace, once begun, is not withdrawn."""

    def __init__(self, min_peers: int, *, grace: float = 1.0, repeat: float = 1.0):
        self.min_peers, self.grace, self.repeat = min_peers, grace, repeat
        self._announced: float | None = None
        self._start_at: float | None = None

    def announce(self, now: float) -> bool:
        """Whether to announce our readiness now (the caller then does)."""
        if self._announced is None or now - self._announced > self.repeat:
            self._announced = now
            return True
        return False

    def start(self, now: float, ready: int) -> bool:
        """Whether to start now, with ``ready`` peers ready (us included)."""
        if ready >= self.min_peers and self._start_at is None:
            self._start_at = now + self.grace
        return self._start_at is not None and now >= self._start_at


TICK = 1e-6  # waits shorter than this count as over (here and in outer.wait_until): an event loop fires a timer
#              that close at once, and on virtual time (the simulator) the clock would then never reach the end


@dataclass
class RoundWait:
    """Whom one round waits for, and how long.

    Every peer in ``expected`` (the peers whose word counts) is waited for up to ``end``. Once they are all in, a
    newcomer holding one of the round's ``slots`` gets ``grace`` s more, and then the rest of the deadline only if
    its contribution is on its way (``coming``: announced and not failed): a fresh key that joined and went quiet
    costs the grace, not the deadline."""

    expected: frozenset[str]
    slots: frozenset[str]
    end: float
    grace: float
    _grace_end: float | None = field(default=None, repr=False)

    @property
    def waited(self) -> frozenset[str]:
        return self.expected | self.slots

    def remaining(self, now: float, have: set[str], coming: set[str] = frozenset()) -> float | None:
        """Seconds to wait more (until something arrives), or None: close the round now."""
        if now >= self.end - TICK:
            return None
        if not self.expected <= have:
            return self.end - now
        quiet = self.slots - have
        if not quiet:
            return None
        if self._grace_end is None:
            self._grace_end = min(self.end, now + self.grace)
        if now < self._grace_end - TICK:
            return self._grace_end - now
        if quiet & coming:
            return self.end - now
        return None

    def newcomers_not_waited(self, have: set[str], coming: set[str] = frozenset()) -> int:
        """Newcomers whose slot was cut short by the grace (counted by the loops)."""
        return 0 if self._grace_end is None else len(self.slots - have - coming)


def plan_wait(standing: Standing, base: set[str], round_key: str, *, fresh: bool, now: float, deadline: float,
              grace: float, me: str | None = None) -> RoundWait:
    """The wait of a round whose candidates are ``base`` (last round's participants and the joins): the peers whose
    word counts, and newcomer slots (a quarter of them, at least one) drawn from ``round_key`` the same way at
    every peer, brand-new keys only in ``fresh`` rounds. A fresh key can neither add itself to the set every round
    waits for nor stall many rounds. ``me``, if given, is left out (a loop that holds its own contribution)."""
    mine = {me} if me is not None else set()
    expected = standing.counting(base) - mine
    slots = standing.newcomers(base - expected - mine, round_key, max(1, len(expected) // 4), fresh_ok=fresh)
    return RoundWait(frozenset(expected), frozenset(slots), now + deadline, grace)


@dataclass(frozen=True)
class HashVerdict:
    majority: str
    agrees: bool
    holders: tuple[str, ...]  # the counted peers holding the majority's hash, sorted: whom to resync from


def hash_verdict(ours: str, theirs: Mapping[str, str], counts=lambda peer: True) -> HashVerdict | None:
    """Our weights' hash after a round against the hashes peers published for it, only those of peers that
    ``counts`` (a fresh key's word does not); None when no counted peer published one."""
    counted = {a: h for a, h in theirs.items() if counts(a)}
    if not counted:
        return None
    top = majority([*counted.values(), ours])
    return HashVerdict(top, top == ours, tuple(sorted(a for a, h in counted.items() if h == top)))
