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
import math
import statistics
from dataclasses import dataclass, field

import msgpack
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from swarmd.node.services import NodeContext
from swarmd.node import allocator
from swarmd.protocols import buffers, codecs, exchange, outer, rounds
from swarmd.protocols import task as tasks
from swarmd.protocols.bulk import BulkError, BulkService, content_hash
from swarmd.protocols.gossip import Gossip, Message, Verdict
from swarmd.protocols.inner import SwarmAdamW, lr_scale, scale_lr
from swarmd.protocols.standing import EARN, FRESH_EVERY, check_peer_ids, fresh_round, next_fresh_round
from swarmd.protocols.steps import StepsEnded, UserSteps
from swarmd.protocols.task import Task, TaskError
from swarmd.protocols.taskloop import TAG, TaskLoop
from swarmd.transport import clock
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.framing import ProtocolSpec, unpack
from swarmd.transport.wire import WIRE, Bool, Bytes, Dict, Float, Int, List, Map, Nil, Str, Tuple, UnknownKind

logger = logging.getLogger(__name__)

CKPT_SPEC = ProtocolSpec("diloco-ckpt", "1.0.0", max_frame=4096, kinds=frozenset({1, 2}))
MAX_FETCH = 64  # announcements asked of a round's coordinator at once
FETCH_AFTER = 1.0  # s: how long a member view's unknown names are left to gossip before we ask its coordinator
FETCH_WAIT = 3.0  # s: how long such a request may take (past the span if it must: the round waits on it)
INITIAL_TOLERANCE = outer.ROUNDING  # how far a peer's initial weights may be from ours for us to start from them
MAX_PEER_ENTRIES = 256  # per round: ready messages and round hashes kept from peers whose word does not count yet
READY_UNLISTED = 64  # "ready"s kept from authors not listed as direct yet, until they are (the newest)
MAX_NEWCOMER_PULLS = 8  # per round: updates pulled from peers that are not waited for
REDUCING = 2  # scatter: parts decoded and reduced at once (the reductions run in worker threads)
MAX_LATE_PULLS = 4  # per round: counted peers' updates pulled after we closed it (for a redo)
HISTORY = 1024  # closed rounds and evaluated losses kept for /status and the dashboard (a run may never end)
MAX_REDUCED_ENTRIES = 4 * exchange.MAX_PARTS  # per round: reduced-part and audit messages kept
MAX_PART_BYTES = 1 << 30  # one encoded part
FEEDBACK_CODECS = ("sign", "topk")  # error_feedback = "auto" turns it on for these
REDUCED_AUTO = {"sign": "e3m0"}  # reduced_codec = "auto": the run's codec but for these
PART_SLACK = 256  # bytes an encoded part may exceed the codec's size for it by (its header)
MAX_PARTS = exchange.MAX_PARTS
MAX_REMEMBERED_UPDATES = 4096  # (peer, fragment) -> the parts of its last update, to refuse a replayed one
MAX_MESSAGE = 1024 + MAX_PARTS * 40  # an update announcement names up to MAX_PARTS parts (hash and size)
# the fingerprint's entries that say how peers compute together, not which run and weights: a checkpoint saved
# under other rules is the same run's weights (resumed; checked by our weights hash), its nodes never in our rounds
RULES = frozenset({"reduce_rule", "outer_step", "e3m0_encoder", "weights_hash"})
CLIP = 2.0  # the clipped mean's limit, x the median norm (outer.combine's default)
MAX_PARTS_LISTS = 64  # per round: part lists kept from counted peers that were not members of the last round
# a scatter step's transfers are given time at the median of our last RATE_ROUNDS steps' measured receive rates,
# where that is below min_bandwidth; a step that moved less than RATE_MIN_BYTES measures latency, not the link
RATE_ROUNDS = 5
RATE_MIN_BYTES = 1 << 16
SERVING_POLL = 0.25  # seconds between looks at whether we still serve a round's bytes, while a wait is past its end
MAX_VIEW = 1024  # peers a member view names (a round of more members is not agreed on: each peer keeps its own)
MAX_AHEAD = 16  # our rounds' hashes kept to compare with the others' when we are that many rounds ahead of them


def _probe_hash(peer: str, size: int) -> bytes:
    return content_hash(exchange.probe_payload(peer, size))


# ---------------------------------------------------------------------------------------------------- the wire
CARRIER = "diloco/<run>"  # the run's pubsub topic
_R, _P = Int(0, 2**31), Int(0, 2**16)
_HASH = Str(64)
_ADDRS = List(Str(64), 8)
_TAG = {"t": ["layout-hash", "config-hash"]}
CKPT_REQUEST = WIRE.frame(CKPT_SPEC, 1, "diloco.checkpoint-request", Nil(), None, doc="your checkpoint, please")
CKPT_REPLY = WIRE.frame(CKPT_SPEC, 2, "diloco.checkpoint-reply", Map.of(blob=Bytes(exact=32), size=Int(1, 4 << 30)),
                        {"blob": bytes(32), "size": 4096}, doc="the hash of the checkpoint blob, now announced")
# a member view names an update announcement that gossip has not brought us (16 peers on two cores: late past the
# span): we ask the view's coordinator, which holds it (it named it), for the signed message itself
ANN_SPEC = ProtocolSpec("diloco-ann", "1.0.0", max_frame=MAX_MESSAGE + 2048, kinds=frozenset({1, 2, 3}))
ANN_REQUEST = WIRE.frame(ANN_SPEC, 1, "diloco.announcement-request",
                         Map.of(r=_R, p=_P, ids=List(Bytes(exact=8), MAX_FETCH)), {"r": 3, "p": 0, "ids": [bytes(8)]},
                         doc="the update announcements of (r, p) you hold from these peers (short ids), please")
ANN_REPLY = WIRE.frame(ANN_SPEC, 2, "diloco.announcement",
                       Map.of(b=Bytes(MAX_MESSAGE + 1024), s=Bytes(exact=64)),
                       {"b": msgpack.packb([1, "diloco/run", "12D3KooW...", 1, 1_800_000_000_000, b"update"]),
                        "s": bytes(64)}, signed="swarmd/pubsub/v1",
                       doc="one announcement as its author signed it (a pubsub message; one frame each): checked "
                       "like one that came through the mesh")
ANN_END = WIRE.frame(ANN_SPEC, 3, "diloco.announcements-end", Nil(), None, doc="no more announcements")
CHECKPOINT = WIRE.blob("(bulk blob)", "diloco.checkpoint", Map.of(
    **{"global": List(Bytes(4 << 30), 1024), "momentum": List(Bytes(4 << 30), 1024),
       "rounds_done": List(Int(0, 2**31), 1024), "step": Int(0), "participants": Dict(Str(8), List(Str(128), 10_000),
                                                                                       1024),
       "global_hash": Str(64)}), {"global": [b"\x00"], "momentum": [b"\x00"], "rounds_done": [3], "step": 150,
                                  "participants": {"0": ["12D3KooW..."]}, "global_hash": "ab" * 16},
    max_size=4 << 30, doc="global weights and outer momentum (codec 'none' tensors), round counters, participants")
READY = WIRE.message(CARRIER, 1, "diloco.ready", Map.of(r=_R, p=_P, ready=_HASH, t=TAG), {
    "r": 0, "p": 0, "ready": "ab" * 16, **_TAG}, max_size=MAX_MESSAGE, doc="I hold these weights and can start")
JOIN = WIRE.message(CARRIER, 2, "diloco.join", Map.of(r=_R, p=_P, join=Bool(only=True), t=TAG), {
    "r": 4, "p": 0, "join": True, **_TAG}, max_size=MAX_MESSAGE, doc="I contribute from round r (a late joiner)")
ROUND_HASH = WIRE.message(CARRIER, 3, "diloco.round-hash", Map.of(r=_R, p=_P, h=_HASH, t=TAG), {
    "r": 3, "p": 0, "h": "ab" * 16, **_TAG}, max_size=MAX_MESSAGE, doc="my global hash after closing round r")
UPDATE = WIRE.message(CARRIER, 4, "diloco.update", Map.of(
    r=_R, p=_P, parts=List(Bytes(exact=32), MAX_PARTS, min=1), sizes=List(Int(1, MAX_PART_BYTES), MAX_PARTS, min=1),
    base=_HASH, norm=Float(), addrs=_ADDRS, bw=List(Tuple.of(Bytes(exact=8), Int(0, 2**31)),
                                                    exchange.MAX_RATE_REPORTS), t=TAG, optional=("bw",)), {
    "r": 3, "p": 0, "parts": [bytes(32)], "sizes": [4096], "base": "ab" * 16, "norm": 1.5, "addrs": [],
    "bw": [[bytes(8), 1500]], **_TAG}, max_size=MAX_MESSAGE, version=2,
    doc="my update for (r, p): its encoded parts' hashes and sizes, the base it was computed from, its norm, where to "
    "pull it; and (bw, optional) the receive rates in kB/s I measured in my last exchange "
    "from the last round's members (short ids), from which every peer weighs who reduces how many parts")
