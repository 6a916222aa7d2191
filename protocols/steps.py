"""Inner steps taken by the user's own training loop, in the user's thread, handed to a loop on the node's thread.

A loop that trains a task draws the batch, computes the loss and steps the optimizer itself (``_inner_step``). A
loop driven from a user's script (``swarmd.DiLoCo``) does none of that: the user's code steps its optimizer as it
always did, and a hook on that optimizer hands each finished step to the loop.

The loop acts on the model only at some steps: where a fragment's update is announced (its weights read) and where
a round closes (the combined weights written). It grants the user's thread the steps up to the next such step
(:meth:`UserSteps.grant`); the user's thread takes them without waiting for the loop, and waits after the last of
them until the loop has done what that step calls for and granted more. So the loop and the user's code never
touch the model at the same time, and between two syncs a step costs the user's thread no hand-off at all.
Anything else that writes the model (a resync from a peer's checkpoint) first takes the user's thread back to a
step's end (:meth:`UserSteps.hold`).

Error handling: the loop's side ends with :class:`StepsEnded` once the user's script has left the run; the user's
side never blocks for good: it returns as soon as the loop has ended (done, failed or refused), and says so.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable


class StepsEnded(Exception):
    """The user's script left the run (its ``with`` block ended): no more inner steps will come."""


class UserSteps:
    """The hand-off of inner steps between the user's thread (which trains) and the loop (which syncs).

    Counted from the run's start in this process: ``granted`` steps the user may have taken, ``taken`` it has,
    ``consumed`` the loop has accounted for (consumed <= taken <= granted)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.granted = self.taken = self.consumed = 0
        self._losses: collections.deque[float | None] = collections.deque()  # taken, not yet consumed
        self._loss: float | None = None  # the loss the user reported for the step under way
        self._waiter: asyncio.Future | None = None  # the loop waiting for the user's next step
        self._waiter_loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False  # the user left the run

    # ------------------------------------------------------------------ the loop's side (node thread)
    def grant(self, ahead: int) -> None:
        """Let the user's thread run up to ``ahead`` steps past the ones the loop has accounted for."""
        with self._cond:
            if self.consumed + ahead > self.granted:
                self.granted = self.consumed + ahead
                self._cond.notify_all()

    async def next_step(self) -> float | None:
        """The user's next step, once taken (granting it, where it was not): returns the loss reported for it
        (None where none was). Raises :class:`StepsEnded` once the user left the run."""
        self.grant(1)
        while True:
            with self._cond:
                if self._stopped:
                    raise StepsEnded
                if self.taken > self.consumed:
                    self.consumed += 1
                    return self._losses.popleft()
                loop = asyncio.get_running_loop()
                self._waiter, self._waiter_loop = loop.create_future(), loop
                waiter = self._waiter
            await waiter

    async def hold(self) -> None:
        """Take the user's thread back to the end of a step (the one under way finishes), before the loop writes
        the model outside the steps it granted for that."""
        while True:
            with self._cond:
                if self._stopped:
                    return
                self.granted = min(self.granted, self.taken + 1) if self.granted > self.taken else self.granted
                if self.taken == self.granted:
                    return
                loop = asyncio.get_running_loop()
                self._waiter, self._waiter_loop = loop.create_future(), loop
                waiter = self._waiter
            await waiter

    def _wake_loop(self) -> None:
        waiter, loop, self._waiter = self._waiter, self._waiter_loop, None
        if waiter is not None:
            try:
                loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))
            except RuntimeError:  # the node's loop is closed: nothing waits any more
                pass

    # ------------------------------------------------------------------ the user's side (training thread)
    def report_loss(self, value: float) -> None:
        """The training loss of the step under way (optional: shown in ``/status`` and used where the run has no
        evaluation)."""
        self._loss = float(value)

    def step_taken(self) -> bool:
        """Called by the optimizer's step hook after each step. False where the step is not the run's (the user
        left it, or it never began)."""
        with self._cond:
            if self._stopped or self.granted == 0:
                return False
            self.taken += 1
            self._losses.append(self._loss)
            self._loss = None
            self._wake_loop()
        return True

    def wait_released(self, ended: Callable[[], str | None], poll: float = 0.1, timeout: float | None = None) -> bool:
        """Block while the user's thread has taken every step granted to it: True once it may take the next, False
        once the loop ended (``ended()`` gave a reason). ``timeout`` (seconds) raises TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.taken >= self.granted and not self._stopped:
                if ended() is not None:
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError
                self._cond.wait(poll)
        return True

    def stop(self) -> None:
        """The user leaves the run: the loop's next :meth:`next_step` (or the one it waits in) ends the run."""
        with self._cond:
            self._stopped = True
            self._wake_loop()
            self._cond.notify_all()
