"""The base model as peers serve it: its layout and bytes on the wire, serving it, fetching a peer's and taking it in
place of ours."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Iterator

import torch

from swarmd.protocols import checkpoint, codecs, outer, rounds
from swarmd.protocols.spsa.weights import _bytes_of, base_digest, tensors_hash
from swarmd.protocols.spsa.wire import (
    BASE_HEAD,
    BASE_PART,
    BASE_PART_BYTES,
    BASE_REQUEST,
    BASE_SERVE_EVERY,
    BASE_SERVE_RATE,
    BASE_SERVES,
    BASE_SPEC,
    MAX_PEER_ENTRIES,
)
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.penalties import RateLimitedLog

logger = logging.getLogger("swarmd.protocols.spsa")  # one logger for the package

BASE_PREFIX = "state.base."  # a checkpoint's copy of the base we replay onto, where it is a peer's


def base_layout(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[tuple[str, int | None, torch.Tensor]]:
    """What a base model is on the wire: each entry of the model's state dict in order, as (name, the index of the
    perturbed parameter it is, or None, its tensor). A perturbed parameter (or a tensor tied to one) is served
    from the base's canonical float32 weights, the rest (frozen parameters, buffers) as the model holds them: the
    loop never changes them."""
    perturbed = {(p.data_ptr(), tuple(p.shape)): i for i, p in enumerate(params) if p.numel()}
    return [(name, perturbed.get((t.data_ptr(), tuple(t.shape))) if t.numel() else None, t)
            for name, t in model.state_dict().items()]


def base_size(layout: list) -> int:
    """A base's bytes on the wire (base_layout)."""
    return sum(t.numel() * (4 if i is not None else t.element_size()) for _, i, t in layout)


def base_arrays(layout: list, base: list[torch.Tensor]) -> list:
    """The base's bytes, entry by entry (uint8 arrays, little-endian values; no copy where a tensor is on the
    CPU already)."""
    return [_bytes_of(base[i] if i is not None else t) for _, i, t in layout]


def base_parts(arrays: list, part_bytes: int = BASE_PART_BYTES) -> Iterator[bytes]:
    """The base's bytes cut in parts of ``part_bytes`` (the last one shorter), small tensors packed together."""
    buf = bytearray()
    for a in arrays:
        view, at = memoryview(a), 0
        while at < len(view):
            take = min(part_bytes - len(buf), len(view) - at)
            buf += view[at:at + take]
            at += take
            if len(buf) == part_bytes:
                yield bytes(buf)
                buf = bytearray()
    if buf:
        yield bytes(buf)


class BaseReceiver:
    """A base model's bytes as they arrive, written straight into tensors shaped as ours (allocated up front: our
    own model's size, which a peer's must equal before anything is allocated)."""

    def __init__(self, layout: list):
        self.tensors = [torch.empty(t.shape, dtype=torch.float32 if i is not None else t.dtype) for _, i, t in layout]
        self._views = [_bytes_of(t) for t in self.tensors]
        self.size = sum(v.nbytes for v in self._views)
        self.received = 0
        self._entry, self._at = 0, 0

    def add(self, data: bytes) -> None:
        if self.received + len(data) > self.size:
            raise MalformedMessage(f"spsa-base: more than the {self.size} B announced")
        src, at = memoryview(data), 0
        while at < len(src):
            while not len(self._views[self._entry]):  # an empty tensor: no bytes of its own
                self._entry += 1
            view = self._views[self._entry]
            take = min(len(view) - self._at, len(src) - at)
            view[self._at:self._at + take] = src[at:at + take]
            at, self._at = at + take, self._at + take
            if self._at == len(view):
                self._entry, self._at = self._entry + 1, 0
        self.received += len(data)

    @property
    def done(self) -> bool:
        return self.received == self.size

    def digest(self) -> str:
        return base_digest(self._views)

    def finite(self) -> bool:
        # one min-max pass a tensor (a bool tensor of every value, then its all(), takes 40x as long)
        return all(codecs.all_finite(t) for t in self.tensors)


