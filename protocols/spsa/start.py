"""The start: the barrier with the ready peers (and the founders' base where it is not ours), or the late path when
the run began without us."""

from __future__ import annotations

import asyncio
import logging

from swarmd.protocols import outer, rounds
from swarmd.protocols.spsa.weights import tensors_hash
from swarmd.protocols.spsa.wire import MAX_PEER_ENTRIES, READY
from swarmd.transport.errors import ProtocolViolation, TransportError

MISMATCH_SAID_AFTER = 10.0  # s a start waits beside ready peers of another base before it says so in the log


class StartMixin:
    """SPSALoop's start barrier and late path."""

    async def _start_or_catch_up(self) -> None:
        """Start at window 0 with the peers that are ready (same base model), or, if the run has begun without
        us, replay the log and join two windows ahead."""
        me = self._ctx.identity.peer_id
        self.state = "waiting for peers"
        self.start_state.hash = start = self.weights.hash()
        barrier = rounds.StartBarrier(self.cfg.min_peers)
        since = None  # when we first saw a ready peer with another base
        while True:
            if barrier.announce(self.clock.monotonic()):
                self._publish(READY, {"w": self.window, "ready": start})
            ahead = self._run_started_without_us()
            if self.faults:  # the peers a test has us replay from, in its order
                ahead = self.faults.altered("replay-from", self, ahead)
            if ahead:
                # replayed on top of our own checkpoint where the served log begins with our log, else from the
                # base; a restart of this loop (it crashed) while the others still count us: back at once, from the
                # first window we have not sent a batch for
                if await self._replay_from(ahead, rejoin=self._sent_up_to >= 0):
                    return
                for window in self.book.open.values():  # none served: do not follow them again at once
                    for a in ahead:
                        window.batches.pop(a, None)
                self.state = "waiting for peers"
            target = self._start_choice(start)
            if target is not None and await self._take_start_base(target):
                self.start_state.hash = start = self.weights.hash()
                self._publish(READY, {"w": self.window, "ready": start})  # at once: our new base
                continue
            linked = rounds.linked(self._ctx)  # a peer reached through a relay only founds too: its batches
            rounds.count_listed(self.start_state.ready, self.start_state.ready_unlisted, linked, MAX_PEER_ENTRIES)
            ready = {p for p, h in self.start_state.ready.items() if h == start and linked(p)} | {me}
            self._check_refusal(len(ready) - 1)
            if barrier.start(self.clock.monotonic(), len(ready)):
                self.start_state.initial = ready
                self.start_state.answers.started_at = self.clock.monotonic()
                self.standing.found(ready)
                self.start_state.ready.clear()
                self.start_state.ready_unlisted.clear()
                self.state = "running"
                return
            if self.start_state.ready and any(h != start for h in self.start_state.ready.values()):
                self.counters["base_mismatch_peers"] = others = sum(h != start for h in self.start_state.ready.values())
                since = since if since is not None else self.clock.monotonic()
                if self.clock.monotonic() - since > MISMATCH_SAID_AFTER:  # (a base within rounding is taken at once)
                    self.base.log.log(logging.WARNING, "mismatch", "spsa: waiting for peers: %d ready peer(s) hold "
                                       "another base model than ours (%d with ours, min_peers = %d). A base within "
                                       "rounding of ours is taken at the start; one further apart (pretrained on "
                                       "another CPU) is not, and its peer joins once the run has begun", others,
                                       len(ready), self.cfg.min_peers)
            await asyncio.sleep(0.1)

    def _start_choice(self, start: str) -> str | None:
        """The base to found the run on, where it is not ours: the hash most of the directly connected ready peers
        and we hold (ties: the smallest), or None. A task's model() that loads pretrained weights and draws a new
        head with nn.init, or builds a model from a seed, gives other low bits under other CPU kernels (torch's
        scalar ones, an ARM CPU's): without this such peers never founded a run together. Only at window 0, from the
        base (not from a checkpoint of a later window); see _take_start_base for what is taken. Holders are asked
        a bounded number of times (rounds.StartWeights): hashes a flood of fresh keys announce cost a few asks."""
        if self.window or self.book.log:
            return None
        ready = self.start_state.ready
        return self.start_state.bases.choice(start, {a: h for a, h in ready.items() if self._ctx.direct(a)})

    async def _take_start_base(self, target: str) -> bool:
        """Take a holder's base of hash ``target`` if each of its tensors is within rounding of ours (outer.ROUNDING
        of its largest magnitude; integer ones equal): so a peer can move our start by rounding at most, never to
        weights of its choosing. Beyond that (a base pretrained on each peer: its steps carry the rounding far) it is
        refused, without a penalty: we wait, or join the run once it has begun, onto its log server's base. A holder
        is asked once."""
        direct = {a: h for a, h in self.start_state.ready.items() if self._ctx.direct(a)}
        for peer in self.start_state.bases.holders(target, direct):
            if not self.start_state.bases.ask(peer, target):  # asked once, whatever comes of it; a bounded number
                break
            try:
                fetched = await self.base.fetch(peer)
                if fetched is None:
                    raise ValueError("it served no base")
                tensors, digest = fetched
                perturbed = {i: t for (_, i, _), t in zip(self.base.layout, tensors) if i is not None}
                if tensors_hash([perturbed[i] for i in sorted(perturbed)]) != target:
                    raise ValueError("not the base it said it was ready with")  # it may have taken another since
                apart = await asyncio.to_thread(self.base.apart, tensors)
            except (TransportError, ProtocolViolation, asyncio.TimeoutError, ValueError) as e:
                if not isinstance(e, ProtocolViolation):  # (counted and penalised where it was found)
                    self.counters["base_unusable"] += 1
                self.base.log.log(logging.WARNING, ("start", peer), "spsa: the base model of %s unusable: %s",
                                   peer, e)
                continue
            if apart > outer.ROUNDING:
                self.counters["base_refused"] += 1
                self.base.log.log(logging.WARNING, ("far", peer), "spsa: not starting from the base model of %s: "
                                   "%.3g of a parameter's scale from ours (another CPU's rounding is below %g; a "
                                   "model() that trains carries it further): we start with the peers that hold ours, "
                                   "or join the run once it has begun", peer, apart, outer.ROUNDING)
                continue
            self.base.replacing = True
            try:
                await asyncio.to_thread(self.base.take, tensors, digest, peer, "start", apart)
                self._reset_to_base()
            finally:
                self.base.replacing = False
            self.start_state.bases.taken(peer)
            return True
        return False

    def _run_started_without_us(self) -> list[str]:
        """The peers to replay the run's log from, if it began without us: batches past our window from peers
        whose word counts, or else from two directly connected peers (a key that is not connected to us, or one
        connected outsider alone, cannot send us down the late path). Empty: it has not."""
        counting, direct = set(), set()
        for w in list(self.book.open):
            if w > self.window:
                authors = set(self.book.open[w].batches) - {self._ctx.identity.peer_id}
                counting |= self.standing.counting(authors)
                direct |= {a for a in authors if self._ctx.direct(a)}
        if counting:
            return sorted(counting, key=lambda a: (not self._ctx.direct(a), a))  # reachable ones first
        return sorted(direct) if len(direct) >= 2 and not self.standing.closed else []
