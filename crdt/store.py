"""The op store: verification, the causal DAG, and the merged state of every declared object.

``receive`` takes an op from anywhere (the network, our log, ourselves) and answers what happened to it:

- ``applied``: verified and merged (with any held ops it unblocked);
- ``duplicate``: already known (idempotent), or an op that its author's base we hold restates;
- ``pending``: verified, but its author's previous op is unknown; held until it arrives, within a budget
  (``crdt.held``: ``max_pending`` ops, ``max_pending_bytes``, ``max_pending_share`` per author, ``pending_ttl_ms``);
- ``rejected`` with a reason code: ``malformed``, ``oversized``, ``bad_signature``, ``unknown_object``,
  ``not_allowed`` (the author wrote outside what the type allows), ``future_clock`` (more than ``max_skew_ms``
  ahead of our clock), ``bad_causality`` (clock not after its author's previous op, or seq not following it),
  ``equivocation`` (a second, different op for an author's seq), ``pending_full`` (its author already holds its
  share of the pending budget), ``not_admitted`` (an author's op #1 without its admission, see
  ``crdt.admission``), ``unknown_author`` (an op after #1 of an author whose op #1 we neither hold nor fetch: not
  held, so keys that were never admitted cannot fill the pending budget; the caller names the authors it fetches
  in ``fetching``), ``probation_full`` (an author on
  probation already holds ``MAX_PROBATION_OPS``), ``over_quota`` (an author's op written less than
  ``QUOTA_WINDOW_MS`` after its op ``QUOTA_OPS`` back in the same base period, by the ops' own clocks: at most 1,000
  ops a minute per author, sustained, whatever objects they rewrite; an op's clock cannot run ahead of real time by
  more than ``max_skew_ms``, so a chain cannot outrun the quota, and the rule reads only the chain, so every replica
  decides the same way).

**Standing and probation.** The caller says, for each op from the network, whether its author has *standing*
(``vouch``). An author with standing is merged as above; one without is held on *probation* (``crdt.probation``: at
most ``max_authors`` ops and ``max_probation_bytes`` in all, the least recent author giving way; status
``probation``), outside the merged state and the digests, and merged as soon as an op of it arrives vouched.

Each author's ops form a chain (``seq`` 1, 2, ...; each op lists the author's previous op as a parent), so a
replica's content is summarized exactly by its version vector ``{author: last seq}``, which anti-entropy compares
bucket by bucket (``crdt.buckets``).

**Compaction.** An author's ops #1000, #2000, ... (every ``BASE_EVERY``-th) are *bases*: object ``_base``, payload
``{"parts": {object: the author's whole contribution to it}, "ticket": its admission ticket}`` (see each type's
``fold``/``rebase``). A replica that applies an author's base drops that author's earlier ops, in memory and (through
the caller) in its log, so it never holds more than ``BASE_EVERY`` ops of one author, whatever the author wrote; a
replica that lacks them takes the base without them (the base carries the author's admission). Only schemas whose
every type is ``per_author`` take bases (the node's schema is). The node writes its bases itself: ``draft`` inserts
one when a batch reaches such a seq.

Pure: no I/O, no clock, no keys; the caller passes ``now_ms`` and a signature verifier.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from swarmd.crdt.admission import Admission
from swarmd.crdt.bases import BASE_OBJECT, Folds
from swarmd.crdt.buckets import Buckets
from swarmd.crdt.held import Held
from swarmd.crdt.hlc import HLC
from swarmd.crdt.ops import (
    MAX_PARENTS, SIGN_DOMAIN, Op, OpError, Signer, Verifier, decode_body, decode_wire, encode_body, verify_op,
)
from swarmd.crdt.probation import MAX_PROBATION_OPS, Probation
from swarmd.crdt.types import CRDTType

APPLIED, DUPLICATE, PENDING, REJECTED = "applied", "duplicate", "pending", "rejected"
PROBATION = "probation"  # verified, held aside until its author has standing (not merged, not in the digest)
# an author's op must come QUOTA_WINDOW_MS after its op QUOTA_OPS back in the same base period, by their clocks (the
# same on every node: part of the protocol). A period's first QUOTA_OPS ops are free, so a period of BASE_EVERY ops
# takes at least QUOTA_WINDOW_MS: at most 1,000 ops a minute, sustained
QUOTA_OPS = 500
QUOTA_WINDOW_MS = 60_000
BASE_EVERY = 1000  # an author's op #n is a base exactly when n is a multiple of this
MAX_BASE_SIZE = 64 << 10  # a base's body (every other op: ``max_op_size``)
MAX_BASE_PARTS = MAX_BASE_SIZE - 4096  # an author's contribution, as its base carries it (room for the envelope)
MAX_DANGLING = 4096


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
        max_probation_bytes: int = 4 << 20,
        hold_unknown_authors: bool = True,
    ):
        self.schema = dict(schema)
        self._verify = verify
        self.admission = admission  # None: every author is admitted (tests of the types alone)
        # False: an op after #1 of an author we hold nothing of is held only while ``fetching`` names the author
        self.hold_unknown_authors = hold_unknown_authors
        self.fetching: set[str] = set()  # authors whose ops the caller is pulling now (op #1 on its way)
        # authors without standing (max_authors: ops, so authors, held at most; merged authors are never refused)
        self.probation = Probation(max_authors, max_probation_bytes)
        self.buckets = Buckets(self.last_seq)
        self.max_skew_ms = max_skew_ms
        self.held = Held(max_pending, max_pending_bytes, pending_ttl_ms, max_pending_share)
        self.max_op_size = max_op_size
        if any(name.startswith("_") for name in self.schema):
            raise ValueError("schema object names may not start with '_' (reserved for bases)")
        self.compactable = all(t.per_author for t in self.schema.values())
        self.ops: dict[bytes, Op] = {}
        self.chains: dict[str, list[bytes]] = {}  # author -> the ids of its ops we keep, by seq
        self.first: dict[str, int] = {}  # author -> the seq of chains[author][0] (its latest base), where not 1
        self.heads: set[bytes] = set()
        self._dangling: dict[bytes, None] = {}  # ids named as parents before we had them (not heads when they come)
        self.compacted = 0  # ops dropped because their author's base restated them
        self.folds = Folds(self.schema)
        self.states: dict[str, Any] = {name: t.initial() for name, t in self.schema.items()}
        self.rejected: Counter = Counter()
        self.clock = HLC()

    @property
    def pending(self) -> dict[bytes, Op]:
        """Ops held until their author's previous op arrives, in arrival order."""
        return self.held.ops

    @property
    def pending_dropped(self) -> Counter:
        return self.held.dropped

    @property
    def probation_counts(self) -> Counter:
        return self.probation.counts

    # ------------------------------------------------------------------ receiving
    @property
    def max_wire_size(self) -> int:
        """The largest op body we take (a base's)."""
        return max(self.max_op_size, MAX_BASE_SIZE) if self.compactable else self.max_op_size

    def last_seq(self, author: str) -> int:
        """The seq of the author's latest op we hold (0: none)."""
        chain = self.chains.get(author)
        return self.first.get(author, 1) + len(chain) - 1 if chain else 0

    def _op_at(self, author: str, seq: int) -> Op:
        return self.ops[self.chains[author][seq - self.first.get(author, 1)]]

    def receive(self, wire: Any, now_ms: int, vouch: Callable[[str], bool] | None = None) -> Result:
        try:
            op = decode_wire(wire, max_size=self.max_wire_size)
        except OpError as e:
            return self._reject(e.reason)
        return self.receive_op(op, now_ms, vouch)

    def _check(self, op: Op, now_ms: int | None = None) -> str | None:
        """What the op's own bytes allow (shape, rights, size, the base schedule, its clock's skew from ``now_ms``
        if given, admission): the same answer on every replica (skew aside)."""
        is_base = op.object == BASE_OBJECT
        if self.compactable and is_base != (op.seq % BASE_EVERY == 0):
            return "malformed"  # a base exactly at every BASE_EVERY-th seq, and nowhere else
        if not is_base:
            ctype = self.schema.get(op.object)
            if ctype is None:
                return "unknown_object"
            if len(op.body) > self.max_op_size:
                return "oversized"
            reason = ctype.check(op)
            if reason is not None:
                return reason
            if now_ms is not None and op.clock[0] > now_ms + self.max_skew_ms:
                return "future_clock"
            if op.seq == 1 and self.admission is not None:
                return self.admission.admits(op.author, op.object, op.payload)
            return None
        if not self.compactable:
            return "unknown_object"
        p = op.payload
        if not isinstance(p, dict) or not set(p) <= {"parts", "ticket"} or not isinstance(p.get("parts"), dict):
            return "malformed"
        for name, part in p["parts"].items():
            ctype = self.schema.get(name) if isinstance(name, str) else None
            if ctype is None:
                return "unknown_object"
            reason = ctype.check_part(part, op.author)
            if reason is not None:
                return reason
        if now_ms is not None and op.clock[0] > now_ms + self.max_skew_ms:
            return "future_clock"
        if self.admission is not None:  # the author's op #1 may be gone: its base carries the admission
            return self.admission.admits(op.author, "members", self.admission.payload(op.author, p.get("ticket")))
        return None

    def receive_op(self, op: Op, now_ms: int, vouch: Callable[[str], bool] | None = None) -> Result:
        """``vouch(author)``: whether an author we have not merged has standing (asked once per such op; None:
        every author has, as for our own log)."""
        author = op.author
        promoted: list[Op] = []
        if author not in self.chains:
            if vouch is not None and not vouch(author):
                return self._on_probation(op, now_ms)
            if author in self.probation:
                promoted = self._promote(author)
        result = self._receive_merged(op, now_ms)
        if promoted:
            result.applied[:0] = promoted
        return result

    def _receive_merged(self, op: Op, now_ms: int) -> Result:
        if op.id in self.ops or op.id in self.pending or op.seq < self.first.get(op.author, 1):
            return Result(DUPLICATE, op=op)  # known, or restated by the author's base we hold
        reason = self._check(op, now_ms)
        if reason is not None:
            return self._reject(reason, op)
        last = self.last_seq(op.author)
        gap = op.seq > last + 1 and op.object != BASE_OBJECT
        if gap and not last and not self.hold_unknown_authors and op.author not in self.fetching:
            return self._reject("unknown_author", op)
        if not verify_op(op, self._verify):
            return self._reject("bad_signature", op)
        if gap:
            return self._hold(op, (op.author, op.seq - 1), now_ms)
        return self._apply_ready(op)

    # ------------------------------------------------------------------ probation
    def _on_probation(self, op: Op, now_ms: int) -> Result:
        """Hold an op of an author without standing aside (see the module's docstring)."""
        chain = self.probation.get(op.author)
        if chain is not None and op.seq <= chain[-1].seq and op.seq >= chain[0].seq:
            if chain[op.seq - chain[0].seq].id == op.id:
                return Result(DUPLICATE, op=op)
            return self._reject("equivocation", op)
        reason = self._check(op, now_ms)
        if reason is not None:
            return self._reject(reason, op)
        restart = op.seq == 1 or op.object == BASE_OBJECT  # op #1 or a base carries the author's admission
        if chain is None or op.seq != chain[-1].seq + 1:
            if not restart or (chain is not None and op.seq < chain[0].seq):
                return self._reject("unknown_author", op)  # its chain's start is not ours to hold: not held
        elif len(chain) >= MAX_PROBATION_OPS:
            return self._reject("probation_full", op)
        elif chain[-1].id not in op.parents or chain[-1].clock >= op.clock:
            return self._reject("bad_causality", op)
        if not verify_op(op, self._verify):
            return self._reject("bad_signature", op)
        self.probation.add(op, restates=chain is not None and op.seq != chain[-1].seq + 1)  # a later base
        return Result(PROBATION, op=op)

    def _promote(self, author: str) -> list[Op]:
        """Merge the chain an author held on probation (verified when it came): the ops it applied."""
        applied: list[Op] = []
        for op in self.probation.drop(author):
            result = self._apply_ready(op)
            if result.status == REJECTED:
                break
            applied.extend(result.applied)
        self.probation.counts["merged"] += 1
        return applied

    def _hold(self, op: Op, missing: tuple, now_ms: int) -> Result:
        if not self.held.hold(op, missing, now_ms):
            return self._reject("pending_full", op)
        return Result(PENDING, op=op)

    def expire_pending(self, now_ms: int) -> int:
        """Drop held ops older than ``pending_ttl_ms`` (oldest first); returns how many."""
        return self.held.expire(now_ms)

    def _apply_ready(self, op: Op) -> Result:
        reason = self._causality(op)
        if reason is not None:
            return self._reject(reason, op)
        applied = [self._merge(op)]
        # unblock held ops whose author's previous op is now known
        ready = [(op.author, op.seq)]
        while ready:
            key = ready.pop()
            for held_id in self.held.waiting_on(key):
                held = self.held.release(held_id)
                reason = self._causality(held)
                if reason is not None:
                    self.rejected[reason] += 1
                    continue
                applied.append(self._merge(held))
                ready.append((held.author, held.seq))
        return Result(APPLIED, op=op, applied=applied)

    def _causality(self, op: Op) -> str | None:
        """Where the op stands in its author's chain: it follows the previous op (or is a base after a gap), its
        clock runs after it, and the quota holds. Reads only the author's chain, so every replica answers the same."""
        last = self.last_seq(op.author)
        if op.seq <= last:
            return "equivocation" if self._op_at(op.author, op.seq).id != op.id else None
        if op.seq > last + 1:
            return None if op.object == BASE_OBJECT else "bad_causality"  # held until the gap fills: a guard
        if op.seq > 1:
            previous = self._op_at(op.author, last)
            if previous.id not in op.parents or previous.clock >= op.clock:
                return "bad_causality"
        if self._over_quota(op.author, op.seq, op.clock[0]):
            return "over_quota"
        return None

    def _over_quota(self, author: str, seq: int, wall_ms: int, drafted: list[int] = ()) -> bool:
        """Would op ``seq`` of ``author``, written at ``wall_ms``, come less than QUOTA_WINDOW_MS after its op
        QUOTA_OPS back, where that op is in the same base period (ops before a base are gone)? That op is in the
        author's chain, or among ``drafted`` (the wall clocks of the ops of a batch being drafted after it)."""
        back = seq - QUOTA_OPS
        if back < max(1, seq - seq % BASE_EVERY):
            return False
        last = self.last_seq(author)
        earlier = self._op_at(author, back).clock[0] if back <= last else drafted[back - last - 1]
        return wall_ms - earlier < QUOTA_WINDOW_MS

    def _merge(self, op: Op) -> Op:
        last = self.last_seq(op.author)
        if op.object == BASE_OBJECT:
            self._rebase(op)
        self.ops[op.id] = op
        self.chains.setdefault(op.author, []).append(op.id)
        self.buckets.advance(op.author, last, op.seq)
        self.heads.difference_update(op.parents)
        if op.id in self._dangling:  # an op we hold already names it as a parent: not a head
            del self._dangling[op.id]
        else:
            self.heads.add(op.id)
        for p in op.parents:
            if p not in self.ops:
                self._dangling[p] = None
        while len(self._dangling) > MAX_DANGLING:
            self._dangling.pop(next(iter(self._dangling)))
        if op.object != BASE_OBJECT:
            self.states[op.object] = self.schema[op.object].apply(self.states[op.object], op)
        self.clock.observe(op.clock)
        return op

    def _rebase(self, base: Op) -> None:
        """Before a base merges: drop its author's earlier ops and restate its contribution to every object."""
        author = base.author
        for op_id in self.chains.get(author, ()):
            self.ops.pop(op_id, None)
            self.heads.discard(op_id)
            self.compacted += 1
        if author in self.chains:
            self.chains[author] = []
        self.first[author] = base.seq
        self.held.restated(author, base.seq)
        parts = base.payload["parts"]
        for name, ctype in self.schema.items():
            self.states[name] = ctype.rebase(self.states[name], author, parts.get(name), base)

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

    def base_payload(self, author: str, drafted: list[Op] = ()) -> dict:
        """``author``'s base as of its ops we hold and then ``drafted`` (``crdt.bases``)."""
        first = self.first.get(author, 1)
        return self.folds.payload(author, first, self.last_seq(author),
                                  lambda seq: [self.ops[i] for i in self.chains.get(author, ())[seq - first:]], drafted)

    def draft(self, author: str, items: list[tuple[str, Any]], now_ms: int) -> tuple[list[bytes], str | None]:
        """Unsigned bodies for a batch of local ops, each checked as ``receive`` would check it, none applied.

        Returns (bodies, None), or ([], "<object>: <reason>") if any op of the batch would be refused: a batch is
        applied whole or not at all. Sign the bodies (off the event loop), persist them, then ``commit`` them."""
        chain = self.chains.get(author, [])
        parents = self._next_parents(chain)
        seq, hlc, bodies, walls, drafted = self.last_seq(author), HLC(self.clock.last), [], [], []
        queue = list(items)
        while queue:
            seq += 1
            if self.compactable and seq % BASE_EVERY == 0:  # our base comes first, at its seq
                obj, payload = BASE_OBJECT, self.base_payload(author, drafted)
            else:
                obj, payload = queue.pop(0)
                if obj not in self.schema:
                    return [], f"{obj}: unknown_object"
            clock = hlc.tick(now_ms)
            if self._over_quota(author, seq, clock[0], walls):
                return [], f"{obj}: over_quota"
            walls.append(clock[0])
            body = encode_body(author, seq, clock, parents, obj, payload)
            try:
                op = decode_body(body, b"", max_size=self.max_wire_size)
            except OpError as e:
                if obj == BASE_OBJECT and e.reason == "oversized":
                    return [], (f"{obj}: base_too_large (our contribution to the state, {len(body)} B, is over "
                                f"{MAX_BASE_SIZE} B: delete keys to write again)")
                return [], f"{obj}: {e.reason}"
            reason = self._check(op)
            if reason is not None:
                return [], f"{obj}: {reason}"
            bodies.append(body)
            drafted.append(op)
            parents = {op.id}
        if self.compactable and drafted:
            # our contribution must stay small enough for our next base to restate it, or we could never write
            # again (the op at that seq must be the base): a write that grows it past that is refused; deleting
            # always goes
            grown = len(msgpack.packb(self.base_payload(author, drafted), use_bin_type=True))
            if grown > MAX_BASE_PARTS and grown > len(msgpack.packb(self.base_payload(author), use_bin_type=True)):
                return [], (f"{items[-1][0]}: state_full (this node's share of the state would be {grown} B, over "
                            f"the {MAX_BASE_PARTS} B a base restates: delete keys first)")
        return bodies, None

    def commit(self, bodies: list[bytes], sigs: list[bytes], now_ms: int) -> list[Op]:
        """Apply a drafted, signed (and persisted) batch. Raises OpError if it no longer applies (a caller bug:
        drafts must not interleave with other local writes of the same author)."""
        ops = []
        for body, sig in zip(bodies, sigs, strict=True):
            op = decode_body(body, sig, max_size=self.max_wire_size)  # ours, just signed: not verified again
            if op.id in self.ops:
                raise OpError("bad_causality", "a drafted op is already known")
            result = self._apply_ready(op)
            if result.status != APPLIED:
                raise OpError(result.reason or result.status, f"a drafted op did not apply: {result.status}")
            ops.append(op)
        return ops

    def create(self, sign: Signer, author: str, obj: str, payload: Any, now_ms: int) -> Result:
        """Write a local op (and our base first, when its seq is due): next seq, current heads as parents, a clock
        after everything seen. The result is the op's (``applied`` holds the base too, if one was written)."""
        bodies, error = self.draft(author, [(obj, payload)], now_ms)
        if error is not None:
            return self._reject(error.split(": ", 1)[1].split(" ", 1)[0])
        ops = self.commit(bodies, [sign(SIGN_DOMAIN + b) for b in bodies], now_ms)
        return Result(APPLIED, op=ops[-1], applied=ops)

    # ------------------------------------------------------------------ anti-entropy
    def version_vector(self) -> dict[str, int]:
        return {author: self.last_seq(author) for author in self.chains}

    def digests(self) -> dict[int, bytes]:
        return self.buckets.digests()

    def differing(self, digests: dict[int, bytes]) -> list[int]:
        return self.buckets.differing(digests)

    def entries(self, buckets: list[int], after: tuple[int, str] | None, limit: int
                ) -> tuple[dict[str, int], tuple[int, str] | None]:
        return self.buckets.entries(buckets, after, limit)

    def page_diff(self, theirs: dict[str, int], buckets: list[int], start: tuple[int, str] | None,
                  end: tuple[int, str] | None) -> tuple[dict[str, int], dict[str, int]]:
        return self.buckets.page_diff(theirs, buckets, start, end)

    def ops_after(self, have: dict[str, int], limit: int, max_bytes: int = 4 << 20) -> tuple[list[Op], bool]:
        """Our ops of the authors in ``have`` past the seq given for each (from the author's base, where we hold
        none before it), in causal order (by clock), at most ``limit`` of them and ``max_bytes`` of bodies (one at
        least); (ops, truncated)."""
        out = []
        for author, seq in have.items():
            chain = self.chains.get(author)
            if chain is not None and seq < self.last_seq(author):
                out.extend(self.ops[i] for i in chain[max(seq - self.first.get(author, 1) + 1, 0):])
        out.sort(key=lambda o: (o.clock, o.id))
        size, n = 0, 0
        for op in out[:limit]:
            size += len(op.body)
            if size > max_bytes and n:
                break
            n += 1
        return out[:n], len(out) > n

    def missing_for(self, vv: dict[str, int], limit: int) -> tuple[list[Op], bool]:
        """Ops a replica with (whole) version vector ``vv`` lacks, in causal order (by clock); (ops, truncated)."""
        return self.ops_after({a: vv.get(a, 0) for a in self.chains}, limit)

    # ------------------------------------------------------------------ views
    def digest(self) -> str:
        """What this replica holds (``crdt.buckets``): equal digests, equal version vectors."""
        return self.buckets.digest()

    def value(self, name: str) -> Any:
        return self.schema[name].value(self.states[name])

    def values(self) -> dict[str, Any]:
        return {name: self.value(name) for name in sorted(self.schema)}

    def summary(self) -> dict:
        return {
            "ops": len(self.ops),
            "authors": len(self.chains),
            "heads": len(self.heads),
            "digest": self.digest(),
            "compacted": self.compacted,
            "pending": len(self.pending),
            "pending_bytes": self.held.bytes,
            "probation": len(self.probation),
            "probation_bytes": self.probation.bytes,
            "probation_ops": self.probation.ops,
            **{f"probation_{k}": n for k, n in sorted(self.probation_counts.items())},
            **{f"pending_{why}": n for why, n in sorted(self.pending_dropped.items())},
            "rejected": dict(self.rejected),
        }
