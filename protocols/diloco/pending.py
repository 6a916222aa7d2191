"""What a round of one fragment gathers while it is open (``Pending``), what a close keeps to redo
it (``Redo``), and the scatter steps' ends and receipts."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import torch
from swarmd.protocols import codecs, exchange
from swarmd.transport import clock


@dataclass
class StepEnd:
    """When a scatter step's pulls give up: ``at``, which each part that comes in the step moves to ``grace`` after
    that arrival, up to ``cap``: bytes still coming are not cut off at a rate that was guessed (before the first
    measurement) or has changed since, and a peer that sends nothing costs ``grace`` after the last of the others'
    bytes, not ``cap``. (Waits for messages keep the step's fixed end: every peer gives up on a late reducer's part
    at about the same time, and the round's coordinator publishes its parts list when the others expect it.)"""
    at: float
    cap: float = 0.0
    grace: float = 0.0

    def arrived(self, now: float) -> None:
        if self.cap > self.at:
            self.at = min(self.cap, max(self.at, now + self.grace))


@dataclass
class Received:
    """What a scatter step received so far (its rate is measured from it): bytes of chunks and parts, and when
    the step started and the last of them came; and the ends of its pulls, which arrivals move."""
    start: float
    bytes: int = 0
    last: float = 0.0
    ends: list[StepEnd] = field(default_factory=list)  # the step's pulls' ends, which arrivals move


@dataclass(frozen=True)
class Announced:
    """A peer's update for a (round, fragment), as its signed announcement describes it."""

    parts: tuple[bytes, ...]  # the content hashes of its encoded parts
    sizes: tuple[int, ...]
    base: str  # the hash of the global fragment it was computed from
    norm: float  # the L2 norm of the whole (decoded) update: every reducer clips with the same factors
    addrs: tuple[str, ...]  # its bulk TCP addresses
    rates: tuple[tuple[bytes, int], ...] = ()  # (short id, kB/s): what it received from those peers last round
    unreached: tuple[bytes, ...] = ()  # short ids of the peers it reaches only through a relay


@dataclass
class Pending:
    """One (round, fragment) being gathered."""

    announced: dict[str, Announced] = field(default_factory=dict)
    updates: dict[str, torch.Tensor] = field(default_factory=dict)  # whole updates pulled (all-to-all)
    opened: float = field(default_factory=lambda: clock.current().monotonic())
    arrivals: dict[str, float] = field(default_factory=dict)
    pulls: set = field(default_factory=set)
    pulling: set = field(default_factory=set)  # peers whose whole update is being pulled
    reduced: dict[int, dict[str, tuple]] = field(default_factory=lambda: collections.defaultdict(dict))
    audits: dict[int, dict[str, tuple]] = field(default_factory=lambda: collections.defaultdict(dict))
    entries: int = 0  # reduced + audit messages held
    # part k -> set when a reduced part or an audit verdict for it comes: what a part's wait in ``ScatterRound`` wakes
    # on (each of a round's up to MAX_PARTS waits woke on every message of the round: at 16 peers and 64 parts,
    # thousands of wake-ups a round)
    part_events: dict[int, asyncio.Event] = field(default_factory=lambda: collections.defaultdict(asyncio.Event))
    sent_at: float | None = None  # when we announced our update
    prefetched: dict[tuple[str, int], asyncio.Task] = field(default_factory=dict)  # (peer, part) -> its chunk's bytes
    prefetch_used: set[tuple[str, int]] = field(default_factory=set)  # the prefetched chunks a reduction took
    prefetchable: set[str] = field(default_factory=set)  # the announcers whose chunks of our parts we prefetch
    failed: set = field(default_factory=set)  # peers whose announced update could not be pulled or decoded
    refused: dict = field(default_factory=dict)  # peer -> why its update's bytes were unusable (its own fault)
    views: dict[str, frozenset[bytes]] = field(default_factory=dict)  # counted peers' member views (short ids)
    view_at: dict[str, float] = field(default_factory=dict)  # when each view came
    coordinator: str | None = None  # whose member view we took (scatter: whose parts we take too)
    count: int | None = None  # the round's part count, once it closes (``DilocoLoop._round_parts``)
    linked: frozenset = frozenset()  # scatter: the members connected to us when the round's step began
    parts: dict[str, tuple] = field(default_factory=dict)  # last round's members' parts: (digest, sets, hashes)
    signed: dict[str, dict] = field(default_factory=dict)  # peer -> its announcement as it signed it (wire form)
    meter: exchange.RateMeter = field(default_factory=exchange.RateMeter)  # what we receive from whom, how fast


@dataclass
class Redo:
    """What closing a round of a fragment took (all-to-all), kept one round: if the majority's updates for the next
    round say they were computed from other weights, the close is redone without the updates whose inclusion may
    differ (ours, whose announcement may have reached the others late; the last other one to arrive), or with the
    counted peers' updates that came after it (``late``, pulled then), before a checkpoint is pulled."""

    round: int
    members: frozenset[str]
    updates: dict[str, torch.Tensor]
    global_before: torch.Tensor  # the fragment's global weights before the close (the step returns new tensors)
    base: str  # their hash: what a late update must have been computed from
    momentum: torch.Tensor  # the outer momentum before it (a copy: the step changes it in place)
    last: str | None  # the other member whose update arrived last
    late: dict[str, torch.Tensor] = field(default_factory=dict)  # counted peers' updates that came after the close
    pulling: dict[str, asyncio.Task | None] = field(default_factory=dict)  # None: a pull of the round, still on

    def drop(self) -> None:
        for task in self.pulling.values():
            if task is not None:
                task.cancel()

    def variants(self, me: str) -> list[frozenset[str]]:
        """The member sets to try: each missing what might have been late at the others, then with what was late
        here."""
        out: list[frozenset[str]] = []
        late = frozenset(self.late)
        for left in (self.members - {me}, self.members - {self.last}, self.members - {me, self.last},
                     self.members | late, (self.members - {me}) | late):
            if left != self.members and left not in out:
                out.append(left)
        return out

    def update(self, peer: str) -> torch.Tensor:
        return self.updates[peer] if peer in self.updates else self.late[peer]


def _decode_part(body, elements: int, out: torch.Tensor | None) -> torch.Tensor:
    """A pulled part or chunk decoded (into ``out``, when given, which holds exactly ``elements`` values)."""
    try:
        return codecs.decode(body, out=out, max_elements=elements)
    except ValueError:  # another element count than the announcement's: the sender's fault
        raise codecs.CodecError(f"a part of another size than its {elements} values") from None


