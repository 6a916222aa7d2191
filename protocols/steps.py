"""Inner steps taken by the user's own training loop, in the user's thread, handed to a loop on the node's thread.

A loop that trains a task draws the batch, computes the loss and steps the optimizer itself (``_inner_step``). A
loop driven from a user's script (``swarmd.DiLoCo``) does none of that: the user's code steps its optimizer as it
always did, and a hook on that optimizer hands each finished step to the loop, which then does what follows a step
(announce an update, close a round, write the combined weights into the model) before it lets the user's thread go
on. So the loop and the user's code never touch the model at the same time, and everything the loop does after a
step is exactly what it does after one of its own.

Error handling: the loop's side of the hand-off ends with :class:`StepsEnded` once the user's script has left the
run; the user's side never blocks for good: it returns as soon as the loop has ended (done, failed or refused), and
says so through ``ended``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable


class StepsEnded(Exception):
    """The user's script left the run (its ``with`` block ended): no more inner steps will come."""


class UserSteps:
    """The hand-off of inner steps between the user's thread (which trains) and the loop (which syncs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = threading.Event()  # the user's thread may take its next step
        self._done: concurrent.futures.Future | None = None  # resolved by the user's thread with the step's loss
        self._stopped = False  # the user left the run
        self._loss: float | None = None  # the loss the user reported for the step under way

    # ------------------------------------------------------------------ the loop's side (node thread)
    async def next_step(self) -> float | None:
        """Let the user's thread take one inner step and wait until it has; returns the loss it reported for the
        step (None where it reported none). Raises :class:`StepsEnded` once the user left the run."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise StepsEnded
            self._done = future
        self._released.set()
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------ the user's side (training thread)
    def report_loss(self, value: float) -> None:
        """The training loss of the step under way (optional: shown in ``/status`` and used where the run has no
        evaluation)."""
        self._loss = float(value)

    def wait_released(self, ended: Callable[[], str | None], poll: float = 0.1, timeout: float | None = None) -> bool:
        """Block until the loop lets the user's thread step (True), or the loop ended (False: ``ended()`` returned
        a reason). ``timeout`` (seconds) raises TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._released.wait(poll):
            if ended() is not None:
                return False
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
        return True

    def step_taken(self) -> bool:
        """Called by the optimizer's step hook after each step: hand it to the loop. False where the loop was not
        waiting for one (the run ended, or the step came before the run started), and so it is not the swarm's."""
        with self._lock:
            future, self._done = self._done, None
            if future is None:
                return False
            self._released.clear()  # before the loop can release the next step
        loss, self._loss = self._loss, None
        future.set_result(loss)
        return True

    def stop(self) -> None:
        """The user leaves the run: the loop's next :meth:`next_step` (or the one it waits in) ends the run."""
        with self._lock:
            self._stopped = True
            future, self._done = self._done, None
        if future is not None and not future.done():
            future.set_exception(StepsEnded())
        self._released.set()
