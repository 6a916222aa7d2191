"""Penalties for misbehaving peers and rate-limited logging of what they did.

Everything that arrives from the network may be malformed, oversized, forged or replayed. Each such event:

- is logged, at most once per ``interval`` per (peer, kind), with a count of what was suppressed;
- adds ``weight`` to the peer's score, which decays exponentially (half-life ``half_life`` seconds);
- bans the peer for ``ban_seconds`` once its score reaches ``ban_threshold``: its streams are refused and we stop
  dialing it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

Clock = Callable[[], float]

# how much each kind of offence costs; unknown kinds cost DEFAULT_WEIGHT
WEIGHTS = {
    "malformed": 10.0,
    "oversized": 20.0,
    "bad_signature": 50.0,
    "forged": 50.0,
    "protocol_violation": 10.0,
    "stale": 2.0,
    # a statistical judgement that an honest peer can also get (a training update no closer to the others than
    # noise, as an honest one near convergence can be): counted and shown, but about 50 in a row before a ban
    "suspect": 2.0,
    "rate_limited": 5.0,
}
DEFAULT_WEIGHT = 10.0


class TokenBuckets:
    """A token bucket per key (a peer, or (kind, peer)): ``allow(key)`` takes a token if one is left, refilling at
    ``rate`` per second up to ``burst``. Bounded: at most ``max_keys`` buckets; when full, buckets that have refilled
    (idle long enough to be full again) are dropped, and a new key that still finds no room is refused."""

    def __init__(self, rate: float, burst: float, *, max_keys: int = 4096, clock: Clock = time.monotonic):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._clock = clock
        self._buckets: dict = {}  # key -> (tokens, updated)

    def allow(self, key) -> bool:
        now = self._clock()
        tokens, updated = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - updated) * self.rate)
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            self.prune()
            if len(self._buckets) >= self.max_keys:
                return False
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        return True

    def prune(self) -> None:
        """Drop the buckets that have refilled: they hold nothing a new bucket would not."""
        now = self._clock()
        self._buckets = {k: (t, u) for k, (t, u) in self._buckets.items()
                         if t + (now - u) * self.rate < self.burst}

    def __len__(self) -> int:
        return len(self._buckets)


class RateLimitedLog:
    """Log a line at most once per ``interval`` seconds per key, then say how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock: Clock = time.monotonic,
                 max_keys: int = 4096):
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[object, float] = {}
        self._suppressed: Counter = Counter()

    def log(self, level: int, key: object, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Returns True if the line was emitted."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] += 1
            return False
        if len(self._last) >= self._max_keys:  # bound memory under a flood of distinct keys
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg = msg + f" ({suppressed} similar suppressed)"
        self._logger.log(level, msg, *args, exc_info=exc_info)
        return True


@dataclass
class _PeerRecord:
    score: float = 0.0
    updated: float = 0.0
    banned_until: float = 0.0
    offences: Counter = field(default_factory=Counter)


class PeerPenalties:
    def __init__(
        self,
        *,
        ban_threshold: float = 100.0,
        ban_seconds: float = 300.0,
        half_life: float = 60.0,
        clock: Clock = time.monotonic,
        logger: logging.Logger | None = None,
        max_peers: int = 10_000,
    ):
        self.ban_threshold = ban_threshold
        self.ban_seconds = ban_seconds
        self._decay = math.log(2) / half_life
        self._clock = clock
        self._peers: dict[str, _PeerRecord] = {}
        self._max_peers = max_peers
        self.totals: Counter = Counter()  # offences by kind, all peers
        self._log = RateLimitedLog(logger or logging.getLogger("swarmd.penalties"), clock=clock)

    def _current(self, rec: _PeerRecord, now: float) -> float:
        return rec.score * math.exp(-self._decay * max(0.0, now - rec.updated))

    def penalize(self, peer_id: str, kind: str, detail: str = "") -> float:
        """Record an offence; returns the peer's new score."""
        now = self._clock()
        rec = self._peers.get(peer_id)
        if rec is None:
            if len(self._peers) >= self._max_peers:
                self._evict(now)
            rec = self._peers[peer_id] = _PeerRecord(updated=now)
        rec.score = self._current(rec, now) + WEIGHTS.get(kind, DEFAULT_WEIGHT)
        rec.updated = now
        rec.offences[kind] += 1
        self.totals[kind] += 1
        banned_now = rec.score >= self.ban_threshold and rec.banned_until <= now
        if banned_now:
            rec.banned_until = now + self.ban_seconds
        self._log.log(
            logging.WARNING,
            (peer_id, kind),
            "peer %s: %s%s (score %.0f%s)",
            peer_id,
            kind,
            f": {detail}" if detail else "",
            rec.score,
            f", banned for {self.ban_seconds:.0f} s" if banned_now else "",
        )
        return rec.score

    def score(self, peer_id: str) -> float:
        rec = self._peers.get(peer_id)
        return 0.0 if rec is None else self._current(rec, self._clock())

    def is_banned(self, peer_id: str) -> bool:
        rec = self._peers.get(peer_id)
        return rec is not None and rec.banned_until > self._clock()

    def offences(self, peer_id: str) -> dict[str, int]:
        rec = self._peers.get(peer_id)
        return dict(rec.offences) if rec else {}

    def banned(self) -> list[str]:
        now = self._clock()
        return [p for p, r in self._peers.items() if r.banned_until > now]

    def _evict(self, now: float) -> None:
        # drop the half of the table with the lowest current score (never a banned peer)
        ranked = sorted(self._peers.items(), key=lambda kv: (kv[1].banned_until > now, self._current(kv[1], now)))
        for peer_id, _ in ranked[: len(ranked) // 2]:
            del self._peers[peer_id]
