"""Replicated data types: signed, content-addressed ops in a hash-linked DAG, merged without coordination.

Pure: no I/O, no asyncio, no torch, nothing else of swarmd's. Signing and verification are passed in.
"""

from swarmd.crdt.hlc import HLC
from swarmd.crdt.ops import Op, OpError, decode_wire
from swarmd.crdt.store import APPLIED, DUPLICATE, PENDING, PROBATION, REJECTED, OpStore, Result
from swarmd.crdt.types import GCounter, LWWMap, MaxRegister, ORSet, PNCounter, ProgressRegister

__all__ = [
    "APPLIED", "DUPLICATE", "GCounter", "HLC", "LWWMap", "MaxRegister", "ORSet", "Op", "OpError", "OpStore",
    "PENDING", "PNCounter", "PROBATION", "ProgressRegister", "REJECTED", "Result", "decode_wire",
]
