"""How a gossiping loop's contributions reach the rounds where some peers have no direct path to us.

A peer behind a symmetric NAT (or any pair punching cannot join) is connected to us through a relay only. In SPSA
and SAPO its contributions are signed pubsub messages (a window's batch of bytes, a round's completions: kilobytes
at most, never bulk bytes), which the gossip mesh carries through the members both of us reach, so such a peer
founds the run with us (``rounds.linked``) and counts in every round. This is the tally ``/status`` shows for it
(``reach``) and ``swarmd doctor`` reads: per peer without a direct path, the rounds whose contribution from it we
took; and the rounds that held our own.
"""

from __future__ import annotations

from swarmd.protocols.rounds import keep_latest

MAX_PEERS = 64  # peers without a direct path tallied (the most recently heard from)


class Reach:
    def __init__(self, via: str):
        self.via = via  # how such a peer's contribution travels, in words ("gossiped")
        self.through: dict[str, int] = {}  # peer without a direct path -> rounds whose contribution from it we took
        self.closed = 0
        self.with_ours = 0

    def took(self, peers, me: str, direct) -> None:
        """One round closed with the contributions of ``peers`` (``direct``: whether a peer is directly
        connected to us)."""
        self.closed += 1
        self.with_ours += me in peers
        for peer in peers:
            if peer != me and not direct(peer):
                keep_latest(self.through, peer, self.through.get(peer, 0) + 1, MAX_PEERS)

    def status(self) -> dict:
        return {"via": self.via, "through_members": dict(sorted(self.through.items())),
                "rounds_with_our_update": self.with_ours, "rounds_closed": self.closed}
