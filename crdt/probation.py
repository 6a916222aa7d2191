"""Authors without standing, held on probation: their chains kept aside, outside the merged state.

Identities cost a ticket, not a wall, so no count of them may close the store: a new author is never refused for want
of room. The caller says, for each op from the network, whether its author has *standing* (its own key sent the op,
or a peer with standing introduced it within a quota; see ``node.replication``). An author without it is held here:
its chain (from op #1 or a base, at most ``MAX_PROBATION_OPS`` ops, verified by the store) kept outside the merged
state, the version vector and the digests, at most ``max_ops`` ops and ``max_bytes`` of bodies in all; when full,
the author that was least recently heard from gives way. An author on probation merges (with the ops it holds) as
soon as an op of it arrives vouched. Since the merged state and the digests are functions of the merged authors
only, replicas that merged the same authors have the same digest and the same state, whichever flood each of them
saw on probation; a flood of fresh identities evicts only other identities that nobody vouched for, never a member
that wrote with standing.

Pure bookkeeping: the store (``crdt.store``) checks what comes and merges what is promoted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from swarmd.crdt.ops import Op

MAX_PROBATION_OPS = 16  # ops of one author held on probation


class Probation:
    def __init__(self, max_ops: int, max_bytes: int):
        self.max_ops = max_ops
        self.max_bytes = max_bytes
        self.chains: OrderedDict[str, list[Op]] = OrderedDict()  # author -> its chain, least recent first
        self.bytes = 0
        self.ops = 0
        self.counts: Counter = Counter()  # "held", "evicted", "merged"

    def __len__(self) -> int:
        return len(self.chains)

    def __contains__(self, author: str) -> bool:
        return author in self.chains

    def get(self, author: str) -> list[Op] | None:
        return self.chains.get(author)

    def add(self, op: Op, restates: bool) -> None:
        """Append a checked op to its author's chain (a new chain when ``restates``: a base past the chain held, which
        restates what was held), then evict the least recent authors while over the budget."""
        if restates:
            self.drop(op.author)
        chain = self.chains.get(op.author)
        if chain is None:
            chain = self.chains[op.author] = []
            self.counts["held"] += 1
        chain.append(op)
        self.chains.move_to_end(op.author)
        self.bytes += len(op.body)
        self.ops += 1
        while self.ops > max(1, self.max_ops) or self.bytes > self.max_bytes:
            oldest = next(iter(self.chains))
            self.drop(oldest)
            self.counts["evicted"] += 1
            if oldest == op.author:
                break

    def drop(self, author: str) -> list[Op]:
        """Stop holding ``author``: its chain (empty if none was held)."""
        chain = self.chains.pop(author, [])
        self.bytes -= sum(len(o.body) for o in chain)
        self.ops -= len(chain)
        return chain
