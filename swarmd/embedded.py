"""A swarmd node inside a Python process: the same node ``swarmd start`` runs, on a thread of its own.

A training script keeps its own thread; the node (transport daemon, DHT, replicated state, gossip, the HTTP
endpoint, and the training loops attached to it) runs on an event loop in a background thread, as hivemind's DHT
and torchft's manager do for a synchronous trainer. The two meet only where a loop hands steps to the script
(protocols/steps.py) and where the script reads a status.

Error handling: a bad setting raises ``ValueError`` at construction, naming the setting; a node that cannot start
(its data dir in use, the daemon failing) raises :class:`NodeError` from :meth:`Node.start`; a node whose thread
ended on an error says so in :attr:`Node.error` and every later call raises it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmd.node import allocator, datadir
from swarmd.node.config import ConfigError, load_config
from swarmd.protocols.bulk import BulkService
from swarmd.protocols.gossip import Gossip

logger = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # seconds for the transport daemon, the DHT and the HTTP endpoint to come up
CLOSE_TIMEOUT = 90.0  # every step of a node's close is bounded (node/core.py); this bounds their sum


class NodeError(RuntimeError):
    """The embedded node could not start, or ended on an error."""


class Node:
    """A swarmd node running in this process.

    Args:
        bootstrap: multiaddrs of swarm members to join through (none: start a new swarm).
        data_dir: the node's data dir (identity, replicated state, checkpoints); default: the platform's user data
            dir, as ``swarmd start``.
        listen: multiaddrs to listen on (default: the config's).
        http: the status endpoint's ``host:port`` (port 0 picks one).
        swarm: the swarm's name.
        config: a TOML config file, read as ``swarmd start --config`` reads it.
        settings: dotted ``key=value`` settings, as ``swarmd start --set`` takes them.

    The node starts with :meth:`start` (or on entering a ``with`` block, or when a training run is entered on it)
    and stops with :meth:`close`. Training runs attach to it: ``swarmd.DiLoCo(node, ...)``.
    """

    def __init__(self, *, bootstrap: Sequence[str] = (), data_dir: str | Path | None = None,
                 listen: Sequence[str] | None = None, http: str | None = None, swarm: str | None = None,
                 config: str | Path | None = None, settings: Sequence[str] = ()):
        if isinstance(bootstrap, str) or isinstance(listen, str) or isinstance(settings, str):
            raise TypeError("swarmd.Node: bootstrap, listen and settings are lists of strings, not one string")
        overrides: dict[str, dict[str, Any]] = {}
        for (section, key), value in {("network", "bootstrap"): list(bootstrap) or None,
                                      ("network", "listen"): None if listen is None else list(listen),
                                      ("node", "data_dir"): None if data_dir is None else str(data_dir),
                                      ("node", "swarm"): swarm, ("http", "listen"): http}.items():
            if value is not None:
                overrides.setdefault(section, {})[key] = value
        try:
            self.config = load_config(config, overrides, list(settings))
        except ConfigError as e:
            raise ValueError(f"swarmd.Node: {e}") from None
        self.data_dir = datadir.resolve(self.config.node.data_dir)
        self.gossip = Gossip()
        tcp_hosts = [a.split("/")[2] for a in self.config.network.listen if a.startswith("/ip4/") and "/tcp/" in a]
        self.bulk = BulkService(self.gossip, host=tcp_hosts[0] if tcp_hosts else "0.0.0.0",
                                port=self.config.network.bulk_port)
        self._pending: list = []  # training loops attached before the node started
        self._core = None  # node.core.Node, once started
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._lock: datadir.DataDirLock | None = None
        self.error: BaseException | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._ready.is_set() and not self._ended.is_set()

    def start(self, timeout: float = START_TIMEOUT) -> Node:
        """Start the node and wait until it listens (its addresses and status URL known). Idempotent."""
        if self._thread is not None:
            self._raise_if_failed()
            return self
        from swarmd.node.core import Node as CoreNode
        from swarmd.transport._compat import load_hivemind
        from swarmd.transport.identity import Identity

        load_hivemind().use_hivemind_log_handler("nowhere")  # hivemind's records go through the script's logging
        allocator.configure(self.config.node.memory)
        datadir.ensure(self.data_dir)
        self._lock = datadir.DataDirLock(self.data_dir)
        try:
            self._lock.acquire()
        except datadir.DataDirError as e:
            raise NodeError(str(e)) from None
        identity, created = Identity.load_or_create(self.data_dir / datadir.IDENTITY_FILE)
        if created:
            logger.info("created identity %s in %s", identity.peer_id, self.data_dir)
        self._core = CoreNode(self.config, identity, self.data_dir,
                              services=[self.gossip, self.bulk, *self._pending])
        self._pending = []
        self._thread = threading.Thread(target=self._thread_main, name="swarmd-node", daemon=True)
        self._thread.start()
        # a script that ends (or fails) without close(): the node still closes as under SIGTERM, its daemon and
        # checkpoints with it. threading's exit hooks run before the worker threads' executors shut down (the
        # close still hands work to them), atexit's after
        threading._register_atexit(self._close_at_exit)
        if not self._ready.wait(timeout) and not self._ended.is_set():
            self.close()
            raise NodeError(f"the node did not start within {timeout:.0f} s")
        self._raise_if_failed()
        return self

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop the node and its training loops (each closes as under ``swarmd start``'s SIGTERM). Idempotent."""
        if self._thread is None:
            return
        self._closed = True
        loop, main = self._loop, self._main
        if loop is not None and main is not None and not self._ended.is_set():
            loop.call_soon_threadsafe(main.cancel)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the swarmd node's thread did not end within %.0f s; leaving it (a daemon thread)",
                           timeout)

    def _close_at_exit(self) -> None:
        if not self._closed:
            self.close()

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _thread_main(self) -> None:
        import uvloop

        from swarmd.node.core import end_tasks

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._main = asyncio.current_task()
            try:
                await self._core.run(lambda _: self._ready.set())
            except asyncio.CancelledError:
                pass
            finally:
                others = asyncio.all_tasks() - {asyncio.current_task()}
                await end_tasks({t: t.get_name() for t in others})

        try:
            uvloop.run(main())
        except BaseException as e:  # the node's own failure: kept for the script's next call
            self.error = e
            logger.error("the swarmd node stopped: %s: %s", type(e).__name__, e)
        finally:
            self._ended.set()
            if self._lock is not None:
                self._lock.release()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise NodeError(f"the swarmd node failed: {type(self.error).__name__}: {self.error}") from self.error
        if self._ended.is_set():
            raise NodeError("the swarmd node has stopped")

    # ------------------------------------------------------------------ attaching loops, reading state
    def attach(self, loop) -> None:
        """Run a training loop on this node: started with it, or at once where the node already runs."""
        if self._thread is None:
            self._pending.append(loop)
            return
        self.call(self._core.add_service(loop))

    def call(self, awaitable, timeout: float = 60.0):
        """Run a coroutine on the node's event loop and return its result (for the API's own use)."""
        self._raise_if_failed()
        if self._loop is None:
            raise NodeError("the node is not running")
        return asyncio.run_coroutine_threadsafe(awaitable, self._loop).result(timeout)

    def status(self) -> dict:
        """What ``GET /status`` answers: the node, its peers, the replicated state's summary, every loop's view."""

        async def read() -> dict:
            return self._core.status()

        return self.call(read())

    @property
    def peer_id(self) -> str:
        self._require_started()
        return self._core.identity.peer_id

    @property
    def addresses(self) -> list[str]:
        """The multiaddrs others join through (``/p2p/<peer id>`` included)."""
        self._require_started()
        return list(self._core.addresses)

    @property
    def status_url(self) -> str:
        """The HTTP endpoint: ``<url>/status``, ``/dashboard``, ``/metrics``."""
        self._require_started()
        return self._core.http.url

    def _require_started(self) -> None:
        if self._core is None or not self._ready.is_set():
            raise NodeError("the node has not started: call start() first")
