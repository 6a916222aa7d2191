"""Seed-based SPSA (MeZO-style zeroth-order fine-tuning) at about one byte per step per peer.

The algorithm (``docs/loops/spsa.md``), per step t and peer i:

- seed(t, i) = BLAKE2b-64(run id || t || peer id) >> 1; seeds are derived, never sent;
- z ~ N(0, I) in the fixed parameter order (the model's), from a CPU generator seeded with it: 16-bit integer
  draws looked up in a table of normal quantiles, the same bits on every CPU (``PERTURBATION``);
- probe from the canonical weights, restoring them by copy (bit-exact; the in-place +-eps trick drifts in fp32):
  L+ at theta + eps*z, L- at theta - eps*z, g = (L+ - L-) / (2 eps), clipped to +-clip;
- one byte: bit 7 the sign, bits 0-6 q = round(4 log2(|g| / 1e-4)) clamped to 0..127 (quarter-octave steps,
  |g| from 1e-4 to ~3.6e5); decoded as sign * 1e-4 * 2^(q/4);
- every peer applies every peer's byte for a step, in canonical order (sorted peer ids):
  theta <- theta - (lr / M) * sum_i dec(b_i) * z(seed(t, i)), M = number of peers in the step.

On the wire, a peer signs one pubsub message per *window* of ``window`` steps (``{"w": window, "b": bytes}``), so the
header and signature are amortised. Updates apply with a one-window lag: the bytes of window w are applied during
window w+1 (step t uses the bytes of step t - window), so a window can be computed while the previous one travels.
A window's participants are the peers whose batch for it arrived before its deadline; every ``hash_every``
windows peers publish a hash of their weights, and a peer that disagrees with the majority counts it and resyncs by
replaying the log. The log (every applied, signed batch) lets a late joiner rebuild the base model, verify each
batch's signature and replay to the same weights bit for bit; where its CPU builds the base with other low bits
(another CPU's kernels draw and pretrain a seed's model otherwise), it replays onto the base of the peer it replays
from (``spsa-base``: ``_base_from``), and founders whose bases differ by rounding start from the one most of them
hold (``_start_choice``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from swarmd.node.services import NodeContext
from swarmd.protocols import checkpoint, codecs, outer, rounds
from swarmd.protocols import task as tasks
from swarmd.protocols.gossip import SIGN_DOMAIN as PUBSUB_DOMAIN
from swarmd.protocols.gossip import Gossip, Message, Verdict, decode_message
from swarmd.protocols.standing import FRESH_EVERY, check_peer_ids, fresh_round, next_fresh_round
from swarmd.protocols.task import Task, TaskError
from swarmd.protocols.taskloop import TAG, TaskLoop
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import verify
from swarmd.transport.penalties import RateLimitedLog
from swarmd.transport.wire import WIRE, Bool, Bytes, Int, List, Map, Nil, Str, Tuple, UnknownKind

logger = logging.getLogger(__name__)

G0 = 1e-4
MAX_PEER_ENTRIES = 256  # per window: batches, joins, hashes and ready messages kept from peers without standing
READY_UNLISTED = 64  # "ready"s kept from authors not listed as direct yet, until they are (the newest)
HISTORY = 1024  # evaluated losses kept for /status and the dashboard (a run may never end)
KEEP_APPLIED = 4  # closed windows whose batches stay decoded (a window's steps apply the one before; the log keeps
# every window's bytes)
# a log is many small signed batches (5 objects per >= 220 B, ~40 B an object): one decoded object per 32 B beyond
# 64 KiB, not the default 64 (at the default a log past ~700 KB, about 900 windows of 4 peers, is refused as too
# dense, and no joiner can replay it). Served in parts of whole windows, so no frame bounds an open run's length
# (one frame of at most 32 MiB holds ~40,000 windows of 4 peers)
LOG_SPEC = ProtocolSpec("spsa-log", "2.0.0", max_frame=16 << 20, kinds=frozenset({1, 2}), item_bytes=32)
LOG_PART_BYTES = 2 << 20  # a part of a served log: whole windows, until about this many bytes
MAX_LOG_BYTES = 1 << 30  # the signed batches a joiner takes from one log (~1.5 M windows of 4 peers; the log is
# held in memory by whoever serves or replays it)
CARRIER = "spsa/<run>"  # the run's pubsub topic
_W = Int(0, 2**40)
_TAG = {"t": ["layout-hash", "config-hash"]}
LOG_REQUEST = WIRE.frame(LOG_SPEC, 1, "spsa.log-request", Nil(), None, doc="your log of signed batches, please")
_ENTRY = Tuple.of(_W, List(Map.of(b=Bytes(8192), s=Bytes(exact=64)), 1 << 16))
LOG_PART = WIRE.frame(LOG_SPEC, 2, "spsa.log-part", Map.of(w=_W, windows=List(_ENTRY, 1 << 20), more=Bool()),
                      {"w": 0, "windows": [[0, [{"b": b"\x96\x01...", "s": bytes(64)}]]], "more": False},
                      doc="the closed windows from w on, in order ([window, [its batches as signed pubsub "
                      "messages]]), about 2 MiB of them; more: further parts follow on this stream")
BATCH = WIRE.message(CARRIER, 1, "spsa.batch", Map.of(w=_W, b=Bytes(4096), h=Bytes(exact=8), t=TAG),
                     {"w": 3, "b": bytes(96), "h": bytes.fromhex("ab" * 8), **_TAG}, max_size=4096 + 256, version=2,
                     doc="my projected gradients for the steps of window w, one byte each (sign + 7-bit log2 |g|), "
                     "and the first 8 bytes of my weights' hash after w (every window before it applied): the weights "
                     "its steps probed, and my vote in the hash check")
HASH = WIRE.message(CARRIER, 2, "spsa.hash", Map.of(w=_W, h=Str(32, min=32), t=TAG), {"w": 4, "h": "ab" * 16, **_TAG},
                    max_size=256, doc="my weights' hash after window w (a peer that follows without contributing; a "
                    "contributor's batch carries it)")
READY = WIRE.message(CARRIER, 3, "spsa.ready", Map.of(w=_W, ready=Str(32, min=32), t=TAG),
                     {"w": 0, "ready": "ab" * 16, **_TAG}, max_size=256, doc="I hold these base weights and can start")
JOIN = WIRE.message(CARRIER, 4, "spsa.join", Map.of(w=_W, join=Bool(only=True), t=TAG), {"w": 8, "join": True, **_TAG},
                    max_size=256, doc="I contribute from window w (a late joiner)")

# a late joiner replays the log onto the base model, so it needs the base the others hold, bit for bit: a task that
# builds it by training (its pretraining steps) or by random init draws other low bits on another CPU's kernels
# (torch's scalar ones, an ARM CPU's), and such a joiner replayed onto other weights and never agreed with the run.
# It asks the peer it replays from for that peer's base (whose hash it gives, so equal bases cost a round trip)
BASE_PART_BYTES = 4 << 20
BASE_SPEC = ProtocolSpec("spsa-base", "1.0.0", max_frame=BASE_PART_BYTES + 1024, kinds=frozenset({1, 2, 3}))
_HASH = Str(32, min=32)
BASE_REQUEST = WIRE.frame(BASE_SPEC, 1, "spsa.base-request", Map.of(have=_HASH), {"have": "ab" * 16},
                          doc="your base model, please, unless its hash (base_state_hash) is this one, mine")
BASE_HEAD = WIRE.frame(BASE_SPEC, 2, "spsa.base-head", Map.of(hash=_HASH, size=Int(0, 1 << 42)),
                       {"hash": "cd" * 16, "size": 1 << 20},
                       doc="my base model's hash and its size in bytes; its bytes follow in parts unless the hash is "
                       "the one you have")
BASE_PART = WIRE.frame(BASE_SPEC, 3, "spsa.base-part", Map.of(data=Bytes(BASE_PART_BYTES)), {"data": bytes(8)},
                       doc="the base model's next bytes: the model's state dict in order, each tensor's values "
                       "little-endian in its own dtype, the perturbed parameters as float32")
MISMATCH_SAID_AFTER = 10.0  # s a start waits beside ready peers of another base before it says so in the log
BASE_PREFIX = "state.base."  # a checkpoint's copy of the base we replay onto, where it is a peer's
BASE_SERVES = 2  # bases served at once (each is the whole model's bytes: more asks meanwhile are refused, and
# their askers go to another peer)
BASE_SERVE_EVERY = 30.0  # seconds before the same peer is served the whole base again
BASE_SERVE_RATE = 256e3  # bytes a second an asker must read at least (a slot is not held longer)


# ------------------------------------------------------------------ the pure parts
def step_seed(run: str, step: int, peer_id: str) -> int:
    digest = hashlib.blake2b(run.encode() + b"\x00" + step.to_bytes(8, "big") + peer_id.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> 1


def encode_grad(g: float, clip: float) -> int:
    if not math.isfinite(g):
        raise ValueError("projected gradient is not finite")
    g = max(-clip, min(clip, g))
    q = 0 if abs(g) <= G0 else min(127, max(0, round(4 * math.log2(abs(g) / G0))))
    return (0x80 if g < 0 else 0) | q


def decode_grad(b: int) -> float:
    magnitude = G0 * 2.0 ** ((b & 0x7F) / 4)
    return -magnitude if b & 0x80 else magnitude


EXTREME_Q = 13  # quarter-octaves (~9.5x): a peer whose median |g| in a window is this far above the window's: refused
CAP_Q = 8  # quarter-octaves (4x): every |g| of a window is capped at this far above the window's median |g|


def screen_window(batches: dict[str, bytes]) -> tuple[set[str], int]:
    """What a window's bytes may move (needs 3 peers; with fewer, nothing is screened): the peers whose median |g|
    exceeds the lower median of every peer's median by EXTREME_Q quarter-octaves (refused for the window), and the
    cap on any one |g| code: the lower median of the other peers' codes + CAP_Q. Integer arithmetic on the window's
    signed bytes only, so live peers and a replaying joiner refuse and cap the same bytes, bit-exactly."""
    if len(batches) < 3 or not all(batches.values()):
        return set(), 0x7F
    medians = {a: statistics.median_low(x & 0x7F for x in b) for a, b in batches.items()}
    typical = statistics.median_low(medians.values())
    out = {a for a, m in medians.items() if m > typical + EXTREME_Q}
    pooled = statistics.median_low(x & 0x7F for a, b in batches.items() if a not in out for x in b)
    return out, min(0x7F, pooled + CAP_Q)


def read_log(entries: Any, *, topic: str, window: int, accepts: Callable[[str, dict], bool]
             ) -> list[tuple[int, dict[str, Message]]]:
    """A peer's log as it serves it (``[[w, [signed batch message, ...]], ...]``, windows contiguous from 0),
    verified whole before a joiner takes anything from it: every entry a message on ``topic`` signed by its author,
    a batch of its window with ``window`` steps, that ``accepts(author, body)`` (the run's task tag). Returns
    [(w, {author: message})]; raises ValueError naming the first fault. Pure: no I/O, no state."""
    if not isinstance(entries, list) or [e[0] if isinstance(e, list) and len(e) == 2 else None
                                         for e in entries] != list(range(len(entries))):
        raise ValueError("spsa-log: windows must be [w, batches] contiguous from 0")
    out = []
    for w, wires in entries:
        if not isinstance(wires, list):
            raise ValueError("spsa-log: batches must be a list")
        batches: dict[str, Message] = {}
        for wire in wires:
            message = decode_message(wire)
            if message.topic != topic or not verify(message.author, PUBSUB_DOMAIN + message.body, message.sig):
                raise ValueError("spsa-log: an entry does not verify")
            try:
                kind, body = WIRE.unpack(CARRIER, message.data)
            except (MalformedMessage, UnknownKind):
                raise ValueError("spsa-log: an entry is not a batch") from None
            if kind is not BATCH or not accepts(message.author, body) or body["w"] != w or len(body["b"]) != window:
                raise ValueError("spsa-log: an entry is not a batch of its window")
            batches[message.author] = message
        out.append((w, batches))
    return out


def _window_bytes(wires: list) -> int:
    """What a window of a log counts against a part's size and a joiner's budget: its signed batches, and 16 B of
    its own (so windows without batches still count: a part holds at most part_bytes / 16 of them, and a peer
    cannot stream empty windows past the budget)."""
    return 16 + sum(len(m["b"]) + len(m["s"]) + 8 for m in wires)


def log_parts(log: list, part_bytes: int | None = None) -> Iterator[tuple[int, list, bool]]:
    """A log as it is served: (first window, whole windows, more follow), each part about ``part_bytes``
    (``_window_bytes``; default LOG_PART_BYTES; at least one window; an empty log is one empty part): at most
    part_bytes / 16 windows (its schema's bound: 2**20)."""
    part_bytes = part_bytes or LOG_PART_BYTES
    first, size = 0, 0
    for i, (_, wires) in enumerate(log):
        size += _window_bytes(wires)
        if size >= part_bytes:
            yield first, log[first:i + 1], i + 1 < len(log)
            first, size = i + 1, 0
    if first < len(log) or not log:
        yield first, log[first:], False


async def read_log_parts(stream: Stream, max_bytes: int = MAX_LOG_BYTES) -> list:
    """A peer's log from its parts (``log_parts``): each part must start where the last ended, and the whole may
    hold at most ``max_bytes`` (``_window_bytes``: checked part by part, so a peer that streams forever, empty
    windows included, costs one part beyond it). Raises MalformedMessage; the caller verifies the windows
    (``read_log``)."""
    entries: list = []
    size = 0
    while True:
        part = await asyncio.wait_for(stream.read_required(), 60)
        if part.kind != LOG_PART.code:
            raise MalformedMessage("spsa-log: a part of the log expected")
        body = part.body  # its schema checked by the stream: [w, [{b, s}]] windows, bounded
        if body["w"] != len(entries):
            raise MalformedMessage(f"spsa-log: a part from window {body['w']} after {len(entries)} windows")
        size += sum(_window_bytes(wires) for _, wires in body["windows"])
        if size > max_bytes:
            raise MalformedMessage(f"spsa-log: more than {max_bytes} B of batches")
        entries += body["windows"]
        if not body["more"]:
            return entries


def log_contributors(windows: list[tuple[int, dict[str, Message]]],
                     screen: Callable[[int, dict[str, bytes]], tuple[set[str], int]] | None = None
                     ) -> list[set[str]]:
    """Each window's contributors as standing records them: its batches less those ``screen`` (``screen_window``,
    or a cached one taking the window too) refuses as out of scale, so a joiner counts the peers the live ones
    counted."""
    out = []
    for w, batches in windows:
        raw = {a: _batch_bytes(m) for a, m in batches.items()}
        extreme, _ = screen(w, raw) if screen is not None else screen_window(raw)
        out.append(set(batches) - extreme)
    return out


def capped(b: int, cap: int) -> int:
    """A byte with its magnitude code capped (its sign kept)."""
    return (b & 0x80) | min(b & 0x7F, cap)


AUDIT_REL = 1e-5  # a loss re-computed on another device or by other kernels may differ by this much, relative
AUDIT_TOL_Q = 4  # quarter-octaves (2x) a peer's |g| may differ from ours re-probed, beyond that rounding
OFF_WEIGHTS_LIMIT = 2  # hash checks' worth of windows an author may probe weights other than the majority's
# (an honest one that diverged resyncs at the next check) before it is taken for dodging the audits


def audit_agrees(sent: int, plus: float, minus: float, eps: float, clip: float) -> bool:
    """Whether a peer's byte for a step is what we get re-probing that step (same weights, its batch, its seed):
    the sign, where the projected gradient is clear of the rounding another device may add to the two losses, and
    |g| within AUDIT_TOL_Q quarter-octaves beyond that rounding (and the quantisation). Where it is not clear of it,
    only a magnitude beyond it disagrees. A probe of ours that is not finite judges nothing (the honest byte is then
    the smallest step)."""
    if not (math.isfinite(plus) and math.isfinite(minus)):
        return True
    g = (plus - minus) / (2 * eps)
    noise = AUDIT_REL * max(abs(plus), abs(minus)) / eps  # what rounding in the losses can move g by
    factor = 2.0 ** (AUDIT_TOL_Q / 4)
    got = decode_grad(sent)
    hi = max(min(abs(g) + noise, clip) * factor, 2 * G0)
    if abs(g) <= noise:
        return abs(got) <= hi  # the sign is rounding's to decide: only the size can be wrong
    lo = min(abs(g) - noise, clip) / factor
    return (got < 0) == (g < 0) and lo <= abs(got) <= hi


_fp32_said = False


def exact_fp32() -> None:
    """Float32 matmuls and cuDNN convolutions in full precision (no TF32) from here on, whatever a task set: an
    auditor compares our losses with its own, computed on another device, within AUDIT_REL. On an H200
    (``docs/benchmarks/audit.md``): fp32 on the GPU is within 2.6e-7 of the CPU, TF32 matmuls up to 4.6e-5 (an
    honest peer fails about 1 audit in 400); PyTorch turns TF32 on for convolutions by default. Process-wide: every
    loop of a node that runs SPSA computes float32 without TF32. (The legacy flags: reading them raises once the newer
    per-backend ``fp32_precision`` API has set them inconsistently.)"""
    global _fp32_said
    try:
        tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cudnn.allow_tf32
    except RuntimeError:  # flags set through both APIs: set them again below
        tf32 = True
    if not tf32:
        return
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not _fp32_said:
        _fp32_said = True
        logger.info("spsa: float32 matmuls and convolutions run without TF32 in this process (audits compare our "
                    "losses with other devices' within %g)", AUDIT_REL)


# z: each value a draw of Z_BITS bits from the seeded CPU generator (torch.randint: integer arithmetic, the same
# on every CPU) looked up in a table of the standard normal's quantiles at the midpoints of 2^Z_BITS bins of equal
# probability (float32; symmetric, |z| <= 4.325, variance 0.99998). torch.randn draws other low bits with torch's
# scalar kernels (a CPU without AVX2) than with its AVX2 ones (38% of 100,000 values), so peers on other CPUs
# would apply other perturbations; this is the same bits everywhere, and costs what randn does
Z_BITS = 16


def _normal_quantiles(bits: int) -> torch.Tensor:
    n = 1 << bits
    normal = statistics.NormalDist()
    return torch.tensor([normal.inv_cdf((i + 0.5) / n) for i in range(n)], dtype=torch.float32)


NORMAL_TABLE = _normal_quantiles(Z_BITS)
# how z is drawn and how a step applies it, with the table's hash (a platform whose libm rounded a quantile
# otherwise would hash otherwise): the weights' bits depend on both, so they are part of a run's fingerprint
# (SpsaConfig.shared) and peers of versions that draw or step otherwise never meet in one run
PERTURBATION = (f"z = table[randint(0, 2^{Z_BITS}, int32)] per parameter in order from one seeded CPU generator, "
                f"table[i] = float32(inv_cdf((i + 1/2) / 2^{Z_BITS})) blake2b-64 "
                f"{hashlib.blake2b(NORMAL_TABLE.numpy().tobytes(), digest_size=8).hexdigest()}; a step adds "
                "coeff x z, the product and the sum each rounded on its own (1)")


DRAW_CHUNK = 1 << 20  # values whose indices are drawn at a time (a 4 MB buffer; the same draws as all at once)


def _perturbation_flat(numel: int, seed: int) -> torch.Tensor:
    """The first ``numel`` values of the perturbation of ``seed``, as one flat tensor."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.empty(numel, dtype=torch.float32)
    index = torch.empty(min(DRAW_CHUNK, numel), dtype=torch.int32)
    for start in range(0, numel, DRAW_CHUNK):
        end = min(start + DRAW_CHUNK, numel)
        drawn = torch.randint(0, 1 << Z_BITS, (end - start,), generator=g, dtype=torch.int32,
                              out=index[:end - start])
        torch.index_select(NORMAL_TABLE, 0, drawn, out=z[start:end])
    return z


def perturbation(shapes: list[torch.Size], seed: int) -> list[torch.Tensor]:
    """The perturbation of a probe's seed, one tensor per shape in order (views of one new flat tensor)."""
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(_perturbation_flat(sum(sizes), seed).split(sizes), shapes)]


class Weights:
    """Canonical fp32 weights of the perturbed parameters of a model, and the loss that probes them."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter] | None = None, loss=None):
        self.model = model
        self.params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
        self.canonical = [p.detach().to("cpu", torch.float32).clone() for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.loss = loss if loss is not None else model.loss

    @torch.no_grad()
    def _load(self, offset: list[torch.Tensor] | None, scale: float) -> None:
        for p, c, z in zip(self.params, self.canonical, offset or [None] * len(self.params)):
            value = c if z is None else c + scale * z
            p.copy_(value)  # to the parameter's device and dtype

    @torch.no_grad()
    def probe(self, batch, seed: int, eps: float) -> float:
        plus, minus = self.losses(batch, seed, eps)
        return (plus - minus) / (2 * eps)

    @torch.no_grad()
    def losses(self, batch, seed: int, eps: float) -> tuple[float, float]:
        """L+ and L- of a probe (the weights restored after, bit-exact), in full float32 precision."""
        exact_fp32()
        z = perturbation(self.shapes, seed)
        self._load(z, eps)
        plus = float(self.loss(batch))
        self._load(z, -eps)
        minus = float(self.loss(batch))
        self._load(None, 0.0)  # restore by copy: bit-exact
        return plus, minus

    @torch.no_grad()
    def apply(self, run: str, step: int, updates: dict[str, int], lr: float) -> None:
        """Apply every peer's byte for ``step`` in canonical order."""
        if not updates:
            return
        m = len(updates)
        sizes = [c.numel() for c in self.canonical]
        for peer_id in sorted(updates):
            coeff = -lr / m * decode_grad(updates[peer_id])
            # a product, then a sum: add(alpha=) is one fused multiply-add in torch's AVX2 and AVX-512 kernels and
            # two roundings in its scalar ones, so the weights' bits would depend on the CPU
            step_z = _perturbation_flat(sum(sizes), step_seed(run, step, peer_id)).mul_(coeff)
            for c, z in zip(self.canonical, step_z.split(sizes)):
                c.add_(z.view(c.shape))
        self._load(None, 0.0)

    def hash(self) -> str:
        return tensors_hash(self.canonical)


def tensors_hash(tensors: list[torch.Tensor]) -> str:
    """The hash of float32 CPU tensors (a Weights' canonical ones, or a base's): their bytes in order."""
    return base_digest([_bytes_of(c) for c in tensors])


# ------------------------------------------------------------------ the base model, as peers serve it
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


def _bytes_of(t: torch.Tensor):
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()


def base_digest(arrays: list) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(a)
    return h.hexdigest()


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


# ------------------------------------------------------------------ the loop
# the built-in task's options when the config names none: the tiny GPT pretrained on generated text, fine-tuned on
# a shifted domain
DEFAULT_TASK_OPTIONS = {"domain": "target", "pretrain_steps": 200, "seed": 1}


class SpsaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    run: str = Field("spsa-demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    task: str = "tinygpt"  # "path/to/file.py:factory", "package.module:factory" or a built-in name
    task_options: dict | None = None  # keyword arguments of the task's factory (default: the built-in's, above)
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    threads: int = Field(0, ge=0, le=4096)  # torch's CPU threads for the loop's compute (0: auto, protocols.task)
    checkpoint_every: int = Field(8, ge=0)  # windows between checkpoints (0: only at the end)
    base_seed: int = 1  # the seed the task's model is built under (every peer builds the same base)
    steps: int = Field(200, ge=0, le=10**12)  # 0: until stopped
    window: int = Field(96, ge=1, le=4096)  # steps per signed message (and the lag of application)
    eps: float = Field(1e-3, gt=0)
    lr: float = Field(1e-3, gt=0)
    clip: float = Field(100.0, gt=0)
    min_peers: int = Field(1, ge=1)  # wait for this many participants (us included) before window 0
    deadline: float = Field(10.0, gt=0)  # seconds to wait for a window's batches after ours is out
    hash_every: int = Field(8, ge=1)  # windows between weight-hash announcements
    eval_every: int = Field(2, ge=1)  # windows between evaluations
    peers: list[str] = Field([], max_length=10_000)  # a closed run: only these peer ids take part (empty: open)
    # audits (tasks with batch_at only): each window, re-probe audit_steps random steps of up to audit_peers random
    # peers, and refuse a peer whose bytes are not what its step gives (0: no audits). Each re-probe costs what one
    # step of ours does; a local choice, not shared
    audit_peers: int = Field(8, ge=0, le=256)
    audit_steps: int = Field(2, ge=1, le=64)

    _peers = field_validator("peers")(check_peer_ids)

    def options(self) -> dict:
        return dict(self.task_options) if self.task_options is not None else (
            dict(DEFAULT_TASK_OPTIONS) if self.task == "tinygpt" else {})

    def shared(self) -> dict:
        """The settings every peer of a run must share (part of the run's fingerprint)."""
        return {**self.model_dump(include={"run", "base_seed", "steps", "window", "eps", "lr", "clip", "peers"}),
                "perturbation": PERTURBATION}


NEWCOMER_GRACE = 2.0  # seconds a window waits for a newcomer's batch once every counting peer's is in


@dataclass
class Window:
    batches: dict[str, Message] = field(default_factory=dict)  # author -> signed batch
    joins: set[str] = field(default_factory=set)  # peers that announced they start contributing at this window


class SPSALoop(TaskLoop):
    """The loop as a node service. Timeline of window w (``window`` steps):

    1. for each step t of w: apply window w-1's byte for step t - window (every participant's, canonical order),
       then probe at the new weights and encode our byte;
    2. publish our batch for w (if we participate in w);
    3. close w: wait for the batches of w's expected participants (those of w-1, plus peers that announced they
       join at w), at most ``deadline`` seconds; the batches that arrived are w's participants, everywhere.

    A late joiner fetches the log (the signed batches of every closed window) from a peer, verifies each batch's
    signature, replays it onto the base model, follows the live windows without contributing, announces that it
    joins two windows ahead, and contributes from there."""

    name = "spsa"

    def __init__(self, gossip: Gossip, config: SpsaConfig, task: Task):
        self.gossip = gossip
        self.cfg = config
        self._init_task(task)
        self.topic = f"spsa/{config.run}"
        self.windows: dict[int, Window] = collections.defaultdict(Window)
        self.applied: dict[int, dict[str, Message]] = {}  # closed windows: author -> batch
        self.log: list[list] = []  # closed windows in order: [window, [signed batch, ...]] (possibly empty)
        self.hashes: dict[int, dict[str, str]] = collections.defaultdict(dict)  # window -> author -> hash
        self.my_hashes: dict[int, str] = {}
        self.counters: collections.Counter = collections.Counter()
        self.window = 0  # the window being computed
        self.join_at = 0  # the first window we contribute to
        self.losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=HISTORY)  # the last evaluations
        self.weights: Weights | None = None
        self.base_hash: str | None = None
        self._base: list[torch.Tensor] = []  # the base's perturbed parameters (canonical float32)
        self._base_layout: list = []  # the model's state dict as a base is served (base_layout)
        self.base_state_hash: str | None = None  # of the whole base as served (base_digest)
        self.base_taken: dict | None = None  # the base we replay onto, where a peer's replaced ours (/status)
        self._base_serving = asyncio.Semaphore(BASE_SERVES)
        self._base_served: collections.OrderedDict[str, float] = collections.OrderedDict()  # peer -> when
        self._base_log = RateLimitedLog(logger, interval=30.0)
        self._replacing_base = False  # a peer's base is being taken in place of ours (none is served meanwhile)
        self._start_bases = rounds.StartWeights()  # whose base we asked for at the start, and how many asks left
        self.final = False  # every window applied (the run ended)
        self._start_hash: str | None = None  # the weights we start from (base, or our checkpoint's)
        self.final_hash: str | None = None
        self.replay_seconds: float | None = None
        self._sent_up_to = -1  # the last window we published a batch for
        self.state = "starting"
        self._ctx: NodeContext | None = None
        self._arrived = asyncio.Event()
        self._initial: set[str] = set()
        self._max_code = encode_grad(config.clip, config.clip) & 0x7F
        self.ready: dict[str, str] = {}  # peer -> base model hash it announced
        # "ready"s from authors our connection list does not show as direct yet (it lags our links, and a peer stops
        # announcing once it starts): counted once they are, the newest READY_UNLISTED kept
        self._ready_unlisted: dict[str, str] = {}
        self._resync_from: list[str] = []
        self._replayed_from: str | None = None  # the peer whose base and log we replayed last
        # the peers whose base and log we had replayed when our weights left the majority's (the latest
        # MAX_PEER_ENTRIES): a resync asks them after the others
        self._led_off: dict[str, None] = {}
        self._screened: dict[int, tuple] = {}  # window -> (its batches, (peers refused as out of scale, cap))
        self.per_step = False  # the task draws batches by step (batch_at): audits possible
        self._audit_plan: dict[int, dict[int, list[str]]] = {}  # window -> step in it -> peers we re-probe there
        self._audits: dict[int, dict[str, list]] = {}  # window -> peer -> [(step in window, L+, L-)] re-probed
        self.convicted: collections.OrderedDict[str, int] = collections.OrderedDict()  # peer -> window it failed
        self._off_weights: collections.Counter = collections.Counter()  # peer -> windows in a row off ours (the
        # majority's)
        self._audit_rng = random.Random(0)  # seeded from our key at start: no one else can tell which steps

    # ------------------------------------------------------------------ service
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        # which steps we audit must be ours alone to know (a peer that knew would be honest on those only): drawn
        # from a signature of ours (deterministic, secret)
        self._audit_rng = random.Random(ctx.identity.sign(b"swarmd/spsa/audit/" + self.cfg.run.encode())[:16])
        self._init_standing(ctx)
        self.standing.judge_self = True  # our own batch is taken only where the others take it (see _close_window)
        self.gossip.subscribe(self.topic, max_size=128 + self.cfg.window, validator=self._validate, queue_size=0)
        await ctx.transport.serve(LOG_SPEC, self._serve_log)
        await ctx.transport.serve(BASE_SPEC, self._serve_base)

    async def close(self) -> None:
        self._stop_progress()

    def _total(self) -> float:
        return -(-self.cfg.steps // self.cfg.window) if self.cfg.steps else math.inf

    def _build(self) -> None:
        self._setup_device()
        model = tasks.build_model(self.task, self.cfg.base_seed)
        named = tasks.trainable(model)
        names = [n for n, _ in named]
        if self.task.has("perturbed"):
            chosen = self.task.call("perturbed", model)
            if not isinstance(chosen, (list, tuple)) or not chosen or any(n not in names for n in chosen):
                raise TaskError(f"{self.task.where('perturbed')} must return a non-empty list of trainable "
                                "parameter names")
            names = [n for n in names if n in set(chosen)]  # the model's order, whatever order it gave
        model = model.to(self.device).eval()
        by_name = dict(model.named_parameters())
        perturbed = [(n, by_name[n]) for n in names]
        # peers that draw their batches by step (batch_at) and peers that read a stream cannot audit each other:
        # they are not one run
        self.per_step = self.task.has("batch_at")
        self.fp = tasks.fingerprint(self.task, {**self.cfg.shared(), "batches": "batch_at" if self.per_step
                                                else "data"}, perturbed)
        self.names = names
        self._base_layout = base_layout(model, [p for _, p in perturbed])
        self.weights = Weights(model, [p for _, p in perturbed],
                               loss=lambda batch: tasks.loss_value(self.task, model, tasks.to_device(batch,
                                                                                                    self.device)))
        self.data = None if self.per_step else tasks.data_iter(self.task, tasks.shard_of(self._ctx.identity.peer_id),
                                                               self.cfg.base_seed)

    def _evaluate(self) -> float | None:
        return tasks.evaluate(self.task, self.weights.model)

    async def run(self) -> None:
        await self._guarded(self._run)

    async def _run(self) -> None:
        self.threads = tasks.set_threads(self.cfg.threads)
        self.state = "building base model"
        with self.work.track("base model build"):
            await asyncio.to_thread(self._build)
        self.base_hash = self.weights.hash()
        self._base = [c.clone() for c in self.weights.canonical]
        self.base_state_hash = await asyncio.to_thread(lambda: base_digest(base_arrays(self._base_layout, self._base)))
        self._resume_own()
        total = self._total()
        if self.window < total:
            await self._start_or_catch_up()
        me = self._ctx.identity.peer_id
        while self.window < total:
            w = self.window
            contribute = w >= self.join_at
            self._plan_audits(w, me)
            codes = []
            for i in range(self.cfg.window):
                g = await asyncio.to_thread(self._step, w, i, contribute, me)  # never on the event loop
                if contribute:
                    codes.append(self._code(g, w * self.cfg.window + i))
            self.my_hashes[w] = self.weights.hash()  # windows < w applied
            if contribute:
                self._publish(BATCH, {"w": w, "b": bytes(codes), "h": bytes.fromhex(self.my_hashes[w][:16])})
            elif w % self.cfg.hash_every == 0:
                self._publish(HASH, {"w": w, "h": self.my_hashes[w]})
            if w % self.cfg.eval_every == 0:
                loss = await asyncio.to_thread(self._evaluate)
                if loss is not None:
                    self.losses.append((w * self.cfg.window, round(loss, 5)))
                    await self._report_progress(loss)
            await self._close_window(w)
            if w % self.cfg.hash_every == 0:
                self._check_hashes(w)  # once the window's batches (their hashes) are in
            self.window = w + 1
            if self.cfg.checkpoint_every and self.window % self.cfg.checkpoint_every == 0 and self.window < total:
                await asyncio.to_thread(self._save_checkpoint, False)
            if self._resync_from:
                await self._resync()
        if not self.final:
            last = self.window - 1
            for i in range(self.cfg.window):
                await asyncio.to_thread(self.weights.apply, self.cfg.run, last * self.cfg.window + i,
                                        self._bytes_for(last, i), self.cfg.lr)
            self.final = True
            loss = await asyncio.to_thread(self._evaluate)
            if loss is not None:
                self.losses.append((self.window * self.cfg.window, round(loss, 5)))
            await asyncio.to_thread(self._save_checkpoint, True)
        self.final_hash = self.weights.hash()
        await self._last_progress()
        self.state = "done"
        logger.info("spsa run %s done after %d steps: weights %s", self.cfg.run, self.window * self.cfg.window,
                    self.final_hash)
        await asyncio.Event().wait()

    def _step(self, w: int, i: int, contribute: bool, me: str) -> float | None:
        """Step i of window w: apply window w-1's bytes for the step one window back, then probe (if we
        contribute)."""
        step = w * self.cfg.window + i
        if w > 0:
            self.weights.apply(self.cfg.run, step - self.cfg.window, self._bytes_for(w - 1, i), self.cfg.lr)
        for peer in self._audit_plan.get(w, {}).get(i, ()):  # the same weights its probe of this step had
            losses = self.weights.losses(self._batch(peer, step), step_seed(self.cfg.run, step, peer), self.cfg.eps)
            self._audits.setdefault(w, {}).setdefault(peer, []).append((i, *losses))
        if not contribute:
            return None
        return self.weights.probe(self._batch(me, step), step_seed(self.cfg.run, step, me), self.cfg.eps)

    def _batch(self, peer: str, step: int):
        if not self.per_step:
            return next(self.data)
        return self.task.call("batch_at", tasks.shard_of(peer), self.cfg.base_seed, step)

    # ------------------------------------------------------------------ audits
    def _plan_audits(self, w: int, me: str) -> None:
        """Which of window w's steps we re-probe, and whose: up to ``audit_peers`` of the peers we expect in it,
        ``audit_steps`` steps each, drawn by our own secret generator."""
        for old in [x for x in self._audit_plan if x < w]:
            del self._audit_plan[old]
        if not self.per_step or not self.cfg.audit_peers:
            return
        # the peers the window will take batches from (those whose word counts and the newcomers holding its
        # slots, as _close_window picks them), not every key that announced a join: a hundred fresh keys that join
        # and never deliver would take our re-probes
        wait = rounds.plan_wait(self.standing, self._expected(w), f"{self.cfg.run}/{w}", fresh=fresh_round(w),
                                now=0.0, deadline=self.cfg.deadline, grace=NEWCOMER_GRACE)
        peers = sorted((wait.expected | wait.slots) - {me})
        plan: dict[int, list[str]] = {}
        for peer in self._audit_rng.sample(peers, min(self.cfg.audit_peers, len(peers))):
            for i in self._audit_rng.sample(range(self.cfg.window), min(self.cfg.audit_steps, self.cfg.window)):
                plan.setdefault(i, []).append(peer)
        self._audit_plan[w] = plan

    def _other_weights(self, w: int) -> set[str]:
        """The authors of window w's batches probed at weights other than ours; counts, per author, the windows in
        a row it did so while ours were the weights of most of the window's batches."""
        mine = self.my_hashes[w][:16]
        hashes = {a: _batch_hash(m) for a, m in self.applied[w].items()}
        other = {a for a, h in hashes.items() if h != mine}
        majority = len(hashes) - len(other) > len(hashes) / 2
        for peer in [p for p in self._off_weights if p not in other]:
            del self._off_weights[peer]
        for peer in other:
            self._off_weights[peer] += int(majority)
        self.counters["batches_other_weights"] += len(other)
        return other

    def _judge_audits(self, w: int, batches: dict[str, Message]) -> set[str]:
        """The peers of window w whose bytes failed a re-probe of ours (they are convicted: refused from then on)."""
        failed = set()
        for peer, probes in self._audits.pop(w, {}).items():
            message = batches.get(peer)
            if message is None:
                continue  # its batch did not come: nothing to judge
            sent = _batch_bytes(message)
            self.counters["audited_steps"] += len(probes)
            wrong = [(i, plus, minus) for i, plus, minus in probes
                     if not audit_agrees(sent[i], plus, minus, self.cfg.eps, self.cfg.clip)]
            if not wrong:
                continue
            i, plus, minus = wrong[0]
            failed.add(peer)
            self._convict(peer, w, f"spsa window {w} step {w * self.cfg.window + i}: sent "
                          f"{decode_grad(sent[i]):+.4g}, re-probing the step gives "
                          f"{(plus - minus) / (2 * self.cfg.eps):+.4g} ({len(wrong)} of {len(probes)} audited steps "
                          "wrong)")
        for old in [x for x in self._audits if x < w]:
            del self._audits[old]
        return failed

    def _convict(self, peer: str, w: int, why: str) -> None:
        self.convicted[peer] = w
        while len(self.convicted) > MAX_PEER_ENTRIES:
            self.convicted.popitem(last=False)
        self.counters["rejected_audit"] += 1
        self._ctx.transport.penalties.penalize(peer, "invalid_message", f"{why}; its bytes are refused from now on")

    def _code(self, g: float, step: int) -> int:
        if math.isfinite(g):
            return encode_grad(g, self.cfg.clip)
        self._nonfinite("the loss", f"is not finite at step {step}; sending the smallest step instead of a gradient")
        return 0

    # ------------------------------------------------------------------ our own checkpoint (the data dir)
    def _save_checkpoint(self, final: bool) -> None:
        """The canonical weights (every window before the last closed one applied, or all of them when
        ``final``), the log of signed batches (for late joiners, and the last window's bytes to apply next)."""
        tensors = self._model_tensors(self.weights.model)
        for name, c in zip(self.names, self.weights.canonical):
            tensors["model." + name] = c.to(tensors["model." + name].dtype).clone()
        log = msgpack.packb(self.log, use_bin_type=True)
        tensors["state.log"] = torch.frombuffer(bytearray(log), dtype=torch.uint8) if log else torch.zeros(0,
                                                                                                     dtype=torch.uint8)
        if self.base_taken is not None:  # the base we replay onto is a peer's, not the one we build: kept too
            for name, b in zip(self.names, self._base):
                tensors[BASE_PREFIX + name] = b.clone()
        h = self.weights.hash()
        self._save(tensors, round=self.window, step=self.window * self.cfg.window, hash=h, final=final,
                   **({"base_taken": self.base_taken} if self.base_taken is not None else {}))
        self.counters["checkpoints_saved"] += 1

    def _resume_own(self) -> None:
        found = self._own_checkpoint()
        if found is None:
            return
        tensors, meta = found
        try:
            canonical = [tensors["model." + n].to(torch.float32) for n in self.names]
            if [c.shape for c in canonical] != list(self.weights.shapes):
                raise ValueError("its weights have other shapes")
            log = msgpack.unpackb(tensors["state.log"].numpy().tobytes(), raw=False) if tensors["state.log"].numel() \
                else []
            if not isinstance(log, list) or len(log) != meta["round"]:
                raise ValueError("its log does not end at its window")
            saved_hash = meta["hash"]
        except (KeyError, ValueError, TypeError, msgpack.UnpackException) as e:
            logger.warning("spsa: ignoring our checkpoint %s: %s", self._checkpoint_path(), e)
            return
        for c, v in zip(self.weights.canonical, canonical):
            c.copy_(v)
        self.weights._load(None, 0.0)
        if self.weights.hash() != saved_hash:
            logger.warning("spsa: ignoring our checkpoint %s: its weights do not match their hash",
                           self._checkpoint_path())
            self._reset_to_base()
            return
        self.log = log
        self._resume_base(tensors, meta)
        for w, wires in log[-KEEP_APPLIED:]:
            self.applied[w] = {m.author: m for m in (decode_message(x) for x in wires)}
        self.window = meta["round"]
        self.final = bool(meta.get("final"))
        self.resumed = {"source": "own checkpoint", "round": self.window, "step": meta["step"], "hash": saved_hash}
        self.saved = {"path": str(self._checkpoint_path()), "round": self.window, "step": meta["step"],
                      "hash": saved_hash}
        logger.info("spsa: resuming run %s from our checkpoint at window %d (weights %s)", self.cfg.run,
                    self.window, saved_hash)

    def _resume_base(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """The base our checkpoint kept, where we had taken a peer's (``_take_base``): its perturbed parameters,
        and the model's other tensors as saved (the base put its own there), so a restart replays onto the run's
        base and probes the run's model, not the ones this CPU builds."""
        taken = meta.get("base_taken")
        base = [tensors.get(BASE_PREFIX + n) for n in self.names]
        if not isinstance(taken, dict) or any(b is None or b.shape != c.shape for b, c in zip(base, self._base)):
            return
        others = [(t, tensors.get(checkpoint.MODEL_PREFIX + name)) for name, i, t in self._base_layout if i is None]
        if any(v is None or v.shape != t.shape or v.dtype != t.dtype for t, v in others):
            logger.warning("spsa: our checkpoint's base does not fit the model; replaying onto the one we build")
            return
        with torch.no_grad():
            for t, v in others:
                t.copy_(v)
        self._base = [b.to(torch.float32) for b in base]
        self.base_hash = tensors_hash(self._base)
        self.base_state_hash = base_digest(base_arrays(self._base_layout, self._base))
        self.base_taken = taken

    # ------------------------------------------------------------------ windows
    def _publish(self, kind, body: dict) -> None:
        payload = WIRE.pack(kind, self._tag(body))
        mid = self.gossip.publish(self.topic, payload)
        # what went on the wire for it: the signed message, framed (counted once, as its author sends it);
        # the one-off start-up messages (ready, join) are counted apart from the per-step traffic
        wire = len(msgpack.packb([3, self.gossip.cache[mid].wire()], use_bin_type=True)) + 4
        kind = "setup" if ("ready" in body or "join" in body) else "step"
        self.counters[f"{kind}_messages"] += 1
        self.counters[f"{kind}_wire_bytes"] += wire
        if "b" in body:
            self.windows[body["w"]].batches[self._ctx.identity.peer_id] = self.gossip.cache[mid]
            self._sent_up_to = max(self._sent_up_to, body["w"])
        if "join" in body:
            self.windows[body["w"]].joins.add(self._ctx.identity.peer_id)

    async def _report_progress(self, loss: float) -> None:
        """Our progress into the replicated state (the CRDT's per-peer progress register)."""
        steps = self.window * self.cfg.window
        await self._write_progress(steps, self._samples(steps), loss, self.counters["step_wire_bytes"], self.window)

    async def _close_window(self, w: int) -> None:
        """Wait for the peers whose word counts (``protocols.standing``) and a few newcomers (picked the same way
        everywhere; brand-new ones only in fresh windows), at most the deadline; apply their batches."""
        window = self.windows[w]
        opened = self.clock.monotonic()
        # a newcomer holding a slot gets NEWCOMER_GRACE once every counting peer is in, not the whole deadline (a
        # fresh key that joined and went quiet would stall every fresh window by the deadline). Our own batch is in
        # the window like anyone's: we wait for it too
        wait = rounds.plan_wait(self.standing, self._expected(w), f"{self.cfg.run}/{w}", fresh=fresh_round(w),
                                now=opened, deadline=self.cfg.deadline, grace=NEWCOMER_GRACE)
        expected, slots, waited = wait.expected, wait.slots, wait.waited
        await self._wait_round(wait, self._arrived, lambda: set(window.batches))
        self.counters["newcomers_not_waited"] += wait.newcomers_not_waited(set(window.batches))
        if not waited <= set(window.batches):
            self.counters["deadline_missed"] += 1
            logger.warning("spsa window %d closed without %s", w, sorted(waited - set(window.batches)))
        self.applied[w] = {a: m for a, m in window.batches.items()
                           if (a in expected or a in slots) and a not in self.convicted}
        # a batch probed at weights other than ours (its hash says so: its author, or we, diverged, and the hash
        # check sends whoever is off to resync) is applied like the others, but cannot be audited. An author that stays
        # off the majority's weights, window after window past any hash check, is not resyncing: it is claiming
        # other weights so as not to be audited, and is convicted
        other = self._other_weights(w)
        audited = self._judge_audits(w, {a: m for a, m in self.applied[w].items() if a not in other})
        for peer in sorted(a for a in other if self._off_weights[a] > OFF_WEIGHTS_LIMIT * self.cfg.hash_every):
            self._convict(peer, w, f"spsa window {w}: {self._off_weights[peer]} windows in a row probed at weights "
                          "other than the majority's, without resyncing")
            audited.add(peer)
        for peer in audited:  # out of the window, like a batch that never came (not in our log either)
            del self.applied[w][peer]
        extreme, _ = self._screen(w, {a: _batch_bytes(m) for a, m in self.applied[w].items()})
        for peer in extreme:  # still in the log (every replaying peer refuses them the same way)
            self.counters["rejected_extreme"] += 1
            self._ctx.transport.penalties.penalize(peer, "invalid_message",
                                                   f"spsa window {w}: gradients out of scale with the others'")
        self._record_round(w, waited_s=self.clock.monotonic() - opened, deadline_s=self.cfg.deadline,
                           participants=set(self.applied[w]) - extreme, missing=waited - set(window.batches),
                           rejected={**{a: "extreme" for a in extreme}, **{a: "audit" for a in audited}})
        self.standing.record(set(self.applied[w]) - extreme)
        for old in [x for x in self.hashes if x < w - 2 * self.cfg.hash_every]:
            del self.hashes[old]
        for old in [x for x in self.my_hashes if x < w - 2 * self.cfg.hash_every]:
            del self.my_hashes[old]
        self.counters["unexpected_batches"] += len(window.batches) - len(self.applied[w])
        me = self._ctx.identity.peer_id
        if me in window.batches and me not in self.applied[w]:
            # we sent a batch that no one takes (we were cut off, or rejoined after a resync, and the others stopped
            # expecting us; standing judges us as them): ask to be expected again, two windows on
            self.counters["joins_repeated"] += 1
            self._publish(JOIN, {"w": w + 2, "join": True})
        self.log.append([w, [m.wire() for _, m in sorted(self.applied[w].items())]])
        self.windows.pop(w, None)
        for old in [x for x in self.applied if x < w - KEEP_APPLIED]:  # a run without end would keep
            del self.applied[old]  # every window's decoded batches: memory growing with the run, beside the log

    def _expected(self, w: int) -> set[str]:
        joins = self.windows[w].joins - set(self.convicted)
        if w == 0:
            return set(self._initial) | joins
        return set(self.applied.get(w - 1, {})) | joins

    def _closed(self, w: int) -> bool:
        """Window w is closed here (``applied`` keeps the last few closed windows, contiguous)."""
        return w in self.applied or (bool(self.applied) and w < min(self.applied))

    def _bytes_for(self, w: int, i: int) -> dict[str, int]:
        """Step i of window w: every applied peer's byte, capped, less the peers whose bytes are out of scale."""
        batches = {author: _batch_bytes(m) for author, m in self.applied.get(w, {}).items()}
        out, cap = self._screen(w, batches)
        return {author: capped(b[i], cap) for author, b in batches.items() if author not in out}

    def _screen(self, w: int, batches: dict[str, bytes]) -> tuple[set[str], int]:
        """screen_window, computed once per window's set of batches (a resync may replace a window's batches)."""
        key = tuple(sorted(batches.items()))
        hit = self._screened.get(w)
        if hit is None or hit[0] != key:
            self._screened[w] = (key, screen_window(batches))
            for old in [x for x in self._screened if x < w - 2 or x > w + 2]:
                del self._screened[old]
        return self._screened[w][1]

    def _check_hashes(self, w: int) -> None:
        verdict = rounds.hash_verdict(self.my_hashes[w][:16], self.hashes.get(w, {}), self.standing.vouched,
                                      me=self._ctx.identity.peer_id, salt=f"{self.cfg.run}/{w}")
        if verdict is not None and not verdict.agrees:
            self.counters["diverged"] += 1
            logger.error("spsa: our weights differ from the majority at window %d; resyncing", w)
            # every counting peer that holds the majority's weights, the directly connected ones first (a log is
            # pulled over a stream: one we only know through others may be unreachable), and the peers whose base
            # and log we had replayed when our weights left the majority's after all the others: they led us here
            # (a base need not be the one its server's weights came from, and nothing in the bytes tells; no
            # penalty, an honest peer a moment off the run serves that too). Asked first again, as the smallest id
            # among the holders, one could send us round for the whole run; with only the last of them put last,
            # two could take turns
            if self._replayed_from is not None:
                rounds.keep_latest(self._led_off, self._replayed_from, None, MAX_PEER_ENTRIES)
            self._resync_from = sorted(verdict.holders, key=lambda a: (a in self._led_off, not self._ctx.direct(a)))

    async def _start_or_catch_up(self) -> None:
        """Start at window 0 with the peers that are ready (same base model), or, if the run has begun without
        us, replay the log and join two windows ahead."""
        me = self._ctx.identity.peer_id
        self.state = "waiting for peers"
        self._start_hash = start = self.weights.hash()
        barrier = rounds.StartBarrier(self.cfg.min_peers)
        since = None  # when we first saw a ready peer with another base
        while True:
            if barrier.announce(self.clock.monotonic()):
                self._publish(READY, {"w": self.window, "ready": start})
            ahead = self._run_started_without_us()
            if ahead:
                # replayed on top of our own checkpoint where the served log begins with our log, else from the
                # base; a restart of this loop (it crashed) while the others still count us: back at once, from the
                # first window we have not sent a batch for
                if await self._replay_from(ahead, rejoin=self._sent_up_to >= 0):
                    return
                for window in self.windows.values():  # none served: do not follow them again at once
                    for a in ahead:
                        window.batches.pop(a, None)
                self.state = "waiting for peers"
            target = self._start_choice(start)
            if target is not None and await self._take_start_base(target):
                self._start_hash = start = self.weights.hash()
                self._publish(READY, {"w": self.window, "ready": start})  # at once: our new base
                continue
            rounds.count_listed(self.ready, self._ready_unlisted, self._ctx.direct, MAX_PEER_ENTRIES)
            ready = {p for p, h in self.ready.items() if h == start and self._ctx.direct(p)} | {me}
            self._check_refusal(len(ready) - 1)
            if barrier.start(self.clock.monotonic(), len(ready)):
                self._initial = ready
                self.standing.found(ready)
                self.ready.clear()
                self._ready_unlisted.clear()
                self.state = "running"
                return
            if self.ready and any(h != start for h in self.ready.values()):
                self.counters["base_mismatch_peers"] = others = sum(h != start for h in self.ready.values())
                since = since if since is not None else self.clock.monotonic()
                if self.clock.monotonic() - since > MISMATCH_SAID_AFTER:  # (a base within rounding is taken at once)
                    self._base_log.log(logging.WARNING, "mismatch", "spsa: waiting for peers: %d ready peer(s) hold "
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
        if self.window or self.log:
            return None
        return self._start_bases.choice(start, {a: h for a, h in self.ready.items() if self._ctx.direct(a)})

    async def _take_start_base(self, target: str) -> bool:
        """Take a holder's base of hash ``target`` if each of its tensors is within rounding of ours (outer.ROUNDING
        of its largest magnitude; integer ones equal): so a peer can move our start by rounding at most, never to
        weights of its choosing. Beyond that (a base pretrained on each peer: its steps carry the rounding far) it is
        refused, without a penalty: we wait, or join the run once it has begun, onto its log server's base. A holder
        is asked once."""
        direct = {a: h for a, h in self.ready.items() if self._ctx.direct(a)}
        for peer in self._start_bases.holders(target, direct):
            if not self._start_bases.ask(peer, target):  # asked once, whatever comes of it; a bounded number
                break
            try:
                fetched = await self._fetch_base(peer)
                if fetched is None:
                    raise ValueError("it served no base")
                tensors, digest = fetched
                perturbed = {i: t for (_, i, _), t in zip(self._base_layout, tensors) if i is not None}
                if tensors_hash([perturbed[i] for i in sorted(perturbed)]) != target:
                    raise ValueError("not the base it said it was ready with")  # it may have taken another since
                apart = await asyncio.to_thread(self._base_apart, tensors)
            except (TransportError, ProtocolViolation, asyncio.TimeoutError, ValueError) as e:
                if not isinstance(e, ProtocolViolation):  # (counted and penalised where it was found)
                    self.counters["base_unusable"] += 1
                self._base_log.log(logging.WARNING, ("start", peer), "spsa: the base model of %s unusable: %s",
                                   peer, e)
                continue
            if apart > outer.ROUNDING:
                self.counters["base_refused"] += 1
                self._base_log.log(logging.WARNING, ("far", peer), "spsa: not starting from the base model of %s: "
                                   "%.3g of a parameter's scale from ours (another CPU's rounding is below %g; a "
                                   "model() that trains carries it further): we start with the peers that hold ours, "
                                   "or join the run once it has begun", peer, apart, outer.ROUNDING)
                continue
            self._replacing_base = True
            try:
                await asyncio.to_thread(self._take_base, tensors, digest, peer, "start", apart)
                self._reset_to_base()
            finally:
                self._replacing_base = False
            self._start_bases.taken(peer)
            return True
        return False

    def _reset_to_base(self) -> None:
        """Back to the base weights with an empty log (before replaying a peer's log)."""
        for c, b in zip(self.weights.canonical, self._base):
            c.copy_(b)
        self.weights._load(None, 0.0)
        self.applied.clear()
        self.log.clear()
        self._audits.clear()
        self._audit_plan.clear()
        self.window = 0
        self.final = False

    async def _resync(self) -> None:
        """Back to the base weights, then replay a majority peer's log (bit-exact), then rejoin."""
        peers, self._resync_from = self._resync_from, []
        # then the other counting peers we reach directly: the majority's holders may be out of our reach, and a
        # log that is not the majority's is found out at the next hash check
        me = self._ctx.identity.peer_id
        peers += sorted(p for p in self.standing.counting(set(self.applied.get(self.window - 1, {})) - {me})
                        if self._ctx.direct(p) and p not in peers)
        closed = self.window  # windows 0 .. closed - 1: a log that stops short of them would lose the last ones
        self._reset_to_base()
        self.counters["resyncs"] += 1
        if not await self._replay_from(peers, rejoin=True, at_least=closed):
            raise RuntimeError("spsa: no majority peer served a usable log to resync from")  # restart: from base

    async def _replay_from(self, peers: list[str], rejoin: bool = False, at_least: int = 0) -> bool:
        """Replay the first usable log the peers serve; False if none did. A late joiner contributes from two
        windows on (announced with a join, so everyone expects it from then); a peer that resyncs (``rejoin``:
        the others still wait for its batches) contributes again at once, from the first window it has not sent a
        batch for (a second, different batch for a window would be equivocation). ``at_least``: a log with fewer
        windows is waited on (a peer a moment behind), at most ``deadline`` seconds."""
        self.state = "replaying"
        started = time.perf_counter()
        until = self.clock.monotonic() + self.cfg.deadline
        replayed = None  # the contributors of each window of the log we replayed
        trusted, peers = set(peers), list(peers)  # (a peer whose log we could not use is still one we trust)
        leads = None  # the log we replayed led to the weights the others said they held; None: nothing told
        while replayed is None:
            behind = 0
            for peer_id in list(peers):
                try:
                    base_taken = await self._base_from(peer_id)  # the log replays onto its base: ours, or its own
                    async with await self._ctx.transport.open_stream(peer_id, LOG_SPEC, timeout=10) as stream:
                        await stream.send(LOG_REQUEST.code, None)
                        entries = await read_log_parts(stream)
                    if len(entries) < at_least:  # it has not closed every window we had: ours would be lost
                        behind += 1
                        continue
                    replayed = await self._replay(entries, from_base=base_taken)
                    leads = await asyncio.to_thread(self._log_leads_where_they_said, trusted - {peer_id})
                    if leads is False:
                        self.counters["log_inconsistent"] += 1
                        replayed = None
                        raise ValueError("its windows do not lead to the weights the others said they held there")
                    self._replayed_from = peer_id
                    break
                except (TransportError, ProtocolViolation, asyncio.TimeoutError, ValueError) as e:
                    logger.warning("could not replay the spsa log from %s: %s", peer_id, e)
                    peers.remove(peer_id)  # not asked again while we wait for a peer that is behind
                    self._reset_to_base()
            if replayed is None and not (behind and self.clock.monotonic() < until):
                self.counters["replay_failed"] += 1
                return False
            if replayed is None:
                await asyncio.sleep(0.2)  # a peer a few moments behind us closes the window soon
        self.replay_seconds = time.perf_counter() - started
        self.counters["replayed_windows"] = len(replayed)
        if rejoin:
            self.join_at = max(self.window, self._sent_up_to + 1)
            # who counts, as the log's windows say: the others' view, our own place included (a peer that was cut
            # off and missed their windows is a newcomer to them, and must see itself as one, or it would take its
            # own batches where they do not)
            self.standing.rebuild(self._initial, replayed)
        else:
            # contribute two windows after the live one, and say so now, so everyone expects us from then on
            self.join_at = next_fresh_round(max(self.window, max(self.windows, default=self.window)) + 2)
            self._publish(JOIN, {"w": self.join_at, "join": True})
            # the peers we replayed on, and the authors of the log's window before its last where the log leads to
            # the weights they said they held after it (_log_leads_where_they_said: which batches a window holds
            # is its server's word alone; a server that added six fresh keys' batches would have them credited
            # as founders, for good, and their votes would outweigh the run's); the last window's authors earn credit as
            # newcomers do, unless they are among those. Where nothing told (its server is the one peer we trust,
            # a bootstrap peer the user chose, or the others said nothing of that window: we started after it),
            # the authors of its last two windows: without them we would not wait for the peers the
            # others wait for, and close windows without them
            windows = sorted(self.applied)
            before_last = set(self.applied[windows[-2]]) if len(windows) >= 2 else set()
            listed = set(self.applied[windows[-1]]) | before_last if windows else set()
            confirmed = before_last if leads else listed
            self.counters["log_authors_unconfirmed"] += len(listed - confirmed - trusted - {self._ctx.identity.peer_id})
            self.standing.found(trusted | confirmed)
        self.state = "running"
        logger.info("spsa: replayed %d windows in %.2f s, following from window %d, contributing from %d",
                    len(replayed), self.replay_seconds, self.window, self.join_at)
        return True

    def _log_leads_where_they_said(self, peers: set[str]) -> bool | None:
        """Whether the log we just replayed leads to the weights most of ``peers`` said they held at its last
        window (each of their batches there carries their weights' hash, signed; else their votes for it as they
        reached us): its windows' batches are each signed by their author, but which ones a window holds is its
        server's word alone, and a batch added or left out moves the weights. None where none of them said
        anything of that window (nothing to tell by)."""
        last = max(self.applied, default=None)
        said = {a: _batch_hash(m)[:16] for a, m in self.applied.get(last, {}).items() if a in peers}
        if not said:  # none of theirs in the log's last window (left out?): what they said there, as it reached us
            live = self.hashes.get(last, {})
            said = {p: live[p] for p in peers if p in live}
        if not said:
            return None
        # (a tie as the hash check breaks one: rounds.majority, the voter drawn first for the run and window)
        return rounds.majority(said, f"{self.cfg.run}/{last}") == self.weights.hash()[:16]

    async def _replay(self, entries: list, from_base: bool = False) -> list[set[str]]:
        """Verify a log's closed windows (all of them, before anything changes), take them as applied, and apply
        their steps to the weights in a worker thread (the node keeps serving; ``/status`` shows how far it is);
        the last window is left to the live loop (one-window lag). Where the log begins with ours (we resumed from
        our own checkpoint: its weights have every window of our log but the last applied), only the windows after
        ours are applied, so a restart costs the windows it missed, not the whole run; otherwise we start from the
        base weights (always, ``from_base``: we just took another peer's base). Returns each window's contributors,
        as standing records them (its batches less the ones refused as out of scale)."""
        verified = read_log(entries, topic=self.topic, window=self.cfg.window,
                            accepts=lambda author, body: self._foreign(author, body) is None)
        kept = 0 if from_base else self._kept_prefix(entries)
        if not kept:
            self._reset_to_base()
        for w, batches in verified:
            self.applied[w] = batches
            if w >= kept:
                self.log.append([w, [m.wire() for _, m in sorted(batches.items())]])
        contributors = log_contributors(verified, self._screen)
        self.window = len(entries)
        start, todo = max(0, kept - 1), max(0, len(entries) - 1)
        self.counters["replay_windows_kept"] = start
        with self.work.track("log replay", total=todo - start, unit="windows") as work:
            def apply() -> None:
                for w in range(start, todo):
                    for i in range(self.cfg.window):
                        self.weights.apply(self.cfg.run, w * self.cfg.window + i, self._bytes_for(w, i), self.cfg.lr)
                    work.update(w + 1 - start)
            await asyncio.to_thread(apply)
        return contributors

    async def _base_from(self, peer: str) -> bool:
        """Ask ``peer``, whose log we are about to replay, for its base model, and take it where it is not ours (the
        same trust as in its log: the peers we replay from are the ones whose word counts, or two direct ones).
        True if we took it. A peer that serves no base (an older version, or one still building its own) leaves
        ours as it is; one whose base is not ours but does not send it raises (its log
        would replay onto the wrong weights: the caller tries another peer), and one that sends a base other than
        it announced is penalised (raises)."""
        fetched = await self._fetch_base(peer)
        if fetched is None:
            return False
        self._replacing_base = True
        try:
            await asyncio.to_thread(self._take_base, *fetched, peer, "join")  # passes over the whole model
        finally:
            self._replacing_base = False
        return True

    async def _fetch_base(self, peer: str) -> tuple[list[torch.Tensor], str] | None:
        """``peer``'s base model (its tensors in base_layout's order, and its hash), checked against the hash it
        announced, or None where it holds ours or serves none (see _base_from)."""
        size = base_size(self._base_layout)
        head = None
        try:
            async with await self._ctx.transport.open_stream(peer, BASE_SPEC, timeout=10) as stream:
                await stream.send(BASE_REQUEST.code, {"have": self.base_state_hash})
                head = await asyncio.wait_for(stream.read_required(), 30)
                if head.kind != BASE_HEAD.code:
                    raise MalformedMessage("spsa-base: the base's head expected")
                if head.body["hash"] == self.base_state_hash:
                    return None
                if head.body["size"] != size:  # before anything is allocated: a base is our own model's size
                    raise ProtocolViolation(f"spsa-base: {head.body['size']} B, our base model is {size} B")
                if not self._ctx.direct(peer):  # a whole model's bytes never cross a relay (nor would it send them)
                    raise TransportError("it is reached through a relay only")
                receiver = BaseReceiver(self._base_layout)
                with self.work.track(f"base model pull from {peer[-8:]}", total=size, unit="B") as work:
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
                self.counters["base_pull_failed"] += 1
                raise TransportError(f"its base model is not ours, and did not come: {e or type(e).__name__}") \
                    from None
            self.counters["base_ask_failed"] += 1
            self._base_log.log(logging.WARNING, ("ask", peer), "spsa: could not ask %s for its base model (%s): "
                               "keeping ours", peer, e or type(e).__name__)
            return None
        except ProtocolViolation as e:
            self.counters["base_unusable"] += 1
            self._ctx.transport.penalties.penalize(peer, "invalid_message", str(e))
            self._base_log.log(logging.WARNING, ("bad", peer), "spsa: the base model of %s is unusable: %s", peer, e)
            raise
        return receiver.tensors, digest

    def _base_apart(self, tensors: list[torch.Tensor]) -> float:
        """How far a fetched base is from ours: the largest difference of a floating tensor relative to its largest
        magnitude in ours (outer.relative_difference), inf where another tensor (integer buffers, masks) differs."""
        apart = 0.0
        for (_, i, t), theirs in zip(self._base_layout, tensors):
            ours = self._base[i] if i is not None else t.detach().to("cpu")
            if not ours.is_floating_point():
                if not torch.equal(ours, theirs):
                    return math.inf
                continue
            apart = max(apart, outer.relative_difference(ours.reshape(-1).to(torch.float32),
                                                         theirs.reshape(-1).to(torch.float32), [ours.numel()]))
        return apart

    def _take_base(self, tensors: list[torch.Tensor], digest: str, peer: str, when: str,
                   apart: float | None = None) -> None:
        """A peer's base model in place of ours: its perturbed parameters as our base, the rest into the model.
        ``when``: "start" (the founders' base, within rounding of ours) or "join" (the base of the log we replay)."""
        base: list[torch.Tensor | None] = [None] * len(self._base)
        for (_, i, _), value in zip(self._base_layout, tensors):
            if i is not None:
                base[i] = value
        if any(b is None for b in base):  # every parameter is in the state dict: not expected
            raise ProtocolViolation("spsa-base: a perturbed parameter missing")
        if apart is None:
            apart = self._base_apart(tensors)
        with torch.no_grad():
            for (_, i, t), value in zip(self._base_layout, tensors):
                if i is None:
                    t.copy_(value)  # the model's own tensor (frozen parameter or buffer): its device and dtype
        self._base = base
        self.base_state_hash = digest
        self.base_hash = tensors_hash(base)
        self.base_taken = {"source": peer, "hash": self.base_hash, "apart": apart, "when": when}
        self.counters["bases_taken"] += 1
        logger.info("spsa: %s the base model of %s (%s; %.3g of a parameter's scale from ours: built on another CPU%s)",
                    "starting from" if when == "start" else "replaying onto", peer, self.base_hash, apart,
                    "" if when == "start" else ", or trained another way")

    async def _serve_base(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10)
        if message.kind != BASE_REQUEST.code:
            raise MalformedMessage("spsa-base: expected a request")
        digest, layout, base = self.base_state_hash, self._base_layout, self._base  # taking a base replaces them
        if digest is None or self._replacing_base:
            return  # not built yet, or being replaced: the stream ends, and the asker replays onto its own
        size = base_size(layout)
        await stream.send(BASE_HEAD.code, {"hash": digest, "size": size})
        if message.body["have"] == digest:
            return
        # the whole model's bytes: over a direct connection only (never through a relay), to one peer once in
        # BASE_SERVE_EVERY, to BASE_SERVES peers at once
        peer, now = stream.peer_id, self.clock.monotonic()
        if not self._ctx.direct(peer) or now - self._base_served.get(peer, -math.inf) < BASE_SERVE_EVERY \
                or self._base_serving.locked():
            self.counters["base_serve_refused"] += 1
            self._base_log.log(logging.INFO, "refused", "spsa: not serving our base model to %s now (through a "
                               "relay, served it lately, or %d others are being served)", peer, BASE_SERVES)
            return
        rounds.keep_latest(self._base_served, peer, now, MAX_PEER_ENTRIES)
        async with self._base_serving:
            # an asker that reads slowly holds a slot: at most as long as 256 kB/s takes
            async with asyncio.timeout(30 + size / BASE_SERVE_RATE):
                for part in base_parts(base_arrays(layout, base)):
                    await stream.send(BASE_PART.code, {"data": part})
        self.counters["base_served"] += 1

    def _kept_prefix(self, entries: list) -> int:
        """How many windows of our own log the served log begins with, byte for byte (0: none, or it differs)."""
        ours = len(self.log)
        if not ours or ours > len(entries):
            return 0
        packed = msgpack.packb(self.log, use_bin_type=True)
        return ours if msgpack.packb(entries[:ours], use_bin_type=True) == packed else 0

    async def _serve_log(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10)
        if message.kind != LOG_REQUEST.code:
            raise MalformedMessage("spsa-log: expected a request")
        log = list(self.log)  # as it is now: a log only grows, but a resync may start it again meanwhile
        for first, windows, more in log_parts(log):
            await stream.send(LOG_PART.code, {"w": first, "windows": windows, "more": more})

    # ------------------------------------------------------------------ validation (runs before forwarding)
    def _validate(self, message: Message) -> Verdict:
        try:
            kind, body = WIRE.unpack(CARRIER, message.data)  # the kind's schema checked: types and bounds
        except MalformedMessage:
            return Verdict.REJECT
        except UnknownKind:
            self.counters["unknown_kind"] += 1  # a newer peer's message: not ours to judge or forward
            return Verdict.IGNORE
        foreign = self._foreign(message.author, body)
        if foreign is not None:
            return Verdict.IGNORE if foreign else Verdict.REJECT  # another run's task: not ours to judge or forward
        author = message.author
        if not self.standing.admitted(author):
            self.counters["not_admitted"] += 1
            return Verdict.IGNORE  # a closed run: not one of its peers
        w = body["w"]
        if self.state == "running" and w > self.window + 4 + FRESH_EVERY and not self.standing.counts(author):
            # far ahead of the swarm we run with: flooding steps. Not from a peer whose word counts: that we are
            # behind it is the likelier story (a restart's log replay, a slow machine), and rejecting would
            # penalise honest peers and leave us without the windows we need to catch up (the backlog is bounded)
            self.counters["rejected_future"] += 1
            return Verdict.REJECT
        if len(self.windows) > 256 and w not in self.windows:
            self.counters["ignored_backlog"] += 1
            return Verdict.IGNORE  # while we are not running yet, hold a bounded backlog only
        # a message that says again what its author said already (new gossip id, same content) is taken but not
        # forwarded: honest peers say each thing once (a ready is repeated only to direct peers, which keep it),
        # and 100 fresh keys repeating their junk every second would have every honest node verify and relay it again
        if kind is HASH:
            if self.hashes.get(w, {}).get(author) == body["h"][:16]:
                return self._repeated()
            self._vote(w, author, body["h"][:16])
            return Verdict.ACCEPT
        if kind is READY:
            if self.ready.get(author) == body["ready"]:
                return self._repeated()
            # only directly connected peers can found a run with us, so only theirs are kept (first come, capped);
            # one not listed as direct yet waits for our next look at the list (the start barrier's count)
            if self.state != "running":
                rounds.hear_ready(self.ready, self._ready_unlisted, author, body["ready"], self._ctx.direct(author),
                                  MAX_PEER_ENTRIES, READY_UNLISTED)
            return Verdict.ACCEPT
        if kind is JOIN:
            joins = self.windows[w].joins
            if author in joins:
                return self._repeated()
            if len(joins) < MAX_PEER_ENTRIES or self.standing.counts(author):
                joins.add(author)  # a newcomer among them gets a slot only if picked (see _close_window)
            return Verdict.ACCEPT
        if len(body["b"]) != self.cfg.window:  # a BATCH
            self.counters["rejected_malformed"] += 1
            return Verdict.REJECT
        if max(b & 0x7F for b in body["b"]) > self._max_code:
            self.counters["rejected_out_of_range"] += 1
            return Verdict.REJECT  # a projected gradient beyond the run's clip
        if self._closed(w):
            # a byte for a window already closed: not forwarded, lightly scored (an honest peer can be slow once)
            self.counters["late"] += 1
            self._record_late(w, author)
            self._ctx.transport.penalties.penalize(message.received_from or message.author, "stale",
                                                   "spsa batch for a closed window")
            return Verdict.IGNORE
        batches = self.windows[w].batches
        existing = batches.get(author)
        if existing is not None and existing.data != message.data:
            self.counters["equivocation"] += 1
            return Verdict.REJECT
        if existing is not None:
            return self._repeated()
        if len(batches) >= MAX_PEER_ENTRIES and not self.standing.counts(author):
            self.counters["ignored_batches"] += 1
            return Verdict.IGNORE
        batches[author] = message
        self._vote(w, author, body["h"].hex())
        self._arrived.set()
        return Verdict.ACCEPT

    def _repeated(self) -> Verdict:
        self.counters["repeated"] += 1
        return Verdict.IGNORE

    def _vote(self, w: int, author: str, h: str) -> None:
        """A peer's weights hash for window w (the first 16 hex digits): its vote in the hash check."""
        hashes = self.hashes[w]
        if author in hashes or len(hashes) < MAX_PEER_ENTRIES or self.standing.counts(author):
            hashes[author] = h

    def _run_started_without_us(self) -> list[str]:
        """The peers to replay the run's log from, if it began without us: batches past our window from peers
        whose word counts, or else from two directly connected peers (a key that is not connected to us, or one
        connected outsider alone, cannot send us down the late path). Empty: it has not."""
        counting, direct = set(), set()
        for w in list(self.windows):
            if w > self.window:
                authors = set(self.windows[w].batches) - {self._ctx.identity.peer_id}
                counting |= self.standing.counting(authors)
                direct |= {a for a in authors if self._ctx.direct(a)}
        if counting:
            return sorted(counting, key=lambda a: (not self._ctx.direct(a), a))  # reachable ones first
        return sorted(direct) if len(direct) >= 2 and not self.standing.closed else []

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        steps = max(1, self.window * self.cfg.window)
        return {
            "run": self.cfg.run,
            "state": self.state,
            "round": self.window,
            "total_rounds": self._total() if self.cfg.steps else 0,
            **self._task_status(),
            "window": self.window,
            "step": self.window * self.cfg.window,
            "participants": len(self.applied.get(self.window - 1, {})),
            "weights_hash": self.final_hash or (self.weights.hash() if self.weights is not None else None),
            "final_hash": self.final_hash,
            "base_hash": self.base_hash,
            "base_taken": self.base_taken,
            "base_bytes": base_size(self._base_layout),  # what a peer that takes our base pulls
            "losses": list(self.losses)[-40:],
            "log_windows": len(self.log),
            "replay_seconds": self.replay_seconds,
            "wire_bytes_per_step": round(self.counters["step_wire_bytes"] / steps, 3),
            "audits": self._audit_state(),
            "convicted": dict(list(self.convicted.items())[-64:]),  # peer -> the window its bytes failed an audit
            **dict(sorted(self.counters.items())),
        }

    def _audit_state(self) -> str | None:
        if self.weights is None:
            return None  # not built yet
        if not self.per_step:
            return "off: the task has no batch_at(), so no peer can re-probe another's step"
        return "on" if self.cfg.audit_peers else "off: audit_peers = 0"

    def bytes_sent(self) -> int:
        return int(self.counters["step_wire_bytes"])

    def routes(self) -> list:
        return []


def _batch_bytes(message: Message) -> bytes:
    return WIRE.unpack(CARRIER, message.data)[1]["b"]


def _batch_hash(message: Message) -> str:
    return WIRE.unpack(CARRIER, message.data)[1]["h"].hex()
