"""A window's data: ``Window`` (the one we compute: its steps, audits and bytes, by argument through its phases),
``Arrivals`` (what the others send for a window not closed yet) and ``WindowBook`` (everything the loop keeps across
windows: the open windows' arrivals, the closed ones' applied batches, the log, the hash votes, the screening cache,
and how long it keeps them)."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from swarmd.protocols.gossip import Message
from swarmd.protocols.spsa.wire import KEEP_APPLIED


@dataclass
class Window:
    """Window ``w`` as we compute it, from its first step to its close: made at its start, dropped once closed
    (what it held goes with it)."""

    w: int
    size: int  # steps in a window (``window``)
    contribute: bool  # we send a batch for it (``w >= join_at``)
    audits: dict[int, list[str]] = field(default_factory=dict)  # step in it -> peers we re-probe there
    probes: dict[str, list] = field(default_factory=dict)  # peer -> [(step in window, L+, L-)] re-probed
    codes: list[int] = field(default_factory=list)  # our byte for each step (if we contribute)

    def step(self, i: int) -> int:
        """The run's step of step ``i`` of this window."""
        return self.w * self.size + i


@dataclass
class Arrivals:
    batches: dict[str, Message] = field(default_factory=dict)  # author -> signed batch
    joins: set[str] = field(default_factory=set)  # peers that announced they start contributing at this window


class WindowBook:
    def __init__(self) -> None:
        self.open: dict[int, Arrivals] = collections.defaultdict(Arrivals)  # windows not closed yet, as messages come
        self.arrived = asyncio.Event()  # a batch came (a window's close waits on it)
        self.applied: dict[int, dict[str, Message]] = {}  # closed windows (the last few): author -> batch
        self.log: list[list] = []  # closed windows in order: [window, [signed batch, ...]] (possibly empty)
        self.hashes: dict[int, dict[str, str]] = collections.defaultdict(dict)  # window -> author -> hash
        self.my_hashes: dict[int, str] = {}  # window -> our weights' hash after it
        self.screened: dict[int, tuple] = {}  # window -> (its batches, (peers refused as out of scale, cap))

    def closed(self, w: int) -> bool:
        """Window w is closed here (``applied`` keeps the last few closed windows, contiguous)."""
        return w in self.applied or (bool(self.applied) and w < min(self.applied))

    def close(self, w: int, hash_every: int) -> None:
        """Window w is closed and in the log: what is kept of it and of the windows before it. Hash votes for the
        last two hash checks; decoded batches for KEEP_APPLIED windows (a window's steps apply the one before; a
        run without end would otherwise keep every window's, beside the log)."""
        for old in [x for x in self.hashes if x < w - 2 * hash_every]:
            del self.hashes[old]
        for old in [x for x in self.my_hashes if x < w - 2 * hash_every]:
            del self.my_hashes[old]
        self.open.pop(w, None)
        for old in [x for x in self.applied if x < w - KEEP_APPLIED]:
            del self.applied[old]

    def reset(self) -> None:
        """Back to no closed window (before replaying a log from the base)."""
        self.applied.clear()
        self.log.clear()
