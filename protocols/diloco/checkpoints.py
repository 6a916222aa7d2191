"""Checkpoints: our own (saved, resumed), serving ours and the announcements a joiner asks for, and
a late joiner's or a resyncing peer's pull of another peer's."""

from __future__ import annotations

import asyncio
import logging
import math

import msgpack
import torch
from swarmd.protocols import codecs, exchange, outer, rounds
from swarmd.protocols.bulk import BulkError
from swarmd.protocols.diloco.wire import (
    ANN_END,
    ANN_REPLY,
    ANN_REQUEST,
    ANN_SPEC,
    CARRIER,
    CHECKPOINT,
    CKPT_REPLY,
    CKPT_REQUEST,
    CKPT_SPEC,
    JOIN,
    MAX_FETCH,
    MAX_PEER_ENTRIES,
    UPDATE,
)
from swarmd.protocols.inner import SwarmAdamW
from swarmd.protocols.standing import next_fresh_round
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.framing import unpack
from swarmd.transport.wire import WIRE, UnknownKind

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class CheckpointsMixin:
    """DilocoLoop's checkpoints methods (the loop composes them; they share its state)."""

    # ------------------------------------------------------------------ our own checkpoint (the data dir)
    def _global_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the global weights in place of our local trainable parameters."""
        tensors = self._model_tensors(self.replica.model)
        for frag in self.fragments:
            offset = 0
            for i in frag.params:
                param = self.replica.params[i]
                n = param.numel()
                tensors["model." + self.replica.names[i]] = frag.weights[offset:offset + n].view(param.shape) \
                    .to(param.dtype).clone()
                offset += n
        return tensors

    def _save_checkpoint(self) -> None:
        tensors = self._global_state()
        tensors.update({f"outer.{p}": b for p, b in enumerate(self.replica.outer_opt.buffers)})
        tensors, opt_meta = self._with_optimizer(tensors, self.replica.inner_opt)  # the inner optimizer's moments too
        # what the codec dropped of our last update (error feedback): ours alone, as the inner moments are; a peer's
        # checkpoint (``_checkpoint``) carries the swarm's state only
        tensors.update({f"feedback.{f.index}": f.residual for f in self.fragments if f.residual is not None})
        h = self.global_hash()
        self._save(tensors, round=self.rounds_done[-1], rounds_done=self.rounds_done, step=self.step, hash=h,
                   participants={str(p): sorted(v) for p, v in self.participants.items()}, **opt_meta)
        self.counters["checkpoints_saved"] += 1

    def _adopt(self, global_flat: list[torch.Tensor], momentum: list[torch.Tensor], rounds_done: list[int],
               step: int, participants: dict) -> None:
        """Take checkpointed state (ours or a peer's) as our global and local weights, momentum and counters."""
        for f in self.fragments:
            if f.redo is not None:  # its inputs were other weights
                self._drop_redo(f.index)
            f.drop_residual()  # what the codec dropped of updates from other weights
        self.fragments.replace_all(global_flat)
        self.replica.outer_opt.buffers = momentum
        with torch.no_grad():
            for f in self.fragments:
                outer.unflatten_into(global_flat[f.index], self.replica.of(f))
        self.step = step
        listed = {int(p): set(v) for p, v in participants.items()}
        for f, done in zip(self.fragments, rounds_done):
            f.rounds_done, f.participants = done, listed.get(f.index)

    def _resume_own(self) -> None:
        """Continue from our own checkpoint of this run (if any, of this task, and intact). The start barrier then
        checks it against the swarm: peers at the same round start with us; a swarm that is further along (or
        published another hash for that round) sends us to a peer's checkpoint instead."""
        found = self._own_checkpoint()
        if found is None:
            return
        tensors, meta = found
        # saved by an older version that hashes weights with BLAKE2b (its fingerprint is one of earlier_fps):
        # checked with that version's hash; from here on the weights go by ours (the start barrier compares
        # global_hash()). One saved by an older version that names no e3m0 encoder has our hash: nothing to convert
        earlier = meta.get("fingerprint") == self._fp_before_blake3
        # saved under other rules than ours and than the versions we list (a later or earlier version that names
        # this run by its resumable fingerprint): the same run's weights, checked by our hash
        other_rules = not self._listed(meta)
        try:
            global_flat = [outer.flatten([tensors["model." + self.replica.names[i]] for i in frag])
                           for frag in self.frag_index]
            momentum = [tensors[f"outer.{p}"].to(torch.float32) for p in range(self.cfg.fragments)]
            if (outer.params_hash_before_blake3 if earlier else outer.params_hash)(global_flat) != meta["hash"]:
                raise ValueError("its weights do not match the hash it was saved with")
            if [m.numel() for m in momentum] != [g.numel() for g in global_flat]:
                raise ValueError("its outer momentum has the wrong size")
        except (KeyError, ValueError, RuntimeError) as e:
            logger.warning("diloco: ignoring our checkpoint %s: %s", self._checkpoint_path(), e)
            return
        self._adopt(global_flat, momentum, meta["rounds_done"], int(meta["step"]), meta.get("participants", {}))
        inner = self._restore_optimizer(self.replica.inner_opt, tensors, meta)
        # the last round's participants: state, not a setting
        if inner and isinstance(self.replica.inner_opt, SwarmAdamW):
            peers = (meta["optimizer"].get("param_groups") or [{}])[0].get("peers")
            if isinstance(peers, int) and peers >= 1:
                self.replica.inner_opt.set_peers(peers)
        if self.feedback:  # our last update's residual, where it fits its fragment (else it starts at zero)
            for p, g in enumerate(global_flat):
                r = tensors.get(f"feedback.{p}")
                if r is not None and r.numel() == g.numel() and codecs.all_finite(r):
                    f = self.fragments[p]
                    f.residual = r.to(torch.float32).reshape(-1).clone()
                    f.residual_norm = round(float(f.residual.norm()), 6)
        self.standing.found(a for v in self.participants.values() for a in v)  # the peers we last trained with
        digest = self.global_hash() if earlier else meta["hash"]
        self.ckpt.resumed = {"source": "own checkpoint", "round": meta["round"], "step": self.step, "hash": digest,
                             "optimizer_state": inner,
                             "residual": [f.index for f in self.fragments if f.residual is not None]}
        if earlier:
            self.ckpt.resumed["saved_by"] = "the version before the BLAKE3 weights hash"
        elif other_rules:
            self.ckpt.resumed["saved_by"] = "a version with other rules (the same run)"
        self.ckpt.saved = {"path": str(self._checkpoint_path()), "round": meta["round"], "step": self.step,
                           "hash": digest}
        logger.info("diloco: resuming run %s from our checkpoint at round %d, step %d (global %s)%s", self.cfg.run,
                    meta["round"], self.step, digest,
                    " (saved by the version before the BLAKE3 weights hash)" if earlier else "")

    def _checkpoint(self) -> bytes:
        none = codecs.get("none")
        ckpt = {
            "global": [none.encode(f.weights).to_wire() for f in self.fragments],
            "momentum": [none.encode(b).to_wire() for b in self.replica.outer_opt.buffers],
            "rounds_done": self.rounds_done,
            "step": self.step,
            "participants": {str(p): sorted(v) for p, v in self.participants.items()},
            "global_hash": self.global_hash(),
        }
        if self.faults:
            ckpt = self.faults.altered("checkpoint", self, ckpt)
        return msgpack.packb(ckpt, use_bin_type=True)

    async def _serve_checkpoint(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10)
        if message.kind != CKPT_REQUEST.code:
            raise MalformedMessage("diloco-ckpt: expected a request")
        payload = self._checkpoint()
        blob = self.bulk.put(payload, codec="diloco-checkpoint", topic=self.topic)
        await stream.send(CKPT_REPLY.code, {"blob": blob, "size": len(payload)})
        # it may ask us next for the announcements of the round it is about to follow (``_join_from_checkpoint``)
        rounds.keep_latest(self.links.checkpoint_served, stream.peer_id, self.clock.monotonic(), MAX_PEER_ENTRIES)
        if self.faults:
            await self.faults.enter("checkpoint-served", self, source=stream.peer_id)

    async def _serve_announcements(self, stream: Stream) -> None:
        """The update announcements of a round we hold (or closed lately), as their authors signed them, to a peer
        of the run whose gossip did not bring them (it names them by short id, at most MAX_FETCH): one frame each,
        then the end."""
        message = await asyncio.wait_for(stream.read_required(), 10)
        if message.kind != ANN_REQUEST.code:
            raise MalformedMessage("diloco-ann: expected a request")
        body = message.body
        key = (body["r"], body["p"])
        held = self._signed_announcements(key)
        # to a peer of that round (it announced an update in it) or one whose word counts, once per round: a small
        # request must not buy a stranger the same ~0.8 MB answer over and over
        # (only rounds we hold are remembered: a key per round asked about would let anyone grow the dict)
        asker = stream.peer_id
        served = self.book.served.setdefault(key, set()) if held else set()
        wanted = set()
        # (or one we just served a checkpoint, far larger than these: a joiner whose announcements of its first
        # round came while it pulled the checkpoint, before it could hold them)
        joiner = self.clock.monotonic() - self.links.checkpoint_served.get(asker, -math.inf) <= self.cfg.deadline_high
        if held and (asker in held or self.standing.counts(asker) or joiner) and asker not in served \
                and len(served) < MAX_PEER_ENTRIES:
            served.add(asker)
            wanted = set(body["ids"])
        else:
            self.counters["announcements_refused"] += 1
        for author, signed in sorted(held.items()):
            if rounds.short_id(author) in wanted:
                if self.faults:
                    signed = self.faults.altered("announcement-served", self, signed, r=key[0], p=key[1],
                                                 source=author)
                await stream.send(ANN_REPLY.code, signed)
                self.counters["announcements_served"] += 1
        await stream.send(ANN_END.code, None)

    def _signed_announcements(self, key: tuple[int, int]) -> dict[str, dict]:
        """The update announcements of a (round, fragment) we hold, open or closed lately, as their authors signed
        them (peer -> wire form; empty for a round we do not hold)."""
        return self.book.signed_announcements(key)

    async def _fetch_announcements(self, peer: str, r: int, p: int, ids: list[bytes]) -> None:
        """Ask ``peer`` (a round's coordinator) for the announcements its member view names and gossip has not
        brought us; each one is checked as if it came through the mesh (its author's signature, the freshness
        window, our validator), so the coordinator can withhold an update but never forge one."""
        wanted = set(ids[:MAX_FETCH])
        try:
            async with await self._ctx.transport.open_stream(peer, ANN_SPEC, timeout=5) as stream:
                await stream.send(ANN_REQUEST.code, {"r": r, "p": p, "ids": sorted(wanted)})
                for _ in range(len(wanted) + 1):
                    reply = await asyncio.wait_for(stream.read_required(), 10)
                    if reply.kind == ANN_END.code:
                        break
                    if reply.kind != ANN_REPLY.code:
                        raise MalformedMessage("diloco-ann: expected an announcement")
                    message = self.gossip.check_signed(reply.body, self.topic)
                    if rounds.short_id(message.author) not in wanted:
                        raise ProtocolViolation("diloco-ann: an announcement we did not ask for")
                    wanted.discard(rounds.short_id(message.author))
                    kind, body = WIRE.unpack(CARRIER, message.data)
                    if kind is not UPDATE or (body["r"], body["p"]) != (r, p):
                        raise ProtocolViolation("diloco-ann: not an update announcement of the round asked for")
                    self._validate(message)
                    if (held := self.book.pending.get((r, p))) is not None and message.author in held.announced:
                        self.counters["announcements_fetched"] += 1
                        self._event.set()
        except (TransportError, ProtocolViolation, MalformedMessage, UnknownKind, asyncio.TimeoutError) as e:
            self.counters["announcement_fetch_failed"] += 1
            # the server's doing, except a stale one (an honest coordinator's, on a round slower than the window)
            if isinstance(e, UnknownKind) or (isinstance(e, ProtocolViolation) and e.kind != "stale"):
                self._ctx.transport.penalties.penalize(peer, "invalid_message", f"diloco-ann: {e}")
            logger.info("diloco round %d/%d: announcements from %s: %s", r, p, peer[-8:], e)

    async def _pull_checkpoint(self, peer: str) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
        """A peer's checkpoint (its fields, its global weights, its momentum), checked: schema, sizes, hash."""
        async with await self._ctx.transport.open_stream(peer, CKPT_SPEC, timeout=10) as stream:
            await stream.send(CKPT_REQUEST.code, None)
            reply = await asyncio.wait_for(stream.read_required(), 30)
        if reply.kind != CKPT_REPLY.code:
            raise MalformedMessage("diloco-ckpt: expected a reply")
        blob = reply.body["blob"]
        for _ in range(100):
            if blob in self.bulk.announcements:
                break
            await asyncio.sleep(0.05)
        size = self.bulk.announcements[blob].size if blob in self.bulk.announcements else None
        # before a byte of it is allocated: a checkpoint of our model is its weights and momentum in fp32 and a
        # few headers, round counters and participants (else a server that announces 4 GiB for a small model has
        # us pull and hold all of it before its tensors are found too large)
        budget = self._checkpoint_budget()
        if size is not None and size > budget:
            raise ProtocolViolation(f"diloco-ckpt: {size} B announced, a checkpoint of our model is at most {budget} B")
        with self.work.track(f"checkpoint pull from {peer[-8:]}", total=size, unit="B") as work:
            body, _ = await self.bulk.pull(blob, progress=work.update)
            if self.faults:
                await self.faults.enter("checkpoint-pulled", self, source=peer)
        ckpt = WIRE.check_blob(CHECKPOINT, unpack(body))
        # past the schema, what only the model and the run can say (a ProtocolViolation: its server's fault).
        # Unchecked, no round counters would crash our loop (an IndexError) and a momentum of another size would
        # wedge it at its next outer step
        done, sizes = ckpt["rounds_done"], [f.numel() for f in self.fragments]
        if len(done) != self.cfg.fragments or max(done) - min(done) > 1 or max(done) > self._rounds():
            raise ProtocolViolation(f"diloco-ckpt: round counters {done[:4]} are not {self.cfg.fragments} "
                                    f"fragments' rounds of a {self._rounds()}-round run")
        if len(ckpt["global"]) != len(sizes) or len(ckpt["momentum"]) != len(sizes):
            raise ProtocolViolation("diloco-ckpt: not one tensor of weights and one of momentum a fragment")
        if not set(ckpt["participants"]) <= {str(p) for p in range(self.cfg.fragments)}:
            raise ProtocolViolation("diloco-ckpt: participants of a fragment the run does not have")
        try:
            global_flat = [codecs.decode(w, max_elements=n) for w, n in zip(ckpt["global"], sizes)]
            momentum = [codecs.decode(w, max_elements=n) for w, n in zip(ckpt["momentum"], sizes)]
        except codecs.CodecError as e:  # malformed, non-finite, or larger than our model
            raise ProtocolViolation(f"diloco-ckpt: {e}") from None
        if [g.numel() for g in global_flat] != sizes or [m.numel() for m in momentum] != sizes:
            raise ProtocolViolation("diloco-ckpt: a checkpoint of another model")
        if outer.params_hash(global_flat) != ckpt["global_hash"]:
            raise ProtocolViolation("diloco-ckpt: its weights do not match their hash")
        return ckpt, global_flat, momentum

    def _checkpoint_budget(self) -> int:
        """The most bytes a peer's checkpoint of our model may take (``_checkpoint``): two fp32 tensors of every
        fragment, 4 KiB of header each, and 16 MiB for the rest (the participants of a swarm of thousands)."""
        return 8 * sum(f.numel() for f in self.fragments) + 8192 * self.cfg.fragments + (16 << 20)

    def _steps_of(self, rounds_done: list[int]) -> tuple[int, int]:
        """The inner steps a peer that closed ``rounds_done`` rounds (of each fragment) can be at: fragment p's
        round r is announced at step offsets[p] + (r + 1) x H and closed within ``overlap`` steps after it, so
        past the step that announced its last closed round, and at most ``overlap`` steps past the one that
        announces its next."""
        h, n = self.cfg.inner_steps, self.cfg.fragments
        offsets = [p * h // n for p in range(n)]
        low = max((offsets[p] + d * h if d else 0) for p, d in enumerate(rounds_done))
        high = min(offsets[p] + (d + 1) * h + self.cfg.overlap for p, d in enumerate(rounds_done))
        return low, max(low, high)

    async def _join_from_checkpoint(self, peers: list[str], rejoin: bool = False) -> bool:
        """Pull a hash-verified checkpoint (global weights, outer momentum, round counters) and join; False if no
        peer served a usable one (the caller goes on: a key that claims a round and serves nothing costs us a
        try, never a crash)."""
        self.state = "joining"
        # the fastest sources first: a checkpoint is the whole model (exchange.fastest_first); and the peers whose
        # checkpoint we had joined from when our weights left the majority's after all the others. Their weights
        # are the run's (their hash is checked) but their outer momentum need not be (no peer publishes a hash of
        # it): asked first again (the fastest, or the first of the holders, none measured) one would send us round for
        # the whole run, each of our updates refused for its other base; two, taking turns, would too where only the
        # last is put last. No penalty: nothing shows they lied
        for peer in sorted(exchange.fastest_first(peers, self.links.source_rates),
                           key=lambda a: a in self.resyncs.led_off):
            if (pulled := await self._usable_checkpoint(peer, peers)) is None:
                continue
            self._joined(peer, peers, *pulled, rejoin)
            if self.faults:
                await self.faults.enter("joined", self, source=peer)
            return True
        self.counters["checkpoint_join_failed"] += 1
        logger.warning("diloco: none of %d peer(s) served a usable checkpoint", len(peers))
        return False

    async def _usable_checkpoint(self, peer: str, peers: list[str]) -> tuple[dict, list, list] | None:
        """``peer``'s checkpoint, pulled and checked against the global hashes the peers that count (or else
        ``peers``) published for its round; None (counted, and a penalty where it is malformed) if unusable."""
        try:
            ckpt, global_flat, momentum = await self._pull_checkpoint(peer)
            done = ckpt["rounds_done"]
            published = self.book.hashes.get((done[-1] - 1, self.cfg.fragments - 1), {})
            published = {a: h for a, h in published.items() if self.standing.vouched(a)} or \
                {a: h for a, h in published.items() if a in peers}
            if published and ckpt["global_hash"] not in published.values():
                raise ValueError("checkpoint does not match any published global hash")
        except (TransportError, ProtocolViolation, BulkError, codecs.CodecError, asyncio.TimeoutError,
                ValueError) as e:
            self.counters["checkpoint_source_failed"] += 1
            logger.warning("checkpoint from %s unusable: %s", peer, e)
            if isinstance(e, ProtocolViolation):  # what it sent is malformed (not: the run moved on meanwhile)
                self._ctx.transport.penalties.penalize(peer, "invalid_message", str(e))
            return None
        return ckpt, global_flat, momentum

    def _joined(self, peer: str, peers: list[str], ckpt: dict, global_flat: list, momentum: list,
                rejoin: bool) -> None:
        """``peer``'s checkpoint taken: our weights, counters and standing from it, and the rounds we follow and
        contribute to from here announced."""
        done = ckpt["rounds_done"]
        # its step, within what its rounds allow: the step is its server's word alone (its rounds are checked,
        # by their hash), and one past the run's end would have a joiner end the run at once on the weights it
        # joined with, having never contributed (the simulator)
        low, high = self._steps_of(done)
        step = min(max(ckpt["step"], low), high)
        if step != ckpt["step"]:
            self.counters["checkpoint_step_clamped"] += 1
            logger.warning("diloco: %s's checkpoint says step %d, its rounds %s put it at %d to %d; at %d",
                           peer, ckpt["step"], done, low, high, step)
        self._adopt(global_flat, momentum, done, step, ckpt["participants"])
        self.resyncs.checkpoint_from = peer
        # the peers that vouched for this state (they hold its hash), and those it was made with that say so
        # themselves (they published its hash for its round): the list is its server's word alone, and a key
        # credited from it would count as a founder of ours for good (a server that lists six fresh keys would
        # have their word outvote the run's peers at our first hash check, and we would take their weights: the
        # simulator)
        holders = {a for a, h in self.book.hashes.get((done[-1] - 1, self.cfg.fragments - 1), {}).items()
                   if h == ckpt["global_hash"]}
        listed = {a for v in self.participants.values() for a in v} - {self._ctx.identity.peer_id}
        self.standing.found(set(peers) | (listed & holders))
        self.counters["participants_unconfirmed"] += len(listed - holders - set(peers))
        self.book.took_checkpoint(self.rounds_done)
        self.start_state.initial = set()
        # follow the next round of each fragment, contribute from the one after (announced now)
        for p in range(self.cfg.fragments):
            # a peer the others count (it resyncs after a divergence) contributes from the next round; a newcomer
            # from a round in which newcomers are let in, two rounds ahead at least (peers a round further than
            # our checkpoint must still hear the join in time). Counted from the last round the swarm is known
            # to have closed, not from the checkpoint's: one that aged on its way would name a round the others
            # have closed already, and they drop such a join (joins_ignored)
            now = max(self.fragments[p].rounds_done, self._swarm_round(p) + 1)
            self.fragments[p].join_round = now + 1 if rejoin else next_fresh_round(now + 2)
            self._publish(JOIN, {"r": self.fragments[p].join_round, "p": p, "join": True})
        self.counters["joined_from_checkpoint"] += 1
        # the announcements of the rounds we now follow that came while we pulled the checkpoint were rounds
        # ahead of ours then, and not held: ask its server for them (else a joiner that arrives as the swarm
        # announces closes its first round alone at deadline_high, then falls behind and resyncs: the
        # simulator, 1 MB updates at 2 MB/s)
        ids = sorted({rounds.short_id(a) for v in self.participants.values() for a in v}
                     - {rounds.short_id(self._ctx.identity.peer_id)})
        for p in range(self.cfg.fragments):
            if ids and self.fragments[p].rounds_done < self._rounds():
                ask = asyncio.get_running_loop().create_task(
                    self._fetch_announcements(peer, self.fragments[p].rounds_done, p, ids))
                self.resyncs.asks.add(ask)
                ask.add_done_callback(self.resyncs.asks.discard)
        self.ckpt.resumed = {"source": f"checkpoint of {peer}", "round": self.rounds_done[-1], "step": self.step,
                             "hash": ckpt["global_hash"]}
        self.state = "running"
        logger.info("diloco: joined from %s's checkpoint at step %d (global %s)", peer, self.step,
                    ckpt["global_hash"])

