"""The run's wire: its pubsub messages, the checkpoint and announcement protocols, and their limits."""

from __future__ import annotations

import msgpack
from swarmd.protocols import exchange, outer
from swarmd.protocols.bulk import content_hash
from swarmd.protocols.taskloop import TAG
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.wire import WIRE, Bool, Bytes, Dict, Float, Int, List, Map, Nil, Str, Tuple

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
FEEDBACK_CODECS = ("sign", "topk", "topk2")  # error_feedback = "auto" turns it on for these
REDUCED_AUTO = {"sign": "e3m0", "topk2": "e3m0"}  # reduced_codec = "auto": the run's codec but for these
PART_SLACK = 256  # bytes an encoded part may exceed the codec's size for it by (its header)
MAX_PARTS = exchange.MAX_PARTS
MAX_REMEMBERED_UPDATES = 4096  # (peer, fragment) -> the parts of its last update, to refuse a replayed one
# an update announcement names up to MAX_PARTS parts (hash and size) and up to MAX_UNREACHED_REPORTS peers (short ids)
MAX_MESSAGE = 1024 + MAX_PARTS * 40 + exchange.MAX_UNREACHED_REPORTS * 10
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
                                                    exchange.MAX_RATE_REPORTS),
    nd=List(Bytes(exact=8), exchange.MAX_UNREACHED_REPORTS), t=TAG, optional=("bw", "nd")), {
    "r": 3, "p": 0, "parts": [bytes(32)], "sizes": [4096], "base": "ab" * 16, "norm": 1.5, "addrs": [],
    "bw": [[bytes(8), 1500]], "nd": [b"\x01" * 8], **_TAG}, max_size=MAX_MESSAGE, version=2,
    doc="my update for (r, p): its encoded parts' hashes and sizes, the base it was computed from, its norm, where to "
    "pull it; (bw, optional) the receive rates in kB/s I measured in my last exchange "
    "from the last round's members (short ids), from which every peer weighs who reduces how many parts; and (nd, "
    "optional) the peers of the round I reach only through a relay (short ids): no part is reduced or audited "
    "across such a path (bulk bytes never cross a relay)")
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


