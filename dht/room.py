"""The members key's records on this DHT node: bounded, by making room rather than by closing.

Every record under a swarm's members key is one admitted identity, and identities cost a work ticket, not a wall.
hivemind's storage keeps every subkey of a key, and a get returns them all in one reply: about 9,000 records (half a
minute of one core at 12 bits) made every member poll fail. So this node stores at most ``MAX_STORED`` records under
the key (and ``MAX_STORED_BYTES`` of them). To store one more when full it evicts, among the records of peers it
does not know first-hand (``known``: we greeted them, or they us), the one that expires first; a record of a peer it
knows first-hand always gets in (in place of a stranger's while there is one, else over the limit: such peers are
few), and a stranger's record gets in while the table holds a stranger's to evict. A flood of identities thus turns
over the strangers' share; members that greeted the storing nodes keep their place, and a newcomer that greets them
gets one. (Newcomers do not depend on the DHT alone: a hello and its introductions show them to the members they
meet.)
"""

from __future__ import annotations

import heapq
import re
from collections import Counter
from typing import Any, Callable

MAX_STORED = 2048  # records under the members key on one node...
MAX_STORED_BYTES = 2 << 20  # ...and their bytes: a get's reply stays well inside one p2p message (4 MiB)
_OWNER = re.compile(rb"\[owner:ed25519:([1-9A-HJ-NP-Za-km-z]{1,64})\]")


def owner_of(subkey: Any) -> str | None:
    """The peer id a stored subkey (its msgpack bytes, as the DHT protocol stores it) names."""
    m = _OWNER.search(subkey) if isinstance(subkey, bytes) else None
    return m.group(1).decode() if m else None


class BoundedKey:
    """Wraps a hivemind ``DHTLocalStorage``'s ``store_subkey`` so that ``key_id``'s dictionary holds at most
    ``limit`` subkeys, making room as the module says. ``counters``: ``members_key_evicted`` and
    ``members_key_refused`` (a stranger's record while the table holds only known peers' records). Strangers'
    records wait in a heap by expiry (entries gone, refreshed or become known are skipped when they come up), so
    making room costs a few heap operations, not a scan of the table."""

    def __init__(self, storage: Any, key_id: Any, known: Callable[[str], bool], counters: Counter | dict,
                 limit: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.storage, self.key_id, self.known, self.counters, self.limit = storage, key_id, known, counters, limit
        self.max_bytes = max_bytes
        self._heap: list[tuple[float, bytes]] = []  # (expiry, subkey) of the strangers' records, some stale
        self._store_subkey = storage.store_subkey
        storage.store_subkey = self.store_subkey

    def _count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    def _stranger(self, subkey: Any) -> bool:
        owner = owner_of(subkey)
        return owner is None or not self.known(owner)

    def store_subkey(self, key: Any, subkey: Any, value: Any, expiration_time: float) -> bool:
        if key != self.key_id:
            return self._store_subkey(key, subkey, value, expiration_time)
        if not self._room_for(subkey, len(value) if isinstance(value, bytes) else 0):
            self._count("members_key_refused")
            return False
        stored = self._store_subkey(key, subkey, value, expiration_time)
        if stored and self._stranger(subkey):
            heapq.heappush(self._heap, (expiration_time, subkey))
            if len(self._heap) > 4 * self.limit:
                self._rebuild()
        return stored

    def _table(self) -> Any:
        held = self.storage.get(self.key_id)
        table = getattr(held, "value", None)
        return table if isinstance(getattr(table, "data", None), dict) else None

    def _rebuild(self) -> None:
        table = self._table()
        items = table.data.items() if table is not None else ()
        self._heap = [(item.expiration_time, k) for k, item in items if self._stranger(k)]
        heapq.heapify(self._heap)

    def _full(self, table: Any, size: int) -> bool:
        if len(table) >= self.limit:
            return True
        held = sum(len(item.value) for item in table.data.values() if isinstance(item.value, bytes))
        return held + size > self.max_bytes

    def _room_for(self, subkey: Any, size: int) -> bool:
        table = self._table()
        if table is None or subkey in table.data:
            return True  # the first record, or a refresh of one we hold (records are at most 8 KiB)
        while self._full(table, size) and self._evict(table):
            pass
        return not self._full(table, size) or not self._stranger(subkey)  # known peers are few: they get in

    def _evict(self, table: Any) -> bool:
        """Evict the stranger's record that expires first; False if there is none."""
        while self._heap:
            expiry, stored = heapq.heappop(self._heap)
            item = table.data.get(stored)
            if item is None or item.expiration_time != expiry or not self._stranger(stored):
                continue  # gone, refreshed (its later entry is in the heap), or no longer a stranger's
            del table[stored]
            self._count("members_key_evicted")
            return True
        return False