class Base:
    """The base model we replay onto (the one we build, or a peer's we took in place of ours): serving it to the
    peers that replay our log, fetching a peer's and taking it in place of ours. Its loop lends it the node's
    context (from ``start``), its counters and work board; the loop's fault plan names the loop."""

    def __init__(self, loop, counters: collections.Counter, work) -> None:
        self._loop = loop  # (its fault plan, read as it is now: a test sets it after the loop is made)
        self._counters, self._work = counters, work
        self._ctx = None  # the node's, from start
        self.hash: str | None = None  # of its perturbed parameters (tensors_hash)
        self.tensors: list[torch.Tensor] = []  # the base's perturbed parameters (canonical float32)
        self.layout: list = []  # the model's state dict as a base is served (base_layout)
        self.state_hash: str | None = None  # of the whole base as served (base_digest)
        self.taken: dict | None = None  # the base we replay onto, where a peer's replaced ours (/status)
        self.replacing = False  # a peer's base is being taken in place of ours (none is served meanwhile)
        self.serving = asyncio.Semaphore(BASE_SERVES)
        self.served: collections.OrderedDict[str, float] = collections.OrderedDict()  # peer -> when
        self.log = RateLimitedLog(logger, interval=30.0)

    def start(self, ctx) -> None:
        self._ctx = ctx

    async def built(self, canonical: list[torch.Tensor]) -> None:
        """Ours: the weights as the model was built."""
        self.hash = tensors_hash(canonical)
        self.tensors = [c.clone() for c in canonical]
        self.state_hash = await asyncio.to_thread(lambda: base_digest(base_arrays(self.layout, self.tensors)))

    async def take_from(self, peer: str) -> bool:
        """Ask ``peer``, whose log we are about to replay, for its base model, and take it where it is not ours (the
        same trust as in its log: the peers we replay from are the ones whose word counts, or two direct ones).
        True if we took it. A peer that serves no base (an older version, or one still building its own) leaves
        ours as it is; one whose base is not ours but does not send it raises (its log
        would replay onto the wrong weights: the caller tries another peer), and one that sends a base other than
        it announced is penalised (raises)."""
        fetched = await self.fetch(peer)
        if fetched is None:
            return False
        self.replacing = True
        try:
            await asyncio.to_thread(self.take, *fetched, peer, "join")  # passes over the whole model
        finally:
            self.replacing = False
        return True

    async def fetch(self, peer: str) -> tuple[list[torch.Tensor], str] | None:
        """``peer``'s base model (its tensors in base_layout's order, and its hash), checked against the hash it
        announced, or None where it holds ours or serves none (see take_from)."""
        size = base_size(self.layout)
        head = None
        try:
            async with await self._ctx.transport.open_stream(peer, BASE_SPEC, timeout=10) as stream:
                await stream.send(BASE_REQUEST.code, {"have": self.state_hash})
                head = await asyncio.wait_for(stream.read_required(), 30)
                if head.kind != BASE_HEAD.code:
                    raise MalformedMessage("spsa-base: the base's head expected")
                if head.body["hash"] == self.state_hash:
                    return None
                if head.body["size"] != size:  # before anything is allocated: a base is our own model's size
                    raise ProtocolViolation(f"spsa-base: {head.body['size']} B, our base model is {size} B")
                if not self._ctx.direct(peer):  # a whole model's bytes never cross a relay (nor would it send them)
                    raise TransportError("it is reached through a relay only")
                receiver = BaseReceiver(self.layout)
                with self._work.track(f"base model pull from {peer[-8:]}", total=size, unit="B") as work:
                    while not receiver.done:
                        part = await asyncio.wait_for(stream.read_required(), 60)
                        if part.kind != BASE_PART.code:
                            raise MalformedMessage("spsa-base: a part of the base expected")
                        receiver.add(part.body["data"])
                        work.update(receiver.received)
            digest, finite = await asyncio.to_thread(lambda: (receiver.digest(), receiver.finite()))
            if digest != head.body["hash"]:
                raise ProtocolViolation("spsa-base: the base's bytes do not match the hash it announced")
            if not finite:
                raise ProtocolViolation("spsa-base: a base with non-finite values")
        except (TransportError, asyncio.TimeoutError) as e:
            if head is not None:
                self._counters["base_pull_failed"] += 1
                raise TransportError(f"its base model is not ours, and did not come: {e or type(e).__name__}") \
                    from None
            self._counters["base_ask_failed"] += 1
            self.log.log(logging.WARNING, ("ask", peer), "spsa: could not ask %s for its base model (%s): "
                               "keeping ours", peer, e or type(e).__name__)
            return None
        except ProtocolViolation as e:
            self._counters["base_unusable"] += 1
            self._ctx.transport.penalties.penalize(peer, "invalid_message", str(e))
            self.log.log(logging.WARNING, ("bad", peer), "spsa: the base model of %s is unusable: %s", peer, e)
            raise
        return receiver.tensors, digest

    def apart(self, tensors: list[torch.Tensor]) -> float:
        """How far a fetched base is from ours: the largest difference of a floating tensor relative to its largest
        magnitude in ours (outer.relative_difference), inf where another tensor (integer buffers, masks) differs."""
        apart = 0.0
        for (_, i, t), theirs in zip(self.layout, tensors):
            ours = self.tensors[i] if i is not None else t.detach().to("cpu")
            if not ours.is_floating_point():
                if not torch.equal(ours, theirs):
                    return math.inf
                continue
            apart = max(apart, outer.relative_difference(ours.reshape(-1).to(torch.float32),
                                                         theirs.reshape(-1).to(torch.float32), [ours.numel()]))
        return apart

    def take(self, tensors: list[torch.Tensor], digest: str, peer: str, when: str,
                   apart: float | None = None) -> None:
        """A peer's base model in place of ours: its perturbed parameters as our base, the rest into the model.
        ``when``: "start" (the founders' base, within rounding of ours) or "join" (the base of the log we replay)."""
        base: list[torch.Tensor | None] = [None] * len(self.tensors)
        for (_, i, _), value in zip(self.layout, tensors):
            if i is not None:
                base[i] = value
        if any(b is None for b in base):  # every parameter is in the state dict: not expected
            raise ProtocolViolation("spsa-base: a perturbed parameter missing")
        if apart is None:
            apart = self.apart(tensors)
        with torch.no_grad():
            for (_, i, t), value in zip(self.layout, tensors):
                if i is None:
                    t.copy_(value)  # the model's own tensor (frozen parameter or buffer): its device and dtype
        self.tensors = base
        self.state_hash = digest
        self.hash = tensors_hash(base)
        self.taken = {"source": peer, "hash": self.hash, "apart": apart, "when": when}
        self._counters["bases_taken"] += 1
        logger.info("spsa: %s the base model of %s (%s; %.3g of a parameter's scale from ours: built on another CPU%s)",
                    "starting from" if when == "start" else "replaying onto", peer, self.hash, apart,
                    "" if when == "start" else ", or trained another way")

    async def serve(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10)
        if message.kind != BASE_REQUEST.code:
            raise MalformedMessage("spsa-base: expected a request")
        digest, layout, base = self.state_hash, self.layout, self.tensors  # taking a base replaces them
        faults = self._loop.faults
        if faults:  # a test's: a slow server, or a base other than ours (its hash, its tensors)
            await faults.enter("serve-base", self._loop, source=stream.peer_id)
            digest, base = faults.altered("serve-base", self._loop, (digest, base), source=stream.peer_id)
        if digest is None or self.replacing:
            return  # not built yet, or being replaced: the stream ends, and the asker replays onto its own
        size = base_size(layout)
        await stream.send(BASE_HEAD.code, {"hash": digest, "size": size})
        if message.body["have"] == digest:
            return
        # the whole model's bytes: over a direct connection only (never through a relay), to one peer once in
        # BASE_SERVE_EVERY, to BASE_SERVES peers at once
        peer, now = stream.peer_id, self._ctx.clock.monotonic()
        if not self._ctx.direct(peer) or now - self.served.get(peer, -math.inf) < BASE_SERVE_EVERY \
                or self.serving.locked():
            self._counters["base_serve_refused"] += 1
            self.log.log(logging.INFO, "refused", "spsa: not serving our base model to %s now (through a "
                               "relay, served it lately, or %d others are being served)", peer, BASE_SERVES)
            return
        rounds.keep_latest(self.served, peer, now, MAX_PEER_ENTRIES)
        async with self.serving:
            # an asker that reads slowly holds a slot: at most as long as 256 kB/s takes
            async with asyncio.timeout(30 + size / BASE_SERVE_RATE):
                for part in base_parts(base_arrays(layout, base)):
                    await stream.send(BASE_PART.code, {"data": part})
        self._counters["base_served"] += 1

    def resume(self, tensors: dict[str, torch.Tensor], meta: dict, names: list[str]) -> None:
        """The base our checkpoint kept, where we had taken a peer's (``take``): its perturbed parameters,
        and the model's other tensors as saved (the base put its own there), so a restart replays onto the run's
        base and probes the run's model, not the ones this CPU builds."""
        taken = meta.get("base_taken")
        base = [tensors.get(BASE_PREFIX + n) for n in names]
        if not isinstance(taken, dict) or any(b is None or b.shape != c.shape for b, c in zip(base, self.tensors)):
            return
        others = [(t, tensors.get(checkpoint.MODEL_PREFIX + name)) for name, i, t in self.layout if i is None]
        if any(v is None or v.shape != t.shape or v.dtype != t.dtype for t, v in others):
            logger.warning("spsa: our checkpoint's base does not fit the model; replaying onto the one we build")
            return
        with torch.no_grad():
            for t, v in others:
                t.copy_(v)
        self.tensors = [b.to(torch.float32) for b in base]
        self.hash = tensors_hash(self.tensors)
        self.state_hash = base_digest(base_arrays(self.layout, self.tensors))
        self.taken = taken
