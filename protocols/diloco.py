"""DiLoCo and Streaming DiLoCo outer steps, peer to peer (``../shared/protocols.md`` section 1).

Each peer runs inner AdamW steps on its own data shard. The model is split into ``fragments`` (1 = plain DiLoCo);
fragment p is synced every ``inner_steps`` steps, staggered by p * inner_steps / fragments:

1. at its sync point the peer computes the pseudo-gradient Delta_p = global_p - local_p, encodes it (e3m0 by
   default), stores it in the bulk store and announces it on ``diloco/<run>`` with the round, the fragment and the
   hash of the global fragment it was computed from;
2. it keeps training for ``overlap`` more inner steps (Streaming DiLoCo's tau; 0 = wait at once) while the
   updates travel: other peers' announcements arrive through pubsub, their bytes are pulled (and hash-verified)
   in the background;
3. it closes the round: the participants are the peers whose update for (round, fragment) arrived by an adaptive
   deadline (median + k MAD of observed arrival offsets); updates with another base hash, a wrong shape or
   non-finite values are rejected; the rest are combined robustly (norm-clipped mean) in canonical order and applied
   with outer Nesterov (lr 0.7, momentum 0.9), so every peer holds bit-identical global weights;
4. the local fragment becomes alpha * local + (1 - alpha) * global (alpha = 0 without overlap).

Every round's new global hash is published; a peer whose global weights differ from the majority, or that joins
late, pulls a hash-verified checkpoint (global weights, outer momentum, round counters) from a peer through the
bulk path and continues from the next round.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass, field

import msgpack
import torch
from pydantic import BaseModel, ConfigDict, Field

from node.services import NodeContext
from protocols import codecs, outer, tinylm
from protocols.bulk import BulkError, BulkService
from protocols.gossip import Gossip, Message, Verdict
from transport.base import Stream
from transport.errors import MalformedMessage, ProtocolViolation, TransportError
from transport.framing import ProtocolSpec

logger = logging.getLogger(__name__)

CKPT_SPEC = ProtocolSpec("diloco-ckpt", "1.0.0", max_frame=4096, kinds=frozenset({1, 2}))


class DilocoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    run: str = Field("diloco-demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    seed: int = 1
    rounds: int = Field(8, ge=1)  # outer rounds per fragment
    inner_steps: int = Field(50, ge=1)  # H
    fragments: int = Field(1, ge=1)  # P (1 = plain DiLoCo)
    overlap: int = Field(0, ge=0)  # tau: inner steps run while a fragment's update travels
    alpha: float = Field(0.0, ge=0, le=1)  # local weight when merging an overlapped fragment
    codec: str = "e3m0"
    inner_lr: float = Field(4e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    batch: int = Field(16, ge=1)
    min_peers: int = Field(1, ge=1)
    deadline_low: float = Field(2.0, gt=0)
    deadline_high: float = Field(60.0, gt=0)
    eval_every: int = Field(1, ge=1)  # rounds between validation evaluations


@dataclass
class Pending:
    """One (round, fragment) being gathered."""

    announced: dict[str, tuple[bytes, str, int]] = field(default_factory=dict)  # peer -> (blob hash, base, size)
    updates: dict[str, torch.Tensor] = field(default_factory=dict)
    opened: float = field(default_factory=time.monotonic)
    arrivals: dict[str, float] = field(default_factory=dict)
    pulls: set = field(default_factory=set)


class DilocoLoop:
    name = "diloco"

    def __init__(self, gossip: Gossip, bulk: BulkService, config: DilocoConfig):
        self.gossip, self.bulk, self.cfg = gossip, bulk, config
        self.topic = f"diloco/{config.run}"
        self.codec = codecs.get(config.codec)
        self.pending: dict[tuple[int, int], Pending] = collections.defaultdict(Pending)
        self.participants: dict[int, set[str]] = {}  # fragment -> participants of its last closed round
        self.round_hashes: dict[tuple[int, int], dict[str, str]] = collections.defaultdict(dict)
        self.history: list[dict] = []  # per closed round: fragment, round, participants, global hash
        self.losses: list[tuple[int, float]] = []
        self.counters: collections.Counter = collections.Counter()
        self.deadline = outer.AdaptiveDeadline(low=config.deadline_low, high=config.deadline_high,
                                               initial=max(config.deadline_low, 10.0))
        self.state = "starting"
        self.step = 0
        self.compute_seconds = 0.0
        self.blocked_seconds = 0.0  # waiting for a round to close, not computing
        self.joins: dict[tuple[int, int], set[str]] = collections.defaultdict(set)
        self.join_round: dict[int, int] = {}  # fragment -> first round we contribute to (late joiner)
        self.started = None
        self.ready: dict[str, str] = {}
        self._ctx: NodeContext | None = None
        self._event = asyncio.Event()
        self.final_hash: str | None = None
        self.rounds_done: list[int] = []
        self._published: dict[tuple[int, int], str] = {}
        self._resync_from: list[str] = []
        self._corrupt_at = int(os.environ["SWARMD_TEST_DILOCO_DRIFT_AT"]) if "SWARMD_TEST_DILOCO_DRIFT_AT" in os.environ \
            else None

    # ------------------------------------------------------------------ service
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self.gossip.subscribe(self.topic, max_size=1024, validator=self._validate, queue_size=0)
        await ctx.transport.serve(CKPT_SPEC, self._serve_checkpoint)

    async def close(self) -> None:
        pass

    def _build(self) -> None:
        torch.manual_seed(self.cfg.seed)
        self.model = tinylm.TinyGPT()
        self.names = [n for n, _ in tinylm.params_in_order(self.model)]
        self.params = [p for _, p in tinylm.params_in_order(self.model)]
        self.frag_index = outer.fragments(self.names, self.cfg.fragments)
        self.global_flat = [outer.flatten([self.params[i] for i in f]) for f in self.frag_index]
        self.rounds_done = [0] * self.cfg.fragments
        self.outer_opt = outer.OuterNesterov([g.numel() for g in self.global_flat], self.cfg.outer_lr,
                                             self.cfg.outer_momentum)
        self.inner_opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.inner_lr, betas=(0.9, 0.95),
                                           weight_decay=self.cfg.weight_decay)
        me = self._ctx.identity.peer_id
        self.data = tinylm.encode_text(tinylm.corpus(self.cfg.seed * 7919 + int.from_bytes(me.encode()[-4:], "big"),
                                                     200_000, target=False))
        self.val = tinylm.encode_text(tinylm.corpus(self.cfg.seed + 424242, 40_000, target=False))

    def global_hash(self) -> str:
        return outer.params_hash(self.global_flat)

    async def run(self) -> None:
        torch.set_num_threads(1)
        self._build()
        await self._start_barrier()
        self.started = time.monotonic()
        h = self.cfg.inner_steps
        offsets = [p * h // self.cfg.fragments for p in range(self.cfg.fragments)]
        total = self.cfg.rounds * h + max(offsets)
        waiting: dict[int, tuple[int, int]] = {}  # fragment -> (round, step at which to close)
        rounds_done = self.rounds_done
        for p in range(self.cfg.fragments):  # a late joiner may arrive mid-round: follow that round at once
            if rounds_done[p] < self.cfg.rounds and self.step >= offsets[p] + (rounds_done[p] + 1) * h:
                waiting[p] = (rounds_done[p], self.step)
        while self.step < total or waiting:
            if self._resync_from:
                peers, self._resync_from = self._resync_from, []
                self.counters["resyncs"] += 1
                await self._join_from_checkpoint(peers)
                rounds_done, waiting = self.rounds_done, {}
                for p in range(self.cfg.fragments):
                    if rounds_done[p] < self.cfg.rounds and self.step >= offsets[p] + (rounds_done[p] + 1) * h:
                        waiting[p] = (rounds_done[p], self.step)
                continue
            if self.step < total:
                t0 = time.perf_counter()
                await asyncio.to_thread(self._inner_step)
                self.compute_seconds += time.perf_counter() - t0
                self.step += 1
            for p in range(self.cfg.fragments):
                if p not in waiting and rounds_done[p] < self.cfg.rounds and self.step >= offsets[p] + h \
                        and (self.step - offsets[p]) % h == 0:
                    r = rounds_done[p]
                    self._send_update(p, r)
                    waiting[p] = (r, self.step + self.cfg.overlap)
            for p, (r, close_at) in list(waiting.items()):
                if self.step >= close_at or self.step >= total:
                    await self._close_round(p, r)
                    del waiting[p]
                    rounds_done[p] += 1
                    if p == self.cfg.fragments - 1 and rounds_done[p] % self.cfg.eval_every == 0:
                        loss = await asyncio.to_thread(tinylm.evaluate, self.model, self.val, 4, 32)
                        self.losses.append((self.step, round(loss, 5)))
                        await self._report(loss)
        self.final_hash = self.global_hash()
        self.state = "done"
        logger.info("diloco run %s done: %d steps, global %s", self.cfg.run, self.step, self.final_hash)
        while True:  # keep saying where the run ended, so a node that arrives later can take the final weights
            self._publish({"r": self.cfg.rounds, "p": self.cfg.fragments - 1, "h": self.final_hash})
            await asyncio.sleep(5.0)

    def _inner_step(self) -> None:
        self.model.train()
        batch = tinylm.batch_at(self.data, self.step, self.cfg.batch, self.model.ctx)
        loss = self.model.loss(batch)
        self.inner_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.inner_opt.step()
        self.model.eval()

    # ------------------------------------------------------------------ sending and closing a round
    def _send_update(self, p: int, r: int) -> None:
        if r < self.join_round.get(p, 0):
            return  # a late joiner follows this round without contributing
        local = outer.flatten([self.params[i] for i in self.frag_index[p]])
        delta = self.global_flat[p] - local
        payload = self.codec.encode(delta).to_wire()
        blob = self.bulk.put(payload, codec=self.cfg.codec, topic=self.topic, round=r, fragment=p)
        base = outer.params_hash([self.global_flat[p]])
        self._publish({"r": r, "p": p, "blob": blob, "base": base, "size": len(payload)})
        self.pending[(r, p)].updates[self._ctx.identity.peer_id] = codecs.decode(payload)
        self.counters["bytes_sent"] += len(payload)
        self.counters["updates_sent"] += 1

    def _publish(self, body: dict) -> None:
        self.gossip.publish(self.topic, msgpack.packb(body, use_bin_type=True))

    async def _close_round(self, p: int, r: int) -> None:
        key = (r, p)
        pending = self.pending[key]
        me = self._ctx.identity.peer_id
        expected = (self.participants.get(p, self._initial) | self.joins.pop(key, set())) - {me}
        blocked_from = time.monotonic()
        if not await outer.wait_until(lambda: expected <= set(pending.updates), self._event, self.deadline.value()):
            self.counters["deadline_missed"] += 1
            logger.warning("diloco round %d/%d closed without %s", r, p, sorted(expected - set(pending.updates)))
        self.blocked_seconds += time.monotonic() - blocked_from
        for peer, t in pending.arrivals.items():
            self.deadline.observe(t - pending.opened)
        contributing = r >= self.join_round.get(p, 0)
        updates = {peer: u for peer, u in pending.updates.items() if peer in expected or
                   (peer == me and contributing)}
        combined, rejected = outer.combine(updates, self.global_flat[p].numel())
        for peer, reason in rejected.items():
            self.counters[f"rejected_{reason}"] += 1
            self._ctx.transport.penalties.penalize(peer, "invalid_message", f"diloco update {reason}")
        participants = set(updates) - set(rejected)
        if combined is not None:
            self.global_flat[p] = self.outer_opt.step(p, self.global_flat[p], combined)
        if self._corrupt_at == r and p == 0:  # fault injection for tests: a peer whose weights drift
            self.global_flat[p] = self.global_flat[p] + 1e-3
            self._corrupt_at = None
        local = outer.flatten([self.params[i] for i in self.frag_index[p]])
        merged = outer.mix(local, self.global_flat[p], self.cfg.alpha)
        with torch.no_grad():
            outer.unflatten_into(merged, [self.params[i] for i in self.frag_index[p]])
        self.participants[p] = participants
        self._check_previous(p, r)
        h = self.global_hash()
        self.history.append({"round": r, "fragment": p, "participants": len(participants), "global_hash": h})
        self._publish({"r": r, "p": p, "h": h})
        self._published[(r, p)] = h
        self.pending.pop(key, None)
        self.counters["rounds"] += 1

    def _check_previous(self, p: int, r: int) -> None:
        """Compare the global hash we published for round r-1 with what the others published for it."""
        ours = self._published.get((r - 1, p))
        theirs = self.round_hashes.get((r - 1, p), {})
        if ours is None or not theirs:
            return
        majority = outer.majority(list(theirs.values()) + [ours])
        if majority != ours:
            self.counters["diverged"] += 1
            logger.error("diloco: our global weights left the majority at round %d/%d; resyncing", r - 1, p)
            self._resync_from = sorted(a for a, h in theirs.items() if h == majority)

    async def _pull(self, key: tuple[int, int], peer: str, blob: bytes, size: int) -> None:
        try:
            for _ in range(100):  # the bulk announcement travels on its own topic and may trail ours a little
                if blob in self.bulk.announcements:
                    break
                await asyncio.sleep(0.05)
            body, _ = await self.bulk.pull(blob)
            update = codecs.decode(bytes(body), max_elements=self.global_flat[key[1]].numel())
            if update.dim() != 1:
                raise codecs.CodecError("an update must be a flat vector")
        except (BulkError, codecs.CodecError) as e:
            self.counters["pull_failed"] += 1
            logger.warning("diloco update from %s unusable: %s", peer, e)
            return
        pending = self.pending.get(key)
        if pending is None:
            return
        pending.updates[peer] = update
        pending.arrivals[peer] = time.monotonic()
        self.counters["bytes_received"] += size
        self._event.set()

    # ------------------------------------------------------------------ start, checkpoints
    async def _start_barrier(self) -> None:
        me = self._ctx.identity.peer_id
        self.state = "waiting for peers"
        base = self.global_hash()
        grace, announced = None, 0.0
        while True:
            started = {a for hashes in self.round_hashes.values() for a in hashes}
            if started:  # rounds have closed without us: take a checkpoint and join
                await self._join_from_checkpoint(sorted(started))
                return
            if time.monotonic() - announced > 1.0:
                self._publish({"r": 0, "p": 0, "ready": base})
                announced = time.monotonic()
            ready = {p for p, h in self.ready.items() if h == base} | {me}
            if len(ready) >= self.cfg.min_peers:
                grace = grace or time.monotonic() + 1.0
                if time.monotonic() >= grace:
                    self._initial = ready
                    self.state = "running"
                    return
            await asyncio.sleep(0.1)

    def _checkpoint(self) -> bytes:
        none = codecs.get("none")
        return msgpack.packb({
            "global": [none.encode(g).to_wire() for g in self.global_flat],
            "momentum": [none.encode(b).to_wire() for b in self.outer_opt.buffers],
            "rounds_done": list(self.rounds_done),
            "step": self.step,
            "participants": {str(p): sorted(v) for p, v in self.participants.items()},
            "global_hash": self.global_hash(),
        }, use_bin_type=True)

    async def _serve_checkpoint(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10)
        if message.kind != 1:
            raise MalformedMessage("diloco-ckpt: expected a request")
        payload = self._checkpoint()
        blob = self.bulk.put(payload, codec="diloco-checkpoint", topic=self.topic)
        await stream.send(2, {"blob": blob, "size": len(payload)})

    async def _join_from_checkpoint(self, peers: list[str]) -> None:
        """Pull a hash-verified checkpoint (global weights, outer momentum, round counters) and join."""
        self.state = "joining"
        for peer in peers:
            try:
                async with await self._ctx.transport.open_stream(peer, CKPT_SPEC, timeout=10) as stream:
                    await stream.send(1, None)
                    reply = await asyncio.wait_for(stream.read_required(), 30)
                blob = reply.body["blob"]
                for _ in range(100):
                    if blob in self.bulk.announcements:
                        break
                    await asyncio.sleep(0.05)
                body, _ = await self.bulk.pull(blob)
                ckpt = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True, max_ext_len=0)
                global_flat = [codecs.decode(w) for w in ckpt["global"]]
                momentum = [codecs.decode(w) for w in ckpt["momentum"]]
                if [g.numel() for g in global_flat] != [g.numel() for g in self.global_flat]:
                    raise ValueError("checkpoint of another model")
                if outer.params_hash(global_flat) != ckpt["global_hash"]:
                    raise ValueError("checkpoint weights do not match their hash")
                done = ckpt["rounds_done"]
                published = self.round_hashes.get((done[-1] - 1, self.cfg.fragments - 1), {})
                if published and ckpt["global_hash"] not in published.values():
                    raise ValueError("checkpoint does not match any published global hash")
            except (TransportError, ProtocolViolation, BulkError, codecs.CodecError, asyncio.TimeoutError,
                    ValueError, KeyError, TypeError) as e:
                logger.warning("checkpoint from %s unusable: %s", peer, e)
                continue
            self.global_flat = global_flat
            self.outer_opt.buffers = momentum
            with torch.no_grad():
                for p, frag in enumerate(self.frag_index):
                    outer.unflatten_into(global_flat[p], [self.params[i] for i in frag])
            self.rounds_done = list(done)
            self._published.clear()  # what we said before the checkpoint no longer describes our weights
            self.pending.clear()
            self.step = ckpt["step"]
            self.participants = {int(p): set(v) for p, v in ckpt["participants"].items()}
            self._initial = set()
            # follow the next round of each fragment, contribute from the one after (announced now)
            for p in range(self.cfg.fragments):
                self.join_round[p] = self.rounds_done[p] + 1
                self._publish({"r": self.join_round[p], "p": p, "join": True})
            self.counters["joined_from_checkpoint"] += 1
            self.state = "running"
            logger.info("diloco: joined from %s's checkpoint at step %d (global %s)", peer, self.step,
                        ckpt["global_hash"])
            return
        raise RuntimeError("no peer served a usable checkpoint")

    # ------------------------------------------------------------------ validation
    def _validate(self, message: Message) -> Verdict:
        try:
            body = msgpack.unpackb(message.data, raw=False, strict_map_key=True, max_ext_len=0)
        except Exception:
            return Verdict.REJECT
        if not isinstance(body, dict) or type(body.get("r")) is not int or type(body.get("p")) is not int:
            return Verdict.REJECT
        r, p = body["r"], body["p"]
        if not 0 <= p < self.cfg.fragments or not 0 <= r <= self.cfg.rounds + 1:
            return Verdict.REJECT
        keys = set(body)
        if keys == {"r", "p", "ready"} and isinstance(body["ready"], str):
            self.ready[message.author] = body["ready"]
            return Verdict.ACCEPT
        if keys == {"r", "p", "join"} and body["join"] is True:
            self.joins[(r, p)].add(message.author)
            return Verdict.ACCEPT
        if keys == {"r", "p", "h"} and isinstance(body["h"], str):
            self.round_hashes[(r, p)][message.author] = body["h"]
            return Verdict.ACCEPT
        if keys == {"r", "p", "blob", "base", "size"} and isinstance(body["blob"], bytes) \
                and isinstance(body["base"], str) and type(body["size"]) is int:
            if hasattr(self, "global_flat") and body["base"] != outer.params_hash([self.global_flat[p]]):
                self.counters["rejected_base"] += 1
                return Verdict.IGNORE  # computed from other global weights: that peer must resync
            if self.rounds_done and r < self.rounds_done[p]:
                self.counters["late_updates"] += 1
                return Verdict.IGNORE  # that round is closed here
            pending = self.pending[(r, p)]
            if message.author in pending.announced:
                return Verdict.IGNORE
            pending.announced[message.author] = (body["blob"], body["base"], body["size"])
            task = asyncio.get_running_loop().create_task(self._pull((r, p), message.author, body["blob"],
                                                                      body["size"]))
            pending.pulls.add(task)
            task.add_done_callback(pending.pulls.discard)
            return Verdict.ACCEPT
        return Verdict.REJECT

    async def _report(self, loss: float) -> None:
        if self._ctx.replicator is None:
            return
        try:
            await self._ctx.replicator.write("progress", {
                "step": self.step, "samples": self.step * self.cfg.batch, "loss": float(loss),
                "bytes": int(self.counters["bytes_sent"]), "round": int(self.counters["rounds"])})
        except ValueError as e:
            logger.warning("could not record diloco progress: %s", e)

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        wall = (time.monotonic() - self.started) if self.started else 0.0
        return {
            "run": self.cfg.run,
            "state": self.state,
            "step": self.step,
            "global_hash": self.final_hash or (self.global_hash() if hasattr(self, "global_flat") else None),
            "final_hash": self.final_hash,
            "history": self.history[-64:],
            "losses": self.losses[-40:],
            "compute_fraction": round(1 - self.blocked_seconds / wall, 4) if wall else None,
            "deadline_s": round(self.deadline.value(), 2),
            **dict(sorted(self.counters.items())),
        }

    def routes(self) -> list:
        return []

