"""A round's update: the pseudo-gradient of a fragment, encoded (with error feedback), stored in the bulk
store and announced."""

from __future__ import annotations

import asyncio
import logging
import math

import torch
from swarmd.protocols import codecs
from swarmd.protocols.bulk import content_hash
from swarmd.protocols.diloco.pending import Announced, Pending
from swarmd.protocols.diloco.wire import (
    UPDATE,
)
from swarmd.transport.wire import WIRE

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class UpdateMixin:
    """DilocoLoop's update methods (the loop composes them; they share its state)."""

    # ------------------------------------------------------------------ sending and closing a round
    async def _send_update(self, p: int, r: int) -> None:
        """Announce our update for round r of fragment p. Its encoding (and the decoding of what the others will see,
        and the parts' hashes) runs in a worker thread: for a large model that is seconds of work, which on the
        event loop held gossip, the bulk service and the status endpoint."""
        if r < self.fragments[p].join_round:
            return  # a late joiner follows this round without contributing
        if self.links.probe is not None:  # our first update reports the probe's rates (at most PROBE_SECONDS in)
            probe, self.links.probe = self.links.probe, None
            await probe
        # in scatter no peer needs our whole update decoded: each chunk we reduce is decoded from its part when
        # it is reduced (a copy of the update less held all round)
        whole = self._mode(p) != "scatter"
        frag = self.fragments[p]
        prepared = None if frag.skipped is not None else await asyncio.to_thread(self._prepare_update, p, whole)
        if prepared is None:
            if frag.skipped is None:
                frag.skipped = "our weights are not finite"
            self.counters["updates_withheld"] += 1
            logger.warning("diloco: not sending our update for round %d/%d: %s", r, p, frag.skipped)
            return
        if self.faults:
            prepared = self.faults.altered("encoded", self, prepared, r=r, p=p)
        payloads, hashes, mine, norm, base = prepared
        for blob_hash, payload in zip(hashes, payloads):
            self.bulk.keep_prepared(blob_hash, payload)  # served to whoever the round makes pull them
        self.book.blobs[(r, p)].update(hashes)
        self.book.own_blobs[(r, p)].update(hashes)
        rates = self._rate_reports(p)
        unreached = self._unreached_reports(p, r)
        ann = Announced(tuple(hashes), tuple(len(x) for x in payloads), base, norm, tuple(self.bulk.addrs), rates,
                        unreached)
        body = {"r": r, "p": p, "parts": hashes, "sizes": list(ann.sizes), "base": base, "norm": ann.norm,
                "addrs": list(ann.addrs)}
        if rates:
            body["bw"] = [list(x) for x in rates]
        if unreached:
            body["nd"] = list(unreached)
        mid = self._publish(UPDATE, body)
        pending = self.book.pending[(r, p)]
        if (signed := self.gossip.cache.get(mid)) is not None:  # for a peer our member view names, if it asks
            pending.signed[self._ctx.identity.peer_id] = signed.wire()
        pending.sent_at = self.clock.monotonic()
        pending.announced[self._ctx.identity.peer_id] = ann
        if mine is not None:
            pending.updates[self._ctx.identity.peer_id] = mine
        self.counters["bytes_sent"] += sum(ann.sizes)  # our update's size (each peer serves it as the mode asks)
        self.counters["updates_sent"] += 1

    def _prepare_update(self, p: int, whole: bool = True) \
            -> tuple[list[bytearray], list[bytes], torch.Tensor | None, float, str] | None:
        """(In a worker thread, while the loop waits for it: nothing else changes the weights meanwhile.) Our update
        for fragment p, encoded part by part: the payloads, their hashes, the update as the others will decode it
        (if ``whole``; else None), its L2 norm, and the global weights' hash it was computed from; None if our
        update is not finite (our weights, since the global ones are: the codec refuses NaN and infinity, and that
        check is the only pass made for it)."""
        frag = self.fragments[p]
        delta = self._pseudo_gradient(p, self.replica.of(frag))
        lossless = self.codec.lossless  # what the others decode is ``delta`` itself, bit for bit
        residual = frag.residual if self.feedback and not lossless else None
        if residual is not None and residual.shape == delta.shape:
            delta.add_(residual, alpha=self.cfg.feedback_decay)  # what the codec dropped of our last update
        bounds = self._bounds(p, self._want_parts(p))
        if isinstance(self.codec, codecs.E3M0Codec):
            # (the default codec) one pass a part: its bytes, the norm of what the others decode of it and, with
            # error feedback, the residual left where the update was; no decode of our own bytes, no norm pass
            mine = torch.empty(bounds[-1][1]) if whole else None
            payloads, kept, dropped = [], 0.0, 0.0
            try:
                for a, b in bounds:
                    into = None if mine is None else mine[a:b]
                    if self.feedback:
                        payload, k, d = self.codec.encode_wire_residual(delta[a:b], into)
                    else:
                        (payload, k), d = self.codec.encode_wire_measured(delta[a:b], into), 0.0
                    payloads.append(payload)
                    kept, dropped = kept + k, dropped + d
            except codecs.CodecError:
                return None
            if self.feedback:
                frag.residual, frag.residual_norm = delta, round(math.sqrt(dropped), 6)
                if residual is not None:  # the last residual, added in: its buffer is the next update's
                    self._buffers.give(residual)
            else:
                self._buffers.give(delta)  # encoded: its buffer is the next round's
            del delta
            return payloads, [content_hash(x) for x in payloads], mine, math.sqrt(kept), self._base_hash(p)
        try:
            payloads = [self.codec.encode_wire(delta[a:b]) for a, b in bounds]
        except codecs.CodecError:
            return None
        if lossless:
            # nothing to decode: the parts' values are ours (and no residual: the codec drops nothing)
            squares = sum(float(delta[a:b].norm()) ** 2 for a, b in bounds)
            if self.feedback:
                frag.residual, frag.residual_norm = None, 0.0
            mine = delta if whole else None
            del delta
            return payloads, [content_hash(x) for x in payloads], mine, math.sqrt(squares), self._base_hash(p)
        if not self.feedback:
            self._buffers.give(delta)
            del delta
        # what the others will see of our update, decoded part by part into one tensor (or only measured)
        mine = torch.empty(bounds[-1][1]) if whole else None
        squares = 0.0
        for (a, b), payload in zip(bounds, payloads):
            part = codecs.decode(payload, out=None if mine is None else mine[a:b])
            squares += float(part.norm()) ** 2  # (torch's fp32 norm of a part; no float64 copy of it)
            if self.feedback:
                delta[a:b].sub_(part)  # the part of it the codec dropped: the next update's residual
            del part
        if self.feedback:
            frag.residual, frag.residual_norm = delta, round(float(delta.norm()), 6)
            if residual is not None:
                self._buffers.give(residual)
        return payloads, [content_hash(x) for x in payloads], mine, math.sqrt(squares), self._base_hash(p)

    def _own_update(self, pending: Pending) -> torch.Tensor | None:
        """Our whole update for a round, decoded from the parts we serve (all-to-all needs it; a round we announced
        in scatter did not keep it decoded); None if the bulk store dropped one of them (``blobs_evicted``)."""
        held = [self.bulk.blobs.get(h) for h in pending.announced[self._ctx.identity.peer_id].parts]
        if any(x is None for x in held):
            return None
        return torch.cat([codecs.decode(x) for x in held])

    def _pseudo_gradient(self, p: int, local: list[torch.Tensor]) -> torch.Tensor:
        """Our update for fragment p: the global weights minus ``local``, our parameters of that fragment, in one new
        flat fp32 tensor on the CPU (one kept from an earlier round where there is one: ``_buffers``), each parameter
        subtracted where it lies (one pass: no flat copy of our weights made first to compute the difference in)."""
        glob = self.fragments[p].weights
        out = self._buffers.take(glob.numel())  # (global_flat's tensors: flat fp32 on the CPU)
        at = 0
        for t in local:
            n = t.numel()
            torch.sub(glob[at:at + n], t.detach().reshape(-1).to("cpu", torch.float32), out=out[at:at + n])
            at += n
        if at != glob.numel():
            raise ValueError(f"{at} parameter values for a fragment of {glob.numel()}")
        if self.faults:
            out = self.faults.altered("update", self, out, r=self.fragments[p].rounds_done, p=p)
        return out

    def _publish(self, kind, body: dict) -> bytes:
        if self.faults:
            self.faults.note("publish", self, r=body.get("r"), p=body.get("p"), kind=kind, info={"body": body})
        return self.gossip.publish(self.topic, WIRE.pack(kind, self._tag(body)))

