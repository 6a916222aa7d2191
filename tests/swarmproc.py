"""Real `swarmd start` processes on loopback, for multi-node tests and benchmarks.

Nodes use ``configs/local.toml`` (127.0.0.1, OS-picked ports, fast discovery) and their own data dirs. Readiness is
a state we wait for (the runtime file the node writes once it serves HTTP), never a sleep. Every process we start is
ended by its PID when the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
LOCAL_CONFIG = REPO / "configs" / "local.toml"

# the node part of the configs that training-loop tests and benches write: loopback, OS-picked ports
LOOPBACK_NODE = """
[network]
listen = ["/ip4/127.0.0.1/tcp/0"]
reachability = "public"
[discovery]
poll_interval = 3.0
backoff_initial = 0.5
[state]
sync_interval = 1.0
admission_bits = 12
[http]
listen = "127.0.0.1:0"
"""


def loop_config(path: Path, loop_table: str, node: str = LOOPBACK_NODE) -> Path:
    """Write a loopback node config (``node``: its node tables) with ``loop_table`` (e.g. a [loops.spsa] table)
    appended; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node + loop_table)
    return path


async def wait_until(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> None:
    """``wait_for`` for a test on an event loop (the node or service it waits on runs in the same process): polls
    ``cond`` every ``interval`` s without blocking the loop; AssertionError naming ``what`` on timeout."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float | None = None):
    """Poll ``predicate`` until it returns something truthy; raise AssertionError naming ``what`` on timeout.

    By default it polls every 50 ms at first, then less often, down to every 0.25 s: a long wait (a run of hundreds
    of steps) costs the nodes it asks ~4 status requests a second, not 20 (measured: ~3 ms of a node's CPU each,
    plus the test's own, on 2 cores shared with the nodes). A test that measures how soon a state comes passes
    ``interval`` and is polled at that fixed period."""
    deadline = time.monotonic() + timeout
    last_exc = None
    period = interval or 0.05
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # the state may not be readable yet
            last_exc = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                                 + (f" ({last_exc!r})" if last_exc else ""))
        time.sleep(period)
        if interval is None:
            period = min(period * 1.5, 0.25)


_PORTS = random.Random()  # its own generator: a test that seeds the module's must not make two workers agree


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (the ports bind(0) and connect() hand out)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now, below the kernel's ephemeral range: a port that bind(0)
    hands out here is free only until the next process's bind(0) or connect() takes it, and a node told to listen
    there fails to start ("already in use", as in a fresh-clone run while other nodes bind their own)."""
    high = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(max(1024, high - 12000), high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def http_get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = resp.read()
        if resp.headers.get_content_type() == "application/json":
            return json.loads(body)
        return body.decode()


TOKENS: dict[str, str] = {}  # a started node's endpoint -> its HTTP write token (read from its data dir)


def http_post(url: str, data: bytes = b"", timeout: float = 30.0, json_body=None, token: str | None = None):
    """POST raw bytes (or ``json_body`` as JSON) with the node's write token (``token``, or the one of the node
    started at that URL), return the decoded JSON reply."""
    headers = {}
    if json_body is not None:
        data, headers = json.dumps(json_body).encode(), {"Content-Type": "application/json"}
    token = token or next((t for base, t in TOKENS.items() if url.startswith(base + "/")), None)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class NodeProc:
    def __init__(self, data_dir: Path, args: list[str], env: dict | None = None, *, prefix: list[str] = (),
                 via: Callable | None = None, entry: list[str] = ("-m", "swarmd")):
        """``prefix`` runs the node under another command (e.g. ``ip netns exec <ns>``); ``via(fn, *args)`` runs
        the HTTP reads where the node's loopback endpoint is reachable (e.g. a thread in that namespace);
        ``entry`` is what python runs (a test's own script that alters a node before starting it: a test seam)."""
        self.data_dir = data_dir
        self.args = args
        self.via = via or (lambda fn, *a: fn(*a))
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *entry, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # several nodes share this machine: one compute thread each unless a test says otherwise (the loops'
            # default, threads = 0, reads OMP_NUM_THREADS; see protocols.task.auto_threads)
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
            cwd=REPO,
        )
        self.info: dict | None = None
        self.token: str | None = None  # its HTTP write token, once it is ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> dict:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited with {self.proc.returncode}:\n{self.log()}")
            path = self.data_dir / "node.json"
            if not path.exists():
                return None
            info = json.loads(path.read_text())
            return info if info.get("pid") == self.pid else None

        self.info = wait_for(ready, timeout, f"node in {self.data_dir} to start")
        self.token = (self.data_dir / "http.token").read_text().strip()
        TOKENS[self.info["http"]] = self.token
        return self.info

    def post(self, path: str, data: bytes = b"", timeout: float = 30.0):
        """POST to this node's endpoint with its token (where its endpoint is reachable: nodes in network
        namespaces may share one loopback URL)."""
        return self.via(http_post, self.url + path, data, timeout, None, self.token)

    @property
    def peer_id(self) -> str:
        return self.info["peer_id"]

    @property
    def url(self) -> str:
        return self.info["http"]

    @property
    def tcp_addr(self) -> str:
        return next(a for a in self.info["addresses"] if "/tcp/" in a)

    def status(self) -> dict:
        return self.via(http_get, self.url + "/status")

    def get(self, path: str):
        return self.via(http_get, self.url + path)

    def member_ids(self) -> set[str]:
        return {p["peer_id"] for p in self.status()["peers"] if p["member"]}

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    @contextlib.contextmanager
    def paused(self):
        """The process stopped (SIGSTOP) for the block, resumed after: a peer that is away, injected from outside."""
        self.signal(signal.SIGSTOP)
        try:
            yield self
        finally:
            self.signal(signal.SIGCONT)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGUSR1)  # the node writes every thread's stack to its log: why it hung
                try:
                    self.proc.wait(1)
                except subprocess.TimeoutExpired:
                    pass
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


class Swarm:
    """Starts nodes under ``root``; ``close()`` ends every process it started."""

    def __init__(self, root: Path, config: Path = LOCAL_CONFIG):
        self.root = root
        self.config = config
        self.nodes: list[NodeProc] = []

    def start(self, name: str, *extra: str, bootstrap: list[str] = (), wait: bool = True, env=None,
              config: Path | None = None, prefix: list[str] = (), via: Callable | None = None,
              entry: list[str] = ("-m", "swarmd")) -> NodeProc:
        data_dir = self.root / name
        args = ["start", "--config", str(config or self.config), "--data-dir", str(data_dir)]
        for addr in bootstrap:
            args += ["--bootstrap", addr]
        node = NodeProc(data_dir, args + list(extra), env, prefix=prefix, via=via, entry=entry)
        self.nodes.append(node)
        if wait:
            node.wait_ready()
        return node

    def start_chain(self, n: int, prefix: str = "n", members_within: float | None = 30.0,
                    more: Sequence[dict] = ()) -> list[NodeProc]:
        """n nodes at once, each bootstrapped from the first (they find each other through the DHT;
        tests/test_swarm.py tests a true chain); by default also wait until every node lists every other as a member.
        ``more``: nodes of their own kind started in the same breath, also bootstrapped from the first (each a dict
        of ``start``'s keywords with its ``name``: another config, entry point or arguments); they come after the n
        in the list returned and are not waited for as members.

        The first node's address is known before it starts (its identity made here, a free loopback port picked
        here), so all n processes import and start together: the others no longer wait ~3.5 s for the first to be
        up (on 2 cores, 3 DiLoCo nodes were up in 9.3 s one after the others, ~6 s together). One that dials the
        first before it listens retries, as any node does with a bootstrap peer not up yet."""
        first = self._prepared_first(f"{prefix}0")
        if first is None:  # a config whose TCP listen address is not loopback's port 0: the first one, then the rest
            nodes = [self.start(f"{prefix}0")]
            bootstrap = nodes[0].tcp_addr
        else:
            listen, bootstrap = first
            nodes = [self.start(f"{prefix}0", *listen, wait=False)]
        nodes += [self.start(f"{prefix}{i}", bootstrap=[bootstrap], wait=False) for i in range(1, n)]
        extra = [self.start(**{"bootstrap": [bootstrap], **spec}, wait=False) for spec in more]
        for node in nodes + extra:
            # n processes import and start at once: on 2 cores 15 of them took over 30 s (the soak's 16 nodes)
            if node.info is None:
                node.wait_ready(max(30.0, 4.0 * (n + len(extra))))
        if members_within is not None:
            ids = {x.peer_id for x in nodes}
            wait_for(lambda: all(x.member_ids() >= ids - {x.peer_id} for x in nodes), members_within,
                     f"{n} nodes to list each other as members", interval=0.2)
        return nodes + extra

    def _prepared_first(self, name: str) -> tuple[list[str], str] | None:
        """For the node ``name``: its identity written into its data dir and the ``--listen`` arguments that put
        its TCP address on a free loopback port, with that address; None where the config does not listen on
        ``/ip4/127.0.0.1/tcp/0``."""
        from swarmd.transport.identity import Identity

        listen = tomllib.loads(self.config.read_text()).get("network", {}).get("listen", [])
        if "/ip4/127.0.0.1/tcp/0" not in listen:
            return None
        tcp = f"/ip4/127.0.0.1/tcp/{free_port()}"
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        identity, _ = Identity.load_or_create(data_dir / "identity.key")  # a data dir used before keeps its own
        args = []
        for addr in listen:
            args += ["--listen", tcp if addr == "/ip4/127.0.0.1/tcp/0" else addr]
        return args, f"{tcp}/p2p/{identity.peer_id}"

    def close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.signal(signal.SIGTERM)
        for node in self.nodes:
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)
            node._log.close()
        from swarmd.node import datadir

        for node in self.nodes:  # what a node killed with SIGKILL (and not started again) left in /tmp
            datadir.remove_stale_sockets(node.data_dir)


def run_cli(*args: str, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    # A generous limit: the `beside` tests (tests/conftest.py) run their CLI calls at nice 19, where a run that takes
    # 0.7 s of CPU alone may wait tens of seconds while the real-time tests fill both cores.
    return subprocess.run(
        [sys.executable, "-m", "swarmd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


__all__ = ["NodeProc", "Swarm", "http_get", "http_post", "run_cli", "wait_for"]
