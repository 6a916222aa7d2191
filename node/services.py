"""What a pluggable service (the gossip layer, training loops) gets from the node, and what it gives back.

``protocols/`` is written against this module only: the node hands each service a :class:`NodeContext` and runs
its ``run()`` in the node's task group (restarted with backoff if it crashes); ``status()`` appears under
``/status`` -> ``services`` and ``routes()`` are added to the local HTTP endpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from swarmd.transport.base import Transport
from swarmd.transport.clock import SYSTEM, Clock
from swarmd.transport.identity import Identity


@dataclass
class NodeContext:
    identity: Identity
    transport: Transport
    data_dir: Path
    members: Callable[[], list[str]]  # connected peers that are swarm members
    replicator: Any  # node.replication.Replicator: write_many(), store (read the merged state)
    direct: Callable[[str], bool]  # True if our connection to the peer is direct (not through a relay)
    punched: Callable[[str], bool] = lambda peer: False  # True if that direct connection was hole-punched
    anchors: Callable[[], set[str]] = set  # peers the user chose to trust (the bootstrap peers' ids)
    clock: Clock = SYSTEM  # what every service reads time from (virtual in a simulation)


class Service(Protocol):
    name: str

    async def start(self, ctx: NodeContext) -> None: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict: ...

    def routes(self) -> list:  # aiohttp RouteDef list
        ...


class Work:
    """One piece of long work (a model build, a checkpoint pull, a log replay): how far it is, in ``/status`` (the
    service's ``work`` list) and, every ``every`` seconds while it lasts, in the log. Thread-safe enough for a worker
    thread to call :meth:`update` while the event loop reads :meth:`view` (two ints and a float)."""

    def __init__(self, board: WorkBoard, what: str, total: int | None, unit: str, logger: logging.Logger,
                 every: float, clock: Callable[[], float]):
        self.board, self.what, self.total, self.unit = board, what, total, unit
        self.done = 0
        self._logger, self._every, self._clock = logger, every, clock
        self.started = self._last_log = clock()

    def update(self, done: int) -> None:
        self.done = done
        now = self._clock()
        if now - self._last_log >= self._every:
            self._last_log = now
            self._logger.info("%s: %s", self.what, self.text())

    def text(self) -> str:
        elapsed = self._clock() - self.started
        if not self.total:
            return f"{_amount(self.done, self.unit) + ', ' if self.done else ''}{elapsed:.0f} s"
        pct = 100 * self.done / self.total
        left = elapsed * (self.total - self.done) / self.done if self.done else None
        return (f"{pct:.0f}% ({_amount(self.done, self.unit)} of {_amount(self.total, self.unit)}), {elapsed:.0f} s"
                + (f", about {left:.0f} s left" if left is not None and elapsed >= 2 else ""))

    def view(self) -> dict:
        return {"what": self.what, "done": self.done, "total": self.total, "unit": self.unit,
                "percent": round(100 * self.done / self.total, 1) if self.total else None,
                "elapsed_s": round(self._clock() - self.started, 1)}

    def __enter__(self) -> Work:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.board.items.remove(self)
        if kind is None and self._clock() - self.started >= self._every:
            self._logger.info("%s: done in %.1f s", self.what, self._clock() - self.started)


class WorkBoard:
    """A service's long work in progress: ``with board.track("checkpoint pull", total=n, unit="B") as w:
    w.update(got)``; :meth:`view` is the list ``/status`` shows."""

    def __init__(self, logger: logging.Logger | None = None, every: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.items: list[Work] = []
        self._logger = logger or logging.getLogger(__name__)
        self._every, self._clock = every, clock

    def track(self, what: str, total: int | None = None, unit: str = "") -> Work:
        work = Work(self, what, total, unit, self._logger, self._every, self._clock)
        self.items.append(work)
        return work

    def view(self) -> list[dict]:
        return [w.view() for w in list(self.items)]


def _amount(n: float, unit: str) -> str:
    if unit == "B":
        return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:.0f} B"
    return f"{n:g} {unit}".rstrip()


def work_text(w: dict) -> str:
    """Long work in progress, from a loop's /status ``work`` entry: 'checkpoint pull 45% of 27.0 MB, 3 s'."""
    if w.get("percent") is None:
        return f"{w['what']} {w['elapsed_s']:.0f} s"
    total = f"{w['total'] / 1e6:.1f} MB" if w.get("unit") == "B" else f"{w['total']} {w.get('unit', '')}".rstrip()
    return f"{w['what']} {w['percent']:.0f}% of {total}, {w['elapsed_s']:.0f} s"
