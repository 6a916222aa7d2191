"""Replication of the swarm's CRDT state: push on write, anti-entropy by version vectors, a durable op log.

The messages and their limits are in ``node.crdt_wire``; pushing (kept streams, the epidemic relay, what peers
refuse of our ops) in ``node.crdt_push``; anti-entropy (every ``sync_interval`` with a random connected member, at
once with a peer just greeted) in ``node.crdt_sync``. Here: the replicator's life (its op log, its admission ticket,
its recovery after log damage), local writes, and what comes in (the responder's side, and every op's verdict).

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
from swarmd.crdt.bases import BASE_OBJECT
from swarmd.crdt.ops import SIGN_DOMAIN
from swarmd.node.crdt_push import Pushing
from swarmd.node.crdt_sync import Syncing
from swarmd.node.crdt_wire import (
    ACK, CRDT_SPEC, ENTRIES, MAX_PUSH_OPS, OPS, PUSH, SYNC, SYNC_BATCH, WANT, answer_sync, answer_want,
)
from swarmd.node.oplog import OpLog
from swarmd.transport.base import Stream, Transport
from swarmd.transport.clock import SYSTEM, Clock
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.identity import Identity, verify
from swarmd.transport.penalties import RateLimitedLog, TokenBuckets

logger = logging.getLogger(__name__)

LOG_SLACK = 1000  # the op log is rewritten without restated ops once it holds this many more than twice the live ones
PREVERIFY_AT = 16  # batches of at least this many ops have their signatures checked in a worker thread

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


class Replicator(Pushing, Syncing):
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


