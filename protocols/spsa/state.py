"""The loop's long-lived state that is not a window's, in one holder per concern: the base model we replay onto
(``Base``), the start barrier's (``Start``), what our resyncs came from (``Resyncs``) and the audits' (``Audits``)."""

from __future__ import annotations

import asyncio
import collections
import logging
import random

import torch

from swarmd.protocols import rounds
from swarmd.protocols.spsa.wire import BASE_SERVES
from swarmd.transport.penalties import RateLimitedLog


class Base:
    """The base model we replay onto (the one we build, or a peer's we took in its place), and its serving."""

    def __init__(self, logger: logging.Logger) -> None:
        self.hash: str | None = None  # of its perturbed parameters (tensors_hash)
        self.tensors: list[torch.Tensor] = []  # the base's perturbed parameters (canonical float32)
        self.layout: list = []  # the model's state dict as a base is served (base_layout)
        self.state_hash: str | None = None  # of the whole base as served (base_digest)
        self.taken: dict | None = None  # the base we replay onto, where a peer's replaced ours (/status)
        self.replacing = False  # a peer's base is being taken in place of ours (none is served meanwhile)
        self.serving = asyncio.Semaphore(BASE_SERVES)
        self.served: collections.OrderedDict[str, float] = collections.OrderedDict()  # peer -> when
        self.log = RateLimitedLog(logger, interval=30.0)


class Start:
    """The start barrier's: who is ready with which base, whom we started with, and the founders' base asks."""

    def __init__(self) -> None:
        self.ready: dict[str, str] = {}  # peer -> base model hash it announced
        # "ready"s from authors our connection list does not show as direct yet (it lags our links, and a peer stops
        # announcing once it starts): counted once they are, the newest READY_UNLISTED kept
        self.ready_unlisted: dict[str, str] = {}
        self.initial: set[str] = set()  # who we started with (window 0 waits for them)
        self.hash: str | None = None  # the weights we start from (base, or our checkpoint's)
        self.bases = rounds.StartWeights()  # whose base we asked for at the start, and how many asks left


class Resyncs:
    """Whom a resync asks, and whose base and log our last replays came from."""

    def __init__(self) -> None:
        self.resync_from: list[str] = []  # the peers the next resync asks (empty: none due)
        self.replayed_from: str | None = None  # the peer whose base and log we replayed last
        # the peers whose base and log we had replayed when our weights left the majority's (the latest
        # MAX_PEER_ENTRIES): a resync asks them after the others
        self.led_off: dict[str, None] = {}


class Audits:
    """Whom the audits convicted, who keeps probing other weights than ours, and the secret draw of which steps we
    re-probe (a window's own re-probes are its ``Window``'s)."""

    def __init__(self) -> None:
        self.convicted: collections.OrderedDict[str, int] = collections.OrderedDict()  # peer -> window it failed
        self.off_weights: collections.Counter = collections.Counter()  # peer -> windows in a row off ours (the
        # majority's)
        self.rng = random.Random(0)  # seeded from our key at start: no one else can tell which steps
