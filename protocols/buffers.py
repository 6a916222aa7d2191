"""Float32 buffers a round needs every time (the update's flat copy, the combined update, the chunks a reducer
decodes), kept for the next round instead of freed and allocated again.

Allocated afresh, each round of a 25 MB update would take about 125 MB of such buffers. glibc (node/allocator.py,
``reuse``) keeps freed blocks, but an aligned block of the same size rarely fits the hole the last one left, so the
heap would grow for a dozen rounds, every new page faulting in (a node: 10-20 thousand faults a second in the first
rounds of the exchange bench, its resident size rising from 250 to 870 MB for a 25 MB model), and the first rounds
would take up to three times a later one. Taken from here, a buffer is the one the last round gave back: mapped, no
faults.

A buffer is given back only where nothing else can still see it: its Python object referenced by the
caller alone, and its storage by no view (torch's use count). Anything held elsewhere (a checkpoint being written,
a redo's inputs, a numpy view) is left to the collector. The pool holds at most ``max_bytes``; 0 keeps
nothing (node.memory = "release": memory given back at once)."""

from __future__ import annotations

import sys
import threading

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def unviewed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a whole contiguous float32 CPU buffer whose storage no other tensor (a view) shares. False
    wherever that cannot be told (torch without its use count). Who holds ``t`` itself is the caller's to count."""
    if _use_count is None or type(t) is not torch.Tensor or t.dtype != torch.float32 or t.device.type != "cpu" \
            or not t.is_contiguous() or t.storage_offset() != 0 or t.requires_grad or t._base is not None:
        return False
    storage = t.untyped_storage()
    if storage.nbytes() != 4 * t.numel():
        return False
    return _use_count(storage._cdata) == 2  # the tensor's own reference to its storage, and ``storage`` here


class Buffers:
    """Flat float32 buffers by size, for worker threads and the event loop alike (a lock around the lists)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.counters = {"taken": 0, "reused": 0, "given": 0, "refused": 0}

    def take(self, n: int) -> torch.Tensor:
        """A flat float32 tensor of ``n`` values (its contents are whatever it held: as ``torch.empty``)."""
        with self._lock:
            self.counters["taken"] += 1
            free = self._free.get(n)
            if free:
                self.held_bytes -= 4 * n
                self.counters["reused"] += 1
                return free.pop()
        return torch.empty(n, dtype=torch.float32)

    def give(self, t: torch.Tensor) -> bool:
        """Keep ``t`` for a later ``take`` if no one else can reach it (no view of it, no other holder of it; the
        caller's one reference, which it must not use again, aside) and the pool has room; True if kept. Otherwise
        nothing happens: the caller's reference goes as it would have."""
        # the caller's reference, ``t`` here, and getrefcount's own argument: no one else holds the object
        if sys.getrefcount(t) > 3 or not unviewed(t):
            self.counters["refused"] += 1
            return False
        with self._lock:
            nbytes = 4 * t.numel()
            if self.held_bytes + nbytes > self.max_bytes:
                self.counters["refused"] += 1
                return False
            self._free.setdefault(t.numel(), []).append(t)
            self.held_bytes += nbytes
            self.counters["given"] += 1
            return True

    def status(self) -> dict:
        with self._lock:
            return {"held_bytes": self.held_bytes, **self.counters}
