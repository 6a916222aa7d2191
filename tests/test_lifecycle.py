"""The node's background loops end on shutdown even when one swallows a cancellation (node.supervise.run_loops)."""

import asyncio
import logging

import pytest

import swarmd.node.core as core
import swarmd.node.supervise as supervise_module


def _stubborn(swallow: int, ended: list[str], name: str, deaf: asyncio.Event | None = None):
    """A loop that ignores its first ``swallow`` cancellations (all of them while ``deaf`` is set), as a loop around
    Python 3.11's asyncio.wait_for does when the cancellation lands just as the awaited future completes."""
    async def run():
        left = swallow
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if deaf is not None and deaf.is_set():
                    continue
                if left == 0:
                    ended.append(name)
                    raise
                left -= 1
    return run


@pytest.mark.timeout(30)
async def test_a_loop_that_swallows_a_cancellation_still_ends():
    ended = []
    loops = [("plain", _stubborn(0, ended, "plain")), ("swallows twice", _stubborn(2, ended, "swallows twice"))]
    runner = asyncio.create_task(core.run_loops(loops))
    await asyncio.sleep(0.05)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(runner, 5)
    assert sorted(ended) == ["plain", "swallows twice"]


@pytest.mark.timeout(30)
async def test_a_loop_that_never_ends_is_named_and_abandoned(monkeypatch, caplog):
    monkeypatch.setattr(supervise_module, "SHUTDOWN_STEP_S", 0.6)  # read where run_loops is
    ended = []
    deaf = asyncio.Event()
    deaf.set()
    never = _stubborn(0, ended, "deaf loop", deaf)
    runner = asyncio.create_task(core.run_loops([("plain", _stubborn(0, ended, "plain")), ("deaf loop", never)]))
    await asyncio.sleep(0.05)
    runner.cancel()
    with caplog.at_level(logging.WARNING, logger=core.logger.name), pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(runner, 5)
    assert ended == ["plain"]
    (line,) = [r.getMessage() for r in caplog.records if "deaf loop did not end" in r.getMessage()]
    # the line says where it was stuck: the innermost frames of its await chain, our test's function among them
    assert "deaf loop at " in line and "test_lifecycle.py:" in line and " run > " in line, line
    deaf.clear()
    (abandoned,) = [t for t in asyncio.all_tasks() if t.get_name() == "loop: deaf loop"]
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    assert ended == ["plain", "deaf loop"]


@pytest.mark.timeout(30)
async def test_loops_that_return_end_the_run():
    ran = []

    async def once():
        ran.append(1)

    await asyncio.wait_for(core.run_loops([("a", once), ("b", once)]), 5)
    assert ran == [1, 1]
