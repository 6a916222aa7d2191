"""Files a crash leaves whole: written beside the target under a temporary name, fsync'd, renamed over it, and the
directory fsync'd (so the rename itself is on disk): after a crash or a power cut the file holds the old bytes or
the new ones, never part of either. The node's key, its runtime files, the op log's compactions, the address book
and the training loops' checkpoints are all written this way."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def write_durably(path: Path, data: bytes | Iterable[bytes], mode: int = 0o644) -> None:
    """Make ``path`` hold ``data`` (bytes, or pieces written in order), atomically and durably. A new file gets
    ``mode`` from its creation on (0o600 for a secret: never readable by others, not even briefly)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink()  # a crash's leftover: O_EXCL below, and the mode is the one asked for
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        for piece in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` (written by someone else, e.g. safetensors, and closed) over ``path``, after an fsync of its
    bytes, then fsync the directory."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """The directory's entries on disk (a rename or a new file in it survives a power cut)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
