"""How the C library's allocator treats a node's large blocks (glibc's ``mallopt``; elsewhere nothing is done).

A training round allocates and frees the same large buffers every time: an update's flat copy and its encoded
parts, the pulled chunks, their decoded values, the reductions, the combined update. How glibc serves them decides
between two costs:

- ``reuse`` (the default): blocks up to 32 MiB (glibc's ceiling for this threshold) come from one heap, and a
  freed block stays there for the next round (the heap gives memory back only when 1 GiB or more is free at its
  top: with 64 MiB, the chunks a 109M-parameter round decodes, 27 MB each and 8 at once, are given back and
  faulted in again, and rounds take 1.5x as long for the same peak). A round then finds its buffers already
  mapped: no page faults, no unmapping. On a 2-core machine this cuts a node's page faults from 66,000 to 1,700 a
  round (8 peers, 25 MB updates) and its CPU time by 20-28%; DiLoCo end to end (4 peers, 109M parameters, e3m0)
  takes 2.6 s from every update in to the combined one against 3.8-4.0 with ``release``, for a peak RSS of 4.6-4.7
  GB against 4.4-4.5 (``docs/loops/diloco.md``, Settings: ``node.memory``).
- ``release``: every block of 1 MiB or more gets its own mapping, given back to the system when freed, and the
  smaller blocks come from at most 2 heaps. The least resident memory, at the cost of faulting every page of
  every large buffer in again each round (and unmapping it, which stops the process's other threads' CPUs).

Either way the threshold is fixed: by default glibc raises it to the size of each large block freed, up to
32 MiB, and each thread that allocates gets its own heap (up to 8 a core) that keeps what it freed; a node's
resident size then grows round after round (46M parameters end to end: 3.8-4.0 GB, against 2.8 GB released)."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
MODES = {
    "reuse": {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_ARENA_MAX: 1},
    "release": {M_MMAP_THRESHOLD: 1 << 20, M_ARENA_MAX: 2},
}
_NAMES = {M_TRIM_THRESHOLD: "trim_threshold", M_MMAP_THRESHOLD: "mmap_threshold", M_ARENA_MAX: "arenas"}

_applied: dict = {"mode": None, "library": None}


def configure(mode: str) -> dict:
    """Set the allocator for ``mode`` (``reuse`` or ``release``) in this process; returns what was applied (also
    what ``applied()`` returns from then on): the mode, the C library, and each setting, or ``library: None``
    where the C library is not glibc (musl and macOS have no such settings; nothing is done)."""
    if mode not in MODES:
        raise ValueError(f"unknown allocator mode {mode!r}")
    global _applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version  # glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _applied = {"mode": mode, "library": None}
        return applied()
    version.restype = ctypes.c_char_p
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = {_NAMES[option]: value for option, value in MODES[mode].items() if mallopt(option, value) == 1}
    _applied = {"mode": mode, "library": f"glibc {version().decode()}", **settings}
    return applied()


def applied() -> dict:
    """What ``configure`` set in this process (``mode: None`` before it ran)."""
    return dict(_applied)
