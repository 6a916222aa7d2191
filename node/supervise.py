"""The node's background loops, supervised, and its shutdown: each loop restarted with backoff when it crashes,
all of them cancelled until they end, and every shutdown step bounded in time, so that a stuck one neither keeps the
node from exiting nor goes unnoticed (the log names it, and where it waits).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Awaitable, Callable

logger = logging.getLogger("swarmd.node.core")  # the node's one logger, whichever of its modules logs


async def supervise(name: str, run: Callable[[], Awaitable[None]], *, max_delay: float = 30.0) -> None:
    """Run a background loop forever; if it crashes (a bug), log it and restart it with backoff.

    A bug in one loop must not take the node down; cancellation passes through."""
    delay = 1.0
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s loop crashed; restarting in %.0f s", name, delay)
        if time.monotonic() - started > 60:
            delay = 1.0
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


async def run_loops(loops: list[tuple[str, Callable[[], Awaitable[None]]]], added: asyncio.Queue | None = None) -> None:
    """Run the node's background loops (each supervised) until they all end or this is cancelled; then end them all.
    Loops put on ``added`` join them as they come (while ``added`` is given, this runs until cancelled).

    One cancellation is not always enough: on Python 3.11 ``asyncio.wait_for`` swallows a cancellation that lands
    just as the awaited future completes (fixed in 3.12), and a loop around it runs on, so a TaskGroup, which cancels
    its tasks once, could wait for it forever (seen: a node given SIGTERM that never exited). Here each loop still
    running is cancelled again every half second, up to SHUTDOWN_STEP_S; one still running then is named in a
    warning and abandoned."""
    tasks = {asyncio.create_task(supervise(name, run), name=f"loop: {name}"): name for name, run in loops}
    arriving = None if added is None else asyncio.ensure_future(added.get())
    try:
        while True:
            running = [t for t in tasks if not t.done()]
            if not running and arriving is None:
                return
            done, _ = await asyncio.wait([*running, *([arriving] if arriving else [])],
                                         return_when=asyncio.FIRST_COMPLETED)
            if arriving in done:
                name, run = arriving.result()
                tasks[asyncio.create_task(supervise(name, run), name=f"loop: {name}")] = name
                arriving = asyncio.ensure_future(added.get())
    finally:
        if arriving is not None:
            arriving.cancel()
        await end_tasks(tasks)


async def end_tasks(tasks: dict[asyncio.Task, str]) -> None:
    """Cancel these tasks until they end (again every half second, since one cancellation can be swallowed), up to
    SHUTDOWN_STEP_S; those still running then are named in a warning and abandoned."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHUTDOWN_STEP_S
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            logger.warning("shutdown: %s did not end within %.0f s of being cancelled; abandoned (%s)",
                           ", ".join(sorted(tasks[t] for t in pending)), SHUTDOWN_STEP_S,
                           "; ".join(sorted(f"{tasks[t]} at {where(t)}" for t in pending)))
            others = [t for t in asyncio.all_tasks() - set(tasks) - {asyncio.current_task()} if not t.done()]
            if others:  # a stuck task is often waiting for one of these (a TaskGroup's children, a stream's reader)
                logger.warning("shutdown: tasks still running then: %s%s",
                               "; ".join(sorted(f"{t.get_name()} at {where(t)}" for t in others)[:MAX_STUCK_SHOWN]),
                               f" (and {len(others) - MAX_STUCK_SHOWN} more)" if len(others) > MAX_STUCK_SHOWN else "")
            return
        _, pending = await asyncio.wait(pending, timeout=min(0.5, left))


SHUTDOWN_STEP_S = 5.0  # the most one step of a shutdown may take before it is abandoned (and named in the log)
MAX_STUCK_SHOWN = 8  # tasks named, with where each waits, when a shutdown step is abandoned


def where(task: asyncio.Task, depth: int = 3) -> str:
    """Where a pending task waits: the innermost ``depth`` coroutine frames of its await chain, outer to inner
    (``file:line function > ...``), the line that says what a stuck shutdown was waiting for."""
    coro, frames = task.get_coro(), []
    while coro is not None:
        f = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if f is None:
            break
        frames.append(f)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(f"{_short(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}" for f in frames[-depth:]) or "?"


def _short(path: str) -> str:
    """A path relative to the sys.path entry it was imported from, where there is one."""
    for root in sys.path:
        root = root.rstrip("/")
        if root and path.startswith(root + "/"):
            return path[len(root) + 1:]
    return path


async def _bounded(what: str, step: Awaitable) -> None:
    """One shutdown step, abandoned after SHUTDOWN_STEP_S with a warning naming it, so a stuck step neither keeps
    the node from exiting nor goes unnoticed."""
    try:
        await asyncio.wait_for(step, SHUTDOWN_STEP_S)
    except asyncio.TimeoutError:
        logger.warning("shutdown: %s took more than %.0f s; abandoned", what, SHUTDOWN_STEP_S)
