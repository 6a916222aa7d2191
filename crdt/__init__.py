"""Replicated data types: signed, content-addressed ops in a hash-linked DAG, merged without coordination.

Pure: no I/O, no asyncio, no torch, nothing else of swarmd's. Signing and verification are passed in.
"""

from crdt.hlc import HLC
from crdt.ops import Op, OpError, decode_wire
from crdt.store import APPLIED, DUPLICATE, PENDING, REJECTED, OpStore, Result
from crdt.types import GCounter, LWWMap, MaxRegister, ORSet, PNCounter, ProgressRegister

__all__ = [
    "APPLIED", "DUPLICATE", "GCounter", "HLC", "LWWMap", "MaxRegister", "ORSet", "Op", "OpError", "OpStore",
    "PENDING", "PNCounter", "ProgressRegister", "REJECTED", "Result", "decode_wire",
]
