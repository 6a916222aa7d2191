"""Who may write to a swarm's replicated state: an author is admitted by its first op.

Identities are free, so an open swarm cannot let any key write: 100,000 fresh keys each adding themselves to
``members`` would grow every replica's author set without bound. Every author's op #1 must therefore be its own
``members`` add, and that op must carry its admission:

- an **open** swarm (no allowlist) asks for a work ticket: a nonce such that
  ``blake2b(DOMAIN | swarm | author | nonce)`` has ``bits`` leading zero bits. Finding one costs about 2^bits hashes
  (22 bits: about 2 s of one core here, once per identity, kept in the op log); checking it costs one hash. It puts a
  price on identities, not a wall: 100,000 of them cost about 50 CPU-hours at 22 bits. The store's ``max_authors``
  bounds what a richer attacker can make a replica hold.
- a **closed** swarm (an allowlist of peer ids, the same on every node) admits exactly those authors; no ticket.

Every later op of an author follows its op #1 in the author's hash chain, so checking op #1 admits or refuses the
whole chain. The rule depends only on the op, so every replica decides the same way (the state still converges).
"""

from __future__ import annotations

import hashlib
from typing import Any

DOMAIN = b"swarmd-admit/1\x00"
MAX_BITS = 40
NONCE_BYTES = 8


class Admission:
    def __init__(self, swarm: str = "swarmd", bits: int = 22, allow: list[str] | tuple[str, ...] = ()):
        if not 0 <= bits <= MAX_BITS:
            raise ValueError(f"admission bits must be 0..{MAX_BITS}")
        self.swarm = swarm
        self.bits = bits
        self.allow = frozenset(allow)

    @property
    def closed(self) -> bool:
        return bool(self.allow)

    def policy(self) -> str:
        """A digest of the rule (swarm, bits, allowlist): nodes whose digests differ judge each other's authors
        differently, so their replicated states cannot merge. Nodes say it in their member record (``adm``)."""
        text = "\n".join([self.swarm, str(self.bits), *sorted(self.allow)])
        return hashlib.blake2b(DOMAIN + text.encode(), digest_size=8).hexdigest()

    def _prefix(self, author: str) -> Any:
        return hashlib.blake2b(DOMAIN + self.swarm.encode() + b"\x00" + author.encode() + b"\x00", digest_size=16)

    def ticket_ok(self, author: str, nonce: Any) -> bool:
        if type(nonce) is not int or not 0 <= nonce < 1 << (8 * NONCE_BYTES):
            return False
        h = self._prefix(author)
        h.update(nonce.to_bytes(NONCE_BYTES, "little"))
        return int.from_bytes(h.digest(), "big") >> (128 - self.bits) == 0 if self.bits else True

    def mint(self, author: str, start: int = 0) -> int:
        """Find a ticket for ``author`` (about 2^bits hashes: run it off the event loop)."""
        base, shift = self._prefix(author), 128 - self.bits
        for nonce in range(start, 1 << (8 * NONCE_BYTES)):
            h = base.copy()
            h.update(nonce.to_bytes(NONCE_BYTES, "little"))
            if int.from_bytes(h.digest(), "big") >> shift == 0:
                return nonce
        raise RuntimeError("no ticket found")  # unreachable for bits <= 40

    def admits(self, author: str, obj: str, payload: Any) -> str | None:
        """Whether an author's op #1 (``obj``, ``payload``) admits it; a rejection reason or None."""
        if self.closed:
            return None if author in self.allow else "not_admitted"
        if obj != "members" or not isinstance(payload, dict) or payload.get("add") != author:
            return "not_admitted"
        return None if self.ticket_ok(author, payload.get("ticket")) else "not_admitted"

    def payload(self, author: str, ticket: int | None) -> dict:
        """The ``members`` add that admits ``author`` (its op #1)."""
        return {"add": author} if self.closed or ticket is None else {"add": author, "ticket": ticket}
