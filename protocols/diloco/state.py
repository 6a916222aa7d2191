"""The loop's long-lived state that is not a round's nor a fragment's, in one holder per concern: the links to the
others (``Links``), our standing in the swarm between resyncs (``Resyncs``), the start barrier's (``Start``), where
the loop's time goes (``Timings``), and what the run reports (``Record``)."""

from __future__ import annotations

import asyncio
import collections
import math

from swarmd.protocols import rounds
from swarmd.protocols.diloco.wire import HISTORY, RATE_ROUNDS
from swarmd.protocols.standing import EARN


class Links:
    """What we measured of the links to the others and what a scatter step made of it."""

    def __init__(self) -> None:
        self.rates: collections.deque[float] = collections.deque(maxlen=RATE_ROUNDS)  # bytes/s, measured
        self.heard: dict[str, float] = {}  # counted peer -> when a message of theirs last came (monotonic)
        self.source_rates: dict[str, int] = {}  # peer -> kB/s we received from it in the last round it served us
        self.probe: asyncio.Task | None = None  # the founders' link probe, awaited before our first update
        self.probe_blobs: list[bytes] = []  # the probe blobs we serve (until our first round closes)
        # the last scatter step: parts we reduced, members that reduced any, its span and the slowest member's
        # measured rate
        self.assignment: dict[str, float | None] = {}
        self.chain_weights: dict[int, dict[str, int]] = {}  # fragment -> its last round's members' rate weights
        self.slow_link_said = False
        self.encoded_size: dict[tuple[int, str], list[int]] = {}  # (fragment, codec) -> bytes of each part
        self.sources: dict[str, asyncio.Semaphore] = {}  # peer -> the pulls from it at once
        self.checkpoint_served: dict[str, float] = {}  # peer -> when we last served it a checkpoint
        self.missing_logged: dict[str, float] = {}  # peer -> when we last logged a part of its that did not come
        # peers we have no direct path to -> their updates we asked the members we reach for (MAX_PEER_ENTRIES)
        self.through_members: dict[str, int] = {}
        # scatter: peers we have no direct path to -> the rounds their chunks were reduced by members that reach
        # both (no part to us nor them: ``ScatterRound._note_reach``; MAX_PEER_ENTRIES)
        self.reduced_by_members: dict[str, int] = {}


class Resyncs:
    """Whether the majority's weights hold our updates, and what our last resyncs came from."""

    def __init__(self) -> None:
        self.included = 0  # rounds in a row in which the majority's weights contained our update
        self.counted_before_resync = False
        self.next_catch_up = 0.0  # when we may next take a checkpoint for having fallen behind
        self.rejoined_at = -EARN - 1  # the round of our last resync
        self.checkpoint_from: str | None = None  # whose checkpoint we joined from last
        # whose checkpoints we had joined from when our weights left the majority's (the latest MAX_PEER_ENTRIES):
        # asked after the others
        self.led_off: dict[str, None] = {}
        self.resync_from: list[str] = []
        self.asks: set[asyncio.Task] = set()  # announcement fetches after a join (held until done)


class Start:
    """The start barrier's: who is ready, with which initial weights, and whom we started with."""

    def __init__(self) -> None:
        self.initial: set[str] = set()  # who we started with (round 0 waits for them)
        self.hash: str | None = None  # the weights we started the run from, with them
        self.answers = rounds.FounderAnswers()  # founders still at their barrier after our start, answered once
        self.founder = False  # we started the run with the others: they count us from the start
        self.ready: dict[str, str] = {}
        # "ready"s from authors our connection list does not show as direct yet (it lags our links: the daemon's
        # listing is read every 2 s, and a peer stops announcing once it starts): counted once they are, the
        # newest READY_UNLISTED kept (a fresh key that never connects only pushes out the oldest)
        self.ready_unlisted: dict[str, str] = {}
        self.weights = rounds.StartWeights()  # whose initial weights we asked for, and how many asks left


class Timings:
    """Where the loop's time goes (``/status``)."""

    def __init__(self) -> None:
        self.compute = 0.0  # seconds computing
        self.blocked = 0.0  # seconds waiting for a round to close, not computing
        self.exchange: collections.deque[float] = collections.deque(maxlen=32)
        self.close: collections.deque[float] = collections.deque(maxlen=32)
        # where a round's exchange spends its time, per phase (``/status`` -> exchange.phase_seconds_median):
        # wait (our update announced -> the close), agree (the member agreement), reduce (scatter: chunks in, our
        # parts reduced, the others' taken and audited), conform (the wait for the coordinator's parts and any
        # part reduced again); all-to-all: combine (the pulled updates combined)
        self.phases: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=32))


class Record:
    """What the run reports (``/status``, the simulator, the training API): its closed rounds, its losses, where it
    ended and whose initial weights it started from."""

    def __init__(self) -> None:
        # per closed round: fragment, round, participants, global hash (the last HISTORY)
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self.losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=HISTORY)  # (step, eval loss)
        self.train_loss: float | None = None  # the last step's
        self.recent: list[float] = []  # the training losses since the last evaluation
        self.final_hash: str | None = None
        self.initial_weights: dict | None = None  # whose initial weights we started from, where not ours
        self.exchange: dict = {}  # the last round's exchange (``/status`` exchange)

    def trained(self, value: float) -> None:
        self.train_loss = value
        self.recent.append(value)

    def round_loss(self) -> float | None:
        """The mean finite training loss since the last call (a task without evaluate())."""
        recent = [x for x in self.recent if math.isfinite(x)]
        self.recent.clear()
        return sum(recent) / len(recent) if recent else None
