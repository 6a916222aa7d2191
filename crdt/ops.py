"""Signed, content-addressed operations.

Wire form of an op: ``{"b": body, "s": signature}`` where ``body`` is the msgpack array::

    [1, author, seq, [wall_ms, counter], [parent id, ...], object, payload]

- ``author``: the writer's peer id; ``seq``: 1, 2, 3... per author (each author's ops form a chain);
- ``[wall_ms, counter]``: the author's hybrid logical clock when it wrote the op;
- parents: ids of the heads the author had seen (its own previous op among them), so ops form a hash-linked DAG;
- ``object``: which replicated object the op changes; ``payload``: the change, checked by the object's type.

The op id is BLAKE2b-256 of ``body``; the signature is the author's Ed25519 signature over a domain tag and ``body``,
exactly as sent (no re-encoding is needed to verify). Signing and verifying are injected, so this module stays
pure (no I/O, no keys).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

SIGN_DOMAIN = b"swarmd/crdt/op/v1\x00"
ID_SIZE = 32
MAX_PARENTS = 64
MAX_OBJECT_NAME = 64
MAX_AUTHOR = 64
MAX_SEQ = 2**53

Signer = Callable[[bytes], bytes]
Verifier = Callable[[str, bytes, bytes], bool]  # (author peer id, data, signature) -> ok


class OpError(ValueError):
    """An op that cannot be decoded; ``reason`` is a stable code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Op:
    id: bytes
    author: str
    seq: int
    clock: tuple[int, int]
    parents: tuple[bytes, ...]
    object: str
    payload: Any
    body: bytes
    sig: bytes

    def wire(self) -> dict:
        return {"b": self.body, "s": self.sig}

    def __repr__(self) -> str:
        return f"Op({self.id.hex()[:12]} {self.author[-6:]}#{self.seq} {self.object} {self.payload!r})"


def op_id(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=ID_SIZE).digest()


def encode_body(author: str, seq: int, clock: tuple[int, int], parents, obj: str, payload: Any) -> bytes:
    return msgpack.packb([1, author, seq, list(clock), sorted(parents), obj, payload], use_bin_type=True)


def make_op(sign: Signer, author: str, seq: int, clock, parents, obj: str, payload: Any) -> Op:
    body = encode_body(author, seq, clock, parents, obj, payload)
    return decode_body(body, sign(SIGN_DOMAIN + body), max_size=len(body))


def decode_wire(wire: Any, *, max_size: int) -> Op:
    """Strictly decode ``{"b": body, "s": sig}``. Does not verify the signature. Raises OpError."""
    if not isinstance(wire, dict) or set(wire) != {"b", "s"}:
        raise OpError("malformed", "op must be {b: bytes, s: bytes}")
    body, sig = wire["b"], wire["s"]
    if not isinstance(body, bytes) or not isinstance(sig, bytes):
        raise OpError("malformed", "op fields must be bytes")
    return decode_body(body, sig, max_size=max_size)


class _OverBudget(Exception):
    pass


def decode_body(body: bytes, sig: bytes, *, max_size: int) -> Op:
    if len(body) > max_size:
        raise OpError("oversized", f"op body of {len(body)} B exceeds {max_size} B")
    # at most one decoded object (a container, an element, a key or a value) per 8 bytes of body, plus a floor:
    # an object costs 30-60 B in memory, so an op held in memory stays under about 8x its body
    budget = 64 + len(body) // 8
    left = [budget]

    def count(container):
        left[0] -= 1 + (2 * len(container) if type(container) is dict else len(container))
        if left[0] < 0:
            raise _OverBudget
        return container

    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, max_ext_len=0,
                              object_hook=count, list_hook=count, max_array_len=budget, max_map_len=budget)
    except _OverBudget:
        raise OpError("oversized", f"more objects than an op body of {len(body)} B may carry") from None
    except Exception as e:
        if "exceeds max" in str(e):  # a map or array longer than the budget: refused before it was allocated
            raise OpError("oversized", f"a map or array longer than an op body of {len(body)} B may carry") from None
        raise OpError("malformed", f"undecodable op body ({type(e).__name__})") from None
    if not isinstance(obj, list) or len(obj) != 7 or obj[0] != 1 or type(obj[0]) is not int:
        raise OpError("malformed", "op body must be [1, author, seq, clock, parents, object, payload]")
    _, author, seq, clock, parents, name, payload = obj
    if not isinstance(author, str) or not 0 < len(author) <= MAX_AUTHOR:
        raise OpError("malformed", "bad author")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise OpError("malformed", "bad seq")
    if (
        not isinstance(clock, list)
        or len(clock) != 2
        or not all(type(c) is int and 0 <= c < 2**63 for c in clock)
    ):
        raise OpError("malformed", "bad clock")
    if (
        not isinstance(parents, list)
        or len(parents) > MAX_PARENTS
        or not all(isinstance(p, bytes) and len(p) == ID_SIZE for p in parents)
        or parents != sorted(set(parents))
    ):
        raise OpError("malformed", "bad parents (sorted unique 32-byte ids)")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_OBJECT_NAME:
        raise OpError("malformed", "bad object name")
    return Op(op_id(body), author, seq, (clock[0], clock[1]), tuple(parents), name, payload, body, sig)


def verify_op(op: Op, verify: Verifier) -> bool:
    return verify(op.author, SIGN_DOMAIN + op.body, op.sig)
