"""An author's base (``crdt.store``: compaction): its contribution to every object, folded from its latest base on,
and its admission ticket. The fold of the ops the store holds is kept per author, so a write folds only what is new.
"""

from __future__ import annotations

from typing import Any, Callable

from swarmd.crdt.ops import Op
from swarmd.crdt.types import CRDTType

BASE_OBJECT = "_base"  # the object name of a base op (no schema object may start with "_")


class Folds:
    def __init__(self, schema: dict[str, CRDTType]):
        self.schema = schema
        self._folded: dict[str, tuple[int, dict, Any]] = {}  # author -> (seq, its parts, ticket)

    def _fold(self, folded: tuple[int, dict, Any], ops) -> tuple[int, dict, Any]:
        seq, parts, ticket = folded
        for op in ops:
            if op.object == BASE_OBJECT:
                parts = {name: self.schema[name].unstate(part, op) for name, part in op.payload["parts"].items()}
                ticket = op.payload.get("ticket", ticket)
            else:
                parts[op.object] = self.schema[op.object].fold(parts.get(op.object), op)
                if op.seq == 1 and op.object == "members" and isinstance(op.payload, dict):
                    ticket = op.payload.get("ticket")
            seq = op.seq
        return seq, parts, ticket

    def payload(self, author: str, first: int, last: int, ops_from: Callable[[int], list[Op]],
                drafted: list[Op] = ()) -> dict:
        """``author``'s base payload as of its ops the store holds (seqs ``first``..``last``; ``ops_from(seq)``:
        those from ``seq`` on) and then ``drafted``."""
        folded = self._folded.get(author)
        if folded is None or folded[0] < first - 1 or folded[0] > last:
            folded = (first - 1, {}, None)
        if folded[0] < last:
            folded = self._fold(folded, ops_from(folded[0] + 1))
            self._folded[author] = folded
        seq, parts, ticket = folded
        if drafted:  # on a copy: the kept fold holds only applied ops
            parts = {name: dict(part) if isinstance(part, dict) else part for name, part in parts.items()}
            _, parts, ticket = self._fold((seq, parts, ticket), drafted)
        out = {"parts": {name: self.schema[name].restate(part) for name, part in sorted(parts.items())}}
        if ticket is not None:
            out["ticket"] = ticket
        return out
