"""The merged authors' version vector, summarized for anti-entropy.

That vector grows with the number of authors, so anti-entropy never sends it whole: authors fall into ``BUCKETS``
buckets by hash, each with a ``DIGEST_SIZE``-byte digest (the XOR of a hash of each ``(author, seq)`` entry, updated
as ops merge), and replicas compare the digests (at most 4 KiB, whatever the number of authors), then page through
the entries of the buckets that differ (``entries``) and exchange the ops one side lacks (the store's
``ops_after``). Convergence is checked by ``digest`` (a hash of every bucket's digest: equal version vectors).
"""

from __future__ import annotations

import hashlib
from typing import Callable

BUCKETS = 256
DIGEST_SIZE = 16


def bucket_of(author: str) -> int:
    return hashlib.blake2b(author.encode(), digest_size=1).digest()[0]


def _entry_hash(author: str, seq: int) -> int:
    if seq == 0:
        return 0  # an author we hold nothing of counts as absent
    h = hashlib.blake2b(author.encode() + b"\x00" + seq.to_bytes(8, "big"), digest_size=DIGEST_SIZE)
    return int.from_bytes(h.digest(), "big")


class Buckets:
    """``last_seq(author)``: the seq of the author's latest op the store holds (0: none)."""

    def __init__(self, last_seq: Callable[[str], int]):
        self._last_seq = last_seq
        self._digests = [0] * BUCKETS  # per bucket: XOR of _entry_hash(author, seq) over its authors
        self._authors: dict[int, set[str]] = {}  # bucket -> its authors (made when the first one merges)

    def advance(self, author: str, last: int, seq: int) -> None:
        """``author``'s entry moves from seq ``last`` to ``seq`` (an op of it merged)."""
        b = bucket_of(author)
        self._authors.setdefault(b, set()).add(author)
        self._digests[b] ^= _entry_hash(author, last) ^ _entry_hash(author, seq)

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
            for a in sorted(a for a in self._authors.get(b, ()) if after is None or (b, a) > after):
                if len(out) == limit:
                    return out, last
                out[a] = self._last_seq(a)
                last = (b, a)
        return out, None

    def authors_in(self, buckets: list[int], start: tuple[int, str] | None, end: tuple[int, str] | None
                   ) -> dict[str, int]:
        """Our entries of ``buckets`` whose key (bucket, author) is in (start, end]: what one page of a peer's
        entries covered (``end`` None: to the end)."""
        out = {}
        for b in set(buckets):
            for a in self._authors.get(b, ()):
                if (start is None or (b, a) > start) and (end is None or (b, a) <= end):
                    out[a] = self._last_seq(a)
        return out

    def page_diff(self, theirs: dict[str, int], buckets: list[int], start: tuple[int, str] | None,
                  end: tuple[int, str] | None) -> tuple[dict[str, int], dict[str, int]]:
        """Compare one page of a peer's entries (``entries(buckets, start, ...)`` ending at ``end``) with ours:
        (what to ask it for: {author: our seq} where it is ahead, what it lacks: {author: its seq} where we are)."""
        want = {a: self._last_seq(a) for a, seq in theirs.items() if seq > self._last_seq(a)}
        lacking = {a: theirs.get(a, 0) for a, seq in self.authors_in(buckets, start, end).items()
                   if seq > theirs.get(a, 0)}
        return want, lacking

    def digest(self) -> str:
        """What this replica holds, in 32 hex digits: equal digests, equal version vectors, so the same ops (each
        author's chain is hash-linked) and the same state, whichever of them compaction dropped."""
        return hashlib.blake2b(b"".join(d.to_bytes(DIGEST_SIZE, "big") for d in self._digests),
                               digest_size=16).hexdigest()
