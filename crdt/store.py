"""The op store: verification, the causal DAG, and the merged state of every declared object.

``receive`` takes an op from anywhere (the network, our log, ourselves) and answers what happened to it:

- ``applied``: verified and merged (with any held ops it unblocked);
- ``duplicate``: already known (idempotent);
- ``pending``: verified, but a parent is unknown; held until the parent arrives, within a budget: at most
  ``max_pending`` ops and ``max_pending_bytes`` of bodies in all, at most ``max_pending_share`` (a tenth) of either per
  author, each for at most ``pending_ttl_ms``. When the budget is full the oldest held op gives way (anti-entropy
  delivers it again in causal order later), so a flood of orphans can neither grow memory nor lock honest out-of-order
  ops out;
- ``rejected`` with a reason code: ``malformed``, ``oversized``, ``bad_signature``, ``unknown_object``,
  ``not_allowed`` (the author wrote outside what the type allows), ``future_clock`` (more than ``max_skew_ms``
  ahead of our clock), ``bad_causality`` (clock not after its parents', or seq not following the author's previous
  op), ``equivocation`` (a second, different op for an author's seq), ``pending_full`` (its author already holds
  its share of the pending budget), ``not_admitted`` (an author's op #1 without its admission, see
  ``crdt.admission``), ``authors_full`` (a new author while we hold ``max_authors``: our limit, not the sender's
  fault), ``over_quota`` (an author's op written less than ``QUOTA_WINDOW_MS`` after its op ``QUOTA_OPS`` back in
  its chain, by the ops' own clocks: at most that many ops a minute per author, sustained, whatever objects they
  rewrite; an op's clock cannot run ahead of real time by more than ``max_skew_ms``, so a chain cannot outrun the
  quota, and the rule reads only the chain, so every replica decides the same way).

Each author's ops form a chain (``seq`` 1, 2, ...; each op lists the author's previous op as a parent), so a
replica's content is summarized exactly by its version vector ``{author: last seq}``. That vector grows with the
number of authors, so anti-entropy never sends it whole: authors fall into ``BUCKETS`` buckets by hash, each with a
16-byte digest (the XOR of a hash of each ``(author, seq)`` entry, updated as ops merge), and replicas compare the
digests (at most 4 KiB, whatever the number of authors), then page through the entries of the buckets that differ
(``entries``) and exchange the ops one side lacks (``ops_after``). Convergence is checked by the heads digest (hash
of the sorted DAG heads).

Pure: no I/O, no clock, no keys; the caller passes ``now_ms`` and a signature verifier.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from crdt.admission import Admission
from crdt.hlc import HLC
from crdt.ops import (
    MAX_PARENTS, Op, OpError, Signer, Verifier, decode_body, decode_wire, encode_body, make_op, verify_op,
)
from crdt.types import CRDTType

APPLIED, DUPLICATE, PENDING, REJECTED = "applied", "duplicate", "pending", "rejected"
QUOTA_OPS = 1000  # an author's ops per QUOTA_WINDOW_MS, by their clocks (the same on every node: part of the protocol)
QUOTA_WINDOW_MS = 60_000
BUCKETS = 256
DIGEST_SIZE = 16


def bucket_of(author: str) -> int:
    return hashlib.blake2b(author.encode(), digest_size=1).digest()[0]


def _entry_hash(author: str, seq: int) -> int:
    if seq == 0:
        return 0  # an author we hold nothing of counts as absent
    h = hashlib.blake2b(author.encode() + b"\x00" + seq.to_bytes(8, "big"), digest_size=DIGEST_SIZE)
    return int.from_bytes(h.digest(), "big")


@dataclass
class Result:
    status: str
    reason: str | None = None
    op: Op | None = None
    applied: list[Op] = field(default_factory=list)  # ops merged by this call (the op and any it unblocked)


class OpStore:
    def __init__(
        self,
        schema: dict[str, CRDTType],
        verify: Verifier,
        *,
        max_skew_ms: int = 30_000,
        max_pending: int = 10_000,
        max_pending_bytes: int = 8 << 20,
        pending_ttl_ms: int = 300_000,
        max_pending_share: float = 0.1,
        max_op_size: int = 4096,
        admission: Admission | None = None,
        max_authors: int = 20_000,
    ):
        self.schema = dict(schema)
        self._verify = verify
        self.admission = admission  # None: every author is admitted (tests of the types alone)
        self.max_authors = max_authors
        self._digests = [0] * BUCKETS  # per bucket: XOR of _entry_hash(author, seq) over its authors
        self._bucket_authors: dict[int, set[str]] = {}  # bucket -> its authors (made when the first one merges)
        self.max_skew_ms = max_skew_ms
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.pending_ttl_ms = pending_ttl_ms
        self.max_pending_share = max_pending_share
        self.max_op_size = max_op_size
        self.ops: dict[bytes, Op] = {}
        self.chains: dict[str, list[bytes]] = {}  # author -> op ids by seq
        self.heads: set[bytes] = set()
        self.pending: dict[bytes, Op] = {}  # in arrival order
        self._held: dict[bytes, tuple[int, bytes]] = {}  # held op id -> (arrival ms, the missing parent it waits on)
        self._waiting: dict[bytes, set[bytes]] = {}  # missing parent id -> held op ids (each op waits on one)
        self._pending_bytes = 0
        self._pending_by_author: Counter = Counter()
        self._author_bytes: Counter = Counter()
        self.pending_dropped: Counter = Counter()  # "evicted" (budget full), "expired"
        self.states: dict[str, Any] = {name: t.initial() for name, t in self.schema.items()}
        self.rejected: Counter = Counter()
        self.clock = HLC()

    # ------------------------------------------------------------------ receiving
    def receive(self, wire: Any, now_ms: int) -> Result:
        try:
            op = decode_wire(wire, max_size=self.max_op_size)
        except OpError as e:
            return self._reject(e.reason)
        return self.receive_op(op, now_ms)

    def receive_op(self, op: Op, now_ms: int) -> Result:
        if op.id in self.ops or op.id in self.pending:
            return Result(DUPLICATE, op=op)
        ctype = self.schema.get(op.object)
        if ctype is None:
            return self._reject("unknown_object", op)
        reason = ctype.check(op)
        if reason is not None:
            return self._reject(reason, op)
        if op.clock[0] > now_ms + self.max_skew_ms:
            return self._reject("future_clock", op)
        if op.seq == 1:
            if self.admission is not None:
                reason = self.admission.admits(op.author, op.object, op.payload)
                if reason is not None:
                    return self._reject(reason, op)
            if op.author not in self.chains and len(self.chains) >= self.max_authors:
                return self._reject("authors_full", op)
        if not verify_op(op, self._verify):
            return self._reject("bad_signature", op)
        missing = next((p for p in op.parents if p not in self.ops), None)
        if missing is not None:
            return self._hold(op, missing, now_ms)
        return self._apply_ready(op)

    def _hold(self, op: Op, missing: bytes, now_ms: int) -> Result:
        share = self.max_pending_share
        if self._pending_by_author[op.author] >= max(1, int(self.max_pending * share)) \
                or self._author_bytes[op.author] + len(op.body) > self.max_pending_bytes * share:
            return self._reject("pending_full", op)
        while self.pending and (len(self.pending) >= self.max_pending
                                or self._pending_bytes + len(op.body) > self.max_pending_bytes):
            self._drop_held(next(iter(self.pending)), "evicted")
        self._register(op, now_ms, missing)
        return Result(PENDING, op=op)

    def _register(self, op: Op, since_ms: int, missing: bytes) -> None:
        self.pending[op.id] = op
        self._held[op.id] = (since_ms, missing)
        self._waiting.setdefault(missing, set()).add(op.id)
        self._pending_bytes += len(op.body)
        self._pending_by_author[op.author] += 1
        self._author_bytes[op.author] += len(op.body)

    def _release(self, held_id: bytes) -> Op | None:
        op = self.pending.pop(held_id, None)
        if op is None:
            return None
        _, parent = self._held.pop(held_id)
        waiting = self._waiting.get(parent)
        if waiting is not None:
            waiting.discard(held_id)
            if not waiting:
                del self._waiting[parent]
        self._pending_bytes -= len(op.body)
        self._pending_by_author[op.author] -= 1
        self._author_bytes[op.author] -= len(op.body)
        if not self._pending_by_author[op.author]:
            del self._pending_by_author[op.author], self._author_bytes[op.author]
        return op

    def _drop_held(self, held_id: bytes, why: str) -> None:
        if self._release(held_id) is not None:
            self.pending_dropped[why] += 1

    def expire_pending(self, now_ms: int) -> int:
        """Drop held ops older than ``pending_ttl_ms`` (oldest first); returns how many."""
        expired = 0
        while self.pending:
            oldest = next(iter(self.pending))
            if self._held[oldest][0] > now_ms - self.pending_ttl_ms:
                break
            self._drop_held(oldest, "expired")
            expired += 1
        return expired

    def _apply_ready(self, op: Op) -> Result:
        reason = self._causality(op)
        if reason is not None:
            return self._reject(reason, op)
        applied = [self._merge(op)]
        # unblock held ops whose parents are now all known
        ready = [op.id]
        while ready:
            parent = ready.pop()
            for held_id in sorted(self._waiting.get(parent, ())):
                since = self._held[held_id][0]
                held = self._release(held_id)
                missing = next((p for p in held.parents if p not in self.ops), None)
                if missing is not None:  # wait on the next missing parent
                    self._register(held, since, missing)
                    continue
                reason = self._causality(held)
                if reason is not None:
                    self.rejected[reason] += 1
                    continue
                applied.append(self._merge(held))
                ready.append(held_id)
        return Result(APPLIED, op=op, applied=applied)

    def _causality(self, op: Op) -> str | None:
        chain = self.chains.get(op.author, [])
        if op.seq <= len(chain):
            return "equivocation" if chain[op.seq - 1] != op.id else None
        if op.seq != len(chain) + 1:
            return "bad_causality"  # unreachable when the previous op is a parent; kept as a guard
        if op.seq > 1 and chain[-1] not in op.parents:
            return "bad_causality"
        if any(self.ops[p].clock >= op.clock for p in op.parents):
            return "bad_causality"
        if self._over_quota(chain, op.seq, op.clock[0]):
            return "over_quota"
        return None

    def _over_quota(self, chain: list[bytes], seq: int, wall_ms: int, drafted: list[int] = ()) -> bool:
        """Would op ``seq`` of an author, written at ``wall_ms``, come less than QUOTA_WINDOW_MS after its op
        QUOTA_OPS back? That op is in the author's ``chain``, or among ``drafted`` (the wall clocks of the ops of a
        batch being drafted after the chain)."""
        back = seq - QUOTA_OPS
        if back < 1:
            return False
        earlier = self.ops[chain[back - 1]].clock[0] if back <= len(chain) else drafted[back - len(chain) - 1]
        return wall_ms - earlier < QUOTA_WINDOW_MS

    def _merge(self, op: Op) -> Op:
        self.ops[op.id] = op
        chain = self.chains.setdefault(op.author, [])
        chain.append(op.id)
        b = bucket_of(op.author)
        self._bucket_authors.setdefault(b, set()).add(op.author)
        self._digests[b] ^= _entry_hash(op.author, len(chain) - 1) ^ _entry_hash(op.author, len(chain))
        self.heads.difference_update(op.parents)
        self.heads.add(op.id)
        self.states[op.object] = self.schema[op.object].apply(self.states[op.object], op)
        self.clock.observe(op.clock)
        return op

    def _reject(self, reason: str, op: Op | None = None) -> Result:
        self.rejected[reason] += 1
        return Result(REJECTED, reason=reason, op=op)

    # ------------------------------------------------------------------ writing
    def _next_parents(self, chain: list[bytes]) -> set[bytes]:
        """A new local op's parents: the newest heads, and the author's own previous op."""
        parents = set(sorted(self.heads, key=lambda i: self.ops[i].clock, reverse=True)[: MAX_PARENTS - 1])
        if chain:
            parents.add(chain[-1])
        return parents

    def draft(self, author: str, items: list[tuple[str, Any]], now_ms: int) -> tuple[list[bytes], str | None]:
        """Unsigned bodies for a batch of local ops, each checked as ``receive`` would check it, none applied.

        Returns (bodies, None), or ([], "<object>: <reason>") if any op of the batch would be refused: a batch is
        applied whole or not at all. Sign the bodies (off the event loop), persist them, then ``commit`` them."""
        chain = self.chains.get(author, [])
        parents = self._next_parents(chain)
        seq, hlc, bodies, walls = len(chain), HLC(self.clock.last), [], []
        for obj, payload in items:
            ctype = self.schema.get(obj)
            if ctype is None:
                return [], f"{obj}: unknown_object"
            seq += 1
            if seq == 1 and self.admission is not None:
                reason = self.admission.admits(author, obj, payload)
                if reason is not None:
                    return [], f"{obj}: {reason}"
            clock = hlc.tick(now_ms)
            if self._over_quota(chain, seq, clock[0], walls):
                return [], f"{obj}: over_quota"
            walls.append(clock[0])
            body = encode_body(author, seq, clock, parents, obj, payload)
            try:
                op = decode_body(body, b"", max_size=self.max_op_size)
            except OpError as e:
                return [], f"{obj}: {e.reason}"
            reason = ctype.check(op)
            if reason is not None:
                return [], f"{obj}: {reason}"
            bodies.append(body)
            parents = {op.id}
        return bodies, None

    def commit(self, bodies: list[bytes], sigs: list[bytes], now_ms: int) -> list[Op]:
        """Apply a drafted, signed (and persisted) batch. Raises OpError if it no longer applies (a caller bug:
        drafts must not interleave with other local writes of the same author)."""
        ops = []
        for body, sig in zip(bodies, sigs, strict=True):
            op = decode_body(body, sig, max_size=self.max_op_size)  # ours, just signed: not verified again
            if op.id in self.ops or any(p not in self.ops for p in op.parents):
                raise OpError("bad_causality", "a drafted op is already known or lost a parent")
            result = self._apply_ready(op)
            if result.status != APPLIED:
                raise OpError(result.reason or result.status, f"a drafted op did not apply: {result.status}")
            ops.append(op)
        return ops

    def create(self, sign: Signer, author: str, obj: str, payload: Any, now_ms: int) -> Result:
        """Write a local op: next seq, current heads as parents, a clock after everything seen."""
        chain = self.chains.get(author, [])
        parents = self._next_parents(chain)
        clock = self.clock.tick(now_ms)
        op = make_op(sign, author, len(chain) + 1, clock, parents, obj, payload)
        return self.receive_op(op, now_ms)

    # ------------------------------------------------------------------ anti-entropy
    def version_vector(self) -> dict[str, int]:
        return {author: len(chain) for author, chain in self.chains.items()}

    def digests(self) -> dict[int, bytes]:
        """The digest of every non-empty bucket: at most ``BUCKETS`` entries of ``DIGEST_SIZE`` bytes, whatever the
        number of authors (a small swarm sends a few)."""
        return {b: d.to_bytes(DIGEST_SIZE, "big") for b, d in enumerate(self._digests) if d}

    def differing(self, digests: dict[int, bytes]) -> list[int]:
        """The buckets whose digest differs from ours (``digests`` as ``digests()`` makes them)."""
        if not isinstance(digests, dict) or len(digests) > BUCKETS or not all(
                type(b) is int and 0 <= b < BUCKETS and isinstance(d, bytes) and len(d) == DIGEST_SIZE
                for b, d in digests.items()):
            raise ValueError(f"digests are at most {BUCKETS} entries {{bucket: {DIGEST_SIZE} bytes}}")
        return [b for b in range(BUCKETS)
                if (int.from_bytes(digests[b], "big") if b in digests else 0) != self._digests[b]]

    def entries(self, buckets: list[int], after: tuple[int, str] | None, limit: int
                ) -> tuple[dict[str, int], tuple[int, str] | None]:
        """One page of our version vector: the entries of ``buckets`` in (bucket, author) order, from just after
        ``after``, at most ``limit`` (>= 1) of them. Returns (entries, the last key of this page if more follow,
        else None)."""
        out: dict[str, int] = {}
        last: tuple[int, str] | None = None
        for b in sorted(set(buckets)):
            if after is not None and b < after[0]:
                continue
            for a in sorted(a for a in self._bucket_authors.get(b, ()) if after is None or (b, a) > after):
                if len(out) == limit:
                    return out, last
                out[a] = len(self.chains[a])
                last = (b, a)
        return out, None

    def authors_in(self, buckets: list[int], start: tuple[int, str] | None, end: tuple[int, str] | None
                   ) -> dict[str, int]:
        """Our entries of ``buckets`` whose key (bucket, author) is in (start, end]: what one page of a peer's
        entries covered (``end`` None: to the end)."""
        out = {}
        for b in set(buckets):
            for a in self._bucket_authors.get(b, ()):
                if (start is None or (b, a) > start) and (end is None or (b, a) <= end):
                    out[a] = len(self.chains[a])
        return out

    def page_diff(self, theirs: dict[str, int], buckets: list[int], start: tuple[int, str] | None,
                  end: tuple[int, str] | None) -> tuple[dict[str, int], dict[str, int]]:
        """Compare one page of a peer's entries (``entries(buckets, start, ...)`` ending at ``end``) with ours:
        (what to ask it for: {author: our seq} where it is ahead, what it lacks: {author: its seq} where we are)."""
        want = {a: len(self.chains.get(a, ())) for a, seq in theirs.items() if seq > len(self.chains.get(a, ()))}
        lacking = {a: theirs.get(a, 0) for a, seq in self.authors_in(buckets, start, end).items()
                   if seq > theirs.get(a, 0)}
        return want, lacking

    def ops_after(self, have: dict[str, int], limit: int) -> tuple[list[Op], bool]:
        """Our ops of the authors in ``have`` past the seq given for each, in causal order (by clock), at most
        ``limit``; (ops, truncated)."""
        out = []
        for author, seq in have.items():
            chain = self.chains.get(author)
            if chain is not None and seq < len(chain):
                out.extend(self.ops[i] for i in chain[max(seq, 0):])
        out.sort(key=lambda o: (o.clock, o.id))
        return out[:limit], len(out) > limit

    def missing_for(self, vv: dict[str, int], limit: int) -> tuple[list[Op], bool]:
        """Ops a replica with (whole) version vector ``vv`` lacks, in causal order (by clock); (ops, truncated)."""
        return self.ops_after({a: vv.get(a, 0) for a in self.chains}, limit)

    # ------------------------------------------------------------------ views
    def heads_digest(self) -> str:
        return hashlib.blake2b(b"".join(sorted(self.heads)), digest_size=16).hexdigest()

    def value(self, name: str) -> Any:
        return self.schema[name].value(self.states[name])

    def values(self) -> dict[str, Any]:
        return {name: self.value(name) for name in sorted(self.schema)}

    def summary(self) -> dict:
        return {
            "ops": len(self.ops),
            "authors": len(self.chains),
            "heads": len(self.heads),
            "heads_digest": self.heads_digest(),
            "pending": len(self.pending),
            "pending_bytes": self._pending_bytes,
            **{f"pending_{why}": n for why, n in sorted(self.pending_dropped.items())},
            "rejected": dict(self.rejected),
        }
