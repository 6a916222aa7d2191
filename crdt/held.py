"""Ops held until their author's previous op arrives (``pending``), within a budget.

At most ``max_ops`` ops and ``max_bytes`` of bodies in all, at most ``share`` (a tenth) of either per author, each for
at most ``ttl_ms``. When the budget is full the oldest held op gives way (anti-entropy delivers it again in causal
order later), so a flood of orphans can neither grow memory nor lock honest out-of-order ops out. An op is held only
while its author's previous op is unknown: other parents are causal context (every type merges in any order), not a
condition, so an op never waits on an op that no replica keeps any more.

Pure bookkeeping: the store (``crdt.store``) decides what to hold and applies what is released.
"""

from __future__ import annotations

from collections import Counter

from swarmd.crdt.ops import Op


class Held:
    def __init__(self, max_ops: int, max_bytes: int, ttl_ms: int, share: float):
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        self.ttl_ms = ttl_ms
        self.share = share
        self.ops: dict[bytes, Op] = {}  # in arrival order
        self._since: dict[bytes, tuple[int, tuple]] = {}  # held op id -> (arrival ms, the (author, seq) it waits on)
        self.waiting: dict[tuple, set[bytes]] = {}  # (author, seq) of a missing op -> held op ids waiting on it
        self.bytes = 0
        self._by_author: Counter = Counter()
        self._author_bytes: Counter = Counter()
        self.dropped: Counter = Counter()  # "evicted" (budget full), "expired", "restated"

    def hold(self, op: Op, missing: tuple, now_ms: int) -> bool:
        """Hold ``op`` until ``missing`` (author, seq) arrives, the oldest held ops giving way if the budget is
        full; False (nothing held) when its author already holds its share of the budget."""
        if self._by_author[op.author] >= max(1, int(self.max_ops * self.share)) \
                or self._author_bytes[op.author] + len(op.body) > self.max_bytes * self.share:
            return False
        while self.ops and (len(self.ops) >= self.max_ops or self.bytes + len(op.body) > self.max_bytes):
            self.drop(next(iter(self.ops)), "evicted")
        self.ops[op.id] = op
        self._since[op.id] = (now_ms, missing)
        self.waiting.setdefault(missing, set()).add(op.id)
        self.bytes += len(op.body)
        self._by_author[op.author] += 1
        self._author_bytes[op.author] += len(op.body)
        return True

    def release(self, held_id: bytes) -> Op | None:
        """Stop holding an op (it is applied or dropped); the op, or None if it was not held."""
        op = self.ops.pop(held_id, None)
        if op is None:
            return None
        _, parent = self._since.pop(held_id)
        waiting = self.waiting.get(parent)
        if waiting is not None:
            waiting.discard(held_id)
            if not waiting:
                del self.waiting[parent]
        self.bytes -= len(op.body)
        self._by_author[op.author] -= 1
        self._author_bytes[op.author] -= len(op.body)
        if not self._by_author[op.author]:
            del self._by_author[op.author], self._author_bytes[op.author]
        return op

    def drop(self, held_id: bytes, why: str) -> None:
        if self.release(held_id) is not None:
            self.dropped[why] += 1

    def waiting_on(self, key: tuple) -> list[bytes]:
        """The ids of the held ops waiting on (author, seq), in a fixed order."""
        return sorted(self.waiting.get(key, ()))

    def restated(self, author: str, seq: int) -> None:
        """Drop the held ops of ``author`` up to ``seq``: its base at ``seq`` restates them."""
        for held_id in [i for i, op in self.ops.items() if op.author == author and op.seq <= seq]:
            self.drop(held_id, "restated")

    def expire(self, now_ms: int) -> int:
        """Drop held ops older than ``ttl_ms`` (oldest first); returns how many."""
        expired = 0
        while self.ops:
            oldest = next(iter(self.ops))
            if self._since[oldest][0] > now_ms - self.ttl_ms:
                break
            self.drop(oldest, "expired")
            expired += 1
        return expired