_BITS = Bytes(max=MAX_VIEW // 8)  # a subset of the round's ordered members (exchange.pack_set)
REDUCED = WIRE.message(CARRIER, 5, "diloco.reduced", Map.of(
    r=_R, p=_P, red=Int(0, MAX_PARTS - 1), blob=Bytes(exact=32), size=Int(1, MAX_PART_BYTES), m=Str(32),
    c=_BITS, addrs=_ADDRS, t=TAG), {"r": 3, "p": 0, "red": 2, "blob": bytes(32), "size": 4096, "m": "ab" * 8,
                                    "c": b"\x0b", "addrs": [], **_TAG}, max_size=MAX_MESSAGE, version=2,
    doc="scatter: the combined part k I reduced (blob hash, size, digest of the round's members, which of them "
    "it combines the chunks of)")
AUDIT = WIRE.message(CARRIER, 6, "diloco.audit", Map.of(r=_R, p=_P, aud=Int(0, MAX_PARTS - 1), ok=Bool(), t=TAG),
                     {"r": 3, "p": 0, "aud": 2, "ok": True, **_TAG}, max_size=MAX_MESSAGE,
                     doc="scatter: my verdict on the reducer's part k")
MEMBERS = WIRE.message(CARRIER, 7, "diloco.members", Map.of(r=_R, p=_P, m=List(Bytes(exact=8), MAX_VIEW), t=TAG),
                       {"r": 3, "p": 0, "m": [bytes(8), b"\x01" * 8], **_TAG}, max_size=512 + MAX_VIEW * 10,
                       doc="the members I would combine for (r, p) (short ids): the round's coordinator's view is "
                       "every peer's")
PARTS = WIRE.message(CARRIER, 8, "diloco.parts", Map.of(
    r=_R, p=_P, m=Str(32), c=List(_BITS, MAX_PARTS), h=List(Bytes(exact=32), MAX_PARTS), t=TAG),
    {"r": 3, "p": 0, "m": "ab" * 8, "c": [b"\x0b", b"\x07"], "h": [bytes(32), b"\x01" * 32], **_TAG},
    max_size=1024 + MAX_PARTS * (MAX_VIEW // 8 + 40),
    doc="scatter, from the round's coordinator: each part's members whose chunks it combined and its blob hash, as "
    "I used them: every peer's parts")


class DilocoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    run: str = Field("diloco-demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    task: str = "tinygpt"  # "path/to/file.py:factory", "package.module:factory" or a built-in name
    task_options: dict = {}  # keyword arguments of the task's factory
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    threads: int = Field(0, ge=0, le=4096)  # torch's CPU threads for the loop's compute (0: auto, protocols.task)
    checkpoint_every: int = Field(1, ge=0)  # rounds between checkpoints (0: only at the end)
    seed: int = 1  # the initial weights (every peer builds the same) and the data order
    rounds: int = Field(8, ge=0)  # outer rounds per fragment (0: until stopped)
    inner_steps: int = Field(50, ge=1)  # H
    fragments: int = Field(1, ge=1)  # P (1 = plain DiLoCo)
    overlap: int = Field(0, ge=0)  # tau: inner steps run while a fragment's update travels
    alpha: float = Field(0.0, ge=0, le=1)  # local weight when merging an overlapped fragment
    codec: str = "e3m0"
    # error feedback: each peer adds what the codec dropped of its last update to its next one (Deep Gradient
    # Compression, 1-bit Adam), so the swarm gets, over rounds, what a peer's steps moved. "auto": on for the codecs
    # that drop magnitudes ("sign", "topk"), off for the others (with e3m0 it gained nothing: bench_diloco_sim.py).
    # Each peer's own state (one fp32 copy of the weights), not part of the run's fingerprint
    error_feedback: str = Field("auto", pattern=r"^(auto|on|off)$")
    # the codec of a scatter round's combined parts (what each reducer sends everyone): "auto" is the run's codec,
    # except e3m0 for "sign" (the sign of the peers' mean loses what they agree on: +2.8% validation loss in
    # bench_diloco_sim's h4-sign-ef-rc; e3m0 keeps it at 3.7x a sign part's bytes in the all-gather)
    reduced_codec: str = Field("auto", pattern=r"^(auto|none|fp16|bf16|int8|e3m0|sign)$")
    # the inner optimizer when the task brings none: "swarm-adamw" (AdamW with its step sized for the round's
    # peers' batches, protocols/inner.py) or plain "adamw"; inner_betas and weight_decay either way. Each peer's
    # own choice, not part of the run's fingerprint. A longer second-moment average (beta2 0.99) steadies
    # swarm-adamw's estimate of the swarm's gradient variance from one peer's batches: bench_diloco_sim.py's
    # h4-sign-ef-b2.99 rows, and the README
    inner_optimizer: str = Field("swarm-adamw", pattern=r"^(adamw|swarm-adamw)$")
    inner_lr: float = Field(4e-4, gt=0)
    inner_betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.1, ge=0)
    # the inner learning rate over the run (any inner optimizer's, the task's too: its groups' lr are the base):
    # a linear warm-up over warmup_steps, then "constant", or "cosine" down to lr_final x the base at the run's
    # last inner step (rounds x inner_steps; an open-ended run, rounds = 0, stays at the base after the warm-up).
    # By the run's inner step, so a late joiner or a restarted peer takes the swarm's lr (protocols/inner.py)
    lr_schedule: str = Field("constant", pattern=r"^(constant|cosine)$")
    warmup_steps: int = Field(0, ge=0)
    lr_final: float = Field(0.1, ge=0, le=1)
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    min_peers: int = Field(1, ge=1)
    deadline_low: float = Field(2.0, gt=0)
    deadline_high: float = Field(60.0, gt=0)
    eval_every: int = Field(1, ge=1)  # rounds between validation evaluations
    peers: list[str] = Field([], max_length=10_000)  # a closed run: only these peer ids take part (empty: open)
    # the update exchange: "all-to-all" (every peer pulls every update), "scatter" (reduce-scatter + all-gather:
    # each peer moves about 2x its update whatever the number of peers), or "auto": scatter from
    # scatter_min_peers participants and scatter_min_bytes per encoded update (measured by bench/bench_exchange.py)
    exchange: str = Field("auto", pattern=r"^(auto|all-to-all|scatter)$")
    # parts an update is cut into (fewer for small fragments): a number, or "auto", which follows the last round's
    # participants so that a scatter round's busiest peer moves at most 2.2 x its update, audits included
    # (``exchange.auto_parts``: 16 up to 8 peers, 64 at 16, 128 at 32)
    parts: int | str = "auto"
    scatter_min_peers: int = Field(4, ge=2)
    scatter_min_bytes: int = Field(1 << 20, ge=0)
    audit: float = Field(0.25, ge=0, le=1)  # fraction of reduced parts re-computed by a second peer
    min_bandwidth: float = Field(10e6, gt=0)  # bytes/s assumed at worst when a round's transfers are given time
    # memory a peer may keep (all-to-all: the last close's updates, global weights and momentum, one round) to redo
    # that close without a contested update when the majority's next updates say they combined without it (0: never;
    # such a peer then always takes a checkpoint)
    redo_bytes: int = Field(1 << 30, ge=0)
    # agree on each round's members: every peer combines the members its round's coordinator (a counted peer drawn
    # from the round) saw, not its own (peers that saw different members end with different weights and resync)
    agree: bool = True

    _peers = field_validator("peers")(check_peer_ids)

    @field_validator("parts")
    @classmethod
    def _parts(cls, v: int | str) -> int | str:
        if v != "auto" and not (isinstance(v, int) and 1 <= v <= MAX_PARTS):
            raise ValueError(f'parts: "auto" or a number from 1 to {MAX_PARTS}')
        return v

    @field_validator("inner_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("inner_betas: two numbers in [0, 1), e.g. [0.9, 0.95]")
        return v

    def options(self) -> dict:
        return dict(self.task_options)

    def shared(self) -> dict:
        """The settings every peer of a run must share (part of the run's fingerprint), and the scatter's reduction
        rule (peers compare reduced parts by hash: two versions of the rule must not meet in one run)."""
        reduced = self.reduced()
        return {**self.model_dump(include={"run", "seed", "rounds", "inner_steps", "fragments", "overlap", "alpha",
                                           "codec", "outer_lr", "outer_momentum", "peers", "exchange", "parts",
                                           "scatter_min_peers", "scatter_min_bytes", "audit", "agree"}),
                "reduce_rule": exchange.REDUCE_RULE,
                "weights_hash": outer.WEIGHTS_HASH,
                "outer_step": outer.OUTER_STEP,
                # (only where it is not the run's codec: runs that never set it keep their fingerprint)
                **({"reduced_codec": reduced} if reduced != self.codec else {}),
                # the reduced parts' bytes depend on how e3m0 picks its codes (codecs.E3M0_ENCODER)
                **({"e3m0_encoder": codecs.E3M0_ENCODER} if reduced == "e3m0" else {})}

    def reduced(self) -> str:
        """The codec of a scatter round's combined parts (``reduced_codec`` resolved)."""
        if self.reduced_codec != "auto":
            return self.reduced_codec
        return REDUCED_AUTO.get(self.codec, self.codec)


@dataclass
class StepEnd:
    """When a scatter step's pulls give up: ``at``, which each part that comes in the step moves to ``grace`` after
    that arrival, up to ``cap``: bytes still coming are not cut off at a rate that was guessed (before the first
    measurement) or has changed since, and a peer that sends nothing costs ``grace`` after the last of the others'
    bytes, not ``cap``. (Waits for messages keep the step's fixed end: every peer gives up on a late reducer's part
    at about the same time, and the round's coordinator publishes its parts list when the others expect it.)"""
    at: float
    cap: float = 0.0
    grace: float = 0.0

    def arrived(self, now: float) -> None:
        if self.cap > self.at:
            self.at = min(self.cap, max(self.at, now + self.grace))


@dataclass
class Received:
    """What a scatter step received so far (its rate is measured from it): bytes of chunks and parts, and when
    the step started and the last of them came; and the ends of its pulls, which arrivals move."""
    start: float
    bytes: int = 0
    last: float = 0.0
    ends: list[StepEnd] = field(default_factory=list)  # the step's pulls' ends, which arrivals move


@dataclass(frozen=True)
class Announced:
    """A peer's update for a (round, fragment), as its signed announcement describes it."""

    parts: tuple[bytes, ...]  # the content hashes of its encoded parts
    sizes: tuple[int, ...]
    base: str  # the hash of the global fragment it was computed from
    norm: float  # the L2 norm of the whole (decoded) update: every reducer clips with the same factors
    addrs: tuple[str, ...]  # its bulk TCP addresses
    rates: tuple[tuple[bytes, int], ...] = ()  # (short id, kB/s): what it received from those peers last round


@dataclass
class Pending:
    """One (round, fragment) being gathered."""

    announced: dict[str, Announced] = field(default_factory=dict)
    updates: dict[str, torch.Tensor] = field(default_factory=dict)  # whole updates pulled (all-to-all)
    opened: float = field(default_factory=lambda: clock.current().monotonic())
    arrivals: dict[str, float] = field(default_factory=dict)
    pulls: set = field(default_factory=set)
    pulling: set = field(default_factory=set)  # peers whose whole update is being pulled
    reduced: dict[int, dict[str, tuple]] = field(default_factory=lambda: collections.defaultdict(dict))
    audits: dict[int, dict[str, tuple]] = field(default_factory=lambda: collections.defaultdict(dict))
    entries: int = 0  # reduced + audit messages held
    # part k -> set when a reduced part or an audit verdict for it comes: what a part's wait in ``_scatter`` wakes
    # on (each of a round's up to MAX_PARTS waits woke on every message of the round: at 16 peers and 64 parts,
    # thousands of wake-ups a round)
    part_events: dict[int, asyncio.Event] = field(default_factory=lambda: collections.defaultdict(asyncio.Event))
    sent_at: float | None = None  # when we announced our update
    prefetched: dict[tuple[str, int], asyncio.Task] = field(default_factory=dict)  # (peer, part) -> its chunk's bytes
    prefetch_used: set[tuple[str, int]] = field(default_factory=set)  # the prefetched chunks a reduction took
    prefetchable: set[str] = field(default_factory=set)  # the announcers whose chunks of our parts we prefetch
    failed: set = field(default_factory=set)  # peers whose announced update could not be pulled or decoded
    refused: dict = field(default_factory=dict)  # peer -> why its update's bytes were unusable (its own fault)
    views: dict[str, frozenset[bytes]] = field(default_factory=dict)  # counted peers' member views (short ids)
    view_at: dict[str, float] = field(default_factory=dict)  # when each view came
    coordinator: str | None = None  # whose member view we took (scatter: whose parts we take too)
    count: int | None = None  # the round's part count, once it closes (``DilocoLoop._round_parts``)
    linked: frozenset = frozenset()  # scatter: the members connected to us when the round's step began
    parts: dict[str, tuple] = field(default_factory=dict)  # last round's members' parts: (digest, sets, hashes)
    signed: dict[str, dict] = field(default_factory=dict)  # peer -> its announcement as it signed it (wire form)
    meter: exchange.RateMeter = field(default_factory=exchange.RateMeter)  # what we receive from whom, how fast


@dataclass
class Redo:
    """What closing a round of a fragment took (all-to-all), kept one round: if the majority's updates for the next
    round say they were computed from other weights, the close is redone without the updates whose inclusion may
    differ (ours, whose announcement may have reached the others late; the last other one to arrive), or with the
    counted peers' updates that came after it (``late``, pulled then), before a checkpoint is pulled."""

    round: int
    members: frozenset[str]
    updates: dict[str, torch.Tensor]
    global_before: torch.Tensor  # the fragment's global weights before the close (the step returns new tensors)
    base: str  # their hash: what a late update must have been computed from
    momentum: torch.Tensor  # the outer momentum before it (a copy: the step changes it in place)
    last: str | None  # the other member whose update arrived last
    late: dict[str, torch.Tensor] = field(default_factory=dict)  # counted peers' updates that came after the close
    pulling: dict[str, asyncio.Task | None] = field(default_factory=dict)  # None: a pull of the round, still on

    def drop(self) -> None:
        for task in self.pulling.values():
            if task is not None:
                task.cancel()

    def variants(self, me: str) -> list[frozenset[str]]:
        """The member sets to try: each missing what might have been late at the others, then with what was late
        here."""
        out: list[frozenset[str]] = []
        late = frozenset(self.late)
        for left in (self.members - {me}, self.members - {self.last}, self.members - {me, self.last},
                     self.members | late, (self.members - {me}) | late):
            if left != self.members and left not in out:
                out.append(left)
        return out

    def update(self, peer: str) -> torch.Tensor:
        return self.updates[peer] if peer in self.updates else self.late[peer]


def _decode_part(body, elements: int, out: torch.Tensor | None) -> torch.Tensor:
    """A pulled part or chunk decoded (into ``out``, when given, which holds exactly ``elements`` values)."""
    try:
        return codecs.decode(body, out=out, max_elements=elements)
    except ValueError:  # another element count than the announcement's: the sender's fault
        raise codecs.CodecError(f"a part of another size than its {elements} values") from None


class DilocoLoop(TaskLoop):
    name = "diloco"

    def __init__(self, gossip: Gossip, bulk: BulkService, config: DilocoConfig, task: Task):
        self.gossip, self.bulk, self.cfg = gossip, bulk, config
        self._init_task(task)
        self.train_loss: float | None = None
        self.skipped: dict[int, str] = {}  # fragment -> why our update for its current round is withheld
        self.topic = f"diloco/{config.run}"
        self.codec = codecs.get(config.codec)
        self.reduced_codec = codecs.get(config.reduced())
        self.feedback = config.error_feedback == "on" or (config.error_feedback == "auto"
                                                          and config.codec in FEEDBACK_CODECS)
        self.residual: dict[int, torch.Tensor] = {}  # fragment -> what the codec dropped of our last update
        self._residual_norms: dict[int, float] = {}
        self.pending: dict[tuple[int, int], Pending] = collections.defaultdict(Pending)
        self.participants: dict[int, set[str]] = {}  # fragment -> participants of its last closed round
        self.round_hashes: dict[tuple[int, int], dict[str, str]] = collections.defaultdict(dict)
        self._global_version = 0  # bumped wherever global_flat (or one of its tensors) is replaced
        # fragment (None: all of them) -> (_global_version, the hash of its global weights)
        self._hashes: dict[int | None, tuple[int, str]] = {}
        # per closed round: fragment, round, participants, global hash (the last HISTORY)
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self.losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=HISTORY)
        self._recent_losses: list[float] = []
        self.counters: collections.Counter = collections.Counter()
        self.deadline = outer.AdaptiveDeadline(low=config.deadline_low, high=config.deadline_high,
                                               initial=max(config.deadline_low, 10.0))
        self.state = "starting"
        self.step = 0
        self.compute_seconds = 0.0
        self.blocked_seconds = 0.0  # waiting for a round to close, not computing
        self.joins: dict[tuple[int, int], set[str]] = collections.defaultdict(set)
        self.join_round: dict[int, int] = {}  # fragment -> first round we contribute to (late joiner)
        self._initial: set[str] = set()  # who we started with (round 0 waits for them)
        self._contributed: dict[tuple[int, int], set[str]] = {}  # (round, fragment) -> who we combined
        self._last_parts: collections.OrderedDict[tuple[str, int], tuple] = collections.OrderedDict()
        self._included = 0  # rounds in a row in which the majority's weights contained our update
        self._counted_before_resync = False
        # fragment -> {peer whose word counts: the last round it says it closed}; the swarm's round is their median
        self._closed_by: dict[int, dict[str, int]] = collections.defaultdict(dict)
        self._next_catch_up = 0.0  # when we may next take a checkpoint for having fallen behind
        self._founder = False  # we started the run with the others: they count us from the start
        self._rejoined_at = -EARN - 1  # the round of our last resync
        self._checkpoint_from: str | None = None  # whose checkpoint we joined from last
        # whose checkpoints we had joined from when our weights left the majority's (the latest MAX_PEER_ENTRIES):
        # asked after the others
        self._led_off: dict[str, None] = {}
        self.started = None
        self.ready: dict[str, str] = {}
        # "ready"s from authors our connection list does not show as direct yet (it lags our links: the daemon's
        # listing is read every 2 s, and a peer stops announcing once it starts): counted once they are, the
        # newest READY_UNLISTED kept (a fresh key that never connects only pushes out the oldest)
        self._ready_unlisted: dict[str, str] = {}
        self._start_weights = rounds.StartWeights()  # whose initial weights we asked for, and how many asks left
        self.initial_weights: dict | None = None  # whose initial weights we started from, where not ours
        self._ctx: NodeContext | None = None
        self._event = asyncio.Event()
        self.final_hash: str | None = None
        self.rounds_done: list[int] = []
        self._published: dict[tuple[int, int], str] = {}
        self._checked: set[tuple[int, int]] = set()  # our published rounds compared with the others' hashes
        self._signed_closed: dict[tuple[int, int], dict[str, dict]] = {}  # the last rounds' signed announcements
        self._moving: dict[tuple[int, int], Received] = {}  # scatter step -> what came in it so far
        self._rates: collections.deque[float] = collections.deque(maxlen=RATE_ROUNDS)  # bytes/s, measured
        self._heard: dict[str, float] = {}  # counted peer -> when a message of theirs last came (monotonic)
        self._source_rates: dict[str, int] = {}  # peer -> kB/s we received from it in the last round it served us
        self._probe: asyncio.Task | None = None  # the founders' link probe, awaited before our first update
        self._probe_blobs: list[bytes] = []  # the probe blobs we serve (until our first round closes)
        self._assignment: dict[str, float | None] = {}  # the last scatter step: parts we reduced, members that
        # reduced any, its span and the slowest member's measured rate
        self._chain_weights: dict[int, dict[str, int]] = {}  # fragment -> its last round's members' rate weights
        self._slow_link_said = False
        self._ann_served: dict[tuple[int, int], set[str]] = {}  # who asked us for a round's announcements
        self._ckpt_served: dict[str, float] = {}  # peer -> when we last served it a checkpoint (MAX_PEER_ENTRIES)
        self._asks: set[asyncio.Task] = set()  # announcement fetches after a join (held until done)
        self._resync_from: list[str] = []
        self._encoded_size: dict[tuple[int, str], list[int]] = {}  # (fragment, codec) -> bytes of each part
        self._sources: dict[str, asyncio.Semaphore] = {}
        self._missing_logged: dict[str, float] = {}
        self.exchange_view: dict = {}
        self._exchange_times: collections.deque[float] = collections.deque(maxlen=32)
        self._close_times: collections.deque[float] = collections.deque(maxlen=32)
        # where a round's exchange spends its time, per phase (``/status`` -> exchange.phase_seconds_median):
        # wait (our update announced -> the close), agree (the member agreement), reduce (scatter: chunks in, our
        # parts reduced, the others' taken and audited), conform (the wait for the coordinator's parts and any
        # part reduced again); all-to-all: combine (the pulled updates combined)
        self._phase_times: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=32))
        # (round, fragment) -> the blobs of its exchange we hold, served while the round may still need them: all of
        # them until we close the next round (a peer's fallback pulls come up to a deadline after its close, from
        # any member that holds a chunk or part), then only our own (our update's parts, our reductions: what a
        # peer a round behind pulls from us to close that round) until the round after, then none
        self._round_blobs: dict[tuple[int, int], set[bytes]] = collections.defaultdict(set)
        self._own_blobs: dict[tuple[int, int], set[bytes]] = collections.defaultdict(set)  # ours among them
        self._redo: dict[int, Redo] = {}  # fragment -> the inputs of its last close (all-to-all, within redo_bytes)
        # scatter: parts whose chunks are decoded and reduced at once (each holds its members' chunks decoded)
        self._reducing = asyncio.Semaphore(REDUCING)
        self._buffers = buffers.Buffers(0)  # (its room set once the model is built)
        # the inner steps of a user's own training loop (swarmd.DiLoCo) in place of ours on the task's data
        self.user_steps: UserSteps | None = None

    # ------------------------------------------------------------------ service
    async def start(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        self._init_standing(ctx)
        self.gossip.subscribe(self.topic, max_size=MAX_MESSAGE, validator=self._validate, queue_size=0)
        await ctx.transport.serve(CKPT_SPEC, self._serve_checkpoint)
        await ctx.transport.serve(ANN_SPEC, self._serve_announcements)

    async def close(self) -> None:
        self._stop_progress()
        running = [t for t in (self._probe, *self._asks) if t is not None]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _build(self) -> None:
        """The task's model on our device, its fragments, the global (CPU, fp32) copy, the optimizers, our data."""
        self._setup_device()
        model = tasks.build_model(self.task, self.cfg.seed)
        named = tasks.trainable(model)
        shared = self.cfg.shared()
        self.fp = tasks.fingerprint(self.task, shared, named)
        # the same run under the versions before: before the e3m0 encoder was named (the log2 encoder), and before
        # that, before the weights hash was named (BLAKE2b). We resume their checkpoints (the weights are the same
        # run's), never mix with their nodes in a round
        before_encoder = {k: v for k, v in shared.items() if k != "e3m0_encoder"}
        self._fp_before_blake3 = tasks.fingerprint(
            self.task, {k: v for k, v in before_encoder.items() if k != "weights_hash"}, named)
        self.earlier_fps = [tasks.fingerprint(self.task, before_encoder, named), self._fp_before_blake3]
        # and before the screen's exact products and the outer step's unfused operations (2026-12-01): the rule's
        # text before, no outer step named. (Its weights stepped with fused multiply-adds on AVX2 CPUs: the same
        # run's weights to resume from, where the start barrier finds the swarm at the same round and hash)
        before_exact = {**{k: v for k, v in shared.items() if k != "outer_step"},
                        "reduce_rule": exchange.REDUCE_RULE_BEFORE_EXACT}
        self.earlier_fps.append(tasks.fingerprint(self.task, before_exact, named))
        self.resumable_fp = tasks.fingerprint(self.task, {k: v for k, v in shared.items() if k not in RULES}, named)
        self.model = model.to(self.device)
        named = tasks.trainable(self.model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.frag_index = tasks.fragment_indices(self.task, self.model, self.cfg.fragments)
        self.global_flat = [outer.flatten([self.params[i] for i in f]) for f in self.frag_index]
        self._global_version += 1
        self.rounds_done = [0] * self.cfg.fragments
        for p in range(self.cfg.fragments):
            for count in self._part_counts(p):  # here in the worker thread: the exchange mode depends on them
                self._part_bytes(p, False, count)
                self._part_bytes(p, True, count)
        # the blobs a round's exchange keeps in the bulk store: per fragment our update, the chunks and parts we
        # pull and reduce (about 3 x an update in scatter), for this round and the last, and our own of the one
        # before (``_drop_round_blobs``); room for 8 x an update (x the combined parts' size where reduced_codec
        # makes them larger; their sizes computed here, in the worker thread, once), so a large model's are never
        # dropped early
        self.bulk.reserve(8 * sum(max(self._update_bytes(p), sum(self._part_bytes(p, reduced=True)))
                                  for p in range(self.cfg.fragments)))
        self.outer_opt = outer.OuterNesterov([g.numel() for g in self.global_flat], self.cfg.outer_lr,
                                             self.cfg.outer_momentum)
        # a round's large buffers kept for the next (protocols/buffers.py): our update's flat copy, the combined
        # update (which becomes the global weights, the old ones given back), the chunks we decode (about one
        # fragment's worth at once); room for 3 fragments, none where node.memory = "release"
        self._buffers.max_bytes = 0 if allocator.applied()["mode"] == "release" else \
            3 * 4 * max(g.numel() for g in self.global_flat)
        if self.task.has("optimizer"):
            self.inner_opt = self.task.call("optimizer", self.model.parameters())
            if not isinstance(self.inner_opt, torch.optim.Optimizer):
                raise TaskError(f"{self.task.where('optimizer')} returned {type(self.inner_opt).__name__}, "
                                "expected a torch.optim.Optimizer")
        elif self.cfg.inner_optimizer == "swarm-adamw":
            self.inner_opt = SwarmAdamW(self.model.parameters(), lr=self.cfg.inner_lr, betas=self.cfg.inner_betas,
                                        weight_decay=self.cfg.weight_decay, peers=max(1, self.cfg.min_peers))
        else:
            self.inner_opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.inner_lr,
                                               betas=self.cfg.inner_betas, weight_decay=self.cfg.weight_decay)
        self.data = tasks.data_iter(self.task, tasks.shard_of(self._ctx.identity.peer_id), self.cfg.seed)

    def global_hash(self) -> str:
        """The hash of all the global weights (a round's close, its checks, and the status views, which poll it
        every few seconds), computed once per change of them."""
        return self._cached_hash(None)

    def _base_hash(self, p: int) -> str:
        """Fragment p's global weights' hash (what updates name as their base), computed once per change of the
        global weights: every incoming announcement is checked against it, and hashing a fragment on the event loop
        per message was a quarter of a node's time at N = 8 (25 MB updates; seconds per message for a 1B model)."""
        if len(self.global_flat) == 1:
            return self.global_hash()  # the same bytes
        return self._cached_hash(p)

    def _cached_hash(self, p: int | None) -> str:
        """The hash of fragment p's global weights (None: of all of them), kept until the global weights change:
        global_flat's tensors are replaced, never changed in place, and every replacement bumps
        ``_global_version``."""
        version = self._global_version  # read before the weights: a hash stored under a version is never older
        cached = self._hashes.get(p)
        if cached is None or cached[0] != version:
            tensors = self.global_flat if p is None else [self.global_flat[p]]
            cached = self._hashes[p] = (version, outer.params_hash(tensors))
        return cached[1]

    def _rounds(self) -> float:
        return self.cfg.rounds or math.inf

    async def run(self) -> None:
        await self._guarded(self._run_until_left)

    async def _run_until_left(self) -> None:
        try:
            await self._run()
        except StepsEnded:  # the user's script left the run (swarmd.DiLoCo): keep where it got to
            await asyncio.to_thread(self._save_checkpoint)
            await self._last_progress()
            self.state = "left"
            logger.info("diloco run %s left by the training script at step %d (checkpoint saved)", self.cfg.run,
                        self.step)

    async def _run(self) -> None:
        self.threads = tasks.set_threads(self.cfg.threads)
        self.state = "building the model"
        with self.work.track("model build"):
            await asyncio.to_thread(self._build)
        self._resume_own()
        if not (self.cfg.rounds and min(self.rounds_done) >= self.cfg.rounds):  # else: our saved run had ended
            if not self.rounds_done[0]:
                await self._serve_probe()
            await self._start_barrier()
            others = sorted(self._initial - {self._ctx.identity.peer_id})
            if others and not self.rounds_done[0]:
                self._probe = asyncio.get_running_loop().create_task(self._probe_links(others))
        self.started = self.clock.monotonic()
        h = self.cfg.inner_steps
        rounds = self._rounds()
        offsets = [p * h // self.cfg.fragments for p in range(self.cfg.fragments)]
        total = rounds * h + max(offsets)
        waiting: dict[int, tuple[int, int]] = {}  # fragment -> (round, step at which to close)
        rounds_done = self.rounds_done
        for p in range(self.cfg.fragments):  # a late joiner may arrive mid-round: follow that round at once
            if rounds_done[p] < rounds and self.step >= offsets[p] + (rounds_done[p] + 1) * h:
                waiting[p] = (rounds_done[p], self.step)
        while self.step < total or waiting:
            if not self._resync_from and (behind := self._fallen_behind()):
                self.counters["fell_behind"] += 1
                logger.warning("diloco: the swarm closed round %d, two past ours (%d); taking a checkpoint",
                               max(map(self._swarm_round, range(len(self.rounds_done)))), min(self.rounds_done))
                self._counted_before_resync = self._still_counted()
                self._resync_from = behind
            if self._resync_from:
                peers, self._resync_from = self._resync_from, []
                self.counters["resyncs"] += 1
                if not await self._join_from_checkpoint(peers, rejoin=self._counted_before_resync):
                    self.state = "running"  # keep our weights; the next round's hashes tell again
                rounds_done, waiting = self.rounds_done, {}
                for p in range(self.cfg.fragments):
                    if rounds_done[p] < rounds and self.step >= offsets[p] + (rounds_done[p] + 1) * h:
                        waiting[p] = (rounds_done[p], self.step)
                continue
            if self.step < total:
                if self._behind_as_follower():
                    self.counters["steps_skipped"] += 1
                    await asyncio.sleep(0)
                else:
                    t0 = self.clock.monotonic()
                    await self._train_step()
                    self.compute_seconds += self.clock.monotonic() - t0
                self.step += 1
            for p in range(self.cfg.fragments):
                if p not in waiting and rounds_done[p] < rounds and self.step >= offsets[p] + h \
                        and (self.step - offsets[p]) % h == 0:
                    r = rounds_done[p]
                    await self._send_update(p, r)
                    waiting[p] = (r, self.step + self.cfg.overlap)
            for p, (r, close_at) in list(waiting.items()):
                if self.step >= close_at or self.step >= total:
                    await self._close_round(p, r)
                    del waiting[p]
                    rounds_done[p] += 1
                    if p == self.cfg.fragments - 1:
                        await self._after_round(rounds_done[p])
        await self._settle_final()
        for p in list(self._redo):
            self._drop_redo(p)
        self.final_hash = self.global_hash()
        if self.saved is None or self.saved.get("round") != self.rounds_done[-1]:
            await asyncio.to_thread(self._save_checkpoint)
        await self._last_progress()
        self.state = "done"
        logger.info("diloco run %s done: %d steps, global %s", self.cfg.run, self.step, self.final_hash)
        while True:  # keep saying where the run ended, so a node that arrives later can take the final weights
            self._publish(ROUND_HASH, {"r": self.cfg.rounds, "p": self.cfg.fragments - 1, "h": self.final_hash})
            await asyncio.sleep(5.0)

    def _behind_as_follower(self) -> bool:
        """Whether our next inner step would be thrown away: we follow every fragment's current round without
        contributing to it (a joiner before its join round), and the peers that count have closed it already (the
        median of the rounds they say they closed). Then we do not train: the round closes from the others'
        updates, which are here, as soon as our steps reach its end, so a joiner that starts rounds behind the
        swarm (a checkpoint that aged on its way, a slow start) is in step by the round it joins, instead of
        staying that far behind and sending late updates every round. Its local weights are the global ones after
        each round anyway."""
        if not self.rounds_done:
            return False
        for p, r in enumerate(self.rounds_done):
            if r >= self.join_round.get(p, 0) or self._swarm_round(p) < r:
                return False
        return True

    def _swarm_round(self, p: int) -> int:
        """The last round of fragment p the run has closed, as far as we know: the median of the last rounds the
        peers whose word counts say they closed (so a few that lie about it move nothing); -1 if none said."""
        closed = [r for a, r in self._closed_by[p].items() if self.standing.counts(a)]
        return statistics.median_high(closed) if closed else -1

    def _fallen_behind(self) -> list[str]:
        """Peers to take a checkpoint from when the counted peers have closed two rounds past the one we are in:
        the updates of our round are gone from their stores by then (they keep a round's blobs one round), so we
        cannot close it with them; a checkpoint of theirs puts us in their round (a joiner whose checkpoint aged
        on its way, a peer that stalled). At most once per deadline."""
        if self.clock.monotonic() < self._next_catch_up:
            return []
        for p, r in enumerate(self.rounds_done):
            latest = self._swarm_round(p)
            if latest >= r + 2:
                self._next_catch_up = self.clock.monotonic() + self.deadline.value()
                return self._trusted_claimers(dict(self.round_hashes.get((latest, p), {})))
        return []

    async def _settle_final(self) -> None:
        """The last round has no next round whose close compares global hashes, so a peer that closed it with
        other updates than the rest (its deadline passed first) would end on its own weights. Wait, up to one
        round deadline, for the hashes of the last round from the peers that count and published one for the
        round before; in the minority, take the majority's final weights from one of them."""
        p = self.cfg.fragments - 1
        r = self.rounds_done[p] - 1
        ours = self._published.get((r, p))
        if ours is None or r < 0:
            return  # the run ended before we closed a round (or we joined at its very end): nothing to compare
        self.state = "settling the last round"
        me = self._ctx.identity.peer_id

        def theirs(round_: int) -> dict[str, str]:
            return {a: h for a, h in self.round_hashes.get((round_, p), {}).items()
                    if a != me and self.standing.vouched(a)}

        expected = set(theirs(r - 1)) | set(self.participants.get(p, set())) - {me}
        expected = {a for a in expected if self.standing.counts(a)}
        until = self.clock.monotonic() + self.deadline.value()
        while self.clock.monotonic() < until and not expected <= set(theirs(r)):
            await asyncio.sleep(0.2)
        await self._wait_if_ahead(p, r, theirs)
        verdict = rounds.hash_verdict(ours, theirs(r), me=me, salt=f"{self.cfg.run}/{r}/{p}")
        redo = self._drop_redo(p)
        if verdict is None or verdict.agrees:
            return
        if redo is not None and redo.round == r and await self._redo_with(p, redo, lambda fixed: outer.params_hash(
                [*self.global_flat[:p], fixed, *self.global_flat[p + 1:]]) == verdict.majority):
            return
        self.counters["diverged"] += 1
        self.counters["resyncs"] += 1
        self._left_majority()
        logger.error("diloco: our weights after the last round (%d/%d) are not the majority's; taking theirs", r, p)
        if not await self._join_from_checkpoint(list(verdict.holders), rejoin=True):
            logger.error("diloco: no peer of the majority served its final weights; ending on ours")

    async def _wait_if_ahead(self, p: int, r: int, theirs) -> None:
        """We closed the run's last round while the peers that count are two or more rounds behind (we ran ahead
        of them, closing rounds without them): wait while they progress (up to ``deadline_high`` without any) for
        most of them to publish their hash of round r, so the last round is compared with theirs, not with none."""
        me = self._ctx.identity.peer_id
        peers = {a for a in self._closed_by[p] if a != me and self.standing.counts(a)}
        seen = self._swarm_round(p)
        if not peers or seen >= r - 1:
            return
        self.counters["waited_for_the_swarm"] += 1
        logger.warning("diloco: we closed the last round (%d/%d) while the others are at round %d; waiting for "
                       "their hashes of it", r, p, seen)
        moved = self.clock.monotonic()
        while len(set(theirs(r)) & peers) * 2 <= len(peers):
            if (now_at := self._swarm_round(p)) > seen:
                seen, moved = now_at, self.clock.monotonic()
            elif self.clock.monotonic() - moved > self.cfg.deadline_high:
                return
            await asyncio.sleep(0.2)

    async def _after_round(self, done: int) -> None:
        """After the last fragment's round closed (every fragment has closed ``done`` rounds): evaluate, report,
        checkpoint."""
        if done % self.cfg.eval_every == 0:
            loss = await asyncio.to_thread(tasks.evaluate, self.task, self.model)
            if loss is None:  # a task without evaluate(): the mean training loss of the round
                loss = self._round_loss()
            if loss is not None:
                self.losses.append((self.step, round(loss, 5)))
                await self._report(loss)
        if self.cfg.checkpoint_every and done % self.cfg.checkpoint_every == 0:
            await asyncio.to_thread(self._save_checkpoint)

    def _round_loss(self) -> float | None:
        recent = [x for x in self._recent_losses if math.isfinite(x)]
        self._recent_losses.clear()
        return sum(recent) / len(recent) if recent else None

    async def _train_step(self) -> None:
        """One inner step, off the event loop (the seam a simulation paces with simulated compute time): ours on the
        task's data, or the one the user's own loop takes (``user_steps``, swarmd.DiLoCo)."""
        if self.user_steps is None:
            await asyncio.to_thread(self._inner_step)
            return
        loss = await self.user_steps.next_step()
        if loss is not None:
            self._record_loss(loss)

    def _record_loss(self, value: float) -> bool:
        """Keep a step's training loss; a non-finite one withholds our updates until a round gives us the global
        weights back (False)."""
        if not math.isfinite(value):
            for p in range(self.cfg.fragments):
                self.skipped.setdefault(p, f"the loss became {value} at step {self.step}")
            self._nonfinite(f"the loss ({value})", f"at step {self.step}; skipping the step and withholding our update")
            return False
        self.train_loss = value
        self._recent_losses.append(value)
        return True

    def lr_factor(self) -> float:
        """The factor on the inner optimizer's base learning rate at our current inner step (``lr_schedule``)."""
        total = self.cfg.rounds * self.cfg.inner_steps if self.cfg.lr_schedule == "cosine" else 0
        return lr_scale(self.step, total, self.cfg.warmup_steps, self.cfg.lr_final)

    def _schedule_lr(self) -> None:
        if self.cfg.lr_schedule == "constant" and not self.cfg.warmup_steps:
            return  # the optimizer's own lr, untouched
        scale_lr(self.inner_opt, self.lr_factor())

    def _inner_step(self) -> None:
        self.model.train()
        batch = tasks.to_device(next(self.data), self.device)
        loss = tasks.loss_value(self.task, self.model, batch)
        self.inner_opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if not math.isfinite(value):
            # this peer's training went wrong: no backward, no step, and our updates are withheld until a round
            # closes and gives us the global weights back
            self._record_loss(value)
            return
        loss.backward()
        self._schedule_lr()
        self.inner_opt.step()
        # the gradients are not held between steps: a round's exchange, whose transients are the node's peak of
        # memory, runs between two steps (4 bytes a parameter: 0.44 GB for a 109M model)
        self.inner_opt.zero_grad(set_to_none=True)
        self._record_loss(value)

    # ------------------------------------------------------------------ sending and closing a round
    async def _send_update(self, p: int, r: int) -> None:
        """Announce our update for round r of fragment p. Its encoding (and the decoding of what the others will see,
        and the parts' hashes) runs in a worker thread: for a large model that is seconds of work, which on the
        event loop held gossip, the bulk service and the status endpoint."""
        if r < self.join_round.get(p, 0):
            return  # a late joiner follows this round without contributing
        if self._probe is not None:  # our first update reports the probe's rates (at most PROBE_SECONDS in)
            probe, self._probe = self._probe, None
            await probe
        # in scatter no peer needs our whole update decoded: each chunk we reduce is decoded from its part when
        # it is reduced (a copy of the update less held all round)
        whole = self._mode(p) != "scatter"
        prepared = None if p in self.skipped else await asyncio.to_thread(self._prepare_update, p, whole)
        if prepared is None:
            self.skipped.setdefault(p, "our weights are not finite")
            self.counters["updates_withheld"] += 1
            logger.warning("diloco: not sending our update for round %d/%d: %s", r, p, self.skipped[p])
            return
        payloads, hashes, mine, norm, base = prepared
        for blob_hash, payload in zip(hashes, payloads):
            self.bulk.keep_prepared(blob_hash, payload)  # served to whoever the round makes pull them
        self._round_blobs[(r, p)].update(hashes)
        self._own_blobs[(r, p)].update(hashes)
        rates = self._rate_reports(p)
        ann = Announced(tuple(hashes), tuple(len(x) for x in payloads), base, norm, tuple(self.bulk.addrs), rates)
        body = {"r": r, "p": p, "parts": hashes, "sizes": list(ann.sizes), "base": base, "norm": ann.norm,
                "addrs": list(ann.addrs)}
        if rates:
            body["bw"] = [list(x) for x in rates]
        mid = self._publish(UPDATE, body)
        pending = self.pending[(r, p)]
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
        delta = self._pseudo_gradient(p, [self.params[i] for i in self.frag_index[p]])
        lossless = self.codec.lossless  # what the others decode is ``delta`` itself, bit for bit
        residual = self.residual.get(p) if self.feedback and not lossless else None
        if residual is not None and residual.shape == delta.shape:
            delta.add_(residual)  # what the codec dropped of our last update travels with this one
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
                self.residual[p] = delta
                self._residual_norms[p] = round(math.sqrt(dropped), 6)
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
                self.residual.pop(p, None)
                self._residual_norms[p] = 0.0
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
            self.residual[p] = delta
            self._residual_norms[p] = round(float(delta.norm()), 6)
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
        subtracted where it lies (one pass; before, a flat copy of our weights was made first, and the difference
        computed in it)."""
        glob = self.global_flat[p]
        out = self._buffers.take(glob.numel())  # (global_flat's tensors: flat fp32 on the CPU)
        at = 0
        for t in local:
            n = t.numel()
            torch.sub(glob[at:at + n], t.detach().reshape(-1).to("cpu", torch.float32), out=out[at:at + n])
            at += n
        if at != glob.numel():
            raise ValueError(f"{at} parameter values for a fragment of {glob.numel()}")
        return out

    def _publish(self, kind, body: dict) -> bytes:
        return self.gossip.publish(self.topic, WIRE.pack(kind, self._tag(body)))

    async def _close_round(self, p: int, r: int) -> None:
        key = (r, p)
        pending = self.pending[key]
        me = self._ctx.identity.peer_id
        # the peers whose word counts are waited for, and a few newcomers (peers that announced a join, or
        # contributed last round without standing yet; brand-new ones only in fresh rounds), picked the same way
        # everywhere: a fresh key can neither add itself to the set every round waits for nor stall many rounds
        base = self.participants.get(p, self._initial) | self.joins.get(key, set())  # popped once closed
        blocked_from = self.clock.monotonic()
        # a newcomer holding a slot gets half of deadline_low once every counting peer is in (then the deadline
        # only if its update is on its way). Half: a peer that did not see the join (gossip is not instant) goes
        # on at once and is that much ahead in the next round, whose deadline is deadline_low at least: the
        # others still make it in time
        # plus the time our last exchange took: the peers ended it at different times (a slow uplink serves its
        # receivers one after another), and so announce this round that much apart; with the deadline alone, a
        # round after a slow exchange closed with whoever was first, and the swarm split (the simulator: one
        # peer's uplink down to 50 kB/s mid-run, rounds of 1-2 members after it)
        spread = min(self._close_times[-1], self.cfg.deadline_high) if self._close_times else 0.0
        wait = rounds.plan_wait(self.standing, base, f"{self.cfg.run}/{r}/{p}", fresh=fresh_round(r), now=blocked_from,
                                deadline=self.deadline.value() + spread, grace=self.cfg.deadline_low / 2, me=me)
        expected, slots, waited = wait.expected, wait.slots, wait.waited
        mode = self._mode(p)
        if mode == "scatter":  # an announcement is all a round waits for: the bytes move after the close
            def have() -> set[str]:
                return set(pending.announced)
        else:
            if me in pending.announced and me not in pending.updates:  # announced when the round was to scatter
                own = await asyncio.to_thread(self._own_update, pending)
                if own is not None:
                    pending.updates[me] = own
                else:
                    self.counters["own_update_dropped"] += 1
                    logger.warning("diloco round %d/%d: our update's bytes were dropped by the bulk store; the "
                                   "round closes without it", r, p)

            def have() -> set[str]:
                return set(pending.updates)
            for peer in sorted(set(pending.announced) - pending.pulling - set(pending.updates)):
                self._start_pull(key, pending, peer)  # announced while we were in the other mode

        def coming() -> set[str]:
            return set(pending.announced) - pending.failed

        coordinator = self._chain(r, p)[:1] if self.cfg.agree else ()

        def covered() -> bool:
            """The round's coordinator's member view is here and names only peers whose contribution we hold: we
            take its view (``_agree``), so waiting on for anyone else changes nothing. Without this, a joiner (its
            deadline deadline_high, before it has measured one) waited that long for a peer killed meanwhile,
            which the coordinator had left out, and fell behind the others (the simulator)."""
            if not coordinator or coordinator[0] == me or coordinator[0] not in pending.views:
                return False
            return not rounds.resolve_view(pending.views[coordinator[0]], {rounds.short_id(a): a for a in have()})[1]

        await self._wait_asking(key, pending, wait, have, coming, covered)
        # closing with our own update alone while the others are behind (a slow exchange, a checkpoint on its way)
        # would leave them nothing to follow: wait on for them, up to deadline_high (rounds.RoundWait.hold_alone)
        if alive := wait.hold_alone(have(), self._heard, now=self.clock.monotonic(), began=blocked_from,
                                    longest=self.cfg.deadline_high):
            self.counters["held_alone"] += 1
            logger.info("diloco round %d/%d: no one else's update yet while %d peer(s) we wait for are still in the "
                        "run; waiting up to deadline_high (%.0f s)", r, p, alive, self.cfg.deadline_high)
            await self._wait_round(wait, self._event, have, coming, covered)
        if covered() and not wait.waited <= have():
            self.counters["closed_on_coordinator_view"] += 1
        self.counters["newcomers_not_waited"] += wait.newcomers_not_waited(have(), coming())
        if not waited <= have():
            self.counters["deadline_missed"] += 1
            logger.warning("diloco round %d/%d closed without %s", r, p, sorted(waited - have()))
        for peer, t in pending.arrivals.items():
            self.deadline.observe(t - pending.opened)
        missing = waited - have()
        waited_s = self.clock.monotonic() - blocked_from
        await self._redo_last_close(p, r, pending, have())
        base_now = self._base_hash(p)
        other_base = {}
        for peer in [a for a, ann in pending.announced.items() if ann.base != base_now and a in have()]:
            # announced ahead of us, from other weights than the ones we close with
            pending.updates.pop(peer, None)
            del pending.announced[peer]
            self.counters["rejected_base"] += 1
            other_base[peer] = "base"
        if mode == "scatter":
            # the round's part count: the one most of its updates from our weights have (each peer cut its update
            # as the last round's members call for: the same count wherever that round closed with the same
            # members); ours first on a tie. An update cut otherwise is not counted here, ours included: its
            # author closed the last round with other members, and follows this one
            ours, present = self._round_parts(key), have()
            counts = collections.Counter(len(ann.parts) for a, ann in pending.announced.items() if a in present)
            pending.count = max(counts, key=lambda c: (counts[c], c == ours), default=ours)
            for peer in [a for a, ann in pending.announced.items() if a in present and len(ann.parts) != pending.count]:
                del pending.announced[peer]
                self.counters["rejected_part_count"] += 1
                other_base[peer] = "part_count"
        contributing = r >= self.join_round.get(p, 0)
        self.counters["newcomer_updates"] += len(slots & have())
        members = {peer for peer in have() if peer in expected or peer in slots or (peer == me and contributing)}
        agreeing = self.clock.monotonic()
        if pending.sent_at is not None:
            self._phase_times["wait"].append(agreeing - max(pending.sent_at, blocked_from))
        members = await self._agree(key, pending, members, base_now, mode)
        replayed = self._replays(p, pending, members)
        members -= set(replayed)
        started = self.clock.monotonic()
        self._phase_times["agree"].append(started - agreeing)
        self._drop_redo(p)
        if mode == "scatter":
            self._moving[key] = Received(started, last=started)
            pending.linked = frozenset(self._ctx.members())
            try:
                combined, rejected = await self._scatter(key, pending, members)
            finally:
                self._measure_rate(self._moving.pop(key))
        else:
            updates = {a: pending.updates[a] for a in members}
            combined, rejected = await asyncio.to_thread(outer.combine, updates, self.global_flat[p].numel())
            self._phase_times["combine"].append(self.clock.monotonic() - started)
            if (len(updates) + 2 + MAX_LATE_PULLS) * 4 * self.global_flat[p].numel() <= self.cfg.redo_bytes:
                late = sorted((pending.arrivals[a], a) for a in members if a != me and a in pending.arrivals)
                redo = self._redo[p] = Redo(r, frozenset(members), updates, self.global_flat[p], base_now,
                                            self.outer_opt.buffers[p].clone(), late[-1][1] if late else None)
                # counted peers' updates still being pulled: kept for a redo when they come
                on_way = sorted(a for a in pending.pulling - set(pending.updates) - pending.failed
                                if pending.announced.get(a) and pending.announced[a].base == base_now
                                and self.standing.counts(a))
                redo.pulling.update(dict.fromkeys(on_way[:MAX_LATE_PULLS]))
        rejected.update(replayed)
        rejected.update({a: why for a, why in pending.refused.items() if a not in rejected})
        if pending.sent_at is not None:  # our update announced -> the round's combined update in hand
            self._exchange_times.append(self.clock.monotonic() - pending.sent_at)
        self._close_times.append(self.clock.monotonic() - started)  # every update announced -> combined update in hand
        self.exchange_view = {"mode": mode, "round": r, "fragment": p, "members": len(members),
                              "parts": self._round_parts(key),
                              **(self._assignment if mode == "scatter" else {}),
                              "close_seconds": round(self._close_times[-1], 3),
                              "close_seconds_median": round(statistics.median(self._close_times), 3),
                              "round_seconds_median": round(statistics.median(self._exchange_times), 3)
                              if self._exchange_times else None,
                              "phase_seconds_median": {k: round(statistics.median(v), 3)
                                                       for k, v in self._phase_times.items() if v}}
        self.blocked_seconds += self.clock.monotonic() - blocked_from
        for peer, reason in rejected.items():
            self.counters[f"rejected_{reason}"] += 1
            # "uncorrelated" is a statistical judgement (near convergence an honest update can be mostly its
            # shard's noise: 5 of 16 honest peers got it in one simulated round), so it costs a suspect's weight,
            # not a malformed message's; the update is refused either way
            kind = "suspect" if reason == "uncorrelated" else "invalid_message"
            self._ctx.transport.penalties.penalize(peer, kind, f"diloco update {reason}")
        participants = members - set(rejected)
        self._record_round(r, fragment=p, waited_s=waited_s, deadline_s=self.deadline.value(),
                           participants=participants, missing=missing, rejected={**other_base, **rejected})
        self.standing.record(participants)
        self._contributed[key] = participants
        for old in [k for k in self._contributed if k[1] == p and k[0] < r - 1]:
            del self._contributed[old]
        broken = bool(self.skipped.pop(p, None))

        def apply() -> tuple[torch.Tensor, str, str]:
            """The outer step, the merge into our parameters and the new global hashes: passes over the whole
            fragment (seconds for a large model) that held the event loop, so they run in a worker thread; the
            training loop waits for it here, so nothing else changes the weights meanwhile."""
            # in scatter the combined update is a buffer of ours, used by nothing else: the new weights take its place
            new = self.global_flat[p] if combined is None else self.outer_opt.step(p, self.global_flat[p], combined,
                                                                                 consume=mode == "scatter")
            # a peer whose training went wrong (non-finite loss or weights) takes the global weights as they are
            outer.merge_into([self.params[i] for i in self.frag_index[p]], new, self.cfg.alpha, broken=broken)
            if combined is None:
                return new, self.global_hash(), ""  # unchanged: the cached hash
            flat = [*self.global_flat[:p], new, *self.global_flat[p + 1:]]
            return new, outer.params_hash(flat), outer.params_hash([new]) if len(flat) > 1 else ""

        new, h, hp = await asyncio.to_thread(apply)
        if new is not self.global_flat[p]:
            # the new weights and their hashes become visible together, here on the event loop: an announcement
            # checked meanwhile saw the old ones and their cached hashes (before, it found the version bumped by
            # the worker thread and hashed the new weights itself, on the loop)
            before, self.global_flat[p] = self.global_flat[p], new
            self._global_version += 1
            self._hashes[None] = (self._global_version, h)
            if hp:
                self._hashes[p] = (self._global_version, hp)
            # the old weights, where nothing holds them any more (a redo's inputs or a checkpoint being written
            # would): the buffer of the next round's combined update
            self._buffers.give(before)
            del before
        # the next round's candidates are this round's members, refused or not: a refusal judges one update, not
        # the peer (an honest update near convergence can be mostly its shard's noise, and in scatter only the
        # reducers of a part see its chunks), and every peer agrees on the members, the refused one included, so
        # it counts itself in next round exactly when the others do (before, the others dropped a refused peer
        # while it counted itself in: it combined another set of updates and resynced; the simulator showed it).
        # A refused peer earns no standing (below), so one refused round after round stops counting and is waited
        # for only as a newcomer, and the penalties ban a sender of garbage
        if members - {me}:
            self.participants[p] = set(members)
            # their weights by the rates their announcements report: the next round's chain of coordinators puts
            # the slow ones last (every peer that closed this round with these members computes the same)
            self._chain_weights[p] = exchange.rate_weights(
                members, {a: dict(pending.announced[a].rates) for a in members if a in pending.announced},
                rounds.short_id)
        else:
            # a round that had no one else's update (every other one late or from other weights) says nothing
            # about who is in the run: the next round waits for the same peers as this one did, or each peer would
            # go on alone, waiting for no one, and the run would split into solo runs for good (found by the
            # simulator). Peers that are really gone stop counting after a few missed rounds (protocols.standing),
            # so this costs at most those rounds' deadlines
            self.participants[p] = self.participants.get(p, self._initial) | members
        if isinstance(self.inner_opt, SwarmAdamW) and participants:
            self.inner_opt.set_peers(len(participants))  # the next round averages about as many peers' steps
        self._check_previous(p, r)
        self.history.append({"round": r, "fragment": p, "participants": len(participants), "global_hash": h})
        self._publish(ROUND_HASH, {"r": r, "p": p, "h": h})
        self._published[(r, p)] = h
        for old in [k for k in self._published if k[1] == p and k[0] < r - MAX_AHEAD]:
            del self._published[old]
            self._checked.discard(old)
        for (peer, k), task in pending.prefetched.items():
            if (peer, k) not in pending.prefetch_used and task.done() and not task.cancelled() \
                    and task.exception() is None:
                self.counters["chunks_prefetched_unused"] += 1  # a wrong guess of our parts: its bytes for nothing
            task.cancel()
        closed = self.pending.pop(key, None)
        if closed is not None:
            self._fold_rates(closed.meter)
        # the signed announcements of the last rounds, for a peer whose gossip did not bring one our view named
        self._signed_closed[key] = closed.signed if closed is not None else {}
        for old in [k for k in self._signed_closed if k[1] == p and k[0] < r - 2]:
            del self._signed_closed[old]
        for old in [k for k in self._ann_served if k[1] == p and k[0] < r - 2]:
            del self._ann_served[old]
        for old in [k for k in self.round_hashes if k[1] == p and k[0] < r - 2]:
            del self.round_hashes[old]
        self._drop_round_blobs(p, r)
        for old in [k for k in self.joins if k[1] == p and k[0] <= r]:
            del self.joins[old]
        if r + 1 < self.join_round.get(p, 0):
            # still following: say again from which round we contribute (a peer that missed the join, or started
            # since, must wait for us then); a set at the receivers, so a repeat costs a small message a round
            self._publish(JOIN, {"r": self.join_round[p], "p": p, "join": True})
        self.counters["rounds"] += 1
        if self._probe_blobs:  # the others probed us before their first update
            self.bulk.drop(self._probe_blobs)
            self._probe_blobs = []

    def _drop_round_blobs(self, p: int, r: int) -> None:
        """After closing round r of fragment p: the blobs of rounds before r - 1 go, and of round r - 1 all but our
        own (a chunk or part pulled from another member mattered only while that round's members were closing it:
        for a 100 MB update at 4 peers, 1.5 x its size a node held a round longer). A blob also named by a round
        still kept (the same bytes) stays."""
        going: set[bytes] = set()
        for old in [k for k in self._round_blobs if k[1] == p and k[0] < r]:
            if old[0] < r - 1:
                going |= self._round_blobs.pop(old)
                self._own_blobs.pop(old, None)
            else:
                own = self._own_blobs.get(old, set())
                going |= self._round_blobs[old] - own
                self._round_blobs[old] = set(own)
        if going:
            kept = set().union(*self._round_blobs.values()) if self._round_blobs else set()
            self.bulk.drop(going - kept)

    async def _wait_asking(self, key: tuple[int, int], pending: Pending, wait: rounds.RoundWait, have, coming,
                           covered=lambda: False) -> None:
        """The round's wait (``_wait_round``), and meanwhile: an update announcement we wait for that a counted
        peer's member view names (it closed the round holding it) and gossip has not brought us a little after that
        view came (FETCH_AFTER, or a quarter of deadline_low if less) is asked of that peer (one peer at a time,
        each once; checked as any fetched announcement). Without it, a peer whose gossip lost one announcement
        waited to its deadline every round, closed after the others had stopped waiting for it, and was left out,
        round after round (the simulator: a peer blind to another's announcements). Ends early once ``covered()``
        (the coordinator's view is here and we hold everything it names)."""
        r, p = key
        after = min(FETCH_AFTER, self.cfg.deadline_low / 4)  # the wait may be no longer than deadline_low
        asked: set[str] = set()
        fetch: asyncio.Task | None = None
        try:
            while not covered() and (left := wait.remaining(self.clock.monotonic(), have(), coming())) is not None:
                now = self.clock.monotonic()
                if fetch is None or fetch.done():
                    lacking = {rounds.short_id(a) for a in wait.waited if a not in pending.announced}
                    due = [(t, a) for a, t in pending.view_at.items()
                           if a not in asked and lacking & pending.views[a]]
                    ready = min(((t, a) for t, a in due if now >= t + after), default=None)
                    if ready is not None:
                        author = ready[1]  # the view that came first
                        asked.add(author)
                        self.counters["announcements_asked_early"] += 1
                        fetch = asyncio.get_running_loop().create_task(
                            self._fetch_announcements(author, r, p, sorted(lacking & pending.views[author])))
                        continue
                    if due:
                        left = min(left, max(min(t for t, _ in due) + after - now, rounds.TICK))
                await outer.wait_event(self._event, left)
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()

    async def _agree(self, key: tuple[int, int], pending: Pending, members: set[str], base: str,
                     mode: str) -> set[str]:
        """The round's members, the same at every peer (``rounds.MemberAgreement``): we publish our view and take
        the view of the round's coordinator. The peers it names must have announced an update from our weights
        (an announcement still on its way is waited for), and in all-to-all their updates are pulled: all within
        one span (``_span``), after which what is missing is left out (we may then end on other weights than the others,
        and resync or redo as before). A coordinator's view naming more newcomers than a round takes is not
        followed (ours is)."""
        r, p = key
        me = self._ctx.identity.peer_id
        if not self.cfg.agree or len(members) > MAX_VIEW:
            return members
        mine = sorted(rounds.short_id(a) for a in members)
        self._publish(MEMBERS, {"r": r, "p": p, "m": mine})
        chain = self._chain(r, p)
        # one span: the coordinator's view and the announcements it names come over gossip, which a loaded peer
        # (16 nodes on 2 cores) delivers seconds late: a deadline alone split views there
        now, span = self.clock.monotonic(), self._span(p)
        end = now + span
        agreement = rounds.MemberAgreement(me, chain, end)
        late = chain and chain[0] == me and rounds.too_late_to_coordinate(me, chain, now, pending.view_at, span)
        if late:
            agreement = agreement.after(now)
            self.counters["coordinator_too_late"] += 1
            logger.info("diloco round %d/%d: we coordinate it, but most of the chain stopped waiting for our view "
                        "a span ago; taking the next coordinator's, as they did", r, p)
        while (left := agreement.remaining(self.clock.monotonic(), pending.views)) is not None:
            await outer.wait_event(self._event, left)
        chosen = agreement.coordinator(pending.views)
        if chosen is not None and chosen != chain[0] and not late:
            self.counters["coordinator_missing"] += 1
            logger.info("diloco round %d/%d: no member view from its coordinator %s; %s's taken", r, p,
                        chain[0][-8:], chosen[-8:])
        if chosen is None or chosen == me or pending.views[chosen] == frozenset(mine):
            pending.coordinator = chosen
            return members
        view = pending.views[chosen]

        def named() -> tuple[set[str], int]:
            return rounds.resolve_view(view, {rounds.short_id(a): a for a, ann in pending.announced.items()
                                              if ann.base == base and a not in pending.failed})

        fetch, fetch_end = None, end
        asked_at = self.clock.monotonic() + min(FETCH_AFTER, max(end - self.clock.monotonic(), 0.0) / 4)
        try:
            while (agreed := named())[1] and (self.clock.monotonic() < end - rounds.TICK or (
                    fetch is not None and not fetch.done() and self.clock.monotonic() < fetch_end)):
                if fetch is None and self.clock.monotonic() >= asked_at:
                    # gossip has not brought some of the updates it names: ask the coordinator, which holds them
                    # (a request and its answers: given FETCH_WAIT past the span if it needs it)
                    known = {rounds.short_id(a) for a in pending.announced}
                    fetch = asyncio.get_running_loop().create_task(
                        self._fetch_announcements(chosen, r, p, sorted(set(view) - known)))
                    fetch_end = max(end, self.clock.monotonic() + FETCH_WAIT)
                wait = (fetch_end if fetch is not None else asked_at) - self.clock.monotonic()
                await outer.wait_event(self._event, max(wait, rounds.TICK))
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()
        agreed, unknown = agreed
        if unknown:
            self.counters["view_peers_unknown"] += unknown
            logger.warning("diloco round %d/%d: %d peer(s) of %s's member view never announced an update here", r,
                           p, unknown, chosen[-8:])
        if sum(not self.standing.counts(a) for a in agreed - members) > MAX_NEWCOMER_PULLS:
            self.counters["views_not_followed"] += 1
            return members
        if mode != "scatter":  # the updates themselves, pulled (most are already)
            for peer in sorted(agreed - set(pending.updates) - pending.pulling):
                self._start_pull(key, pending, peer)
            await outer.wait_until(lambda: agreed - pending.failed <= set(pending.updates), self._event,
                                   end - self.clock.monotonic())
            if missing := agreed - set(pending.updates):  # we combine without them: the others may not
                self.counters["view_updates_missing"] += len(missing)
                logger.warning("diloco round %d/%d: the update of %s, which %s's member view names, did not come "
                               "within the span; combined without it", r, p, sorted(a[-8:] for a in missing),
                               chosen[-8:])
            agreed &= set(pending.updates)
        self.counters["members_from_coordinator"] += 1
        pending.coordinator = chosen
        if me in members and me not in agreed:
            # our update reached the coordinator after its deadline: we are behind the others in time, and the
            # next rounds, whose candidates are this round's members, would not wait for us either (we would be
            # left out round after round). Ask to be waited for, as a joiner does: the next rounds then wait for
            # us (a deadline at most) and we are back in step
            self.counters["own_update_left_out"] += 1
            for ahead in (r + 1, r + 2):
                self._publish(JOIN, {"r": ahead, "p": p, "join": True})
        return agreed

    def _chain(self, r: int, p: int) -> tuple[str, ...]:
        """Round r's chain of coordinators (``rounds.MemberAgreement``). It comes from the last round's members
        (agreed: the same set at every peer), so a peer that was late here and in time elsewhere is not first at
        some peers and skipped at others; members the others measured slow in the last round come last (stable:
        the round's order otherwise): a slow coordinator's own pulls, and so its parts list, wait behind its
        uploads."""
        me = self._ctx.identity.peer_id
        last = self.participants.get(p, self._initial)
        chain = tuple(a for a in exchange.order(self.cfg.run, r, p, last) if a == me or self.standing.counts(a))
        return exchange.slow_last(chain, self._chain_weights.get(p, {}))

    async def _redo_last_close(self, p: int, r: int, pending: Pending, have: set[str]) -> None:
        """Before closing round r: if most counted peers' updates for it were computed from other weights than
        ours, and closing round r - 1 without our update, without the last one to arrive, or without both gives
        those weights, take them instead of pulling a checkpoint next round. The usual case: our update reached the
        others after their deadline (a far peer) but counted at ours, or one arrived just in time here and just too
        late there."""
        redo = self._redo.get(p)
        me = self._ctx.identity.peer_id
        if redo is None or redo.round != r - 1:
            return
        bases = collections.Counter(ann.base for a, ann in pending.announced.items()
                                    if a != me and a in have and self.standing.vouched(a))
        if not bases:
            return
        base, votes = bases.most_common(1)[0]
        if 2 * votes > sum(bases.values()) and base != self._base_hash(p):
            await self._redo_with(p, redo, lambda fixed: outer.params_hash([fixed]) == base)

    def _drop_redo(self, p: int) -> Redo | None:
        """Forget fragment p's redo (its late pulls cancelled); returns it, its tensors still usable."""
        redo = self._redo.pop(p, None)
        if redo is not None:
            redo.drop()
        return redo

    async def _redo_with(self, p: int, redo: Redo, matches) -> bool:
        """Close ``redo``'s round again with each of its variants' member sets (in a worker thread, on copies of
        the momentum: up to five combinations of a fragment); the first whose weights ``matches`` accepts replaces
        ours (global weights and momentum; our local weights move by the same difference, so our training goes on
        from them). The hash we published for that round goes: it is not ours any more."""
        me = self._ctx.identity.peer_id

        def search() -> tuple[frozenset[str], torch.Tensor, torch.Tensor] | None:
            opt = outer.OuterNesterov([], self.outer_opt.lr, self.outer_opt.momentum)  # the same step, bit for bit
            for members in redo.variants(me):
                combined, _ = outer.combine({a: redo.update(a) for a in members}, redo.global_before.numel())
                opt.buffers = {p: redo.momentum.clone()}
                fixed = redo.global_before if combined is None else opt.step(p, redo.global_before, combined)
                if matches(fixed):
                    return members, fixed, opt.buffers[p]
            return None

        found = await asyncio.to_thread(search)
        if found is None:
            return False
        members, fixed, self.outer_opt.buffers[p] = found
        frag = [self.params[i] for i in self.frag_index[p]]
        with torch.no_grad():
            outer.unflatten_into(outer.flatten(frag) + (fixed - self.global_flat[p]), frag)
        self.global_flat[p] = fixed
        self._global_version += 1
        self._published.pop((redo.round, p), None)
        self.counters["redone"] += 1
        logger.warning("diloco: the others closed round %d/%d without %s; redone so, no checkpoint needed",
                       redo.round, p, sorted(redo.members - members))
        return True

    def _check_previous(self, p: int, r: int) -> None:
        """Compare the global hash we published for round r-1 with what the others published for it; where none
        of them has (we are ahead of them: our deadlines passed before their updates came, and we close rounds
        without them, faster than they do), the newest of our rounds not yet compared that they published a hash
        for. Without that, a peer that ran ahead alone was never compared with anyone and ended the run on its own
        weights (the simulator: one peer's uplink down to 50 kB/s mid-run, another peer ahead from then on)."""
        for rr in sorted((k[0] for k in self._published if k[1] == p and k[0] < r), reverse=True):
            if (rr, p) in self._checked:
                return
            verdict = rounds.hash_verdict(self._published[(rr, p)], self.round_hashes.get((rr, p), {}),
                                          self.standing.vouched, me=self._ctx.identity.peer_id,
                                          salt=f"{self.cfg.run}/{rr}/{p}")
            if verdict is not None:
                self._checked.add((rr, p))
                if rr < r - 1:
                    self.counters["checked_behind_us"] += 1
                self._judge_previous(p, r, rr, verdict)
                return

    def _judge_previous(self, p: int, r: int, rr: int, verdict: rounds.HashVerdict) -> None:
        """Our hash for round rr (before r, the round we close) against the others': in the minority, resync."""
        if verdict.agrees and self._ctx.identity.peer_id in self._contributed.pop((rr, p), ()):
            self._included += 1  # the others combined our update too: our word counts there
        if not verdict.agrees:
            # do the others still count us? yes if we started the run with them (unless a rejoin just failed to
            # take), or if the majority's weights contained our update in EARN rounds since
            self._counted_before_resync = self._still_counted(r)
            self._rejoined_at = r
            self._included = 0
            self.counters["diverged"] += 1
            logger.error("diloco: our global weights left the majority at round %d/%d; resyncing", rr, p)
            self._resync_from = list(verdict.holders)
            self._left_majority()

    def _left_majority(self) -> None:
        """Our weights left the majority's: the peer whose checkpoint we joined from is asked after the others."""
        if self._checkpoint_from is not None:
            rounds.keep_latest(self._led_off, self._checkpoint_from, None, MAX_PEER_ENTRIES)

    def _still_counted(self, r: int | None = None) -> bool:
        """Do the others still count us when we resync at round r? Yes if we started the run with them (unless a
        rejoin just failed to take), or if the majority's weights contained our update in EARN rounds since."""
        r = min(self.rounds_done) if r is None else r
        return (self._founder and r - self._rejoined_at > EARN) or self._included >= EARN

    def _replays(self, p: int, pending: Pending, members: set[str]) -> dict[str, str]:
        """Members whose update for this round is the very one they sent for an earlier round of the fragment (the
        same encoded parts: an honest peer's next update always differs): refused as "replayed". Remembers the
        members' parts for the next round (at most MAX_REMEMBERED_UPDATES peers x fragments)."""
        out = {}
        for a in sorted(members):
            ann = pending.announced.get(a)
            if ann is None:
                continue
            if a != self._ctx.identity.peer_id and self._last_parts.get((a, p)) == ann.parts:
                out[a] = "replayed"
            self._last_parts[(a, p)] = ann.parts
            self._last_parts.move_to_end((a, p))
        while len(self._last_parts) > MAX_REMEMBERED_UPDATES:
            self._last_parts.popitem(last=False)
        return out

    def _mode(self, p: int) -> str:
        """How this round's updates move: the same answer at every peer that closed the last round with us (it
        depends on that round's participants and on the encoded update's size, which the codec fixes)."""
        if self.cfg.exchange != "auto":
            return self.cfg.exchange
        peers = len(self.participants.get(p, self._initial))
        return "scatter" if peers >= self.cfg.scatter_min_peers and self._update_bytes(p) >= \
            self.cfg.scatter_min_bytes else "all-to-all"

    def _update_bytes(self, p: int) -> int:
        return sum(self._part_bytes(p))

    def _slowest_rate(self, members: list[str], announced: dict[str, Announced]) -> int | None:
        """The lowest rate (kB/s) at which the others received from one of the round's members last time, as their
        announcements report it (``exchange.measured_rates``); None if none was measured. A member measured at 0
        (it sent nothing: its pulls failed) is a stall, not a rate to wait on, and is left out."""
        rates = exchange.measured_rates(members, {a: dict(announced[a].rates) for a in members if a in announced},
                                        rounds.short_id)
        return min((rate for rate in rates.values() if rate > 0), default=None)

    def _span(self, p: int, slowest: int | None = None, members: int = 1) -> float:
        """The time a round's exchange step is given: the deadline, and each peer moving about 2 x one update at
        ``min_bandwidth``, or at the rate our last scatter steps measured where that is lower (that time capped at
        deadline_high, or at what ``min_bandwidth`` gives where that is more); a peer that stalls costs the others
        one span at most.

        Measured, not only configured: 4 peers on 200 kB/s links (the simulator) exchanging a 0.27 MB update with
        the default 10 MB/s had 0.05 s for seconds of transfers: over seeds 1-8, 4 runs ended on 2 or 3 different
        weights, none had fewer than 5 resyncs (1.0 to 1.9 members a round); with the measured rate, 2 ended
        split, 4 had 0-1 resyncs and 3.4-4 members; with the coordinator's minority parts replaced as well
        (``_majority_parts``), all 8 ended on one weights with no resync and 4 members a round
        (``bench/bench_sim.py --slow``).

        And, with ``slowest`` (kB/s: the slowest of the round's ``members`` members' rates, ``_slowest_rate``),
        that member sending each peer its chunks (about 1/N of an update each) at that rate: every peer's steps
        wait on it, not only ours. With our receive rate alone, the fast peers gave their steps 1.5 s of a round
        that needed 4 s for a peer whose uplink had fallen to 50 kB/s, gave up on its chunks at different times
        and ended on different weights (the simulator; ``bench/bench_sim.py --uplink``)."""
        moved = self._update_bytes(p) + sum(self._part_bytes(p, reduced=True))  # the chunks in, the combined out
        need = moved / self._transfer_rate()
        if slowest:
            need = max(need, self._update_bytes(p) / max(1, members) / (slowest * 1000))
        # the measured rate is never above min_bandwidth, so this is never less than what min_bandwidth gives
        transfer = min(need, max(moved / self.cfg.min_bandwidth, self.cfg.deadline_high))
        return max(self.cfg.deadline_low, self.deadline.value()) + transfer

    def _transfer_rate(self) -> float:
        """Bytes/s: ``min_bandwidth``, or the median rate our last scatter steps received at where that is lower."""
        if not self._rates:
            return self.cfg.min_bandwidth
        return min(self.cfg.min_bandwidth, statistics.median(self._rates))

    def _fold_rates(self, meter: exchange.RateMeter) -> None:
        """A closed round's receive rates per source (kB/s) become the ones we report with our next updates."""
        rates = meter.rates()
        if len(self._source_rates) + len(rates) > 4 * MAX_VIEW:
            self._source_rates.clear()  # bounded: peers come and go; the next round measures again
        for peer, rate in rates.items():
            self._source_rates[peer] = min(2**31, int(rate // 1000))

    def _rates_now(self, pending: Pending, peers) -> dict[str, int]:
        """kB/s from each of ``peers`` as this round measured it so far (its pulls that ended), else as the last
        round did; one measured by neither is left out."""
        out = {}
        for a in peers:
            rate = pending.meter.so_far(a)
            if rate is not None:
                out[a] = int(rate // 1000)
            elif a in self._source_rates:
                out[a] = self._source_rates[a]
        return out

    def _chunk_source(self, pending: Pending, owner: str, first: str | None) -> str:
        """Whom to ask first for ``owner``'s chunk: ``first`` (a member that holds it) or its owner, whichever this
        round measured faster (``_rates_now``; one not measured counts as fast; a tie keeps ``first``)."""
        if first in (None, self._ctx.identity.peer_id, owner) or first not in pending.announced:
            return owner
        return exchange.fastest_first([first, owner], self._rates_now(pending, (first, owner)))[0]

    def _rate_reports(self, p: int) -> tuple[tuple[bytes, int], ...]:
        """What our announcement reports: the rates we measured from the last round's members (short ids, sorted)."""
        last = self.participants.get(p, self._initial)  # round 0: the founders, as the link probe measured them
        known = sorted((rounds.short_id(a), self._source_rates[a]) for a in last if a in self._source_rates)
        return tuple(known[:exchange.MAX_RATE_REPORTS])

    async def _serve_probe(self) -> None:
        """Hold the blobs the others' link probe pulls from us (``exchange.probe_payload``), from before the start
        barrier (a peer past it probes at once) until our first round closes."""
        me = self._ctx.identity.peer_id

        def make() -> list[tuple[bytes, bytearray]]:
            out = []
            for size in exchange.probe_sizes(self._update_bytes(0)):
                payload = bytearray(exchange.probe_payload(me, size))
                out.append((content_hash(payload), payload))
            return out

        for blob_hash, payload in await asyncio.to_thread(make):
            self._probe_blobs.append(self.bulk.keep_prepared(blob_hash, payload))

    async def _probe_links(self, peers: list[str]) -> None:
        """The founders' rates before round 0 (``exchange.PROBE_SIZES``): from each peer we started with, the
        probe blobs it serves, pulled in turn until one takes MIN_BUSY, all of them within PROBE_SECONDS, at once
        from every peer (as a round pulls). The rates become the ones our first update reports, so round 0's span
        already gives a slow uplink's chunks their time (``_span``), its parts follow the reports (``_owners``), and
        a checkpoint is taken from a fast holder (``exchange.fastest_first``)."""
        sizes = exchange.probe_sizes(self._update_bytes(0))
        end = self.clock.monotonic() + exchange.PROBE_SECONDS

        async def one(peer: str) -> None:
            pulls: list[tuple[int, float, bool]] = []
            for size in sizes:
                left = end - self.clock.monotonic()
                if left <= 0:
                    break
                blob = await asyncio.to_thread(_probe_hash, peer, size)
                t0 = self.clock.monotonic()
                # timed from the source's answer to the last byte: the stream's opening and the request's round
                # trip are latency, not the link's rate (timed from the request, a 16 KiB probe over 2 MB/s links
                # with 150 ms one way measured 35 kB/s in the simulator, under a slow uplink's 50)
                marks: list[float] = []
                try:
                    await self.bulk.pull_from(blob, size, peer, [], timeout=left,
                                              progress=lambda _: marks.append(self.clock.monotonic()))
                    pulls.append((size, marks[-1] - marks[0] if marks else self.clock.monotonic() - t0, True))
                except (BulkError, asyncio.TimeoutError):
                    if self.clock.monotonic() - t0 >= 0.9 * left:  # still coming at the end: at most that fast
                        pulls.append((size, self.clock.monotonic() - (marks[0] if marks else t0), False))
                    break  # anything else (it serves no probe: an older node, not reached directly): no rate
                finally:
                    self.bulk.drop([blob])
                if pulls[-1][1] >= exchange.MIN_BUSY:
                    break
            rate = exchange.probe_rate(pulls)
            if rate is not None:
                self._source_rates[peer] = min(2**31, int(rate // 1000))
                self.counters["links_probed"] += 1

        await asyncio.gather(*(one(peer) for peer in peers[:exchange.MAX_RATE_REPORTS]))
        measured = sorted((self._source_rates[a], a) for a in peers if a in self._source_rates)
        if measured:
            logger.info("diloco: link probe: %d of %d peer(s) measured, %d to %d kB/s (slowest: %s)", len(measured),
                        len(peers), measured[0][0], measured[-1][0], measured[0][1][-8:])

    def _owners(self, ordered: list[str], parts: int, announced: dict[str, Announced]) -> list[str]:
        """Who reduces each part this round: the round's order, weighted by the rates its members' announcements
        report (``exchange.rate_weights``: only peers the others receive slowly from reduce fewer parts)."""
        weights = exchange.rate_weights(ordered, {a: dict(announced[a].rates) for a in ordered if a in announced},
                                        rounds.short_id)
        return exchange.reducers(ordered, parts, weights)

    def _measure_rate(self, moving: Received) -> None:
        """One scatter step's receive rate: the bytes of the chunks and parts that came, over the time from the
        step's start to the last of them (a peer that never sends adds no time)."""
        if moving.bytes < RATE_MIN_BYTES or moving.last <= moving.start:
            return
        self._rates.append(moving.bytes / (moving.last - moving.start))
        rate = self._transfer_rate()
        if rate < self.cfg.min_bandwidth / 2 and not self._slow_link_said:
            self._slow_link_said = True  # once a run: the rate itself is in /status
            logger.warning("diloco: transfers measured at %.0f kB/s, below min_bandwidth (%.0f kB/s): the exchange "
                           "now gets the measured time (loops.%s.min_bandwidth = your link's rate gives it from the "
                           "first round)", rate / 1e3, self.cfg.min_bandwidth / 1e3, self.name)

    def _want_parts(self, p: int) -> int:
        """How many parts we cut our next update of fragment p into: ``parts``, or with "auto" as many as the last
        round's participants call for (``exchange.auto_parts``: every peer that closed that round with the same
        members cuts its update the same way, as with the exchange's mode)."""
        n = self.global_flat[p].numel()
        if self.cfg.parts != "auto":
            return exchange.part_count(n, self.cfg.parts)
        return exchange.part_count(n, exchange.auto_parts(len(self.participants.get(p, self._initial)), self.cfg.audit))

    def _part_counts(self, p: int) -> set[int]:
        """The part counts an announcement for fragment p may have: ours, or with "auto" any that "auto" gives."""
        n = self.global_flat[p].numel()
        if self.cfg.parts != "auto":
            return {exchange.part_count(n, self.cfg.parts)}
        return {exchange.part_count(n, x) for x in exchange.AUTO_PARTS}

    def _round_parts(self, key: tuple[int, int]) -> int:
        """A round's part count: from its close on, the count most of its announcements have (``_close_round``);
        before, our announcement's if we sent one, else what we would cut an update into now. An announcement with
        another count (its author closed the last round with other members) is not counted in a scatter round, as
        one from other weights is not."""
        pending = self.pending.get(key)
        if pending is not None and pending.count is not None:
            return pending.count
        mine = pending.announced.get(self._ctx.identity.peer_id) if pending is not None else None
        return len(mine.parts) if mine is not None else self._want_parts(key[1])

    def _bounds(self, p: int, count: int) -> list[tuple[int, int]]:
        """The value ranges fragment p's update is cut into when it is cut into ``count`` parts."""
        return exchange.part_bounds(self.global_flat[p].numel(), count)

    def _part_bytes(self, p: int, reduced: bool = False, count: int | None = None) -> list[int]:
        """The size of each encoded part of fragment p cut into ``count`` parts (default: ``_want_parts``; the codec
        fixes it): what a peer may announce, at most; with ``reduced``, of each combined part a reducer may publish
        (``reduced_codec``)."""
        codec = self.reduced_codec if reduced else self.codec
        count = self._want_parts(p) if count is None else count
        # one encoding of zeros per codec, count and part length (the parts of a count differ by one value at most:
        # two short encodings, not the whole fragment's); a run whose reduced_codec is its codec pays it once
        key = (p, codec.name, count)
        if key not in self._encoded_size:
            bounds = self._bounds(p, count)
            size = {m: len(codec.encode(torch.zeros(m)).to_wire()) for m in {b - a for a, b in bounds}}
            self._encoded_size[key] = [size[b - a] for a, b in bounds]
        return self._encoded_size[key]

    def _start_pull(self, key: tuple[int, int], pending: Pending, peer: str) -> None:
        pending.pulling.add(peer)
        task = asyncio.get_running_loop().create_task(self._pull(key, peer, pending.announced[peer]))
        pending.pulls.add(task)
        task.add_done_callback(pending.pulls.discard)

    def _source(self, peer: str) -> asyncio.Semaphore:
        """At most two transfers from one peer at once (a peer serves four to one requester at most)."""
        sem = self._sources.get(peer)
        if sem is None:
            if len(self._sources) > 4096:
                self._sources.clear()
            sem = self._sources[peer] = asyncio.Semaphore(2)
        return sem

    async def _by(self, end: StepEnd, awaitable):
        """``awaitable``'s result, or TimeoutError once ``end`` has passed (re-read as arrivals move it)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                remaining = end.at - self.clock.monotonic()
                if remaining <= 0:
                    raise asyncio.TimeoutError()
                try:
                    return await asyncio.wait_for(asyncio.shield(task), max(0.05, remaining))
                except asyncio.TimeoutError:
                    if task.done():
                        return task.result()  # (its own TimeoutError raised again)
                    if end.at - self.clock.monotonic() <= rounds.TICK:
                        raise
        finally:
            if not task.done():  # as wait_for: cancelled, and its end awaited
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _pulls_end(self, key: tuple[int, int], at: float, grace: float) -> StepEnd:
        """An end for pulls of the scatter step ``key`` made from ``at``: arrivals in the step move it by ``grace``
        after each, up to deadline_high from now (or ``at`` where that is later)."""
        now = self.clock.monotonic()
        end = StepEnd(at, cap=max(at, now + self.cfg.deadline_high), grace=grace)
        if (moving := self._moving.get(key)) is not None:
            moving.ends.append(end)
        return end

    async def _fetch_part(self, key: tuple[int, int], peer: str, blob: bytes, size: int, addrs, elements: int,
                          timeout: float | StepEnd, holders: list[tuple[str, tuple]] = (),
                          counter: str = "chunks_from_other_holders", out: torch.Tensor | None = None,
                          decode: bool = True) -> torch.Tensor | bytearray:
        """One encoded part that ``peer`` named, pulled and decoded (off the event loop when large): from ``peer``,
        and if it fails us (gone: killed mid-round), from each of ``holders`` in turn ((peer, addrs): the round's
        other members, any of which may have pulled it already: a pulled blob is kept and served, and its hash is
        the one ``peer`` signed), all within ``timeout``; a part that came from a holder is counted as ``counter``.
        Without the holders, a member that pulled a dead peer's chunk (the part's auditor, a prefetch) combined it
        and the others could not: the round split (found by the simulator, and seen as the kill bench's survivors
        diverging); and a reducer that died after serving its part to some members left the others without it.
        With ``out`` (a float32 view of ``elements`` values) the part is decoded into it, not into a new tensor;
        without ``decode``, the (hash-checked) bytes are returned as they came, to be decoded when used. A
        ``StepEnd`` as the timeout: its time, as arrivals move it."""
        end = timeout if isinstance(timeout, StepEnd) else StepEnd(self.clock.monotonic() + max(0.05, timeout))
        sources = [(peer, addrs), *[(h, a) for h, a in holders if h != peer]]
        body, failure = None, None
        meter = pending.meter if (pending := self.pending.get(key)) is not None else None
        for i, (source, where) in enumerate(sources):
            if end.at - self.clock.monotonic() <= 0:
                break
            got = 0
            if meter is not None:
                meter.start(source, self.clock.monotonic())
            try:
                async with self._source(source):
                    body = await self._by(end, self.bulk.pull_from(blob, size, source, list(where)))
                got = size
            except (BulkError, asyncio.TimeoutError) as e:
                failure = failure or e
                continue
            finally:
                if meter is not None:
                    meter.end(source, self.clock.monotonic(), got)
            if i:
                self.counters[counter] += 1
            break
        if body is None:
            raise failure or asyncio.TimeoutError()
        self._round_blobs[key].add(blob)
        self.counters["bytes_received"] += size
        if (moving := self._moving.get(key)) is not None:
            moving.bytes += size
            moving.last = self.clock.monotonic()
            for step_end in moving.ends:
                step_end.arrived(moving.last)
        if not decode:
            return body
        # the held blob itself (never changed, only dropped), not a copy
        if size > 1 << 18:
            return await asyncio.to_thread(_decode_part, body, elements, out)
        return _decode_part(body, elements, out)

    def _pull_late(self, r: int, p: int, peer: str, ann: Announced) -> None:
        """A counted peer's update for the round we closed last, computed from the weights we closed it from, came
        after the close: pulled all the same (a few a round) for a redo of that close (see ``_redo_last_close``)."""
        redo = self._redo.get(p)
        if redo is None or redo.round != r or peer in redo.members or peer in redo.pulling or ann.base != redo.base \
                or len(redo.pulling) >= MAX_LATE_PULLS or not self.standing.counts(peer):
            return
        redo.pulling[peer] = asyncio.get_running_loop().create_task(self._pull((r, p), peer, ann, into=redo.late))

    async def _pull(self, key: tuple[int, int], peer: str, ann: Announced,
                    into: dict[str, torch.Tensor] | None = None) -> None:
        """All-to-all: the whole update of ``peer``, every part (into its round's pending updates, or ``into``)."""
        try:
            if len(ann.parts) not in self._part_counts(key[1]):
                raise codecs.CodecError(f"{len(ann.parts)} parts, not one of {sorted(self._part_counts(key[1]))}")
            # (whatever the count, the parts decoded one after another make the whole update)
            bounds = self._bounds(key[1], len(ann.parts))
            chunks = await asyncio.gather(*(self._fetch_part(key, peer, h, size, ann.addrs, b - a, 300.0)
                                            for h, size, (a, b) in zip(ann.parts, ann.sizes, bounds)))
            update = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            if update.dim() != 1:
                raise codecs.CodecError("an update must be a flat vector")
        except (BulkError, codecs.CodecError, asyncio.TimeoutError) as e:
            self.counters["pull_failed"] += 1
            logger.warning("diloco update from %s unusable: %s", peer, e)
            if key in self.pending:  # not 'on its way' any more: its round stops waiting for it
                self.pending[key].failed.add(peer)
                if isinstance(e, codecs.CodecError):  # the bytes it announced, hash-checked: the sender's fault
                    self.pending[key].refused[peer] = "undecodable"
                self._event.set()
            return
        if into is not None:
            into[peer] = update
            return
        pending = self.pending.get(key)
        if pending is None:
            redo = self._redo.get(key[1])
            if redo is not None and redo.round == key[0] and peer in redo.pulling:  # on its way when we closed
                redo.late[peer] = update
            return
        pending.updates[peer] = update
        pending.arrivals[peer] = self.clock.monotonic()
        self._event.set()

    # ------------------------------------------------------------------ the reduce-scatter + all-gather exchange
    async def _scatter(self, key: tuple[int, int], pending: Pending,
                       members: set[str]) -> tuple[torch.Tensor | None, dict[str, str]]:
        """Combine the members' updates by reduce-scatter + all-gather (``protocols/exchange.py``): we reduce the
        parts the round's order gives us and publish them (with the members whose chunks each combines), audit a
        part when the round draws it for us, and take every other part from its reducer; a part whose reducer fails
        us by the deadline, or that its auditor disputes, we reduce ourselves from the members' chunks. Then every
        peer takes the round's coordinator's parts (``_conform``): peers that reduced a late part themselves, from
        other chunks than its reducer (a chunk that did not come in time somewhere), end on the same weights."""
        r, p = key
        me = self._ctx.identity.peer_id
        n = self.global_flat[p].numel()
        bounds = self._bounds(p, self._round_parts(key))
        # before the digest: every peer refuses the same updates from the same announcements
        members, rejected = exchange.screen_members(
            {a: (len(pending.announced[a].parts), pending.announced[a].norm) for a in members}, len(bounds))
        if not members:
            return None, rejected
        ordered = exchange.order(self.cfg.run, r, p, members)
        digest = exchange.members_digest(members)
        factors = exchange.clip_factors({a: pending.announced[a].norm for a in members}, CLIP)
        # time for the transfers: each peer moves about 2 x one update; a peer that stalls costs one such span
        slowest = self._slowest_rate(ordered, pending.announced)
        span = self._span(p, slowest, len(ordered))
        end = self.clock.monotonic() + span
        # the pulls' end moves while parts still come: the span's transfer time is a guess before the first
        # measurement (on a slower link than min_bandwidth round 0 had 1 s for ~11 s of transfers, and every peer
        # ended it on its own weights: the simulator at 100 kB/s)
        pulls = self._pulls_end(key, end, span)
        # the combined update, filled as parts come: a part taken from its reducer is decoded straight into its
        # place (no second copy of the update); one we reduced is copied in at the end (``parts`` -> our tensor)
        combined = self._buffers.take(n)  # (the last global weights' buffer, where it was given back)
        parts: dict[int, torch.Tensor] = {}
        used: dict[int, tuple[bytes, frozenset[str] | None]] = {}  # the part we take: (blob hash, whose chunks)
        screened: dict[str, str] = {}
        computed: dict[int, tuple[bytes, torch.Tensor, int, frozenset[str]]] = {}  # our reductions (and whose)

        async def compute(k: int, until: float | StepEnd, only: frozenset[str] | None = None,
                          first: str | None = None) -> bool:
            """Reduce part k from the members' chunks (``only`` those: False if one of them did not come) by
            ``until``. The chunks are pulled as bytes and decoded only when the part is reduced, a few parts at a
            time (``_reducing``): decoded, a round's chunks were a copy of the update held at once. ``first``: a
            member that holds them all (the coordinator whose part we follow), asked before each chunk's owner."""
            a, b = bounds[k]
            if not isinstance(until, StepEnd):
                until = self._pulls_end(key, until, span)
            got: dict[str, torch.Tensor | bytearray] = {}  # peer -> its chunk, decoded (whole) or as bytes

            async def one(peer: str) -> None:
                ann = pending.announced[peer]
                whole = pending.updates.get(peer)
                early = pending.prefetched.get((peer, k))
                if early is not None and early.done() and (early.cancelled() or early.exception() is not None):
                    early = None  # that pull failed: try again now
                if whole is not None:  # ours, or an update pulled whole already
                    got[peer] = whole[a:b]
                elif peer == me:  # ours: the bytes of the part we serve
                    if (held := self.bulk.blobs.get(ann.parts[k])) is not None:
                        got[peer] = held
                    else:  # dropped by the bulk store, over its budget (``blobs_evicted``): left out, as a late one
                        self.counters["chunks_missing"] += 1
                else:
                    if early is not None and (first is None or early.done()):  # pulled as its announcement came
                        pending.prefetch_used.add((peer, k))
                        pull = self._by(until, asyncio.shield(early))
                    else:
                        # from its owner, then any member that holds it; or first from ``first``: the coordinator
                        # reduced its part from this chunk, so it holds it (the hash is the one the owner signed),
                        # and when we follow its part the owner is the slow source, its uplink the one the round
                        # waits on (the simulator: one uplink down to 50 kB/s, and the others could not check the
                        # coordinator's parts in time and kept theirs). Of the two, the faster as measured
                        # (``_rates_now``): when the coordinator is the slow one, its chunks of the fast peers' went
                        # through its uplink too, and the others gave up on parts their owners could have sent at
                        # once (the simulator: two uplinks of 4 falling mid-round, the coordinator's among them)
                        source = self._chunk_source(pending, peer, first)
                        pull = self._fetch_part(key, source, ann.parts[k], ann.sizes[k],
                                                pending.announced[source].addrs, b - a, until, holders=[
                                                    (x, pending.announced[x].addrs)
                                                    for x in dict.fromkeys([peer, *ordered]) if x not in (me, source)],
                                                counter="chunks_from_other_holders" if source == peer
                                                else "chunks_not_from_coordinator", decode=False)
                    try:
                        got[peer] = await pull
                    except (BulkError, asyncio.TimeoutError) as e:
                        self.counters["chunks_missing"] += 1
                        self._log_missing(peer, f"part {k} of its update for round {r}/{p} did not arrive: {e}")

            await asyncio.gather(*(one(peer) for peer in sorted(members if only is None else members & only)))

            def decode_and_check() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
                """The chunks decoded (each into a buffer a part decoded before gave back: ``drop``) and checked."""
                chunks, bad = {}, {}
                for peer in sorted(got):
                    chunk = got[peer]
                    if not isinstance(chunk, torch.Tensor):
                        buf = self._buffers.take(b - a)
                        try:
                            chunk = _decode_part(chunk, b - a, buf)
                        except codecs.CodecError:
                            self._buffers.give(buf)
                            bad[peer] = "undecodable"
                            continue
                        if chunk.dtype == torch.float32 and chunk.data_ptr() == buf.data_ptr():
                            chunk = buf  # the same values (a view of it, shaped as sent: one dimension)
                    # (decoded: codecs.decode refused non-finite values; a whole update was decoded so too)
                    why = exchange.chunk_ok(chunk, b - a, pending.announced[peer].norm, checked=True)
                    if why is not None:
                        bad[peer] = why
                        self._buffers.give(chunk)
                    else:
                        chunks[peer] = chunk
                return chunks, bad

            def drop(held: dict[str, torch.Tensor]) -> None:
                """The decoded chunks in ``held`` given back for the next part's (one that is a view of a whole
                update is not ours to give: ``Buffers.give`` leaves it), ``held`` emptied."""
                while held:
                    self._buffers.give(held.popitem()[1])

            async with self._reducing:
                chunks, bad = await asyncio.to_thread(decode_and_check)
                got.clear()
                for peer, why in bad.items():
                    rejected.setdefault(peer, why)
                chunks = {peer: c for peer, c in chunks.items() if peer not in rejected}
                if only is not None and set(chunks) != only:
                    drop(chunks)
                    return False
                whose = frozenset(chunks)
                # the same rule wherever this part is reduced (its reducer, its auditor, a fallback): its chunks only
                noise = await asyncio.to_thread(exchange.uncorrelated, chunks)
                for peer in noise:
                    screened[peer] = "uncorrelated"  # from this part only: each part is judged on its own chunks
                    self._buffers.give(chunks.pop(peer))

                def reduce_and_encode() -> tuple[bytearray, bytes, torch.Tensor]:
                    combined = exchange.reduce_part(chunks, factors, b - a)
                    payload = self.reduced_codec.encode_wire(combined)
                    if self.reduced_codec.lossless:  # its values are the payload's, bit for bit
                        return payload, content_hash(payload), combined
                    # decoded into the reduction's own buffer, its values now in the payload
                    return payload, content_hash(payload), codecs.decode(payload, out=combined)

                payload, blob_hash, decoded = await asyncio.to_thread(reduce_and_encode)
                drop(chunks)
            computed[k] = (self.bulk.keep_prepared(blob_hash, payload), decoded, len(payload), whose)
            self._round_blobs[key].add(computed[k][0])
            self._own_blobs[key].add(computed[k][0])
            return True

        def own(k: int) -> None:
            blob, decoded, _, whose = computed[k]
            parts[k], used[k] = decoded, (blob, whose)

        owners = self._owners(ordered, len(bounds), pending.announced)  # part -> its reducer
        mine = [k for k in range(len(bounds)) if owners[k] == me]
        # what the round's steps wait: the span, and the slowest member's rate (kB/s, as the others measured it) it
        # took into account
        self._assignment = {"parts_reducing": len(mine), "members_reducing": len(set(owners)),
                            "span_seconds": round(span, 3), "slowest_member_kBps": slowest}
        plan = exchange.audit_plan(self.cfg.run, r, p, ordered, len(bounds), self.cfg.audit, owners)  # -> auditor
        auditing = [k for k, auditor in plan.items() if auditor == me]

        async def reduce_mine(k: int) -> None:
            await compute(k, pulls)
            blob, _, size, whose = computed[k]
            own(k)
            self._publish(REDUCED, {"r": r, "p": p, "red": k, "blob": blob, "size": size, "m": digest,
                                    "c": exchange.pack_set(ordered, whose), "addrs": list(self.bulk.addrs)})
            self.counters["parts_reduced"] += 1

        async def take(k: int) -> None:
            reducer = owners[k]
            a, b = bounds[k]
            audit = asyncio.get_running_loop().create_task(compute(k, pulls)) if k in auditing else None
            got = None  # (blob, digest, part, whose chunks)
            # a reducer gone (killed, or cut off) publishes nothing more: we reduce its part ourselves at once, not
            # at the span's end (the kill bench: a reducer killed mid-round cost the others the span, then the
            # fallback's pulls, 2 deadlines and more on a loaded machine)
            if await outer.wait_until(lambda: reducer in pending.reduced[k] or self._gone(pending, reducer),
                                      pending.part_events[k], end - self.clock.monotonic(), poll=SERVING_POLL) \
                    and reducer in pending.reduced[k]:
                blob, _, m, _, bits = pending.reduced[k][reducer]
                whose = exchange.unpack_set(ordered, bits) if m == digest else None
                if not exchange.take_reduced(m, digest, whose, members):
                    # the reducer lacked most chunks (or named no members of ours): not a part to take
                    self.counters["reduced_parts_partial"] += 1
                else:
                    try:
                        part = await self._pull_reduced(key, pending, ordered, reducer, pending.reduced[k][reducer],
                                                        b - a, pulls, out=combined[a:b])
                        if part is not None:
                            got = (blob, m, part, whose)
                    except (BulkError, asyncio.TimeoutError):
                        pass  # no member could give it to us in time: we reduce it ourselves below
            if audit is not None:
                await audit
                if got is not None:
                    # judged on the chunks the reducer says it combined (one that did not come in time at the
                    # reducer is no lie): our own reduction, or another from exactly those chunks. Other members
                    # than ours, or a chunk it names that did not come to us: nothing to compare, no dispute
                    ours = None
                    if got[1] == digest:
                        if computed[k][3] == got[3] or await compute(k, self.clock.monotonic() + span, only=got[3]):
                            ours = computed[k][0]
                        else:
                            self.counters["audits_incomplete"] += 1
                    ok = exchange.audit_verdict(got[1], digest, got[0], ours)
                    self._publish(AUDIT, {"r": r, "p": p, "aud": k, "ok": ok})
                    self.counters["parts_audited"] += 1
                    if not ok:
                        self._liar(reducer, k, r, p)
                        got = None
                if got is None:
                    own(k)  # (the audit's reduction: a failed one from exactly the reducer's chunks keeps it)
                    return
            elif got is not None and k in plan:
                auditor = plan[k]
                await outer.wait_until(lambda: auditor in pending.audits[k] or self._gone(pending, auditor),
                                       pending.part_events[k], end - self.clock.monotonic(), poll=SERVING_POLL)
                if pending.audits[k].get(auditor) is False:  # disputed: see for ourselves
                    self.counters["parts_disputed"] += 1
                    could = got[3] is not None and await compute(k, self.clock.monotonic() + span, only=got[3])
                    liar = exchange.settle_dispute(got[0], computed[k][0] if could else None)
                    if liar == "auditor":
                        self._liar(auditor, k, r, p, role="auditor")
                    elif liar == "reducer":
                        self._liar(reducer, k, r, p)
                        got = None
                    else:
                        got = None  # we cannot tell who is right: our own reduction
            if got is None:
                if k not in computed:  # its reducer failed us: reduce it ourselves (we pull its chunks)
                    self.counters["parts_fallback"] += 1
                    await compute(k, self.clock.monotonic() + span)
                own(k)
            else:
                parts[k], used[k] = got[2], (got[0], got[3])

        started = self.clock.monotonic()
        await asyncio.gather(*(reduce_mine(k) for k in mine), *(take(k) for k in range(len(bounds)) if k not in mine))
        reduced = self.clock.monotonic()
        self._phase_times["reduce"].append(reduced - started)
        await self._conform(key, pending, members, ordered, digest, parts, used, compute, computed, span)
        self._phase_times["conform"].append(self.clock.monotonic() - reduced)

        def assemble() -> torch.Tensor:  # the parts not decoded in place, copied in: off the event loop
            for k, (a, b) in enumerate(bounds):
                part = parts.pop(k)
                if part.data_ptr() != combined[a:b].data_ptr():
                    combined[a:b] = part
            return combined

        return await asyncio.to_thread(assemble), {**screened, **rejected}

    async def _conform(self, key: tuple[int, int], pending: Pending, members: set[str], ordered: list[str],
                       digest: str, parts: dict, used: dict, compute, computed: dict, span: float) -> None:
        """Every peer ends on the round's coordinator's parts. A part whose reducer was late (or disputed) is
        reduced by each peer that gave up on it from the chunks that came to it by then, and the reducer's own
        part may lack a chunk that came too late to it: peers could end on different weights (at 16 peers on two
        cores most rounds did: 126 parts fell back in one). The coordinator (the member view we took) publishes
        each part's blob hash and the members whose chunks it combines; a peer whose part differs reduces it again
        from exactly those chunks (pulled from anyone who holds them), so the result is checked, not trusted: a
        coordinator can choose only among the honest reductions of a majority's chunks. The wait is one span
        at most; without the coordinator's list we keep our parts."""
        r, p = key
        coordinator = pending.coordinator
        if coordinator is None:
            return
        if coordinator == self._ctx.identity.peer_id:
            # the others follow only parts that combine a majority's chunks: half the wait they give us goes to
            # replacing ours that do not
            await self._majority_parts(key, pending, members, ordered, digest, parts, used, compute, computed,
                                       span / 2)
            self._publish(PARTS, {"r": r, "p": p, "m": digest,
                                  "c": [b"" if used[k][1] is None else exchange.pack_set(ordered, used[k][1])
                                        for k in range(len(used))],
                                  "h": [used[k][0] for k in range(len(used))]})
            # a part we kept of a minority's chunks, the others do not follow: they reduce it from all the members'
            # chunks (below), and so do we. Keeping it, we ended alone on other weights and resynced (the
            # simulator: two uplinks of 4 falling mid-run, ours among them)
            everyone = frozenset(members)
            # (a part over another view of the members, whose set is None, is taken as it is: its reducer, on
            # that view, kept it)
            kept = [k for k in range(len(used))
                    if used[k][1] is not None and not exchange.names_majority(used[k][1], members)]
            if kept:
                wait = self._conform_wait(pending, {k: everyone for k in kept}, None, span)
                await asyncio.gather(*(self._of_all(k, members, parts, used, compute, computed, wait) for k in kept))
            return
        def gone() -> bool:
            """Waiting on a coordinator that is gone (while we serve our bytes, or for a slow member) would cost us
            up to deadline_high."""
            return self._gone(pending, coordinator)

        if not await self._wait_serving(lambda: coordinator in pending.parts or gone(), span, self._round_blobs[key]) \
                and not gone():
            # a round with a member this round measured slow: the coordinator's own pulls may run to their cap
            # (deadline_high from the step's start) and its list come after that; we wait for it up to there.
            # With one span, a fast coordinator whose reduce step waited on the slow peer's chunks published its
            # list after two of the others had stopped waiting, and they resynced (the simulator: one uplink of 4
            # falling mid-run, seeds 7 and 15). The price: a coordinator that hangs in such a round costs that
            # wait, deadline_high (plus a span) at most, instead of one span; one that is gone, nothing more
            me = self._ctx.identity.peer_id
            typical = self._transfer_rate()
            slow = any(exchange.slow_source(pending.meter.so_far(a), typical) for a in members if a != me)
            moving = self._moving.get(key)
            if slow and moving is not None:
                self.counters["parts_wait_extended"] += 1
                # and one more span at least: a list published by then may still be behind a slow coordinator's
                # uploads (it came 10 ms after a peer had stopped waiting: two uplinks falling, seed 2)
                until = max(moving.start + self.cfg.deadline_high + span / 2, self.clock.monotonic() + span)
                await outer.wait_until(lambda: coordinator in pending.parts or gone(), self._event,
                                       until - self.clock.monotonic(), poll=SERVING_POLL)
        if coordinator not in pending.parts and gone():
            self.counters["parts_coordinator_gone"] += 1
            logger.info("diloco round %d/%d: coordinator %s left while we waited for its parts list", r, p,
                        coordinator[-8:])
        held = pending.parts.get(coordinator)
        if held is None:
            self.counters["parts_coordinator_missing"] += 1
            return
        m, sets, hashes = held
        if m != digest or len(hashes) != len(used):
            self.counters["parts_not_followed"] += 1
            return

        everyone = frozenset(members)
        # part -> the chunks we take it from: those the coordinator names (from it first) where ours differs, or,
        # where it names a minority's, everyone's (from their owners), even where ours is the same as its part:
        # the coordinator reduces such a part from everyone's too (a peer whose part was the coordinator's minority
        # one kept it, and ended alone: the simulator, two uplinks falling mid-run, seed 15)
        # (a part over another view of the members, whose set is None, only where ours differs, as before)
        followed, of_all = {}, {}
        for k, h in enumerate(hashes):
            whose = exchange.unpack_set(ordered, sets[k])
            if exchange.names_majority(whose, members):
                if h != used[k][0]:
                    followed[k] = whose
            elif used[k][1] != everyone and (h != used[k][0] or whose is not None):
                of_all[k] = everyone
        wait = max(self._conform_wait(pending, followed, coordinator, span),
                   self._conform_wait(pending, of_all, None, span))

        async def conform(k: int) -> None:
            whose = exchange.unpack_set(ordered, sets[k])
            could = exchange.names_majority(whose, members) \
                and await compute(k, self.clock.monotonic() + wait, only=whose, first=coordinator)
            action = exchange.conform_action(whose, members, computed[k][0] if could else None, hashes[k])
            if action == "not_followed":
                self.counters["parts_not_followed"] += 1
                # the coordinator's part combines a minority's chunks (its own pulls came late: a congested
                # uplink delays a peer's requests too), and ours may combine other chunks than the other peers':
                # every peer that does not follow it reduces the part from all the members' chunks (from any
                # holder), the same bytes wherever all of them come in the span. Keeping ours, the peers ended
                # on as many weights as there were peers (the simulator: a coordinator whose uplink fell to
                # 50 kB/s mid-round)
                await self._of_all(k, members, parts, used, compute, computed, wait)
            elif action == "not_conformed":
                self.counters["parts_not_conformed"] += 1  # a chunk it names did not come to us
            elif action == "mismatch":
                self.counters["parts_coordinator_mismatch"] += 1  # its bytes are not what those chunks give
                logger.warning("diloco round %d/%d: coordinator %s's part %d is not the reduction of the chunks it "
                               "names; ours kept", r, p, coordinator[-8:], k)
            else:
                parts[k], used[k] = computed[k][1], (hashes[k], whose)
                self.counters["parts_conformed"] += 1

        await asyncio.gather(*(conform(k) for k in sorted({*followed, *of_all})))

    def _gone(self, pending: Pending, peer: str) -> bool:
        """``peer`` was connected to us when the round's step began and is not now (killed, or cut off): it
        publishes nothing more this round. One we reach only through others (its messages come by gossip) is
        waited for."""
        return peer in pending.linked and peer not in self._ctx.members()

    async def _of_all(self, k: int, members: set[str], parts: dict, used: dict, compute, computed: dict,
                      wait: float) -> None:
        """Part k reduced from all the members' chunks (from any holder) within ``wait``, where ours combines
        other chunks: what every peer does with a part the coordinator reduced from a minority's."""
        everyone = frozenset(members)
        if used[k][1] != everyone and await compute(k, self.clock.monotonic() + wait, only=everyone):
            parts[k], used[k] = computed[k][1], (computed[k][0], everyone)
            self.counters["parts_of_all_members"] += 1

    def _conform_wait(self, pending: Pending, needed: dict[int, frozenset[str]], first: str | None,
                      span: float) -> float:
        """The time our pulls of the chunks of ``needed`` (part -> whose chunks) get, each from ``first`` or its
        owner, whichever is faster (``_chunk_source``), as ``compute`` pulls them: one span, or deadline_high where one
        of those sources sends slowly (``exchange.transfer_wait``). A peer whose uplink fell mid-round serves them
        slowly, all at once: with one span the others gave up on its chunks while they came, kept their own parts,
        and the round split (the simulator: two uplinks of 4 falling to 50 kB/s mid-run; 1 of 16 draws clean)."""
        me = self._ctx.identity.peer_id
        need: dict[str, int] = collections.Counter()
        for k, whose in needed.items():
            for a in whose:
                ann = pending.announced.get(a)
                if a == me or ann is None or a in pending.updates or ann.parts[k] in self.bulk.blobs:
                    continue
                need[self._chunk_source(pending, a, first)] += ann.sizes[k]
        rates = {a: r for a in need if (r := pending.meter.so_far(a)) is not None}
        return exchange.transfer_wait(need, rates, self._transfer_rate(), span, self.cfg.deadline_high)

    async def _wait_serving(self, done, span: float, blobs) -> bool:
        """Wait until ``done()`` holds for ``span``, and while we are still serving one of ``blobs`` (the round's:
        our chunks and parts, the chunks we pulled), and ``span`` after the last transfer ended, up to
        deadline_high: the others cannot be done before those bytes reached them. A peer whose uplink is the
        round's bottleneck finished its own pulls long before the others, and its wait for the coordinator's parts
        list ran out while the coordinator was still pulling from it: it kept its own parts and resynced (the
        simulator: one uplink down to 50 kB/s mid-run)."""
        now = self.clock.monotonic()
        end, cap = now + span, now + max(span, self.cfg.deadline_high)
        while not done():
            now = self.clock.monotonic()
            if end - now <= rounds.TICK:
                until = self.bulk.serving_until(blobs)
                end = min(cap, now + SERVING_POLL if until is None else until + span)
                if end - now <= rounds.TICK:
                    return False
            await outer.wait_event(self._event, min(end - now, SERVING_POLL))  # (``done`` may not set the event)
        return True

    async def _pull_reduced(self, key: tuple[int, int], pending: Pending, ordered: list[str], reducer: str,
                            reduced: tuple, elements: int, until: float | StepEnd,
                            out: torch.Tensor | None = None) -> torch.Tensor | None:
        """A reducer's part (``reduced``: its entry in ``pending.reduced``), pulled from the reducer, else from a
        member that pulled it already (the reducer may have died after serving some of us: the others must end with
        the same bytes), by ``until``, and decoded (into ``out`` where given). None: its bytes, which match the
        reducer's hash, are not a part (the wrong shape, non-finite values): the reducer is penalised. Raises
        BulkError or TimeoutError when no member could give it to us in time."""
        me = self._ctx.identity.peer_id
        blob, size, _, addrs, _ = reduced
        try:
            part = await self._fetch_part(key, reducer, blob, size, addrs, elements,
                                          until if isinstance(until, StepEnd) else until - self.clock.monotonic(),
                                          holders=[(x, pending.announced[x].addrs) for x in ordered
                                                   if x not in (me, reducer)],
                                          counter="parts_from_other_holders", out=out)
            # (decoded by codecs.decode, which refuses non-finite values)
            if part.dim() != 1 or part.numel() != elements:
                raise codecs.CodecError("a reduced part of the wrong shape")
        except codecs.CodecError as e:  # the bytes match the reducer's hash: the reducer's fault
            self._ctx.transport.penalties.penalize(reducer, "invalid_message", f"diloco reduced part: {e}")
            self.counters["reduced_parts_rejected"] += 1
            return None
        return part

    async def _majority_parts(self, key: tuple[int, int], pending: Pending, members: set[str], ordered: list[str],
                              digest: str, parts: dict, used: dict, compute, computed: dict, wait: float) -> None:
        """The coordinator's parts reduced from fewer than a majority's chunks (its reducer's part came too late,
        and the chunks it had by then were few) are replaced, within ``wait``, by a reducer's part that combines a
        majority's, or else reduced again from the chunks that came since. The others never follow a minority part
        (``exchange.conform_action``): they reduce it from all the members' chunks (``_conform``), and a
        coordinator that kept it ended alone on other weights and resynced (the simulator, 4 peers on 200 kB/s
        links: round 0's coordinator, a part of 1 or 2 chunks of 4). A reducer's part is taken as in the reduce
        step (its blob is the one the reducer signed; audits judge reducers); one reduced again is checked by the
        others against the chunks it names."""
        me = self._ctx.identity.peer_id
        until = self.clock.monotonic() + wait
        bounds = self._bounds(key[1], self._round_parts(key))

        async def replace(k: int) -> None:
            a, b = bounds[k]
            for reducer, reduced in sorted(pending.reduced[k].items()):
                blob, _, m, _, bits = reduced
                whose = exchange.unpack_set(ordered, bits) if m == digest else None
                if reducer == me or not exchange.names_majority(whose, members):
                    continue
                try:
                    part = await self._pull_reduced(key, pending, ordered, reducer, reduced, b - a, until)
                except (BulkError, asyncio.TimeoutError):
                    break  # out of time
                if part is None:
                    continue
                parts[k], used[k] = part, (blob, whose)
                self.counters["minority_parts_replaced"] += 1
                return
            # no reducer's part of a majority (ours may be the part's own reduction, from the chunks that had come
            # by the deadline): reduced again from those that came since (the others check it against the chunks),
            # by a fixed end (arrivals must not move it: the others wait for our parts list only so long)
            if await compute(k, StepEnd(until)) and exchange.names_majority(computed[k][3], members):
                parts[k], used[k] = computed[k][1], (computed[k][0], computed[k][3])
                self.counters["minority_parts_reduced_again"] += 1
                return
            self.counters["minority_parts_kept"] += 1

        await asyncio.gather(*(replace(k) for k in range(len(used))
                               if used[k][1] is not None and not exchange.names_majority(used[k][1], members)))

    def _prefetch(self, key: tuple[int, int], pending: Pending, peer: str) -> None:
        """Scatter: pull at once the chunks of the parts we will likely reduce (our place in the round's order over
        the last round's participants, which a round usually keeps), so the transfer overlaps the wait for the
        others and Streaming DiLoCo's overlap steps; a wrong guess costs those chunks' bytes, never the result.
        Who reduces how many parts goes by the rates the members' announcements report (``_owners``), and those
        come one by one, so the guess is made again as each comes, and only parts that stay ours whatever the
        reports still to come say of others are pulled: ours in the plain round robin and under the weights so far
        (``exchange.reducers`` takes parts from the round robin only from a member over its share, and gives them
        to those under theirs; a part we would gain from a slow member is pulled at the close). The pulls of parts
        no longer ours stop where they have not ended. (Each guess from the reports so far, the parts placed by a
        smooth weighted round robin, 50 of 442 chunks prefetched in a run at N = 8 went unused: 0.1 x S a round
        for nothing, and the busiest peer took in 2.36 x S.)"""
        r, p = key
        me = self._ctx.identity.peer_id
        likely = self.participants.get(p, self._initial) | {me}
        if peer == me or peer not in likely or len(likely) < 2:
            return
        pending.prefetchable.add(peer)
        bounds = self._bounds(p, self._round_parts(key))
        ordered = exchange.order(self.cfg.run, r, p, likely)
        owners = self._owners(ordered, len(bounds), pending.announced)
        mine = [k for k, owner in enumerate(owners) if owner == me and exchange.reducer_of(ordered, k) == me]
        for (source, k), task in list(pending.prefetched.items()):
            if k not in mine and not task.done():
                task.cancel()
                del pending.prefetched[(source, k)]
                self.counters["chunks_prefetch_dropped"] += 1
        for source in sorted(pending.prefetchable):
            ann = pending.announced[source]
            if len(ann.parts) != len(bounds):
                continue
            for k in mine:
                if (source, k) in pending.prefetched:
                    continue
                a, b = bounds[k]
                # the bytes only: decoded when the part is reduced (a decoded chunk held from its announcement
                # to the close was 4 bytes a value, 7.5 x its bytes with e3m0)
                task = asyncio.get_running_loop().create_task(
                    self._fetch_part(key, source, ann.parts[k], ann.sizes[k], ann.addrs, b - a, 300.0,
                                     decode=False))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is seen at the close
                pending.prefetched[(source, k)] = task
                self.counters["chunks_prefetched"] += 1

    def _liar(self, peer: str, k: int, r: int, p: int, role: str = "reducer") -> None:
        self.counters[f"lying_{role}s"] += 1
        self._ctx.transport.penalties.penalize(peer, "bad_data", f"diloco: a wrong {role} result for part {k}")
        logger.warning("diloco: %s %s gave a wrong result for part %d of round %d/%d; we use our own", role, peer,
                       k, r, p)

    def _log_missing(self, peer: str, what: str) -> None:
        now = self.clock.monotonic()
        if now - self._missing_logged.get(peer, 0.0) > 30.0:
            if len(self._missing_logged) > 4096:
                self._missing_logged.clear()
            self._missing_logged[peer] = now
            logger.warning("diloco: %s: %s", peer, what)

    # ------------------------------------------------------------------ start, checkpoints
    async def _start_barrier(self) -> None:
        """Start together with the peers that hold the same weights (the task's initial ones, or the same saved
        round), or join a run that has moved past our weights through a peer's checkpoint."""
        me = self._ctx.identity.peer_id
        self.state = "waiting for peers"
        barrier = rounds.StartBarrier(self.cfg.min_peers)
        while True:
            claims = {a: h for (r, p), hashes in self.round_hashes.items() if r >= self.rounds_done[p]
                      for a, h in hashes.items()}
            ahead = self._trusted_claimers(claims)
            if ahead:  # rounds we have not closed have closed without us: take a checkpoint and join
                if await self._join_from_checkpoint(ahead):
                    return
                for hashes in self.round_hashes.values():  # none served: do not ask them again at once
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
            rounds.count_listed(self.ready, self._ready_unlisted, self._ctx.direct, MAX_PEER_ENTRIES)
            ready = {p for p, h in self.ready.items() if h == base and self._ctx.direct(p)} | {me}
            self._check_refusal(len(ready) - 1)
            if barrier.start(self.clock.monotonic(), len(ready)):
                self._initial = ready
                if isinstance(self.inner_opt, SwarmAdamW):
                    self.inner_opt.set_peers(len(ready))
                self.standing.found(ready)
                self._founder = len(ready) > 1
                self.ready.clear()
                self._ready_unlisted.clear()
                self.state = "running"
                return
            await asyncio.sleep(0.1)

    def _initial_choice(self, base: str) -> str | None:
        """The initial weights to start from, where they are not ours: the hash most of the directly connected
        ready peers and we hold (ties: the smallest), or None. Peers of one run build the task's initial weights
        from the same seed, but torch draws other low bits under other CPU kernels (its scalar ones, on a CPU
        without AVX2, or an ARM CPU's): without this such peers never started together. Only before the first
        round, from the task's weights (not from a checkpoint of a later round). Holders are asked a bounded number
        of times (rounds.StartWeights): hashes a flood of fresh keys announce cost a start a few asks at most."""
        if any(self.rounds_done) or self.step:
            return None
        direct = {a: h for a, h in self.ready.items() if self._ctx.direct(a)}
        others = sum(h != base for h in direct.values())
        if others:  # in /status: ready peers that hold other initial weights than ours (the most seen at once)
            self.counters["initial_other_weights_peers"] = max(others, self.counters["initial_other_weights_peers"])
        return self._start_weights.choice(base, direct)

    async def _take_initial(self, target: str) -> bool:
        """Take a holder's initial weights of hash ``target`` if each of their parameters is within rounding of
        ours (INITIAL_TOLERANCE of its largest magnitude): so a peer can move our start by rounding at most, never
        to weights of its choosing. A holder that serves none, or other ones, is not asked again."""
        direct = {a: h for a, h in self.ready.items() if self._ctx.direct(a)}
        for peer in exchange.fastest_first(self._start_weights.holders(target, direct), self._source_rates):
            if not self._start_weights.ask(peer, target):  # asked once, whatever comes of it; a bounded number
                break
            try:
                ckpt, global_flat, _ = await self._pull_checkpoint(peer)  # its momentum is not taken: ours is 0
                if any(ckpt["rounds_done"]) or ckpt["step"] or ckpt["global_hash"] != target:
                    raise ValueError("not the initial weights it announced")
                apart = max(outer.relative_difference(ours, theirs, [self.params[i].numel() for i in frag])
                            for ours, theirs, frag in zip(self.global_flat, global_flat, self.frag_index))
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
            self._start_weights.taken(peer)
            self.counters["initial_weights_taken"] += 1
            self.initial_weights = {"source": peer, "hash": target, "apart": apart}
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

    # ------------------------------------------------------------------ our own checkpoint (the data dir)
    def _global_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the global weights in place of our local trainable parameters."""
        tensors = self._model_tensors(self.model)
        for p, frag in enumerate(self.frag_index):
            offset = 0
            for i in frag:
                param = self.params[i]
                n = param.numel()
                tensors["model." + self.names[i]] = self.global_flat[p][offset:offset + n].view(param.shape) \
                    .to(param.dtype).clone()
                offset += n
        return tensors

    def _save_checkpoint(self) -> None:
        tensors = self._global_state()
        tensors.update({f"outer.{p}": b for p, b in enumerate(self.outer_opt.buffers)})
        tensors, opt_meta = self._with_optimizer(tensors, self.inner_opt)  # the inner optimizer's moments too
        # what the codec dropped of our last update (error feedback): ours alone, as the inner moments are; a peer's
        # checkpoint (``_checkpoint``) carries the swarm's state only
        tensors.update({f"feedback.{p}": r for p, r in dict(self.residual).items()})
        h = self.global_hash()
        self._save(tensors, round=self.rounds_done[-1], rounds_done=list(self.rounds_done), step=self.step, hash=h,
                   participants={str(p): sorted(v) for p, v in self.participants.items()}, **opt_meta)
        self.counters["checkpoints_saved"] += 1

    def _adopt(self, global_flat: list[torch.Tensor], momentum: list[torch.Tensor], rounds_done: list[int],
               step: int, participants: dict) -> None:
        """Take checkpointed state (ours or a peer's) as our global and local weights, momentum and counters."""
        for p in list(self._redo):  # their inputs were other weights
            self._drop_redo(p)
        self.residual.clear()  # what the codec dropped of updates from other weights
        self._residual_norms.clear()
        self.global_flat = global_flat
        self._global_version += 1
        self.outer_opt.buffers = momentum
        with torch.no_grad():
            for p, frag in enumerate(self.frag_index):
                outer.unflatten_into(global_flat[p], [self.params[i] for i in frag])
        self.rounds_done = list(rounds_done)
        self.step = step
        self.participants = {int(p): set(v) for p, v in participants.items()}

    def _resume_own(self) -> None:
        """Continue from our own checkpoint of this run (if any, of this task, and intact). The start barrier then
        checks it against the swarm: peers at the same round start with us; a swarm that is further along (or
        published another hash for that round) sends us to a peer's checkpoint instead."""
        found = self._own_checkpoint()
        if found is None:
            return
        tensors, meta = found
        # saved by the version before the BLAKE3 weights hash (its fingerprint is one of earlier_fps): checked with
        # that version's hash; from here on the weights go by ours (the start barrier compares global_hash()). One
        # saved by the version before the e3m0 encoder's name has our hash: nothing to convert
        earlier = meta.get("fingerprint") == self._fp_before_blake3
        # saved under other rules than ours and than the versions we list (a later or earlier version that names
        # this run by its resumable fingerprint): the same run's weights, checked by our hash
        other_rules = not self._listed(meta)
        try:
            global_flat = [outer.flatten([tensors["model." + self.names[i]] for i in frag])
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
        inner = self._restore_optimizer(self.inner_opt, tensors, meta)
        if inner and isinstance(self.inner_opt, SwarmAdamW):  # the last round's participants: state, not a setting
            peers = (meta["optimizer"].get("param_groups") or [{}])[0].get("peers")
            if isinstance(peers, int) and peers >= 1:
                self.inner_opt.set_peers(peers)
        if self.feedback:  # our last update's residual, where it fits its fragment (else it starts at zero)
            for p, g in enumerate(global_flat):
                r = tensors.get(f"feedback.{p}")
                if r is not None and r.numel() == g.numel() and codecs.all_finite(r):
                    self.residual[p] = r.to(torch.float32).reshape(-1).clone()
                    self._residual_norms[p] = round(float(self.residual[p].norm()), 6)
        self.standing.found(a for v in self.participants.values() for a in v)  # the peers we last trained with
        digest = self.global_hash() if earlier else meta["hash"]
        self.resumed = {"source": "own checkpoint", "round": meta["round"], "step": self.step, "hash": digest,
                        "optimizer_state": inner, "residual": sorted(self.residual)}
        if earlier:
            self.resumed["saved_by"] = "the version before the BLAKE3 weights hash"
        elif other_rules:
            self.resumed["saved_by"] = "a version with other rules (the same run)"
        self.saved = {"path": str(self._checkpoint_path()), "round": meta["round"], "step": self.step,
                      "hash": digest}
        logger.info("diloco: resuming run %s from our checkpoint at round %d, step %d (global %s)%s", self.cfg.run,
                    meta["round"], self.step, digest,
                    " (saved by the version before the BLAKE3 weights hash)" if earlier else "")

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
        if message.kind != CKPT_REQUEST.code:
            raise MalformedMessage("diloco-ckpt: expected a request")
        payload = self._checkpoint()
        blob = self.bulk.put(payload, codec="diloco-checkpoint", topic=self.topic)
        await stream.send(CKPT_REPLY.code, {"blob": blob, "size": len(payload)})
        # it may ask us next for the announcements of the round it is about to follow (``_join_from_checkpoint``)
        rounds.keep_latest(self._ckpt_served, stream.peer_id, self.clock.monotonic(), MAX_PEER_ENTRIES)

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
        served = self._ann_served.setdefault(key, set()) if held else set()
        wanted = set()
        # (or one we just served a checkpoint, far larger than these: a joiner whose announcements of its first
        # round came while it pulled the checkpoint, before it could hold them)
        joiner = self.clock.monotonic() - self._ckpt_served.get(asker, -math.inf) <= self.cfg.deadline_high
        if held and (asker in held or self.standing.counts(asker) or joiner) and asker not in served \
                and len(served) < MAX_PEER_ENTRIES:
            served.add(asker)
            wanted = set(body["ids"])
        else:
            self.counters["announcements_refused"] += 1
        for author, signed in sorted(held.items()):
            if rounds.short_id(author) in wanted:
                await stream.send(ANN_REPLY.code, signed)
                self.counters["announcements_served"] += 1
        await stream.send(ANN_END.code, None)

    def _signed_announcements(self, key: tuple[int, int]) -> dict[str, dict]:
        """The update announcements of a (round, fragment) we hold, open or closed lately, as their authors signed
        them (peer -> wire form; empty for a round we do not hold)."""
        return self.pending[key].signed if key in self.pending else self._signed_closed.get(key, {})

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
                    if (held := self.pending.get((r, p))) is not None and message.author in held.announced:
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
        # few headers, round counters and participants (a server that announced 4 GiB for a small model had us
        # pull and hold all of it before its tensors were found too large)
        budget = self._checkpoint_budget()
        if size is not None and size > budget:
            raise ProtocolViolation(f"diloco-ckpt: {size} B announced, a checkpoint of our model is at most {budget} B")
        with self.work.track(f"checkpoint pull from {peer[-8:]}", total=size, unit="B") as work:
            body, _ = await self.bulk.pull(blob, progress=work.update)
        ckpt = WIRE.check_blob(CHECKPOINT, unpack(body))
        # past the schema, what only the model and the run can say (a ProtocolViolation: its server's fault). Before,
        # no round counters crashed our loop (an IndexError) and a momentum of another size wedged it at its
        # next outer step
        done, sizes = ckpt["rounds_done"], [g.numel() for g in self.global_flat]
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
        return 8 * sum(g.numel() for g in self.global_flat) + 8192 * self.cfg.fragments + (16 << 20)

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
        # were the run's (their hash is checked) but their outer momentum need not be (no peer publishes a hash of
        # it): asked first again (the fastest, or the first of the holders, none measured) one sent us round for
        # the whole run, each of our updates refused for its other base; two, taking turns, did too where only the
        # last was put last. No penalty: nothing shows they lied
        for peer in sorted(exchange.fastest_first(peers, self._source_rates), key=lambda a: a in self._led_off):
            try:
                ckpt, global_flat, momentum = await self._pull_checkpoint(peer)
                done = ckpt["rounds_done"]
                published = self.round_hashes.get((done[-1] - 1, self.cfg.fragments - 1), {})
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
                continue
            # its step, within what its rounds allow: the step is its server's word alone (its rounds are checked,
            # by their hash), and one past the run's end had a joiner end the run at once on the weights it joined
            # with, having never contributed (the simulator)
            low, high = self._steps_of(done)
            step = min(max(ckpt["step"], low), high)
            if step != ckpt["step"]:
                self.counters["checkpoint_step_clamped"] += 1
                logger.warning("diloco: %s's checkpoint says step %d, its rounds %s put it at %d to %d; at %d",
                               peer, ckpt["step"], done, low, high, step)
            self._adopt(global_flat, momentum, done, step, ckpt["participants"])
            self._checkpoint_from = peer
            # the peers that vouched for this state (they hold its hash), and those it was made with that say so
            # themselves (they published its hash for its round): the list is its server's word alone, and a key
            # credited from it counted as a founder of ours for good (a server that listed six fresh keys had their
            # word outvote the run's peers at our first hash check, and we took their weights: the simulator)
            holders = {a for a, h in self.round_hashes.get((done[-1] - 1, self.cfg.fragments - 1), {}).items()
                       if h == ckpt["global_hash"]}
            listed = {a for v in self.participants.values() for a in v} - {self._ctx.identity.peer_id}
            self.standing.found(set(peers) | (listed & holders))
            self.counters["participants_unconfirmed"] += len(listed - holders - set(peers))
            self._published.clear()  # what we said before the checkpoint no longer describes our weights
            self._checked.clear()
            # updates already here for rounds we have yet to close stay: their base is checked when we close them
            self.pending = collections.defaultdict(Pending, {k: v for k, v in self.pending.items()
                                                             if k[0] >= self.rounds_done[k[1]]})
            self._initial = set()
            # follow the next round of each fragment, contribute from the one after (announced now)
            for p in range(self.cfg.fragments):
                # a peer the others count (it resyncs after a divergence) contributes from the next round; a newcomer
                # from a round in which newcomers are let in, two rounds ahead at least (peers a round further than
                # our checkpoint must still hear the join in time). Counted from the last round the swarm is known
                # to have closed, not from the checkpoint's: one that aged on its way would name a round the others
                # have closed already, and they drop such a join (joins_ignored)
                now = max(self.rounds_done[p], self._swarm_round(p) + 1)
                self.join_round[p] = now + 1 if rejoin else next_fresh_round(now + 2)
                self._publish(JOIN, {"r": self.join_round[p], "p": p, "join": True})
            self.counters["joined_from_checkpoint"] += 1
            # the announcements of the rounds we now follow that came while we pulled the checkpoint were rounds
            # ahead of ours then, and not held: ask its server for them (a joiner that arrived as the swarm
            # announced closed its first round alone at deadline_high, then fell behind and resynced: the
            # simulator, 1 MB updates at 2 MB/s)
            ids = sorted({rounds.short_id(a) for v in self.participants.values() for a in v}
                         - {rounds.short_id(self._ctx.identity.peer_id)})
            for p in range(self.cfg.fragments):
                if ids and self.rounds_done[p] < self._rounds():
                    ask = asyncio.get_running_loop().create_task(
                        self._fetch_announcements(peer, self.rounds_done[p], p, ids))
                    self._asks.add(ask)
                    ask.add_done_callback(self._asks.discard)
            self.resumed = {"source": f"checkpoint of {peer}", "round": self.rounds_done[-1], "step": self.step,
                            "hash": ckpt["global_hash"]}
            self.state = "running"
            logger.info("diloco: joined from %s's checkpoint at step %d (global %s)", peer, self.step,
                        ckpt["global_hash"])
            return True
        self.counters["checkpoint_join_failed"] += 1
        logger.warning("diloco: none of %d peer(s) served a usable checkpoint", len(peers))
        return False

    # ------------------------------------------------------------------ validation
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
        if not self.standing.admitted(message.author):
            self.counters["not_admitted"] += 1
            return Verdict.IGNORE  # a closed run: not one of its peers
        r, p = body["r"], body["p"]
        if not 0 <= p < self.cfg.fragments or not 0 <= r <= (self.cfg.rounds + 1 if self.cfg.rounds else 2**31):
            return Verdict.REJECT
        author = message.author
        if self.standing.counts(author) and not (kind is ROUND_HASH and self.cfg.rounds and r >= self.cfg.rounds):
            # still in the run (a peer that ended it says so every 5 s: not one to wait for). Bounded: only peers
            # whose word counts
            self._heard[author] = self.clock.monotonic()
        if kind is READY:
            # only directly connected peers can found a run with us, so only theirs are kept (first come, capped);
            # one not listed as direct yet waits for our next look at the list (``rounds.count_listed``)
            if self.state != "running":
                rounds.hear_ready(self.ready, self._ready_unlisted, author, body["ready"], self._ctx.direct(author),
                                  MAX_PEER_ENTRIES, READY_UNLISTED)
            return Verdict.ACCEPT
        done = self.rounds_done[p] if self.rounds_done else 0
        if kind is JOIN:
            horizon = done + 2 + FRESH_EVERY
            joins = self.joins[(r, p)] if done <= r <= horizon else set()
            if done <= r <= horizon and (len(joins) < MAX_PEER_ENTRIES or self.standing.counts(author)):
                joins.add(author)  # a newcomer among them gets a slot only if picked (see _close_round)
            else:
                self.counters["joins_ignored"] += 1
            return Verdict.ACCEPT
        if kind is ROUND_HASH:
            hashes = self.round_hashes[(r, p)]
            if author in hashes or len(hashes) < MAX_PEER_ENTRIES or self.standing.counts(author):
                hashes[author] = body["h"]
            # (r = cfg.rounds says "the run ended here"; cfg.rounds 0 is a run without end)
            if self.standing.counts(author) and (r < self.cfg.rounds or not self.cfg.rounds):
                closed = self._closed_by[p]
                if r > closed.get(author, -1) and (author in closed or len(closed) < MAX_PEER_ENTRIES):
                    closed[author] = r
            return Verdict.ACCEPT
        if kind is UPDATE:
            ann = self._announced(body, p)
            if ann is None:
                return Verdict.REJECT
            # an update computed from other global weights than ours is kept (we may be the one that drifted and
            # resync before we close that round) but not forwarded; every update's base is checked when we close
            # its round
            other_base = bool(self.rounds_done) and r == done \
                and ann.base != self._base_hash(p)
            if self.rounds_done and r < self.rounds_done[p]:
                self.counters["late_updates"] += 1
                self._record_late(r, message.author, p)
                self._pull_late(r, p, message.author, ann)
                return Verdict.IGNORE  # that round is closed here
            if r > max(done, self._swarm_round(p) + 1) + 2:  # (a joiner's done may be rounds old)
                self.counters["early_updates"] += 1
                return Verdict.IGNORE  # rounds we are nowhere near: not held, not pulled
            pending = self.pending[(r, p)]
            if message.author in pending.announced:
                return Verdict.IGNORE
            if not self.standing.counts(author) and self.state == "running":
                # a newcomer: taken only if it can hold a slot this round
                candidates = self.participants.get(p, self._initial) | self.joins.get((r, p), set())
                if author not in candidates or \
                        sum(not self.standing.counts(a) for a in pending.announced) >= MAX_NEWCOMER_PULLS:
                    self.counters["newcomer_updates_not_pulled"] += 1
                    return Verdict.IGNORE
            pending.announced[author] = ann
            pending.signed[author] = message.wire()  # for a peer whose gossip did not bring it (a member view's)
            self._event.set()  # (a member view may be waiting for it)
            if not self.rounds_done or self._mode(p) == "all-to-all":
                self._start_pull((r, p), pending, author)
            else:
                pending.arrivals[author] = self.clock.monotonic()
                self._event.set()
                if not other_base:
                    self._prefetch((r, p), pending, author)
            if other_base:
                self.counters["other_base_held"] += 1
                return Verdict.IGNORE
            return Verdict.ACCEPT
        if (kind is MEMBERS or kind is PARTS or kind is REDUCED or kind is AUDIT) and self.rounds_done \
                and not self.rounds_done[p] <= r <= self.rounds_done[p] + 2:
            return Verdict.IGNORE  # a round's exchange messages: kept for the rounds we are at or about to close
        if kind is MEMBERS:
            if not self.standing.counts(author):
                self.counters["views_ignored"] += 1  # only a counted peer coordinates a round
                return Verdict.IGNORE
            pending = self.pending[(r, p)]
            if author not in pending.views and len(pending.views) >= MAX_PEER_ENTRIES:
                return Verdict.IGNORE
            verdict = self._once(pending.views, author, frozenset(body["m"]), "views_conflicting", "member views")
            if verdict is Verdict.ACCEPT:
                pending.view_at[author] = self.clock.monotonic()
            return verdict
        if kind is PARTS:
            # a round's coordinator is one of the last round's counted members (whose set we may not know yet
            # when a message for the next round comes): counted peers' only, the others' capped
            if len(body["c"]) != len(body["h"]):
                return Verdict.REJECT  # a malformed list, signed by its author: counts against it
            pending = self.pending[(r, p)]
            if not self.standing.counts(author) or (
                    author not in self.participants.get(p, self._initial) and len(pending.parts) >= MAX_PARTS_LISTS):
                self.counters["parts_ignored"] += 1
                return Verdict.IGNORE
            return self._once(pending.parts, author, (body["m"], tuple(body["c"]), tuple(body["h"])),
                              "parts_conflicting", "part lists")
        if kind is REDUCED or kind is AUDIT:
            k = body["red"] if kind is REDUCED else body["aud"]
            pending = self.pending[(r, p)]
            if kind is REDUCED:
                # the round's count once it closed; before, any count "auto" may give it (ours may not be the
                # round's: an honest reducer's part must not be refused, and its author penalised, for that)
                counts = [pending.count] if pending.count is not None else self._part_counts(p)
                if body["size"] > max(self._max_part(p, k, c, reduced=True) for c in counts):
                    return Verdict.REJECT
                held, value = pending.reduced[k], (body["blob"], body["size"], body["m"], tuple(body["addrs"]),
                                                   body["c"])
            else:
                held, value = pending.audits[k], body["ok"]
            if author in held:
                return Verdict.IGNORE
            if pending.entries >= MAX_REDUCED_ENTRIES:
                self.counters["exchange_messages_over_cap"] += 1
                return Verdict.IGNORE
            held[author] = value
            pending.entries += 1
            pending.part_events[k].set()
            self._event.set()
            return Verdict.ACCEPT
        return Verdict.REJECT

    def _once(self, held: dict, author: str, value, counter: str, what: str) -> Verdict:
        """Keep an author's one signed answer for a round; a second, different one is the author's doing, whoever
        forwarded it (penalised as suspect)."""
        if author in held:
            if held[author] != value:
                self.counters[counter] += 1
                self._ctx.transport.penalties.penalize(author, "suspect", f"two {what} of one round")
            return Verdict.IGNORE
        held[author] = value
        self._event.set()
        return Verdict.ACCEPT

    def _max_part(self, p: int, k: int, count: int, reduced: bool = False) -> int:
        """The most bytes part k of fragment p cut into ``count`` parts may claim (checked before anything is
        pulled, so a peer cannot make us allocate for a size it made up); ``reduced``: a combined part's."""
        if not self.rounds_done:  # not built yet: only the absolute cap
            return MAX_PART_BYTES
        sizes = self._part_bytes(p, reduced, count)
        return sizes[k] + PART_SLACK if k < len(sizes) else 0

    def _announced(self, body: dict, p: int) -> Announced | None:
        """An update announcement's parts, checked against the run (the schema checked types): every peer cuts an
        update the same way, no part may claim more bytes than the codec makes of it, a norm is not negative."""
        parts, sizes, norm = body["parts"], body["sizes"], body["norm"]
        if not (len(parts) == len(sizes) and len(parts) in self._part_counts(p)
                and all(x <= self._max_part(p, k, len(parts)) for k, x in enumerate(sizes)) and norm >= 0):
            return None
        return Announced(tuple(parts), tuple(sizes), body["base"], norm, tuple(body["addrs"]),
                         tuple((bytes(sid), int(rate)) for sid, rate in body.get("bw", ())))

    async def _report(self, loss: float) -> None:
        await self._write_progress(self.step, self._samples(self.step), loss, self.counters["bytes_sent"],
                                   self.counters["rounds"])

    # ------------------------------------------------------------------ views
    def status(self) -> dict:
        wall = (self.clock.monotonic() - self.started) if self.started else 0.0
        rounds_done = getattr(self, "rounds_done", None)
        return {
            "run": self.cfg.run,
            "state": self.state,
            "round": rounds_done[-1] if rounds_done else 0,
            "total_rounds": self.cfg.rounds,
            "train_loss": None if self.train_loss is None else round(self.train_loss, 5),
            "inner_lr": ([round(g["lr"], 8) for g in self.inner_opt.param_groups][:8]
                         if getattr(self, "inner_opt", None) is not None else None),
            "inner_betas": ([list(g["betas"]) for g in self.inner_opt.param_groups if "betas" in g][:8]
                            if getattr(self, "inner_opt", None) is not None else None),
            "withheld": {str(p): why for p, why in self.skipped.items()},
            "codec": self.cfg.codec,
            # error feedback: the norm of what the codec dropped of our last update, per fragment (null: off)
            "residual_norm": ({str(p): v for p, v in sorted(self._residual_norms.items())}
                              if self.feedback else None),
            **self._task_status(),
            "step": self.step,
            "global_hash": self.final_hash or (self.global_hash() if hasattr(self, "global_flat") else None),
            "final_hash": self.final_hash,
            "parameters": sum(g.numel() for g in self.global_flat) if hasattr(self, "global_flat") else None,
            "history": list(self.history)[-64:],
            "losses": list(self.losses)[-40:],
            "compute_fraction": round(1 - self.blocked_seconds / wall, 4) if wall else None,
            "initial_weights": self.initial_weights,
            "deadline_s": round(self.deadline.value(), 2),
            "transfer_rate_bps": round(self._transfer_rate()) if self._rates else None,
            "exchange": {"setting": self.cfg.exchange, **self.exchange_view},
            # a round's large buffers kept for the next (protocols/buffers.py): bytes held, taken (reused: from
            # the pool), given back, refused (held elsewhere, or no room)
            "buffers": self._buffers.status(),
            **dict(sorted(self.counters.items())),
        }

    def routes(self) -> list:
        return []

