"""A step's one byte: the seeds of the probes, the projected gradient's code, and the screening of a window's bytes
(the pure parts every peer, live or replaying, computes the same, bit for bit)."""

from __future__ import annotations

import hashlib
import math
import statistics

G0 = 1e-4


def step_seed(run: str, step: int, peer_id: str) -> int:
    digest = hashlib.blake2b(run.encode() + b"\x00" + step.to_bytes(8, "big") + peer_id.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> 1


def encode_grad(g: float, clip: float) -> int:
    if not math.isfinite(g):
        raise ValueError("projected gradient is not finite")
    g = max(-clip, min(clip, g))
    q = 0 if abs(g) <= G0 else min(127, max(0, round(4 * math.log2(abs(g) / G0))))
    return (0x80 if g < 0 else 0) | q


def decode_grad(b: int) -> float:
    magnitude = G0 * 2.0 ** ((b & 0x7F) / 4)
    return -magnitude if b & 0x80 else magnitude


EXTREME_Q = 13  # quarter-octaves (~9.5x): a peer whose median |g| in a window is this far above the window's: refused
CAP_Q = 8  # quarter-octaves (4x): every |g| of a window is capped at this far above the window's median |g|


def screen_window(batches: dict[str, bytes]) -> tuple[set[str], int]:
    """What a window's bytes may move (needs 3 peers; with fewer, nothing is screened): the peers whose median |g|
    exceeds the lower median of every peer's median by EXTREME_Q quarter-octaves (refused for the window), and the
    cap on any one |g| code: the lower median of the other peers' codes + CAP_Q. Integer arithmetic on the window's
    signed bytes only, so live peers and a replaying joiner refuse and cap the same bytes, bit-exactly."""
    if len(batches) < 3 or not all(batches.values()):
        return set(), 0x7F
    medians = {a: statistics.median_low(x & 0x7F for x in b) for a, b in batches.items()}
    typical = statistics.median_low(medians.values())
    out = {a for a, m in medians.items() if m > typical + EXTREME_Q}
    pooled = statistics.median_low(x & 0x7F for a, b in batches.items() if a not in out for x in b)
    return out, min(0x7F, pooled + CAP_Q)


def capped(b: int, cap: int) -> int:
    """A byte with its magnitude code capped (its sign kept)."""
    return (b & 0x80) | min(b & 0x7F, cap)
