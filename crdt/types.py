"""The replicated types, with their merge semantics.

Every type's ``apply`` is commutative, associative and idempotent over a set of ops (the store applies each op once,
after its parents), so any delivery order gives the same state. ``check`` says whether ``op`` is allowed at all
(payload shape and who may write what); it returns a rejection reason or None.

A type whose state is a sum of per-author contributions that only their author writes (``per_author``) can be
compacted: an author's *base* op (see ``crdt.store``) restates its contribution to every object, and every replica
then drops that author's earlier ops. ``fold`` builds an author's contribution (its "part") from its own ops,
``check_part`` vets a part received in a base, and ``rebase`` replaces an author's contribution with a part. For
every type, applying an author's ops one by one and applying its base give the same ``value``.

| type | payload | who may write | value |
|---|---|---|---|
| LWWMap | ``{"k": str, "v": JSON value or None}`` (None deletes; depth <= 8) | namespaced: keys ``<author>/...`` only; shared: anyone | per key, the write with the greatest (clock, author, id) |
| ORSet | ``{"add": e}`` (optionally ``"ticket": int``, see crdt.admission) or ``{"rm": e, "tags": [add op ids]}`` | self_only: e == author | e is in the set while some add of e is not removed by a later-observed rm |
| GCounter | ``{"n": int >= 0}`` | anyone (each into its own slot) | sum of all increments |
| PNCounter | ``{"n": int}`` | anyone (own slot) | sum of increments minus decrements |
| MaxRegister | ``{"v": int}`` | anyone | the largest value written (e.g. round numbers) |
| ProgressRegister | ``{"step", "samples", "bytes": int >= 0, "loss": float or None, "round": int >= 0}``, optional ``"metrics"`` (<= 16 names to finite floats) | each author its own entry | per author, its latest write (by clock) |
"""

from __future__ import annotations

import math
from typing import Any

from swarmd.crdt.ops import ID_SIZE, Op

MAX_KEY = 128
MAX_TAGS = 64
MAX_INT = 2**53


def _rank(op: Op) -> tuple:
    return (op.clock, op.author, op.id)


def _is_int(v: Any, lo: int = -MAX_INT, hi: int = MAX_INT) -> bool:
    return type(v) is int and lo <= v <= hi


class CRDTType:
    name = "?"
    per_author = False  # True: compactable (each author's contribution is its own, restated by its base)

    def check(self, op: Op) -> str | None:
        raise NotImplementedError

    def initial(self) -> Any:
        raise NotImplementedError

    def apply(self, state: Any, op: Op) -> Any:
        """Return the new state (may mutate ``state`` in place and return it)."""
        raise NotImplementedError

    def value(self, state: Any) -> Any:
        """JSON-ready value."""
        raise NotImplementedError

    def fold(self, part: Any, op: Op) -> Any:
        """An author's contribution after its ``op`` (``part``: the contribution before it, None at first; a
        mutable part may be changed in place)."""
        raise NotImplementedError

    def restate(self, part: Any) -> Any:
        """A folded contribution as a base carries it (most types: itself)."""
        return part

    def unstate(self, part: Any, base: Op) -> Any:
        """A base's part as ``fold`` goes on from it (the inverse of ``restate``)."""
        return part

    def check_part(self, part: Any, author: str) -> str | None:
        """Whether ``part`` may be ``author``'s contribution (None) or the rejection reason."""
        raise NotImplementedError

    def rebase(self, state: Any, author: str, part: Any, base: Op) -> Any:
        """The state with ``author``'s contribution replaced by ``part`` (None: no contribution), restated by
        ``base``. May mutate ``state`` in place and return it."""
        raise NotImplementedError


MAX_VALUE_DEPTH = 8


