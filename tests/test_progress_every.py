"""A loop's progress register is written at most every ``progress.every`` seconds (each write is an op every peer
of the swarm verifies, logs and forwards), the newest value waiting is written when the interval ends, and the
run's last progress is written at once when the run ends."""

from __future__ import annotations

import asyncio
import types

import pytest

from swarmd.protocols.loopstate import ProgressWrites
from swarmd.protocols.taskloop import TaskLoop
from swarmd.transport import clock as clockmod

pytestmark = pytest.mark.timeout(30)


class _Replicator:
    """The part of node.replication.Replicator a loop's progress uses: what was written, in order."""

    def __init__(self):
        self.writes: list[dict] = []

    async def write(self, kind: str, value: dict):
        assert kind == "progress"
        self.writes.append(value)


class _Loop(TaskLoop):
    name = "probe"

    def __init__(self):
        self._ctx = types.SimpleNamespace(replicator=_Replicator(), clock=clockmod.current())
        self.progress = ProgressWrites(every=0.3)


def _steps(loop):
    return [v["step"] for v in loop._ctx.replicator.writes]


async def test_progress_is_written_at_most_once_an_interval_and_the_newest_value_wins():
    loop = _Loop()
    for step in range(1, 6):  # five values inside one interval
        await loop._write_progress(step, step, 1.0, 0, step)
    assert _steps(loop) == [1]  # the first at once, the others wait
    await asyncio.wait_for(loop.progress.later, 5)
    assert _steps(loop) == [1, 5]  # one write for the four that waited: the newest
    await asyncio.sleep(loop.progress.every)
    await loop._write_progress(6, 6, 1.0, 0, 6)
    assert _steps(loop) == [1, 5, 6]  # past the interval: at once again


async def test_the_runs_last_progress_is_written_when_the_run_ends():
    loop = _Loop()
    loop.progress.every = 60.0

    await loop._write_progress(1, 1, 1.0, 0, 1)
    await loop._write_progress(2, 2, 1.0, 0, 2)
    await loop._last_progress()  # (each loop, as its run ends)
    assert _steps(loop) == [1, 2]  # the second at the run's end, not a minute later
    await asyncio.gather(loop.progress.later, return_exceptions=True)
    assert loop.progress.later.cancelled() and _steps(loop) == [1, 2]  # and not twice


async def test_close_drops_a_write_that_waits():
    loop = _Loop()
    loop.progress.every = 60.0
    await loop._write_progress(1, 1, 1.0, 0, 1)
    await loop._write_progress(2, 2, 1.0, 0, 2)
    waiting = loop.progress.later
    loop._stop_progress()
    await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled() and _steps(loop) == [1]
