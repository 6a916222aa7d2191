"""The clock every part of the node reads time from, so a simulation can run it on virtual time.

Two readings, as the standard library has them: ``monotonic()`` for durations, deadlines and rates (never goes
back), ``time()`` for wall-clock timestamps that travel (message stamps, record expiry, logs of rounds). In a normal
node both are the system's (:data:`SYSTEM`). Under :class:`transport.virtual_time.VirtualTimeLoop` both follow the
loop's virtual time, so a deadline of ten minutes passes in the CPU time the code between needs.

Code that runs inside a node gets its clock from the node (``NodeContext.clock``) or takes one as an argument;
code with neither asks :func:`current`, which returns the running loop's clock.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The system's clocks (``time.monotonic`` and ``time.time``)."""

    @staticmethod
    def monotonic() -> float:
        return time.monotonic()

    @staticmethod
    def time() -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM = SystemClock()


class LoopClock:
    """Virtual time: a loop's ``time()`` for durations, ``epoch + time()`` for the wall clock."""

    def __init__(self, loop: asyncio.AbstractEventLoop, epoch: float):
        self._loop = loop
        self.epoch = epoch

    def monotonic(self) -> float:
        return self._loop.time()

    def time(self) -> float:
        return self.epoch + self._loop.time()

    def __repr__(self) -> str:
        return f"LoopClock(epoch={self.epoch})"


def current() -> Clock:
    """The running event loop's clock (a virtual loop carries its own), or the system's outside a loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return SYSTEM
    return getattr(loop, "clock", SYSTEM)
