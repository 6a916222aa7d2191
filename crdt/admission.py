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
That is also why the op's ticket never expires: a replica that syncs the log a year later must judge op #1 as the
others did, and an op's own time is the author's to choose.

A node's **record** under the DHT's members key (and in its hello) is different: it is re-published all the time and
judged now. Its ticket is bound to a time window as well as to the swarm: a nonce such that
``blake2b(RECORD_DOMAIN | swarm | author | epoch | nonce)`` has ``bits`` leading zero bits, where ``epoch`` is the
current ``window`` (6 h) of the wall clock or the one before; each node mints a new one as a window begins (about
2^bits hashes a window). A stock of record tickets is good for two windows at most, so keeping many identities on
the members key costs work all the time, not once. A record with an op-style ticket (an older swarmd's) is refused as
``old_ticket``; the rule's digest (:meth:`Admission.policy`) says the windowed records, so such a node is named as
one with another admission rule.
"""

from __future__ import annotations

import hashlib
from typing import Any

DOMAIN = b"swarmd-admit/1\x00"
RECORD_DOMAIN = b"swarmd-admit-record/1\x00"
MAX_BITS = 40
NONCE_BYTES = 8
WINDOW = 6 * 3600.0  # seconds: a record's ticket is good in the window it was minted for and the next one


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
        text = "\n".join([self.swarm, str(self.bits), "records:windowed", *sorted(self.allow)])
        return hashlib.blake2b(DOMAIN + text.encode(), digest_size=8).hexdigest()

    def _prefix(self, author: str) -> Any:
        return hashlib.blake2b(DOMAIN + self.swarm.encode() + b"\x00" + author.encode() + b"\x00", digest_size=16)

    def _record_prefix(self, author: str, epoch: int) -> Any:
        return hashlib.blake2b(RECORD_DOMAIN + self.swarm.encode() + b"\x00" + author.encode() + b"\x00"
                               + epoch.to_bytes(8, "little", signed=True), digest_size=16)

    def _ok(self, prefix: Any, nonce: Any) -> bool:
        if type(nonce) is not int or not 0 <= nonce < 1 << (8 * NONCE_BYTES):
            return False
        h = prefix.copy()
        h.update(nonce.to_bytes(NONCE_BYTES, "little"))
        return int.from_bytes(h.digest(), "big") >> (128 - self.bits) == 0 if self.bits else True

    def _mint(self, base: Any, start: int) -> int:
        shift = 128 - self.bits
        for nonce in range(start, 1 << (8 * NONCE_BYTES)):
            h = base.copy()
            h.update(nonce.to_bytes(NONCE_BYTES, "little"))
            if int.from_bytes(h.digest(), "big") >> shift == 0:
                return nonce
        raise RuntimeError("no ticket found")  # unreachable for bits <= 40

    def ticket_ok(self, author: str, nonce: Any) -> bool:
        return self._ok(self._prefix(author), nonce)

    def mint(self, author: str, start: int = 0) -> int:
        """Find a ticket for ``author``'s op #1 (about 2^bits hashes: run it off the event loop)."""
        return self._mint(self._prefix(author), start)

    @staticmethod
    def epoch(now: float) -> int:
        """The time window ``now`` (wall-clock seconds) falls in."""
        return int(now // WINDOW)

    def mint_record(self, author: str, epoch: int, start: int = 0) -> int:
        """Find a ticket for ``author``'s record in window ``epoch`` (about 2^bits hashes: off the event loop)."""
        return self._mint(self._record_prefix(author, epoch), start)

    def record_refusal(self, author: str, nonce: Any, now: float) -> str | None:
        """Whether a record of ``author`` with ticket ``nonce`` is admitted at wall-clock ``now``: None, or
        "unadmitted", or "old_ticket" (an op's ticket, not bound to a window: a node of an older swarmd)."""
        if self.closed:
            return None if author in self.allow else "unadmitted"
        epoch = self.epoch(now)
        if any(self._ok(self._record_prefix(author, e), nonce) for e in (epoch, epoch - 1)):
            return None
        return "old_ticket" if self.bits and self.ticket_ok(author, nonce) else "unadmitted"

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


class RecordTicket:
    """A node's own record ticket, renewed as a time window begins: :meth:`at` mints (about 2^bits hashes, so off
    the event loop) only when the window has changed since the last call."""

    def __init__(self, admission: Admission, author: str):
        self.admission, self.author = admission, author
        self.epoch: int | None = None
        self.nonce: int | None = None
        self.minted = 0

    def at(self, now: float) -> int | None:
        """The ticket for the window of ``now`` (None in a closed swarm: the allowlist admits)."""
        if self.admission.closed:
            return None
        epoch = self.admission.epoch(now)
        if epoch != self.epoch:
            self.nonce, self.epoch = self.admission.mint_record(self.author, epoch), epoch
            self.minted += 1
        return self.nonce
