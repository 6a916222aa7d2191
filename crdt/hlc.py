"""Hybrid logical clock (Kulkarni et al., 2014): physical milliseconds plus a logical counter.

A timestamp is ``(wall_ms, counter)``; tuples compare lexicographically. ``tick`` stamps a local event, ``observe``
merges a remote timestamp so the next local stamp is after everything seen. Pure: the caller passes the time.
"""

from __future__ import annotations

Timestamp = tuple[int, int]

MAX_COUNTER = 2**31 - 1


class HLC:
    def __init__(self, last: Timestamp = (0, 0)):
        self.last: Timestamp = last

    def tick(self, now_ms: int) -> Timestamp:
        wall, counter = self.last
        if now_ms > wall:
            self.last = (now_ms, 0)
        else:
            self.last = (wall, min(counter + 1, MAX_COUNTER))
        return self.last

    def observe(self, remote: Timestamp) -> None:
        """Make every later ``tick`` come after ``remote`` (call it for each verified incoming op)."""
        if remote > self.last:
            self.last = remote
