"""The node's data directory: identity key, an exclusive lock, and the runtime file that local commands read.

Layout::

    <data dir>/identity.key   Ed25519 key (mode 0600)
    <data dir>/swarmd.lock    held with flock(LOCK_EX) while a node runs; holds its pid
    <data dir>/node.json      written when the node is up: pid, peer id, addresses, status URL; removed at exit
    <data dir>/p2p-sockets.json  the unix sockets its p2p daemon and client listen on (in /tmp, named by hivemind),
                              while it runs: a node killed before it could close leaves them, and its next start
                              removes them
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import stat
from pathlib import Path

import platformdirs

from swarmd.transport.multiaddrs import validate_peer_addr
from swarmd.transport.files import write_durably

IDENTITY_FILE = "identity.key"
LOCK_FILE = "swarmd.lock"
RUNTIME_FILE = "node.json"
TOKEN_FILE = "http.token"  # the local HTTP endpoint's write secret (mode 0600): only who can read the data dir writes
RELAYS_FILE = "relays.json"  # relays found through the DHT, reserved on at the next start
MAX_RELAYS = 8
SOCKETS_FILE = "p2p-sockets.json"
# the only paths a sockets file may name for removal: hivemind's P2P makes these (hivemind/p2p/p2p_daemon.py)
_P2P_SOCKET = re.compile(r"/tmp/hivemind-(?:p2pd|p2pclient)-[A-Za-z0-9_-]{1,64}\.sock")


class DataDirError(Exception):
    """A one-line, user-facing problem with the data directory."""


def resolve(data_dir: str | os.PathLike | None) -> Path:
    if data_dir:
        return Path(data_dir).expanduser().resolve()
    return Path(platformdirs.user_data_dir("swarmd", appauthor=False))


def ensure(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise DataDirError(f"cannot create data dir {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise DataDirError(f"data dir {path} is not writable")
    return path


class DataDirLock:
    """An exclusive advisory lock on the data dir, so two nodes never share one identity."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        lock_path = self.path / LOCK_FILE
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                other = os.read(fd, 32).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise DataDirError(
                f"data dir {self.path} is in use by another swarmd (pid {other}); "
                "give each node its own --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None


def _write_json(path: Path, name: str, obj) -> None:
    write_durably(path / name, json.dumps(obj, indent=2).encode())


def http_token(path: Path) -> str:
    """The node's HTTP write token, created (32 random bytes, hex, mode 0600) on first use."""
    file = path / TOKEN_FILE
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = file.read_text().strip()
        if len(token) == 64:
            return token
        file.unlink()  # damaged: make a new one
        return http_token(path)
    token = os.urandom(32).hex()
    with os.fdopen(fd, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())
    return token


def read_http_token(path: Path) -> str | None:
    try:
        return (path / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def write_runtime(path: Path, info: dict) -> None:
    _write_json(path, RUNTIME_FILE, info)


def write_relays(path: Path, relays: list[str]) -> None:
    _write_json(path, RELAYS_FILE, relays[:MAX_RELAYS])


def read_relays(path: Path) -> list[str]:
    """Remembered relays (full multiaddrs with /p2p/); a missing or damaged file is no relays."""
    try:
        with open(path / RELAYS_FILE) as f:
            relays = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return []
    out = []
    for r in relays if isinstance(relays, list) else []:
        try:
            out.append(validate_peer_addr(r))
        except (ValueError, TypeError):
            continue
    return out[:MAX_RELAYS]


def read_runtime(path: Path) -> dict | None:
    try:
        with open(path / RUNTIME_FILE) as f:
            info = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    pid = info.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        return None  # left behind by a node that was killed
    return info


def remove_runtime(path: Path) -> None:
    try:
        (path / RUNTIME_FILE).unlink()
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_sockets(path: Path, sockets: list[str]) -> None:
    _write_json(path, SOCKETS_FILE, sockets)


def remove_stale_sockets(path: Path) -> list[str]:
    """Remove the unix sockets that this data dir's last run left in /tmp (it was killed before it could close),
    or that a close left, and return them; the list is forgotten. Called at start with the data dir's lock held,
    and after the transport's close. A path is removed only if it is one that hivemind names, is a socket of
    ours, and nothing accepts a connection on it."""
    try:
        with open(path / SOCKETS_FILE) as f:
            listed = json.load(f)
    except FileNotFoundError:
        return []
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        listed = []
    removed = []
    for name in listed[:8] if isinstance(listed, list) else []:
        if not isinstance(name, str) or not _P2P_SOCKET.fullmatch(name):
            continue
        try:
            st = os.lstat(name)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid() or _listening(name):
            continue
        try:
            os.unlink(name)
        except OSError:
            continue
        removed.append(name)
    (path / SOCKETS_FILE).unlink(missing_ok=True)
    return removed


def _listening(name: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(name)
        except OSError:
            return False
        return True
