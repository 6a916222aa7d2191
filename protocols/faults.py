"""Faults a test injects into a training loop, by peer, round, fragment and phase (as torchft's
``EventInjector().fail_at(rank, step)``): what fails and when, without the test knowing a private method's name.

A loop holds a :class:`FaultPlan` (``loop.faults``; empty in production, where every hook is one falsy check). At a
few named phases the loop reports an :class:`Event` and the plan's matching faults act on it:

- ``await plan.enter(phase, loop, ...)`` at the start of a step (async): a fault may delay it, hang it (the test
  kills the node meanwhile), raise, or signal the test;
- ``plan.drops(phase, loop, ...)``: whether to drop what arrives (a message the gossip validator sees);
- ``plan.altered(phase, loop, value, ...)``: a value the loop computed or serves, changed (a Byzantine update, a
  checkpoint that lies);
- ``plan.note(phase, loop, ...)``: a moment the loop goes through where it cannot wait (a synchronous method): a
  test ``watch``es it, or acts on it at once (``on``: a callback).

DiLoCo's phases (``protocols/diloco/``): ``built`` (enter: the model is built and our own checkpoint, if any,
resumed; before the start barrier), ``step`` (enter: an inner step has run, ``info["step"]``; the simulator's
compute time is a delay here), ``update`` (alter: our pseudo-gradient, r = the round it is for), ``encoded`` (alter:
our update as we will serve and announce it, the tuple (payloads, their hashes, the update as the others decode it
or None, its norm, the base's hash)), ``scatter`` (enter: a scatter round's exchange starts), ``conform`` (enter:
its parts are made the coordinator's; ``info["coordinator"]``), ``fetch`` (enter: a part or chunk is pulled from
``source``), ``message`` (drops: a pubsub message from ``source`` of ``kind``), ``checkpoint`` (alter: the
checkpoint we serve, as a dict before it is packed), ``checkpoint-served`` (enter: after serving one),
``checkpoint-pulled`` (enter: after pulling one from ``source``), ``joined`` (enter: we joined from a checkpoint),
``ask-early`` (drops: a round's wait asks no peer for the announcements its view names), ``announcement-served``
(alter: a signed announcement we serve), ``publish`` (a note: we publish a message of ``kind``, ``info["body"]``;
``watch`` it, then ``happened``, or act ``on`` it), ``reduce`` (enter: we combine a round's updates: a scatter part,
``info["part"]``, or all-to-all's whole updates), ``reduced`` (alter, in a worker thread: a scatter part we
reduced, before it is encoded), ``closed`` (enter: round r of every fragment closed).

SPSA's phases (``protocols/spsa/``; r = the window): ``code`` (alter: the byte we send for a step,
``info["step"]``), ``publish`` (alter: the body of a message of ``kind`` we publish, before it is signed),
``message`` (drops: a pubsub message from ``source`` of ``kind``), ``serve-base`` (enter: ``source`` asks for our
base; alter: the (hash, perturbed tensors) we serve it), ``serve-log`` (alter: the log we serve ``source``, a list
of [window, signed batches]), ``replay-from`` (alter: the peers a late start replays the run's log from, in order),
``built`` (alter: the perturbed parameters' float32 values as the model was built, in the model's order; what it
returns is the base we start from: a base with other low bits, as another CPU's kernels build one), ``replay-leads``
(alter: whether the log just replayed from ``source`` leads to the weights the other peers said they held at its
last window: True, False, or None where nothing tells), ``start`` (enter: our model and base are built and our own
checkpoint resumed, before the start barrier or a late start), ``close`` (enter: window r is about to close; the
simulator's compute time is a delay here), ``closed`` (enter: window r closed).

SAPO's phases (``protocols/sapo/``): ``rollouts`` (alter: our round's (scored groups, completions), as we train on
and share them; ``info`` as ``share``'s), ``share`` (alter: the completions we share for a round, a list per
question; ``info["q_seed"]``, ``info["specs"]`` the questions' (dataset, index)), ``close`` (enter: round r is
about to close; the simulator's compute time is a delay here), ``closed`` (enter: round r closed).

A node run by ``swarmd start`` reaches its loops through ``node.cli.main(on_loops=...)`` (tests/byzantine_peer.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    phase: str
    me: str  # the peer whose loop reports it
    loop: Any
    r: int | None = None  # the round
    p: int | None = None  # the fragment
    source: str | None = None  # the other peer involved (a message's author, a pull's source)
    kind: Any = None  # a message's kind
    info: dict = field(default_factory=dict)


@dataclass
class Fault:
    phase: str
    effect: str  # "enter", "drop", "alter" or "note"
    action: Callable | None = None  # enter: async (event) -> None; alter: (event, value) -> value; note: (event)
    peer: str | None = None
    round: int | None = None
    fragment: int | None = None
    source: str | None = None
    kind: Any = None
    when: Callable[[Event], bool] | None = None
    times: int | None = None  # how often it acts (None: whenever it matches)
    fired: int = 0

    def matches(self, event: Event) -> bool:
        return ((self.times is None or self.fired < self.times)
                and (self.peer is None or self.peer == event.me)
                and (self.round is None or self.round == event.r)
                and (self.fragment is None or self.fragment == event.p)
                and (self.source is None or self.source == event.source)
                and (self.kind is None or self.kind is event.kind)
                and (self.when is None or self.when(event)))


class FaultPlan:
    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self.log: list[Event] = []  # the events of the phases watched (``watch``), for ``happened``
        self._watched: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.faults or self._watched)

    # ------------------------------------------------------------------ building a plan
    def add(self, phase: str, effect: str, action: Callable | None = None, **match) -> Fault:
        fault = Fault(phase, effect, action, **match)
        self.faults.append(fault)
        return fault

    def delay(self, phase: str, seconds: float, **match) -> Fault:
        async def wait(event: Event) -> None:
            await asyncio.sleep(seconds)
        return self.add(phase, "enter", wait, **match)

    def hang(self, phase: str, *, after: float = 0.0, then: Callable[[Event], None] | None = None,
             **match) -> Fault:
        """The step waits ``after`` seconds, calls ``then`` (a test's signal), then never goes on: the test kills
        the node meanwhile."""
        async def hang(event: Event) -> None:
            if after:
                await asyncio.sleep(after)
            if then is not None:
                then(event)
            await asyncio.Event().wait()
        return self.add(phase, "enter", hang, **match)

    def fail(self, phase: str, error: Callable[[], BaseException], **match) -> Fault:
        async def fail(event: Event) -> None:
            raise error()
        return self.add(phase, "enter", fail, **match)

    def signal(self, phase: str, then: Callable[[Event], None], **match) -> Fault:
        async def call(event: Event) -> None:
            then(event)
        return self.add(phase, "enter", call, **match)

    def drop(self, phase: str, **match) -> Fault:
        return self.add(phase, "drop", **match)

    def alter(self, phase: str, fn: Callable[[Event, Any], Any], **match) -> Fault:
        return self.add(phase, "alter", fn, **match)

    def on(self, phase: str, then: Callable[[Event], None], **match) -> Fault:
        """``then(event)`` where the loop notes ``phase`` (at once: the loop does not wait for anything there)."""
        return self.add(phase, "note", then, **match)

    def watch(self, phase: str) -> None:
        self._watched.add(phase)

    def happened(self, phase: str, **match) -> bool:
        """Whether a watched phase's event matching ``match`` (me, r, p, source, kind) was reported."""
        return any(e.phase == phase and all(getattr(e, k) == v for k, v in match.items()) for e in self.log)

    # ------------------------------------------------------------------ the loop's hooks
    def _event(self, phase: str, loop, kw: dict) -> Event:
        event = Event(phase, loop._ctx.identity.peer_id, loop, **kw)
        if phase in self._watched:
            self.log.append(event)
        return event

    def _matching(self, event: Event, effect: str) -> list[Fault]:
        out = [f for f in self.faults if f.phase == event.phase and f.effect == effect and f.matches(event)]
        for f in out:
            f.fired += 1
        return out

    async def enter(self, phase: str, loop, **kw) -> None:
        event = self._event(phase, loop, kw)
        for fault in self._matching(event, "enter"):
            await fault.action(event)

    def note(self, phase: str, loop, **kw) -> None:
        event = self._event(phase, loop, kw)
        for fault in self._matching(event, "note"):
            fault.action(event)

    def drops(self, phase: str, loop, **kw) -> bool:
        return bool(self._matching(self._event(phase, loop, kw), "drop"))

    def altered(self, phase: str, loop, value, **kw):
        event = self._event(phase, loop, kw)
        for fault in self._matching(event, "alter"):
            value = fault.action(event, value)
        return value
