"""The replicated state's wire: ``/swarmd/crdt/2.0.0``, its messages and limits, and the responder's answers.

``/swarmd/crdt/2.0.0`` on one stream, requester first:

- ``PUSH {"ops": [op, ...]}`` -> ``ACK {"applied": n, "rejected": n}``: new ops, sent at once to every connected
  member when we write them;
- ``SYNC {"d": [[bucket, digest], ...], "after": key | None}`` -> ``ENTRIES {"b": [bucket, ...], "vv": {author: seq},
  "next": key | None}``: we send our bucket digests (at most 256 of 16 bytes, whatever the number of authors, see
  ``crdt.buckets``); the responder names the buckets that differ and sends one page (at most ``PAGE`` entries) of its
  version vector for them, in (bucket, author) order from just after ``after``; ``next`` is where the following page
  starts.
- ``WANT {"have": {author: seq}}`` -> ``OPS {"ops": [...], "more": bool}``: for the authors of the page where the
  responder is ahead, the ops past our seq (in causal order, at most ``SYNC_BATCH`` per reply; we ask again while
  ``more``). Then we PUSH on the same stream what the page shows the responder lacks, and ask for the next page.

So a sync costs what differs, never the whole version vector: with a million authors a message is still at most
``PAGE`` entries, and no honest peer ever exceeds a limit of ours.
"""

from __future__ import annotations

from typing import Any

from swarmd.crdt import OpStore
from swarmd.crdt.buckets import BUCKETS, DIGEST_SIZE
from swarmd.crdt.ops import ID_SIZE, MAX_AUTHOR, MAX_OBJECT_NAME, MAX_PARENTS, MAX_SEQ, SIGN_DOMAIN
from swarmd.crdt.store import MAX_BASE_SIZE
from swarmd.crdt.types import MAX_KEY
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.wire import ANY, WIRE, Bool, Bytes, Dict, Int, List, Map, Nil, OneOf, Str, Tuple

PUSH, ACK, SYNC, OPS, ENTRIES, WANT = 1, 2, 3, 4, 5, 6
CRDT_SPEC = ProtocolSpec("crdt", "2.0.0", max_frame=8 << 20, kinds=frozenset({PUSH, ACK, SYNC, OPS, ENTRIES, WANT}))
MAX_PUSH_OPS = 1000
SYNC_BATCH = 1000
PUSH_BYTES = 4 << 20  # op bodies per PUSH or OPS frame (the frame limit is 8 MiB)
PAGE = 2048  # version-vector entries per ENTRIES / WANT message
MAX_PAGES = 64  # pages per sync (the next anti-entropy round goes on)
MAX_WANTS = 64  # WANT round trips per page

_OPS = List(ANY("crdt.decode_wire, op by op: a bad op is refused alone"), MAX_PUSH_OPS)
_VV = Dict(Str(MAX_KEY), Int(0), PAGE)  # a page of a version vector: {author: seq}
_PAGE_KEY = OneOf((Nil(), Tuple.of(Int(0, BUCKETS - 1), Str(MAX_KEY))))
_OP = {"b": b"\x97\x01...", "s": bytes(64)}
WIRE.blob("(inside a signed op)", "crdt.op", Tuple.of(
    Int(1, 1), Str(MAX_AUTHOR, min=1), Int(1, MAX_SEQ), Tuple.of(Int(0, 2**63 - 1), Int(0, 2**63 - 1)),
    List(Bytes(exact=ID_SIZE), MAX_PARENTS), Str(MAX_OBJECT_NAME, min=1), ANY("the object's CRDT type")),
    [1, "12D3KooW...", 1, [1_800_000_000_000, 0], [], "kv", {"k": "12D3KooW.../note", "v": "hi"}],
    max_size=MAX_BASE_SIZE, signed=SIGN_DOMAIN.rstrip(b"\0").decode(),
    doc="an op's body b: [1, author, seq, HLC clock, parent op ids (sorted), object, payload]; s signs it; the op "
        "id is BLAKE2b-256(b). At most 4 KiB, but an author's every 1,000th op is its base (up to 64 KiB): object "
        "'_base', payload {parts: {object: the author's whole contribution}, ticket?: its admission ticket}")
WIRE.frame(CRDT_SPEC, PUSH, "crdt.push", Map.of(ops=_OPS), {"ops": [_OP]}, signed=SIGN_DOMAIN.rstrip(b"\0").decode(),
           doc="new ops, each signed by its author")
