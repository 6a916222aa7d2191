"""What the loop keeps of each round of each fragment, keyed by (round, fragment), and for how long.

A round's record has several parts with lives of their own: what an open round gathers (``pending``, until its
close), the others' hashes of it (``hashes``, two rounds past its close: the checks of the previous round and a
joiner's vouchers read them), who asked to join it (``joins``, until its close), the members we combined
(``contributed``, one round: the next round's hash check reads it), the hash we published (``published``, up to
MAX_AHEAD rounds: compared with the others' when we are ahead), the signed announcements of closed rounds
(``signed``, two rounds: served to a peer whose gossip lost one), who asked us for them (``served``), a scatter
step's receipts (``moving``), and the blobs of its exchange we hold (``blobs``, ``own_blobs``: see
``blobs_going``). Each ``closed_*`` method is the retention rule of one part, run when round r of fragment p closes."""

from __future__ import annotations

import collections

from swarmd.protocols.diloco.pending import Pending, Received
from swarmd.protocols.diloco.wire import MAX_AHEAD


class RoundBook:
    def __init__(self) -> None:
        self.pending: dict[tuple[int, int], Pending] = collections.defaultdict(Pending)
        self.hashes: dict[tuple[int, int], dict[str, str]] = collections.defaultdict(dict)  # peer -> its hash
        self.joins: dict[tuple[int, int], set[str]] = collections.defaultdict(set)
        self.contributed: dict[tuple[int, int], set[str]] = {}  # who we combined
        self.published: dict[tuple[int, int], str] = {}  # the hash we published
        self.checked: set[tuple[int, int]] = set()  # our published rounds compared with the others' hashes
        self.signed: dict[tuple[int, int], dict[str, dict]] = {}  # closed rounds' signed announcements
        self.served: dict[tuple[int, int], set[str]] = {}  # who asked us for a round's announcements
        self.moving: dict[tuple[int, int], Received] = {}  # scatter step -> what came in it so far
        # the blobs of a round's exchange we hold, served while the round may still need them: all of them until
        # we close the next round (a peer's fallback pulls come up to a deadline after its close, from any member
        # that holds a chunk or part), then only our own (our update's parts, our reductions: what a peer a round
        # behind pulls from us to close that round) until the round after, then none
        self.blobs: dict[tuple[int, int], set[bytes]] = collections.defaultdict(set)
        self.own_blobs: dict[tuple[int, int], set[bytes]] = collections.defaultdict(set)  # ours among them
        # (peer, fragment) -> the parts of its last update (the latest MAX_REMEMBERED_UPDATES): a replay is refused
        self.last_parts: collections.OrderedDict[tuple[str, int], tuple] = collections.OrderedDict()

    def closed_contributed(self, r: int, p: int, participants: set[str]) -> None:
        self.contributed[(r, p)] = participants
        for old in [k for k in self.contributed if k[1] == p and k[0] < r - 1]:
            del self.contributed[old]

    def closed_published(self, r: int, p: int, h: str) -> None:
        self.published[(r, p)] = h
        for old in [k for k in self.published if k[1] == p and k[0] < r - MAX_AHEAD]:
            del self.published[old]
            self.checked.discard(old)

    def closed_signed(self, r: int, p: int, closed: Pending | None) -> None:
        """The signed announcements of the last rounds (for a peer whose gossip did not bring one our view named);
        the requests for them, the others' hashes and the joins of rounds that far back go."""
        self.signed[(r, p)] = closed.signed if closed is not None else {}
        for old in [k for k in self.signed if k[1] == p and k[0] < r - 2]:
            del self.signed[old]
        for old in [k for k in self.served if k[1] == p and k[0] < r - 2]:
            del self.served[old]
        for old in [k for k in self.hashes if k[1] == p and k[0] < r - 2]:
            del self.hashes[old]

    def closed_joins(self, r: int, p: int) -> None:
        for old in [k for k in self.joins if k[1] == p and k[0] <= r]:
            del self.joins[old]

    def blobs_going(self, r: int, p: int) -> set[bytes] | None:
        """After closing round r of fragment p, the blobs no round still keeps: those of rounds before r - 1, and
        of round r - 1 all but our own (a chunk or part pulled from another member mattered only while that
        round's members were closing it: for a 100 MB update at 4 peers, keeping them would hold 1.5 x its size a
        round longer). A blob also named by a round still kept (the same bytes) stays."""
        going: set[bytes] = set()
        for old in [k for k in self.blobs if k[1] == p and k[0] < r]:
            if old[0] < r - 1:
                going |= self.blobs.pop(old)
                self.own_blobs.pop(old, None)
            else:
                own = self.own_blobs.get(old, set())
                going |= self.blobs[old] - own
                self.blobs[old] = set(own)
        if going:
            kept = set().union(*self.blobs.values()) if self.blobs else set()
            return going - kept
        return None

    def signed_announcements(self, key: tuple[int, int]) -> dict[str, dict]:
        return self.pending[key].signed if key in self.pending else self.signed.get(key, {})

    def took_checkpoint(self, rounds_done: list[int]) -> None:
        """Our weights are a checkpoint's: what we published before no longer describes them; updates already
        here for rounds we have yet to close stay (their base is checked when we close them)."""
        self.published.clear()
        self.checked.clear()
        self.pending = collections.defaultdict(Pending, {k: v for k, v in self.pending.items()
                                                         if k[0] >= rounds_done[k[1]]})
