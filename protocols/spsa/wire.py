"""The run's messages on the wire (pubsub batches, hashes, readies, joins; the log and base protocols) and the
limits on what a peer keeps of them. Registered in the wire registry in the order they always were."""

from __future__ import annotations

from swarmd.protocols.gossip import Message
from swarmd.protocols.taskloop import TAG
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.wire import WIRE, Bool, Bytes, Int, List, Map, Nil, Str, Tuple

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

BASE_SERVES = 2  # bases served at once (each is the whole model's bytes: more asks meanwhile are refused, and
# their askers go to another peer)
BASE_SERVE_EVERY = 30.0  # seconds before the same peer is served the whole base again
BASE_SERVE_RATE = 256e3  # bytes a second an asker must read at least (a slot is not held longer)

NEWCOMER_GRACE = 2.0  # seconds a window waits for a newcomer's batch once every counting peer's is in


def _batch_bytes(message: Message) -> bytes:
    return WIRE.unpack(CARRIER, message.data)[1]["b"]


def _batch_hash(message: Message) -> str:
    return WIRE.unpack(CARRIER, message.data)[1]["h"].hex()