WIRE.frame(CRDT_SPEC, ACK, "crdt.ack", Map.of(applied=Int(0), rejected=Int(0)), {"applied": 1, "rejected": 0})
WIRE.frame(CRDT_SPEC, SYNC, "crdt.sync", Map.of(d=List(Tuple.of(Int(0, BUCKETS - 1), Bytes(exact=DIGEST_SIZE)),
                                                       BUCKETS), after=_PAGE_KEY),
           {"d": [[7, bytes(DIGEST_SIZE)]], "after": None}, doc="our bucket digests, and where the page starts")
WIRE.frame(CRDT_SPEC, OPS, "crdt.ops", Map.of(ops=_OPS, more=Bool()), {"ops": [_OP], "more": False},
           doc="the ops a WANT asked for, in causal order")
WIRE.frame(CRDT_SPEC, ENTRIES, "crdt.entries", Map.of(b=List(Int(0, BUCKETS - 1), BUCKETS), vv=_VV, next=_PAGE_KEY),
           {"b": [7], "vv": {"12D3KooW...": 3}, "next": None}, doc="the buckets that differ and a page of ours")
WIRE.frame(CRDT_SPEC, WANT, "crdt.want", Map.of(have=_VV), {"have": {"12D3KooW...": 2}},
           doc="send me each author's ops after these seqs")


def answer_sync(store: OpStore, body: Any) -> dict:
    """A SYNC request's ENTRIES reply: the buckets that differ and one page of our entries for them."""
    if not isinstance(body, dict) or set(body) != {"d", "after"}:
        raise MalformedMessage("crdt: SYNC body must be {d: digests, after}")
    try:
        buckets = store.differing(_parse_digests(body["d"]))
    except ValueError as e:
        raise MalformedMessage(f"crdt: {e}") from None
    entries, nxt = store.entries(buckets, _parse_key(body["after"]), PAGE)
    return {"b": buckets, "vv": entries, "next": None if nxt is None else list(nxt)}


def answer_want(store: OpStore, body: Any) -> dict:
    """A WANT request's OPS reply: our ops past the seqs it names, in causal order, at most ``SYNC_BATCH``."""
    if not isinstance(body, dict) or set(body) != {"have"}:
        raise MalformedMessage("crdt: WANT body must be {have: {author: seq}}")
    ops, more = store.ops_after(_parse_vv(body["have"]), SYNC_BATCH, PUSH_BYTES)
    return {"ops": [o.wire() for o in ops], "more": more}


def parse_entries(body: Any) -> tuple[list[int], dict[str, int], tuple[int, str] | None]:
    """An ENTRIES reply: (differing buckets, the page of entries, where the next page starts)."""
    if not isinstance(body, dict) or set(body) != {"b", "vv", "next"}:
        raise MalformedMessage("crdt: expected ENTRIES {b, vv, next}")
    return _parse_buckets(body["b"]), _parse_vv(body["vv"]), _parse_key(body["next"])


def _parse_vv(vv: Any) -> dict[str, int]:
    """One page of a version vector: at most ``PAGE`` entries {author: seq} (the protocol's limit for every
    honest peer, so more is the sender's fault)."""
    if (
        not isinstance(vv, dict)
        or len(vv) > PAGE
        or not all(isinstance(k, str) and len(k) <= MAX_KEY and type(v) is int and v >= 0 for k, v in vv.items())
    ):
        raise MalformedMessage(f"crdt: a version-vector page is at most {PAGE} entries {{author: seq}}")
    return vv


def _parse_digests(d: Any) -> dict:
    """[[bucket, digest], ...] -> {bucket: digest} (the store checks the entries)."""
    if not isinstance(d, list) or len(d) > BUCKETS or not all(isinstance(x, list) and len(x) == 2 for x in d):
        raise MalformedMessage("crdt: digests are at most 256 [bucket, digest] pairs")
    out = {x[0]: x[1] for x in d if isinstance(x[0], int)}
    if len(out) != len(d):
        raise MalformedMessage("crdt: digests name each bucket once, by number")
    return out


def _parse_buckets(b: Any) -> list[int]:
    if not isinstance(b, list) or len(b) > BUCKETS or not all(type(x) is int and 0 <= x < BUCKETS for x in b):
        raise MalformedMessage("crdt: buckets are a list of bucket numbers")
    return b


def _parse_key(key: Any) -> tuple[int, str] | None:
    if key is None:
        return None
    if not (isinstance(key, list) and len(key) == 2 and type(key[0]) is int and 0 <= key[0] < BUCKETS
            and isinstance(key[1], str) and len(key[1]) <= MAX_KEY):
        raise MalformedMessage("crdt: a page key is [bucket, author]")
    return key[0], key[1]
