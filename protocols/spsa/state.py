"""The loop's long-lived state that is not a window's nor the base's (``base.Base``), in one holder per concern: the
start barrier's (``Start``) and what our resyncs came from (``Resyncs``)."""

from __future__ import annotations

from swarmd.protocols import rounds


class Start:
    """The start barrier's: who is ready with which base, whom we started with, and the founders' base asks."""

    def __init__(self) -> None:
        self.ready: dict[str, str] = {}  # peer -> base model hash it announced
        # "ready"s from authors our connection list does not show as direct yet (it lags our links, and a peer stops
        # announcing once it starts): counted once they are, the newest READY_UNLISTED kept
        self.ready_unlisted: dict[str, str] = {}
        self.initial: set[str] = set()  # who we started with (window 0 waits for them)
        self.answers = rounds.FounderAnswers()  # founders still at their barrier after our start, answered once
        self.hash: str | None = None  # the weights we start from (base, or our checkpoint's)
        self.bases = rounds.StartWeights()  # whose base we asked for at the start, and how many asks left


class Resyncs:
    """Whose base and log our last replays came from."""

    def __init__(self) -> None:
        self.replayed_from: str | None = None  # the peer whose base and log we replayed last
        # the peers whose base and log we had replayed when our weights left the majority's (the latest
        # MAX_PEER_ENTRIES): a resync asks them after the others
        self.led_off: dict[str, None] = {}
