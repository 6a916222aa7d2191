"""The op store: verification, the causal DAG, and the merged state of every declared object.

``receive`` takes an op from anywhere (the network, our log, ourselves) and answers what happened to it:

- ``applied``: verified and merged (with any held ops it unblocked);
- ``duplicate``: already known (idempotent);
- ``pending``: verified, but a parent is unknown; held (at most ``max_pending`` ops) until the parent arrives;
- ``rejected`` with a reason code: ``malformed``, ``oversized``, ``bad_signature``, ``unknown_object``,
  ``not_allowed`` (the author wrote outside what the type allows), ``future_clock`` (more than ``max_skew_ms``
  ahead of our clock), ``bad_causality`` (clock not after its parents', or seq not following the author's previous
  op), ``equivocation`` (a second, different op for an author's seq), ``pending_full``.

Each author's ops form a chain (``seq`` 1, 2, ...; each op lists the author's previous op as a parent), so a
replica's content is summarized exactly by its version vector ``{author: last seq}``: anti-entropy sends that and
gets back what it lacks. Convergence is checked by the heads digest (hash of the sorted DAG heads).

Pure: no I/O, no clock, no keys; the caller passes ``now_ms`` and a signature verifier.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from crdt.hlc import HLC
from crdt.ops import (
    MAX_PARENTS, Op, OpError, Signer, Verifier, decode_body, decode_wire, encode_body, make_op, verify_op,
)
from crdt.types import CRDTType

APPLIED, DUPLICATE, PENDING, REJECTED = "applied", "duplicate", "pending", "rejected"


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
        max_op_size: int = 4096,
    ):
        self.schema = dict(schema)
        self._verify = verify
        self.max_skew_ms = max_skew_ms
        self.max_pending = max_pending
        self.max_op_size = max_op_size
        self.ops: dict[bytes, Op] = {}
        self.chains: dict[str, list[bytes]] = {}  # author -> op ids by seq
        self.heads: set[bytes] = set()
        self.pending: dict[bytes, Op] = {}
        self._waiting: dict[bytes, set[bytes]] = {}  # missing parent id -> held op ids
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
        if not verify_op(op, self._verify):
            return self._reject("bad_signature", op)
        missing = [p for p in op.parents if p not in self.ops]
        if missing:
            if len(self.pending) >= self.max_pending:
                return self._reject("pending_full", op)
            self.pending[op.id] = op
            for parent in missing:
                self._waiting.setdefault(parent, set()).add(op.id)
            return Result(PENDING, op=op)
        return self._apply_ready(op)

    def _apply_ready(self, op: Op) -> Result:
        reason = self._causality(op)
        if reason is not None:
            return self._reject(reason, op)
        applied = [self._merge(op)]
        # unblock held ops whose parents are now all known
        ready = [op.id]
        while ready:
            parent = ready.pop()
            for held_id in sorted(self._waiting.pop(parent, ())):
                held = self.pending.get(held_id)
                if held is None or any(p not in self.ops for p in held.parents):
                    continue
                del self.pending[held_id]
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
        return None

    def _merge(self, op: Op) -> Op:
        self.ops[op.id] = op
        self.chains.setdefault(op.author, []).append(op.id)
        self.heads.difference_update(op.parents)
        self.heads.add(op.id)
        self.states[op.object] = self.schema[op.object].apply(self.states[op.object], op)
        self.clock.observe(op.clock)
        return op

    def _reject(self, reason: str, op: Op | None = None) -> Result:
        self.rejected[reason] += 1
        return Result(REJECTED, reason=reason, op=op)

    # ------------------------------------------------------------------ writing
    def draft(self, author: str, items: list[tuple[str, Any]], now_ms: int) -> tuple[list[bytes], str | None]:
        """Unsigned bodies for a batch of local ops, each checked as ``receive`` would check it, none applied.

        Returns (bodies, None), or ([], "<object>: <reason>") if any op of the batch would be refused: a batch is
        applied whole or not at all. Sign the bodies (off the event loop), persist them, then ``commit`` them."""
        chain = self.chains.get(author, [])
        parents = set(sorted(self.heads, key=lambda i: self.ops[i].clock, reverse=True)[: MAX_PARENTS - 1])
        if chain:
            parents.add(chain[-1])
        seq, hlc, bodies = len(chain), HLC(self.clock.last), []
        for obj, payload in items:
            ctype = self.schema.get(obj)
            if ctype is None:
                return [], f"{obj}: unknown_object"
            seq += 1
            body = encode_body(author, seq, hlc.tick(now_ms), parents, obj, payload)
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
        parents = set(sorted(self.heads, key=lambda i: self.ops[i].clock, reverse=True)[: MAX_PARENTS - 1])
        if chain:
            parents.add(chain[-1])
        clock = self.clock.tick(now_ms)
        op = make_op(sign, author, len(chain) + 1, clock, parents, obj, payload)
        return self.receive_op(op, now_ms)

    # ------------------------------------------------------------------ anti-entropy
    def version_vector(self) -> dict[str, int]:
        return {author: len(chain) for author, chain in self.chains.items()}

    def missing_for(self, vv: dict[str, int], limit: int) -> tuple[list[Op], bool]:
        """Ops a replica with version vector ``vv`` lacks, in causal order (by clock); (ops, truncated)."""
        out = []
        for author, chain in self.chains.items():
            have = vv.get(author, 0)
            if have < len(chain):
                out.extend(self.ops[i] for i in chain[have:])
        out.sort(key=lambda o: (o.clock, o.id))
        return out[:limit], len(out) > limit

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
            "rejected": dict(self.rejected),
        }
