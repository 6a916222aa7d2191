"""Replication of the swarm's CRDT state: push on write, anti-entropy by version vectors, a durable op log.

``/swarmd/crdt/2.0.0`` on one stream, requester first:

- ``PUSH {"ops": [op, ...]}`` -> ``ACK {"applied": n, "rejected": n}``: new ops, sent at once to every connected
  member when we write them;
- ``SYNC {"d": [[bucket, digest], ...], "after": key | None}`` -> ``ENTRIES {"b": [bucket, ...], "vv": {author: seq},
  "next": key | None}``: we send our bucket digests (at most 256 of 16 bytes, whatever the number of authors, see
  ``crdt.store``); the responder names the buckets that differ and sends one page (at most ``PAGE`` entries) of its
  version vector for them, in (bucket, author) order from just after ``after``; ``next`` is where the following page
  starts.
- ``WANT {"have": {author: seq}}`` -> ``OPS {"ops": [...], "more": bool}``: for the authors of the page where the
  responder is ahead, the ops past our seq (in causal order, at most ``SYNC_BATCH`` per reply; we ask again while
  ``more``). Then we PUSH on the same stream what the page shows the responder lacks, and ask for the next page.

So a sync costs what differs, never the whole version vector: with a million authors a message is still at most
``PAGE`` entries, and no honest peer ever exceeds a limit of ours.

Anti-entropy runs every ``sync_interval`` with a random connected member, and at once with a peer we have just
greeted, so a node that was offline or just joined catches up from any peer.

An op of an author we have not merged is merged only if its author has *standing* with us: its own key sent it
(a node pushes and syncs its own ops itself), or a peer with standing introduced it, at most ``INTRO_BURST`` new
authors at once and ``INTRO_PER_S`` a second per peer; otherwise the store holds it on probation (``crdt.store``),
bounded, not relayed, not logged. A flood of admitted identities pushed by a stranger therefore only cycles through
the probation table, and the authors that honest members wrote with stay merged, so nobody is locked out by a count
of identities. In a closed swarm (an allowlist), streams of keys outside the list are refused both ways: its state is
private to its members.

Every op from the network is verified by the store (signature, author rights, clock skew, causality, size). A
rejected op is counted by reason and penalises the peer that sent it: honest peers only relay ops they verified.
Ops we apply are appended to the op log and fsync'd before we acknowledge them (a local write returns, a PUSH is
ACKed), so a restart, even after kill -9, rebuilds the same state and loses nothing acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import msgpack

from swarmd.crdt import (
    PROBATION, REJECTED, GCounter, LWWMap, MaxRegister, Op, OpError, OpStore, ORSet, ProgressRegister, decode_wire,
)
from swarmd.crdt.admission import Admission
from swarmd.crdt.ops import ID_SIZE, MAX_AUTHOR, MAX_OBJECT_NAME, MAX_PARENTS, MAX_SEQ, SIGN_DOMAIN
from swarmd.crdt.buckets import BUCKETS, DIGEST_SIZE
from swarmd.crdt.store import BASE_OBJECT, MAX_BASE_SIZE
from swarmd.crdt.types import MAX_KEY
from swarmd.node.oplog import OpLog
from swarmd.transport.base import Stream, Transport
from swarmd.transport.clock import SYSTEM, Clock
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import Identity, verify
from swarmd.transport.penalties import RateLimitedLog, TokenBuckets
from swarmd.transport.wire import ANY, WIRE, Bool, Bytes, Dict, Int, List, Map, Nil, OneOf, Str, Tuple

logger = logging.getLogger(__name__)

PUSH, ACK, SYNC, OPS, ENTRIES, WANT = 1, 2, 3, 4, 5, 6
CRDT_SPEC = ProtocolSpec("crdt", "2.0.0", max_frame=8 << 20, kinds=frozenset({PUSH, ACK, SYNC, OPS, ENTRIES, WANT}))
MAX_PUSH_OPS = 1000
SYNC_BATCH = 1000
PUSH_BYTES = 4 << 20  # op bodies per PUSH or OPS frame (the frame limit is 8 MiB)
# a push of few bytes (a node's progress record, a member op, their relays) goes over a stream kept to that peer, not
# a new one: a p2p stream opened, used for one PUSH and ACK and closed costs both nodes and their p2p daemons 3.0 ms
# of CPU against 0.37 ms on a kept stream (loopback, 2-core machine), and an 8-node DiLoCo swarm pushes about 20
# times a node a round (each node's progress record, to everyone and relayed on), which its p2p daemon and event loop
# carry as a fixed cost of every round (``docs/benchmarks/crdt.md``, Kept push streams)
KEPT_PUSH_BYTES = 64 << 10  # op bodies: a larger push (a joiner's catch-up, a base) gets a stream of its own
KEPT_REPLY = 5.0  # s: an ACK later than this on a kept stream: the stream is taken for broken (a partition, a peer
# restarted), closed, and the push goes over a new stream, with the usual timeouts
KEPT_IDLE = 20.0  # s: a kept stream unused this long is closed (the responder stops waiting for the next at 30 s)
LOG_SLACK = 1000  # the op log is rewritten without restated ops once it holds this many more than twice the live ones
PAGE = 2048  # version-vector entries per ENTRIES / WANT message
MAX_PAGES = 64  # pages per sync (the next anti-entropy round goes on)
MAX_WANTS = 64  # WANT round trips per page
PREVERIFY_AT = 16  # batches of at least this many ops have their signatures checked in a worker thread

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

# how a rejected op counts against the peer that sent it (see transport.penalties.WEIGHTS)
PENALTY = {
    "bad_signature": "bad_signature",
    "not_allowed": "forged",
    "malformed": "malformed",
    "oversized": "oversized",
    "unknown_object": "malformed",
    "bad_causality": "malformed",
    "not_admitted": "forged",  # an honest peer applies (and so relays) only admitted authors' ops
    "over_quota": "malformed",  # the rule reads only the author's chain: an honest peer never relays such an op
    # "pending_full", "probation_full" and "unknown_author" are our limits (an honest relay may send an op before its
    # author's op #1 reached us), never the sender's fault: counted and logged, no penalty
    "future_clock": "stale",  # may be clock skew between honest nodes: a light penalty
    "equivocation": "stale",  # an honest relay may carry the other fork first
}

# The objects every node replicates. All nodes of a swarm must declare the same schema.
BASE_SCHEMA = {
    "members": ORSet(self_only=True),  # who is in the swarm (each peer adds and removes itself)
    "progress": ProgressRegister(),  # per peer: step, samples, loss, bytes, round
    "rounds": MaxRegister(),  # the highest round number anyone reached
    "kv": LWWMap(namespaced=True),  # per-peer settings and notes: keys "<peer id>/..."
    "events": GCounter(),  # a swarm-wide counter (e.g. samples processed)
}


INTRO_BURST = 4096  # new authors one peer with standing may introduce at once (two pages of entries)...
INTRO_PER_S = 0.5  # ...and then this many a second (1,800 an hour)
MAX_INTRO_PEERS = 4096  # peers whose introduction budget we track (full budgets are forgotten first)
RELAY_WINDOW_MS = 60_000  # ops a sync pulls are pushed on if written this recently
RECOVERY_ALONE_S = 120.0  # with no peer at all for this long, a node whose log was damaged writes again anyway


class WritesPaused(ValueError):
    """Local writes wait: the op log was damaged and this node has not yet re-fetched its own ops from a peer."""


class Replicator:
    def __init__(
        self,
        identity: Identity,
        transport: Transport,
        data_dir: Path,
        *,
        peers: Callable[[], list[str]],
        schema: dict | None = None,
        sync_interval: float = 5.0,
        max_skew_ms: int = 30_000,
        admission: Admission | None = None,
        max_authors: int = 20_000,
        clock: Clock = SYSTEM,
        rng: random.Random | None = None,
        log: OpLog | None = None,
        relay_fanout: int = 3,
        compatible: Callable[[str], bool] = lambda peer_id: True,
    ):
        self.identity = identity
        self.clock = clock
        self._rng = rng or random.Random()
        self.transport = transport
        self.admission = admission or Admission()
        self._verified: dict[tuple, bool] = {}  # (author, signed data, sig) checked off the event loop, used once
        self.store = OpStore(schema or BASE_SCHEMA, self._verify, max_skew_ms=max_skew_ms, admission=self.admission,
                             max_authors=max_authors, hold_unknown_authors=False)
        self._intro = TokenBuckets(INTRO_PER_S, INTRO_BURST, max_keys=MAX_INTRO_PEERS, clock=clock.monotonic)
        self.refused_by: dict[str, dict] = {}  # peer -> {"ops": our ops it refused, "at": when last}
        self.ticket_file = data_dir / "admission.ticket"
        self._member_ticket: int | None = None
        self._ticket_lock = asyncio.Lock()
        self.log = log if log is not None else OpLog(data_dir / "crdt.log")
        self._peers = peers
        self._compatible = compatible
        self.sync_interval = sync_interval
        self.last_sync: dict[str, float] = {}
        self.counters: Counter = Counter()
        self._write_lock = asyncio.Lock()
        self._outbox: list[Op] = []
        self.relay_fanout = relay_fanout
        self._relays: list[tuple[Op, str]] = []  # ops new to us that a peer pushed, with that peer: pushed on
        self._outbox_event = asyncio.Event()
        self._kept: dict[str, tuple[Stream, float]] = {}  # peer -> the stream our small pushes go over, last used
        self._sync_soon: set[str] = set()
        self._sync_event = asyncio.Event()
        self._log = RateLimitedLog(logger, interval=30.0, clock=clock.monotonic)
        self._recovered = asyncio.Event()  # set once writes are safe (at once unless the op log was damaged)

    def _now_ms(self) -> int:
        return int(self.clock.time() * 1000)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        wires = await asyncio.to_thread(self.log.open)
        now = self._now_ms()
        bad = 0
        for wire in wires:
            if self.store.receive(wire, now).status == REJECTED:
                bad += 1
        if bad:
            logger.warning("op log: %d records did not verify and were skipped", bad)
        logger.info("CRDT state: %d ops from the log", len(self.store.ops))
        await self.compact_log()
        await self.transport.serve(CRDT_SPEC, self._on_stream)
        if self.log.damaged_mid:
            return  # writes (our member op included) wait for _recover
        self._recovered.set()
        await self._join_members()

    async def _join_members(self) -> None:
        me = self.identity.peer_id
        if me in self.store.value("members"):
            return
        ticket = None
        if me not in self.store.chains and not self.admission.closed:
            ticket = await self.member_ticket()
        await self.write("members", self.admission.payload(me, ticket))

    async def member_ticket(self) -> int | None:
        """Our admission ticket (None in a closed swarm), for our members add and our member record: minted off the
        event loop the first time (about 2 s at 22 bits), then kept."""
        if self.admission.closed:
            return None
        async with self._ticket_lock:  # one minting, whoever asks first (our member op, our member record)
            if self._member_ticket is None:
                self._member_ticket = await asyncio.to_thread(self._ticket)
        return self._member_ticket

    def _ticket(self) -> int:
        """Our admission ticket (crdt.admission): minted once per identity and swarm, kept in the data dir."""
        me = self.identity.peer_id
        try:
            kept = json.loads(self.ticket_file.read_text())
            if kept.get("swarm") == self.admission.swarm and self.admission.ticket_ok(me, kept.get("ticket")):
                return kept["ticket"]
        except (OSError, ValueError, AttributeError):
            pass
        started = self.clock.monotonic()
        ticket = self.admission.mint(me)
        logger.info("admission ticket for swarm %r minted in %.1f s (%d bits of work)", self.admission.swarm,
                    self.clock.monotonic() - started, self.admission.bits)
        try:
            self.ticket_file.write_text(json.dumps({"swarm": self.admission.swarm, "ticket": ticket}))
        except OSError as e:
            logger.warning("could not keep the admission ticket in %s: %s", self.ticket_file, e)
        return ticket

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._push_loop())
            tg.create_task(self._anti_entropy_loop())
            if not self._recovered.is_set():
                tg.create_task(self._recover())

    async def _recover(self) -> None:
        """After log damage: sync with peers until our own chain has no gap, then write again.

        A new op of ours must follow the last one any peer holds, or it would equivocate (same seq, different op)
        and every later write of ours would be refused wherever the old one is known."""
        me, synced, started = self.identity.peer_id, set(), self.clock.monotonic()
        while True:
            peers = self._peers()
            for peer_id in [p for p in peers if p not in synced]:
                try:
                    await self.sync_with(peer_id)
                    synced.add(peer_id)
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    logger.debug("recovery sync with %s failed: %s", peer_id, e)
            gap = sorted(op.seq for op in self.store.pending.values() if op.author == me)
            if synced and not gap:
                logger.warning("op log recovery: own ops re-fetched from %d peer(s) (chain at #%d); writing again",
                               len(synced), self.store.last_seq(me))
                break
            if synced and synced >= set(peers):
                logger.error("op log recovery: no peer has own op #%d (held after it: %s); writing again",
                             self.store.last_seq(me) + 1, gap[:8])
                break
            if not synced and self.clock.monotonic() - started > RECOVERY_ALONE_S:
                logger.error("op log recovery: no peer reachable for %.0f s; writing again without re-fetching "
                             "(ops lost with the damaged records may be re-used)", RECOVERY_ALONE_S)
                break
            await asyncio.sleep(0.5)
        self.counters["log_recoveries"] += 1
        self._recovered.set()
        try:
            await self._join_members()
        except ValueError as e:
            logger.warning("could not re-add ourselves to the member set: %s", e)

    async def leave(self, timeout: float = 1.0) -> None:
        """Remove ourselves from the member set and tell connected peers (best effort)."""
        if self.identity.peer_id not in self.store.value("members"):
            return
        try:
            op = await self.write("members", {"rm": self.identity.peer_id}, push=False)
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(self._push(p, [op]) for p in self._peers()), return_exceptions=True)
        except (TimeoutError, ValueError, OSError):
            pass

    def close(self) -> None:
        self.log.close()

    async def compact_log(self) -> bool:
        """Rewrite the op log without the ops that their authors' bases restated (``crdt.store``: compaction),
        once they outnumber the live ones: the log then holds what the store holds, at most ``BASE_EVERY`` ops per
        author. An op goes only where the log itself holds the base that restates it (a base the store applied may
        not be on disk yet), and appends wait on the log's lock meanwhile: nothing durable is ever lost."""
        live = len(self.store.ops) + len(self.store.pending)
        if self.log.records <= 2 * live + LOG_SLACK:
            return False
        before, size = self.log.records, self.log.size
        if not await asyncio.to_thread(self.log.rewrite, still_live):
            return False
        self.counters["log_compactions"] += 1
        logger.info("op log compacted: %d -> %d records (%d -> %d bytes)", before, self.log.records, size,
                    self.log.size)
        return True

    # ------------------------------------------------------------------ local writes
    async def write(self, obj: str, payload: Any, *, push: bool = True) -> Op:
        return (await self.write_many([(obj, payload)], push=push))[0]

    async def write_many(self, items: list[tuple[str, Any]], *, push: bool = True) -> list[Op]:
        """Create, fsync and (by default) push a batch of ops, whole or not at all.

        Raises ValueError naming the first refusal (nothing of the batch is applied) and OSError if the log cannot
        persist it (nothing applied either). Signing runs in a worker thread; the ops become visible to readers and
        to anti-entropy only once they are on disk, so no peer ever holds an op of ours that a restart forgets."""
        if not self._recovered.is_set():
            raise WritesPaused("the op log was damaged: re-fetching this node's own ops from a peer before writing")
        async with self._write_lock:
            resolved = []
            for obj, payload in items:
                if obj in self.store.schema and isinstance(self.store.schema[obj], ORSet) \
                        and isinstance(payload, dict) and set(payload) == {"rm"} and isinstance(payload["rm"], str):
                    payload = {"rm": payload["rm"], "tags": ORSet.live_tags(self.store.states[obj], payload["rm"])}
                resolved.append((obj, payload))
            bodies, refusal = self.store.draft(self.identity.peer_id, resolved, self._now_ms())
            if refusal is not None:
                raise ValueError(refusal)
            sign = self.identity.sign
            sigs = await asyncio.to_thread(lambda: [sign(SIGN_DOMAIN + body) for body in bodies])
            await asyncio.to_thread(self.log.append, [{"b": b, "s": s} for b, s in zip(bodies, sigs)])
            ops = self.store.commit(bodies, sigs, self._now_ms())
        self.counters["ops_written"] += len(ops)
        if push:
            self._outbox.extend(ops)
            self._outbox_event.set()
        return ops

    # ------------------------------------------------------------------ ingest
    def _verify(self, author: str, data: bytes, sig: bytes) -> bool:
        ok = self._verified.pop((author, data, sig), None)
        return verify(author, data, sig) if ok is None else ok

    def _preverify(self, wires: list) -> list[tuple]:
        """Check the signatures of a batch in a worker thread (the store then finds the answers): a thousand ops
        would otherwise hold the event loop for about 0.1 s. Returns the keys it added."""
        keys = []
        for wire in wires:
            try:
                op = decode_wire(wire, max_size=self.store.max_wire_size)
            except OpError:
                continue  # the store refuses it with its reason
            if op.id not in self.store.ops:
                key = (op.author, SIGN_DOMAIN + op.body, op.sig)
                self._verified[key] = verify(*key)
                keys.append(key)
        return keys

    async def _ingest(self, peer_id: str, wires: Any, seen: dict[str, int] | None = None,
                      relay: bool = False) -> tuple[int, int]:
        """Verify and apply ops from ``peer_id``; returns (applied, rejected). ``seen`` collects the highest seq
        received per author (applied, held or already known); ``relay``: ops new to us are pushed on (fresh writes
        arrive by push; what a sync pages in is old news)."""
        if not isinstance(wires, list) or len(wires) > max(MAX_PUSH_OPS, SYNC_BATCH):
            raise MalformedMessage("crdt: ops must be a list of at most 1000")
        keys = await asyncio.to_thread(self._preverify, wires) if len(wires) >= PREVERIFY_AT else []
        try:
            return await self._apply_wires(peer_id, wires, seen, relay)
        finally:
            for key in keys:
                self._verified.pop(key, None)

    def _voucher(self, peer_id: str) -> Callable[[str], bool]:
        """Whether an author we have not merged has standing when ``peer_id`` sends its op: its own key sends it,
        or ``peer_id`` has standing itself and its introduction budget allows one more author."""
        me, granted = self.identity.peer_id, set()

        def vouch(author: str) -> bool:
            if author in (peer_id, me) or author in granted:
                return True
            if peer_id not in self.store.chains or not self._introduce(peer_id):
                return False
            granted.add(author)
            return True
        return vouch

    def _introduce(self, peer_id: str) -> bool:
        """Take one introduction from ``peer_id``'s budget (``INTRO_BURST`` at once, ``INTRO_PER_S`` a second)."""
        if not self._intro.allow(peer_id):
            self.counters["introductions_refused"] += 1
            return False
        self.counters["introductions"] += 1
        return True

    async def _apply_wires(self, peer_id: str, wires: list, seen: dict[str, int] | None,
                           relay: bool = False) -> tuple[int, int]:
        now = self._now_ms()
        applied: list[Op] = []
        rejected = Counter()
        vouch, probation = self._voucher(peer_id), 0
        for i, wire in enumerate(wires):
            if i and i % 16 == 0:
                # a batch of a thousand ops must not hold the event loop: 16 ops of 4 KiB of empty maps (the most
                # costly to decode) are about 5 ms
                await asyncio.sleep(0)
            result = self.store.receive(wire, now, vouch)
            applied.extend(result.applied)  # a rejected op may follow its author's held ops it promoted
            if result.status == REJECTED:
                rejected[result.reason] += 1
            else:
                probation += result.status == PROBATION
                if seen is not None and result.op is not None:
                    seen[result.op.author] = max(seen.get(result.op.author, 0), result.op.seq)
        if applied:
            try:
                await asyncio.to_thread(self.log.append, [op.wire() for op in applied])
            except OSError as e:  # disk full, or closing: do not ACK what is not durable
                raise TransportError(f"crdt: cannot persist ops: {e}") from None
            if self.relay_fanout:
                # fresh ops go on: what a push brought, and what a sync pulled that was written in the last minute
                # (a partition's writes after it heals), not an old history a joiner pages in
                fresh = applied if relay else [op for op in applied if op.clock[0] >= now - RELAY_WINDOW_MS]
                if fresh:
                    self._relays.extend((op, peer_id) for op in fresh)
                    self._outbox_event.set()
        self.counters["ops_received"] += len(wires)
        self.counters["ops_applied"] += len(applied)
        self.counters["ops_on_probation"] += probation
        if probation:
            held = self.store.probation_counts
            self._log.log(logging.INFO, "probation", "crdt: %d op(s) from %s held on probation (authors without "
                          "standing: %d held now, %d evicted to make room so far)", probation, peer_id,
                          len(self.store.probation), held["evicted"])
        if rejected.get("unknown_author") and relay:
            self.sync_soon(peer_id)  # it pushed ops whose author's op #1 we lack: a sync with it brings them
        for reason, count in rejected.items():
            kind = PENALTY.get(reason)
            if kind is not None:
                for _ in range(count):
                    self.transport.penalties.penalize(peer_id, kind, f"crdt op rejected: {reason}")
            self.transport.stats.errors[f"crdt_{reason}"] += count
            self._log.log(logging.WARNING, ("rejected", reason), "crdt: %d op(s) from %s refused: %s",
                          count, peer_id, reason)
        return len(applied), sum(rejected.values())

    # ------------------------------------------------------------------ protocol: server side
    def _private_from(self, peer_id: str) -> bool:
        """A closed swarm's state is for its members only: no stream with a key outside the allowlist."""
        return self.admission.closed and peer_id not in self.admission.allow

    def _refuse_outsider(self, peer_id: str, way: str) -> None:
        self.counters["refused_not_member"] += 1
        self.transport.stats.errors["crdt_not_member"] += 1
        self._log.log(logging.WARNING, ("outsider", way), "crdt: %s stream with %s refused: not on this closed "
                      "swarm's allowlist (state.allow)", way, peer_id)

    async def _on_stream(self, stream: Stream) -> None:
        if self._private_from(stream.peer_id):
            self._refuse_outsider(stream.peer_id, "inbound")
            return
        if not self._compatible(stream.peer_id):
            # another admission rule (its member record says so): it would take our authors' ops for forged and
            # we its; honest, not the peer's fault, so refused without a penalty (discovery logs the mismatch)
            self.counters["refused_other_rule"] += 1
            return
        while True:
            message = await asyncio.wait_for(stream.read(), 30.0)
            if message is None:
                return
            body = message.body
            if message.kind == SYNC:
                await stream.send(ENTRIES, answer_sync(self.store, body))
                self.last_sync[stream.peer_id] = self.clock.time()
            elif message.kind == WANT:
                reply = answer_want(self.store, body)
                await stream.send(OPS, reply)
                self.counters["ops_sent"] += len(reply["ops"])
            elif message.kind == PUSH:
                if not isinstance(body, dict) or set(body) != {"ops"}:
                    raise MalformedMessage("crdt: PUSH body must be {ops: [...]}")
                applied, rejected = await self._ingest(stream.peer_id, body["ops"], relay=True)
                await stream.send(ACK, {"applied": applied, "rejected": rejected})
            else:
                raise MalformedMessage(f"crdt: unexpected message kind {message.kind}")

    # ------------------------------------------------------------------ protocol: client side
    async def _push(self, peer_id: str, ops: list[Op]) -> None:
        """Push ``ops`` to ``peer_id``: a few bytes over the stream kept to it (``KEPT_PUSH_BYTES``), opened on the
        first push; a kept stream that fails or answers late is closed and the push goes over a new one (the ops
        are idempotent: one the peer got twice is acked as known)."""
        if self._private_from(peer_id):
            self._refuse_outsider(peer_id, "outbound")
            return
        small = sum(len(op.body) for op in ops) <= KEPT_PUSH_BYTES
        kept = self._kept.pop(peer_id, None) if small else None
        if kept is not None:
            stream, used = kept
            if self.clock.monotonic() - used < KEPT_IDLE:  # else its responder may be ending it: not used
                try:
                    await self._push_on(stream, ops, reply_timeout=KEPT_REPLY)
                    await self._keep(peer_id, stream)
                    return
                except (TransportError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                    self.counters["kept_push_failed"] += 1
                    logger.debug("push to %s over the kept stream failed: %r; over a new one", peer_id, e)
                except BaseException:
                    await stream.close()
                    raise
            await stream.close()
        stream = await self.transport.open_stream(peer_id, CRDT_SPEC, timeout=10.0)
        self.counters["push_streams_opened"] += 1
        keep = False
        try:
            await self._push_on(stream, ops)
            keep = small
        finally:
            if keep:
                await self._keep(peer_id, stream)
            else:
                await stream.close()

    async def _keep(self, peer_id: str, stream: Stream) -> None:
        """``stream`` becomes the one kept to ``peer_id``, unless another push to it kept one meanwhile."""
        if peer_id in self._kept:
            await stream.close()
        else:
            self._kept[peer_id] = (stream, self.clock.monotonic())

    async def _close_idle(self, peers: list[str]) -> None:
        """Close the kept streams unused for ``KEPT_IDLE`` and those to peers no longer among ``peers``."""
        now, connected = self.clock.monotonic(), set(peers)
        for peer_id, (stream, used) in list(self._kept.items()):
            if now - used >= KEPT_IDLE or peer_id not in connected:
                del self._kept[peer_id]
                await stream.close()

    async def _push_on(self, stream: Stream, ops: list[Op], reply_timeout: float = 30.0) -> None:
        batches, size = [[]], 0
        for op in ops:  # at most MAX_PUSH_OPS ops and PUSH_BYTES of bodies a frame (bases are up to 64 KiB)
            if batches[-1] and (len(batches[-1]) == MAX_PUSH_OPS or size + len(op.body) > PUSH_BYTES):
                batches.append([])
                size = 0
            batches[-1].append(op)
            size += len(op.body)
        for batch in batches if ops else []:
            await stream.send(PUSH, {"ops": [o.wire() for o in batch]})
            reply = await asyncio.wait_for(stream.read_required(), reply_timeout)
            if reply.kind != ACK:
                raise MalformedMessage("crdt: expected ACK")
            self.counters["ops_sent"] += len(batch)
            self._note_ack(stream.peer_id, batch, reply.body)

    def _note_ack(self, peer_id: str, batch: list[Op], ack: Any) -> None:
        """What a peer refused of a batch that carried our own ops: the writer learns that its writes do not spread
        (``refused_by`` in /status, ``swarmd doctor``). An ACK counts the whole batch; ops of ours that a peer had
        already are acked as applied or known, never as refused, so a refusal of a batch of ours alone is ours."""
        if not isinstance(ack, dict) or type(ack.get("rejected")) is not int or ack["rejected"] <= 0:
            return
        me = self.identity.peer_id
        ours = sum(op.author == me for op in batch)
        if not ours:
            return
        n = min(ours, ack["rejected"])
        if peer_id not in self.last_sync:
            # a peer we never synced with may lack our earlier ops (it refuses a later one as unknown_author): a
            # sync brings them, and only what it refuses after one counts
            self.counters["own_ops_refused_before_sync"] += n
            self.sync_soon(peer_id)
            return
        entry = self.refused_by.setdefault(peer_id, {"ops": 0, "at": 0.0})
        entry["ops"] += n
        entry["at"] = self.clock.time()
        self.counters["own_ops_refused"] += n
        self._log.log(logging.WARNING, ("refused_by", peer_id), "crdt: %s refused %d of our op(s) (it refused %d "
                      "so far): our writes may not reach the swarm; see its log and `swarmd doctor`", peer_id, n,
                      entry["ops"])
        if len(self.refused_by) > 256:
            self.refused_by.pop(min(self.refused_by, key=lambda p: self.refused_by[p]["at"]))

    async def sync_with(self, peer_id: str) -> None:
        """Page through the buckets where ``peer_id``'s state differs from ours: pull what we lack, push what it
        lacks."""
        if self._private_from(peer_id):
            self._refuse_outsider(peer_id, "outbound")
            return
        async with await self.transport.open_stream(peer_id, CRDT_SPEC, timeout=10.0) as stream:
            after = None
            for _ in range(MAX_PAGES):
                digests = [[b, d] for b, d in self.store.digests().items()]
                await stream.send(SYNC, {"d": digests, "after": None if after is None else list(after)})
                reply = await asyncio.wait_for(stream.read_required(), 30.0)
                body = reply.body
                if reply.kind != ENTRIES:
                    raise MalformedMessage("crdt: expected ENTRIES")
                buckets, theirs, nxt = parse_entries(body)
                if nxt is not None and after is not None and nxt <= after:
                    raise MalformedMessage("crdt: ENTRIES paging went backwards")
                if not buckets:
                    break
                want, lacking = self.store.page_diff(theirs, buckets, after, nxt)
                if want:
                    self.store.fetching.update(want)  # their op #1 is on its way: later ops wait for it
                    try:
                        await self._pull_page(stream, peer_id, theirs)
                    finally:
                        self.store.fetching.difference_update(want)
                ops, _ = self.store.ops_after(lacking, 10 * SYNC_BATCH, 10 * PUSH_BYTES)
                if ops:
                    await self._push_on(stream, ops)
                if nxt is None:
                    break
                after = nxt
        self.last_sync[peer_id] = self.clock.time()
        self.counters["syncs"] += 1

    async def _pull_page(self, stream: Stream, peer_id: str, theirs: dict[str, int]) -> None:
        """WANT the ops of the authors where the peer is ahead, until it has sent everything up to its page."""
        def known(author: str) -> int:
            return max(self.store.last_seq(author), seen.get(author, 0))

        seen: dict[str, int] = {}
        for _ in range(MAX_WANTS):
            want = {a: known(a) for a, seq in theirs.items() if seq > known(a)}
            if not want:
                return
            await stream.send(WANT, {"have": want})
            reply = await asyncio.wait_for(stream.read_required(), 30.0)
            body = reply.body
            if reply.kind != OPS or not isinstance(body, dict) or set(body) != {"ops", "more"}:
                raise MalformedMessage("crdt: expected OPS {ops, more}")
            before = dict(seen)
            await self._ingest(peer_id, body["ops"], seen)
            if body["more"] is not True or seen == before:
                return

    def sync_soon(self, peer_id: str) -> None:
        self._sync_soon.add(peer_id)
        self._sync_event.set()

    # ------------------------------------------------------------------ background loops
    async def _push_loop(self) -> None:
        sem = asyncio.Semaphore(16)

        async def push_one(peer_id: str, ops: list[Op]) -> None:
            async with sem:
                try:
                    await self._push(peer_id, ops)
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    self.counters["push_failures"] += 1
                    logger.debug("push to %s failed: %s (anti-entropy will repair)", peer_id, e)

        while True:
            await self._outbox_event.wait()
            self._outbox_event.clear()
            ops, self._outbox = self._outbox, []
            relays, self._relays = self._relays, []
            peers = self._peers()
            batches: dict[str, list[Op]] = {p: list(ops) for p in peers} if ops else {}
            if ops:
                self.counters["pushes"] += 1
            for op, came_from in relays:
                # an epidemic push: each new op goes on to a few random peers other than the one it came from and
                # its author, so in a swarm too large for everyone to be connected it crosses the graph in hops of
                # one round trip, not of one anti-entropy interval (a peer that has it already acks it as known)
                others = [p for p in peers if p != came_from and p != op.author]
                for p in self._rng.sample(others, min(self.relay_fanout, len(others))):
                    batches.setdefault(p, []).append(op)
                self.counters["ops_relayed"] += 1
            if batches:
                await asyncio.gather(*(push_one(p, batch) for p, batch in batches.items()))

    async def _anti_entropy_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._sync_event.wait(), self.sync_interval * self._rng.uniform(0.8, 1.2))
            except asyncio.TimeoutError:
                pass
            self._sync_event.clear()
            try:
                await self.compact_log()
            except OSError as e:
                self._log.log(logging.WARNING, "compact", "crdt: could not rewrite the op log: %s", e)
            dropped = dict(self.store.pending_dropped)
            self.store.expire_pending(self._now_ms())
            if dict(self.store.pending_dropped) != dropped:
                self._log.log(logging.WARNING, "pending", "crdt: held ops waiting for unknown parents dropped so "
                              "far: %s (anti-entropy re-delivers honest ones)", dict(self.store.pending_dropped))
            peers = self._peers()
            await self._close_idle(peers)
            targets = [p for p in sorted(self._sync_soon) if p in peers]
            self._sync_soon.clear()
            if not targets and peers:
                targets = [self._rng.choice(peers)]
            for peer_id in targets:
                try:
                    await self.sync_with(peer_id)
                except (TransportError, ProtocolViolation, asyncio.TimeoutError) as e:
                    self.counters["sync_failures"] += 1
                    if isinstance(e, ProtocolViolation):
                        self.transport.penalties.penalize(peer_id, e.kind, str(e))
                    self._log.log(logging.DEBUG, ("sync", peer_id), "sync with %s failed: %s", peer_id, e)

    # ------------------------------------------------------------------ views
    def summary(self) -> dict:
        s = self.store.summary()
        s.update(
            {
                "log_records": self.log.records,
                "log_bytes": self.log.size,
                "log_truncated_bytes": self.log.truncated_bytes,
                "log_damaged_bytes": self.log.damaged_bytes,
                "log_damaged_stretches": self.log.damaged_mid,
                "writes_paused": not self._recovered.is_set(),
                "last_sync": {p: t for p, t in sorted(self.last_sync.items())},
                "refused_by": {p: dict(v) for p, v in sorted(self.refused_by.items())},
                **{k: v for k, v in sorted(self.counters.items())},
            }
        )
        return s

    def state(self) -> dict:
        return {"digest": self.store.digest(), "ops": len(self.store.ops), "objects": self.store.values()}


def still_live(wires: list) -> list[bool]:
    """Which op log records are still needed: all but the ops before a base of their author that the log holds
    too. A record that does not decode as an op is kept (not this pass's to judge: the store refuses it at the next
    start)."""
    def author_seq(wire: Any) -> tuple[str, int, bool] | None:
        try:
            body = msgpack.unpackb(wire["b"], raw=False, max_ext_len=0)
            return body[1], body[2], body[5] == BASE_OBJECT
        except Exception:
            return None

    keys = [author_seq(w) for w in wires]
    bases: dict[str, int] = {}
    for key in keys:
        if key is not None and key[2] and isinstance(key[1], int):
            bases[key[0]] = max(bases.get(key[0], 0), key[1])
    return [key is None or not isinstance(key[1], int) or key[1] >= bases.get(key[0], 0) for key in keys]


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
