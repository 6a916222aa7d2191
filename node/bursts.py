"""When a node makes a burst of many flows with a peer (``transport.birthday``): the policy, apart from the punch.

A burst opens hundreds of connections at once, so a node makes one only where it can work and never so often that
it acts as a port scanner: the two NATs' mappings must give roles (one keeps its port, the other changes it), and
there is at most one burst with a peer every ``EVERY`` seconds (either role), ``AT_ONCE`` in flight for all peers,
and one every ``GAP`` seconds in all (so many peer ids cannot chain bursts either). Pure bookkeeping: the caller
passes the time; ``node.nat`` asks it before it asks for a burst and before it grants one.
"""

from __future__ import annotations

import contextlib

from swarmd.transport.birthday import roles

PEERS = 256  # peers whose mapping and last burst are remembered (the most recent)


class Bursts:
    EVERY = 300.0  # seconds between two bursts with one peer
    AT_ONCE = 1  # bursts in flight at once, for all peers
    GAP = 30.0  # seconds between two bursts, for all peers

    def __init__(self):
        self.mappings: dict[str, str] = {}  # peer -> its NAT's mapping, as its last punch message showed it
        self.started: dict[str, float] = {}  # peer -> when our last burst with it started
        self.running = 0

    def note_mapping(self, peer: str, body: object, theirs: list[tuple[str, int]]) -> str:
        """The peer's mapping: as it declares it (burst messages), else as its candidates show it (its listen
        port first, then the ports peers observed it at: one port for all is a kept port)."""
        declared = body.get("mapping") if isinstance(body, dict) else None
        if not isinstance(declared, str):
            declared = "unknown" if not theirs else "kept" if len({p for _, p in theirs}) == 1 else "changed"
        self.mappings.pop(peer, None)
        self.mappings[peer] = declared
        if len(self.mappings) > PEERS:
            del self.mappings[next(iter(self.mappings))]
        return declared

    def mapping_of(self, peer: str) -> str:
        return self.mappings.get(peer, "unknown")

    def role(self, ours: str, peer: str) -> str | None:
        """Our role in a burst with ``peer`` (``transport.birthday.roles``), None where a burst cannot help."""
        return roles(ours, self.mapping_of(peer))

    def free(self, peer: str, now: float) -> bool:
        """Whether the budgets allow a burst with ``peer`` now."""
        if len(self.started) > PEERS:
            self.started = {p: t for p, t in self.started.items() if now - t < self.EVERY}
        return (self.running < self.AT_ONCE and now - max(self.started.values(), default=-1e9) >= self.GAP
                and now - self.started.get(peer, -1e9) >= self.EVERY)

    def may(self, ours: str, peer: str, now: float) -> bool:
        """Whether to ask ``peer`` for a burst: the mappings give roles and the budgets allow one."""
        return self.role(ours, peer) is not None and self.free(peer, now)

    def take(self, peer: str, now: float) -> None:
        """A burst with ``peer`` is agreed: its budget is spent now, so no other burst starts before it."""
        self.started[peer] = now

    @contextlib.contextmanager
    def flowing(self):
        """While a burst's flows are open (counted against ``AT_ONCE``)."""
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
