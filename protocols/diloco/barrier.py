"""The start barrier: the founders wait for each other and agree on their initial weights."""

from __future__ import annotations

import asyncio
import logging

import torch
from swarmd.protocols import codecs, exchange, outer, rounds
from swarmd.protocols.bulk import BulkError
from swarmd.protocols.diloco.wire import (
    INITIAL_TOLERANCE,
    MAX_PEER_ENTRIES,
    READY,
)
from swarmd.protocols.inner import SwarmAdamW
from swarmd.transport.errors import ProtocolViolation, TransportError

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class BarrierMixin:
    """DilocoLoop's barrier methods (the loop composes them; they share its state)."""

    # ------------------------------------------------------------------ start, checkpoints
    async def _start_barrier(self) -> None:
        """Start together with the peers that hold the same weights (the task's initial ones, or the same saved
        round), or join a run that has moved past our weights through a peer's checkpoint."""
        me = self._ctx.identity.peer_id
        self.state = "waiting for peers"
        barrier = rounds.StartBarrier(self.cfg.min_peers)
        while True:
            claims = {a: h for (r, p), hashes in self.book.hashes.items() if r >= self.fragments[p].rounds_done
                      for a, h in hashes.items()}
            ahead = self._trusted_claimers(claims)
            if ahead:  # rounds we have not closed have closed without us: take a checkpoint and join
                if await self._join_from_checkpoint(ahead):
                    return
                for hashes in self.book.hashes.values():  # none served: do not ask them again at once
                    for a in ahead:
                        hashes.pop(a, None)
                self.state = "waiting for peers"
            base = self.global_hash()
            target = self._initial_choice(base)
            if target is not None and await self._take_initial(target):
                self._publish(READY, {"r": 0, "p": 0, "ready": self.global_hash()})  # at once: our new weights
                continue
            if barrier.announce(self.clock.monotonic()):
                self._publish(READY, {"r": 0, "p": 0, "ready": base})
            start = self.start_state
            linked = self._linked()
            rounds.count_listed(start.ready, start.ready_unlisted, linked, MAX_PEER_ENTRIES)
            ready = {p for p, h in self.start_state.ready.items() if h == base and linked(p)} | {me}
            self._check_refusal(len(ready) - 1)
            if barrier.start(self.clock.monotonic(), len(ready)):
                self.start_state.initial = ready
                self.start_state.hash = base
                self.start_state.answers.started_at = self.clock.monotonic()
                if isinstance(self.replica.inner_opt, SwarmAdamW):
                    self.replica.inner_opt.set_peers(len(ready))
                self.standing.found(ready)
                self.start_state.founder = len(ready) > 1
                self.start_state.ready.clear()
                self.start_state.ready_unlisted.clear()
                self.state = "running"
                return
            await asyncio.sleep(0.1)

    def _linked(self):
        """Whether a peer can found a run with us (``rounds.linked``): its bulk bytes come through the members we
        both reach directly (``PullsMixin._through_members``), never the relay."""
        return rounds.linked(self._ctx)

    def _initial_choice(self, base: str) -> str | None:
        """The initial weights to start from, where they are not ours: the hash most of the directly connected
        ready peers and we hold (ties: the smallest), or None. Peers of one run build the task's initial weights
        from the same seed, but torch draws other low bits under other CPU kernels (its scalar ones, on a CPU
        without AVX2, or an ARM CPU's): without this such peers never start together. Only before the first
        round, from the task's weights (not from a checkpoint of a later round). Holders are asked a bounded number
        of times (rounds.StartWeights): hashes a flood of fresh keys announce cost a start a few asks at most."""
        if any(self.rounds_done) or self.step:
            return None
        direct = {a: h for a, h in self.start_state.ready.items() if self._ctx.direct(a)}
        others = sum(h != base for h in direct.values())
        if others:  # in /status: ready peers that hold other initial weights than ours (the most seen at once)
            self.counters["initial_other_weights_peers"] = max(others, self.counters["initial_other_weights_peers"])
        return self.start_state.weights.choice(base, direct)

    async def _take_initial(self, target: str) -> bool:
        """Take a holder's initial weights of hash ``target`` if each of their parameters is within rounding of
        ours (INITIAL_TOLERANCE of its largest magnitude): so a peer can move our start by rounding at most, never
        to weights of its choosing. A holder that serves none, or other ones, is not asked again."""
        direct = {a: h for a, h in self.start_state.ready.items() if self._ctx.direct(a)}
        for peer in exchange.fastest_first(self.start_state.weights.holders(target, direct), self.links.source_rates):
            if not self.start_state.weights.ask(peer, target):  # asked once, whatever comes of it; a bounded number
                break
            try:
                ckpt, global_flat, _ = await self._pull_checkpoint(peer)  # its momentum is not taken: ours is 0
                if any(ckpt["rounds_done"]) or ckpt["step"] or ckpt["global_hash"] != target:
                    raise ValueError("not the initial weights it announced")
                apart = max(outer.relative_difference(ours, theirs, [self.replica.params[i].numel() for i in frag])
                            for ours, theirs, frag in zip(self.fragments.weights(), global_flat, self.frag_index))
            except (TransportError, ProtocolViolation, BulkError, codecs.CodecError, asyncio.TimeoutError,
                    ValueError) as e:
                self.counters["initial_weights_unusable"] += 1
                logger.warning("diloco: initial weights from %s unusable: %s", peer, e)
                continue
            if apart > INITIAL_TOLERANCE:
                # not a penalty: an honest peer's differ this much where the task's model() trains (its pretraining
                # steps carry the CPU's rounding far: 0.19 of a parameter's scale after 200 steps of the tiny GPT)
                self.counters["initial_weights_refused"] += 1
                logger.warning("diloco: not starting from the initial weights of %s: %.3g of a parameter's scale "
                               "from ours (another CPU's rounding is below %g; a model() that trains carries it "
                               "further): we start with the peers that hold ours, or join the run later by a "
                               "checkpoint", peer, apart, INITIAL_TOLERANCE)
                continue
            self._adopt(global_flat, [torch.zeros_like(g) for g in global_flat], ckpt["rounds_done"], 0, {})
            self.start_state.weights.taken(peer)
            self.counters["initial_weights_taken"] += 1
            self.record.initial_weights = {"source": peer, "hash": target, "apart": apart}
            logger.info("diloco: starting from %s's initial weights %s (%.3g of a parameter's scale from ours: "
                        "another CPU's rounding)", peer, target, apart)
            return True
        return False

    def _trusted_claimers(self, claims: dict[str, str]) -> list[str]:
        """Whom to follow when peers say the run is ahead of us: the peers whose word counts (closed run: the
        listed ones; open run: our bootstrap peers and peers with standing), holding their majority hash. With none
        of those (an open run whose founders we have never met), the directly connected peers holding their
        majority hash; a fresh key that is not connected to us is never followed."""
        trusted = {a: h for a, h in claims.items() if self.standing.vouched(a)}
        if not trusted and not self.standing.closed:
            trusted = {a: h for a, h in claims.items() if self._ctx.direct(a)}
        if not trusted:
            return []
        top = rounds.majority(trusted, self.cfg.run)
        return sorted(a for a, h in trusted.items() if h == top)