def _json_value(v: Any, depth: int = 0) -> bool:
    """A value every replica can store and serve as JSON: no bytes, no non-string keys, no NaN, bounded depth."""
    if v is None or type(v) in (bool, str):
        return True
    if type(v) is int:
        return -MAX_INT <= v <= MAX_INT
    if type(v) is float:
        return math.isfinite(v)
    if depth >= MAX_VALUE_DEPTH:
        return False
    if type(v) is list:
        return all(_json_value(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(type(k) is str and _json_value(x, depth + 1) for k, x in v.items())
    return False


class LWWMap(CRDTType):
    name = "lww_map"

    def __init__(self, namespaced: bool = True):
        self.namespaced = namespaced

    def check(self, op: Op) -> str | None:
        p = op.payload
        if not isinstance(p, dict) or set(p) != {"k", "v"} or not isinstance(p["k"], str) or not p["k"]:
            return "malformed"
        if len(p["k"]) > MAX_KEY:
            return "oversized"
        if self.namespaced and not p["k"].startswith(op.author + "/"):
            return "not_allowed"
        if not _json_value(p["v"]):
            return "malformed"  # bytes, a non-string map key, NaN, or nested deeper than MAX_VALUE_DEPTH
        return None

    def initial(self) -> dict:
        return {}

    def apply(self, state: dict, op: Op) -> dict:
        key = op.payload["k"]
        current = state.get(key)
        if current is None or _rank(op) > current[0]:
            state[key] = (_rank(op), op.payload["v"])
        return state

    def value(self, state: dict) -> dict:
        return {k: v for k, (_, v) in sorted(state.items()) if v is not None}

    @property
    def per_author(self) -> bool:
        return self.namespaced  # a shared map's keys are anyone's: no author can restate them alone

    def fold(self, part: dict | None, op: Op) -> dict:
        part = {} if part is None else part  # folded in place: the caller owns it (see ``unstate``)
        if op.payload["v"] is None:
            part.pop(op.payload["k"], None)
        else:
            part[op.payload["k"]] = op.payload["v"]
        return part

    def check_part(self, part: Any, author: str) -> str | None:
        if not isinstance(part, dict):
            return "malformed"
        for k, v in part.items():
            if not isinstance(k, str) or not k.startswith(author + "/") or len(k) > MAX_KEY:
                return "not_allowed" if isinstance(k, str) and len(k) <= MAX_KEY else "malformed"
            if v is None or not _json_value(v):
                return "malformed"
        return None

    def unstate(self, part: dict, base: Op) -> dict:
        return dict(part)  # a copy: fold goes on in place, and the base's payload must stay as signed

    def rebase(self, state: dict, author: str, part: dict | None, base: Op) -> dict:
        prefix = author + "/"
        for k in [k for k in state if k.startswith(prefix)]:
            del state[k]
        for k, v in (part or {}).items():
            state[k] = (_rank(base), v)
        return state


class ORSet(CRDTType):
    name = "or_set"

    def __init__(self, self_only: bool = False):
        self.self_only = self_only

    def check(self, op: Op) -> str | None:
        p = op.payload
        if not isinstance(p, dict):
            return "malformed"
        if set(p) == {"add"} or set(p) == {"add", "ticket"}:  # a ticket admits its author (crdt.admission)
            element = p["add"]
            if "ticket" in p and not _is_int(p["ticket"], 0, 2**64 - 1):
                return "malformed"
        elif set(p) == {"rm", "tags"}:
            element, tags = p["rm"], p["tags"]
            if not isinstance(tags, list) or not all(isinstance(t, bytes) and len(t) == ID_SIZE for t in tags):
                return "malformed"
            if len(tags) > MAX_TAGS:
                return "oversized"
        else:
            return "malformed"
        if not isinstance(element, str) or not element:
            return "malformed"
        if len(element) > MAX_KEY:
            return "oversized"
        if self.self_only and element != op.author:
            return "not_allowed"
        return None

    def initial(self) -> dict:
        return {}  # element -> (add tags, removed tags)

    def apply(self, state: dict, op: Op) -> dict:
        p = op.payload
        if "add" in p:
            state.setdefault(p["add"], (set(), set()))[0].add(op.id)
        else:
            state.setdefault(p["rm"], (set(), set()))[1].update(p["tags"])
        return state

    def value(self, state: dict) -> list[str]:
        return sorted(e for e, (adds, removed) in state.items() if adds - removed)

    @property
    def per_author(self) -> bool:
        return self.self_only  # otherwise anyone may remove anyone's adds: not one author's to restate

    def fold(self, part: frozenset | None, op: Op) -> frozenset:
        """The author's live add tags (self_only: its element is in the set while one is live)."""
        p = op.payload
        return (part or frozenset()) | {op.id} if "add" in p else (part or frozenset()) - set(p["tags"])

    def restate(self, part: frozenset) -> bool:
        return bool(part)

    def unstate(self, part: bool, base: Op) -> frozenset:
        return frozenset({base.id}) if part else frozenset()

    def check_part(self, part: Any, author: str) -> str | None:
        return None if part is True or part is False else "malformed"

    def rebase(self, state: dict, author: str, part: bool | None, base: Op) -> dict:
        state.pop(author, None)
        if part:
            state[author] = ({base.id}, set())  # the base is the add that keeps the author in (rm it by its id)
        return state

    @staticmethod
    def live_tags(state: dict, element: str) -> list[bytes]:
        adds, removed = state.get(element, (set(), set()))
        return sorted(adds - removed)


class GCounter(CRDTType):
    name = "g_counter"

    def check(self, op: Op) -> str | None:
        p = op.payload
        if not isinstance(p, dict) or set(p) != {"n"} or not _is_int(p["n"], 0, 2**32):
            return "malformed"
        return None

    def initial(self) -> dict:
        return {}

    def apply(self, state: dict, op: Op) -> dict:
        state[op.author] = state.get(op.author, 0) + op.payload["n"]
        return state

    def value(self, state: dict) -> dict:
        return {"total": sum(state.values()), "by_peer": dict(sorted(state.items()))}

    per_author = True

    def fold(self, part: int | None, op: Op) -> int:
        return (part or 0) + op.payload["n"]

    def check_part(self, part: Any, author: str) -> str | None:
        return None if _is_int(part, 0 if type(self) is GCounter else -MAX_INT) else "malformed"

    def rebase(self, state: dict, author: str, part: int | None, base: Op) -> dict:
        state.pop(author, None)
        if part is not None:
            state[author] = part
        return state


class PNCounter(GCounter):
    name = "pn_counter"

    def check(self, op: Op) -> str | None:
        p = op.payload
        if not isinstance(p, dict) or set(p) != {"n"} or not _is_int(p["n"], -(2**32), 2**32):
            return "malformed"
        return None


class MaxRegister(CRDTType):
    name = "max_register"

    def check(self, op: Op) -> str | None:
        p = op.payload
        if not isinstance(p, dict) or set(p) != {"v"} or not _is_int(p["v"]):
            return "malformed"
        return None

    def initial(self) -> None:
        return None

    def apply(self, state, op: Op):
        v = op.payload["v"]
        return v if state is None or v > state else state

    def value(self, state):
        return state

    per_author = True  # the register is the max over every author's largest write: restating one's own is enough

    def fold(self, part: int | None, op: Op) -> int:
        return op.payload["v"] if part is None else max(part, op.payload["v"])

    def check_part(self, part: Any, author: str) -> str | None:
        return None if _is_int(part) else "malformed"

    def rebase(self, state, author: str, part: int | None, base: Op):
        return state if part is None or (state is not None and state >= part) else part


PROGRESS_FIELDS = {"step", "samples", "loss", "bytes", "round"}
MAX_METRICS = 16  # optional "metrics": a loop's own numbers (e.g. rewards), short names to finite floats


def _metrics_ok(m: Any) -> bool:
    return (isinstance(m, dict) and len(m) <= MAX_METRICS
            and all(isinstance(k, str) and 0 < len(k) <= 32 and type(v) is float and math.isfinite(v)
                    for k, v in m.items()))


class ProgressRegister(CRDTType):
    name = "progress"

    def check(self, op: Op) -> str | None:
        return self.check_part(op.payload, op.author)

    per_author = True

    def check_part(self, p: Any, author: str) -> str | None:
        if not isinstance(p, dict) or set(p) - {"metrics"} != PROGRESS_FIELDS:
            return "malformed"
        if "metrics" in p and not _metrics_ok(p["metrics"]):
            return "malformed"
        if not all(_is_int(p[k], 0) for k in ("step", "samples", "bytes", "round")):
            return "malformed"
        loss = p["loss"]
        if loss is not None and (type(loss) is not float or not math.isfinite(loss)):
            return "malformed"
        return None

    def initial(self) -> dict:
        return {}

    def apply(self, state: dict, op: Op) -> dict:
        current = state.get(op.author)
        if current is None or _rank(op) > current[0]:
            state[op.author] = (_rank(op), op.payload)
        return state

    def value(self, state: dict) -> dict:
        return {author: payload for author, (_, payload) in sorted(state.items())}

    def fold(self, part: dict | None, op: Op) -> dict:
        return op.payload  # an author's ops come in its chain's order, which is its clock's

    def rebase(self, state: dict, author: str, part: dict | None, base: Op) -> dict:
        state.pop(author, None)
        if part is not None:
            state[author] = (_rank(base), part)
        return state
