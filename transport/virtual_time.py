"""The virtual-time event loop that the simulator and the one-process tests run on.

:class:`VirtualTimeLoop` is an asyncio event loop whose clock is virtual: when nothing is ready to run and no worker
thread is busy, it jumps to the next timer instead of sleeping, so a minute of a simulated swarm takes the CPU time
its code needs, not a minute, and a run with the same seed takes the same steps. Code that reads the time must read
``loop.time()`` (or a :class:`transport.clock.Clock` over it), not ``time.monotonic()``.
:func:`run_virtual` runs a coroutine on a fresh one, as ``asyncio.run`` does on a real one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
import threading

from swarmd.transport.clock import LoopClock

DEADLOCK_WAIT = 10.0  # real seconds an idle virtual loop waits for another thread before calling it a deadlock


class _VirtualSelector(selectors.BaseSelector):
    """The loop's selector: the real one for the loop's own wake-up pipe (worker threads finishing), and for
    waits, a jump of the virtual clock instead of a sleep whenever no worker thread is busy."""

    def __init__(self, loop: VirtualTimeLoop):
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout=None):
        # a worker thread is computing: virtual time stands still, and nothing else runs until every thread has
        # finished; then the finished work's results are handed over, in the order it was started (so they land at
        # the same point of the schedule in every run, also work that finished while the loop ran callbacks), and
        # their callbacks run before the clock moves
        waited = bool(self._loop.threads_in_flight())
        events = {}
        while self._loop.threads_in_flight():
            events.update((key.fd, (key, mask)) for key, mask in self._real.select(None))
            self._loop._read_from_self()  # the wake-up pipe, drained (else the wait spins until the last)
        if self._loop.deliver() or waited:
            events.update((key.fd, (key, mask)) for key, mask in self._real.select(0))
            return list(events.values())
        if timeout is not None and timeout <= 0:
            return self._real.select(0)
        if timeout is None:
            # nothing is scheduled: only another thread (one not started through run_in_executor, such as the
            # executor's shutdown) can still wake us; wait a while for it, then call it what it is
            events = self._real.select(DEADLOCK_WAIT)
            if not events:
                raise RuntimeError("simulation deadlock: nothing is scheduled and nothing is running")
            return events
        self._loop.advance(timeout)
        return self._real.select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (see the module's docstring). ``epoch`` is the wall-clock time (seconds since
    1970) that virtual time 0 stands for: the loop's :attr:`clock` reads ``epoch + time()`` as the wall clock.

    Worker threads (``asyncio.to_thread``, ``run_in_executor``) still run for real, and the loop waits for them:
    virtual time does not move and no other callback runs while one is busy, so what they compute is free in
    simulated time and lands at the same point of the schedule in every run."""

    def __init__(self, epoch: float = 1_800_000_000.0):
        self._now = 0.0
        self.epoch = epoch
        # work handed to worker threads through run_in_executor, in the order it was started: token -> its asyncio
        # future, until the loop hands it its result; and the work finished (token -> its concurrent future)
        self._in_flight: dict[object, asyncio.Future] = {}
        self._finished: dict[object, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.clock = LoopClock(self, epoch)  # what transport.clock.current() hands to code on this loop
        super().__init__(selector=_VirtualSelector(self))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds

    def threads_in_flight(self) -> int:
        """Work the loop waits for: not finished, and still awaited. A cancelled one is not (its task was cancelled,
        as a killed simulated node's are): if it had not started it never will, and its result is dropped anyway."""
        with self._lock:
            return sum(1 for token, f in self._in_flight.items() if token not in self._finished and not f.cancelled())

    def run_in_executor(self, executor, func, *args):
        """asyncio's, but the result is handed to its future by the loop itself, at its next wait (``select``),
        in the order the work was started: not by the worker thread as soon as it is done, which would put it among
        the callbacks of the current step when it is fast and after them when it is slow (a run under load would
        replay another schedule than the same run alone)."""
        self._check_closed()
        if executor is None:
            executor = self._default_executor
            if executor is None:
                executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmd-sim")
                self.set_default_executor(executor)
        fut = self.create_future()
        token = object()
        with self._lock:
            self._in_flight[token] = fut
        try:
            work = executor.submit(func, *args)
        except BaseException:
            self._forget(token)
            raise

        def finished(done: concurrent.futures.Future) -> None:  # in the worker thread (or here, if already done)
            with self._lock:
                if token in self._in_flight:  # (not cancelled meanwhile)
                    self._finished[token] = done
            self._write_to_self()  # wake the loop's wait

        work.add_done_callback(finished)
        fut.add_done_callback(lambda f: (work.cancel(), self._forget(token)) if f.cancelled() else None)
        return fut

    def _forget(self, token: object) -> None:
        with self._lock:
            self._in_flight.pop(token, None)
            self._finished.pop(token, None)

    def deliver(self) -> int:
        """Finished work's results into their futures, in the order it was started (on the loop's thread); how
        many were handed over."""
        if not self._finished:  # (every select asks: nothing to lock for in the usual case)
            return 0
        with self._lock:
            done = [(self._in_flight.pop(token), self._finished.pop(token)) for token in list(self._in_flight)
                    if token in self._finished]
        handed = 0
        for fut, work in done:
            if fut.cancelled() or work.cancelled():
                continue
            exc = work.exception()
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(work.result())
            handed += 1
        return handed


def run_virtual(main, *, epoch: float = 1_800_000_000.0, workers: int = 1):
    """Run coroutine ``main`` to completion on a fresh :class:`VirtualTimeLoop` (like ``asyncio.run``). One worker
    thread by default: threads finish in the order they were started, so a run is the same every time."""
    loop = VirtualTimeLoop(epoch)
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                                    thread_name_prefix="swarmd-sim"))
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
