"""One simulated node, and the simulator's settings (:class:`SimConfig`: peers, graph degree, links).

Each :class:`SimNode` is what a node runs above its transport (the same :class:`~protocols.gossip.Gossip`, the same
:class:`~node.replication.Replicator`, each with its own seeded random generator and the loop's virtual clock) on a
:class:`~transport.memory.MemoryTransport`. The op log is kept in memory. Everything else is production code.
``node/sim.py`` (a swarm of them) and ``node/sim_loops.py`` (a training loop's swarm) build on it.

This module is a composition root (like ``node/cli.py``): it may plug ``protocols/`` into the node's parts.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swarmd.crdt.admission import Admission
from swarmd.node.oplog import MemoryOpLog
from swarmd.node.replication import Replicator
from swarmd.node.services import NodeContext
from swarmd.protocols.gossip import Gossip
from swarmd.transport.clock import Clock
from swarmd.transport.identity import Identity
from swarmd.transport.memory import MemoryNetwork, MemoryTransport
from swarmd.transport.ping import serve_ping

TOPIC = "sim/flood"
SIM_DIR = Path("/nonexistent/swarmd-sim")  # a simulated node writes nothing to disk


@dataclass
class SimConfig:
    peers: int = 100
    degree: int = 8  # connections each node opens (the graph is their union, so the mean degree is about 2x)
    latency: float = 0.025  # one way, per host (a pair's is the mean of its two): 50 ms round trips
    bandwidth: float | None = 12.5e6  # bytes/s up and down per host (100 Mbit/s); None: unlimited
    loss: float = 0.0
    seed: int = 1
    sync_interval: float = 5.0  # CRDT anti-entropy, as the default config
    crdt: bool = True  # False: gossip only (every replica holds every op, so 10,000 replicas do not fit one process)


class SimNode:
    """One simulated node: gossip and CRDT replication over an in-memory transport, and optionally a DiLoCo loop
    (``loop``: its config and task; the node's data dir then holds its checkpoints, so a restarted node resumes).
    ``listed_late`` (peer -> seconds) delays when the node lists a neighbour among its direct connections, counted
    from each start: a real node's connection list lags its links (the daemon's listing is read every 2 s)."""

    def __init__(self, net: MemoryNetwork, identity: Identity, admission: Admission, cfg: SimConfig, clock: Clock,
                 *, neighbours: set[str] | None = None, log: MemoryOpLog | None = None, data_dir: Path = SIM_DIR,
                 loop: Callable | None = None, life: int = 0, listed_late: dict[str, float] | None = None):
        self.identity = identity
        self.peer_id = identity.peer_id
        self.transport: MemoryTransport = net.add(identity)
        self.neighbours: set[str] = set(neighbours or ())
        self.log = log or MemoryOpLog()
        rng = random.Random(f"{cfg.seed}/{self.peer_id}/{life}")
        self.gossip = Gossip(clock=clock, rng=random.Random(rng.random()))
        self.replicator = Replicator(identity, self.transport, data_dir, peers=self.members, admission=admission,
                                     sync_interval=cfg.sync_interval, clock=clock, rng=random.Random(rng.random()),
                                     log=self.log) if cfg.crdt or loop is not None else None
        self.ctx = NodeContext(identity=identity, transport=self.transport, data_dir=data_dir, members=self.members,
                               replicator=self.replicator, direct=self.direct, clock=clock)
        self.clock = clock
        self.data_dir = data_dir
        self.services: list = []
        self.loop = None
        if loop is not None:  # makes the loop from the node's gossip and bulk services
            from swarmd.protocols.bulk import BulkService

            bulk = BulkService(self.gossip, tcp=False)  # blobs move over the in-memory streams
            self.loop = loop(self.gossip, bulk)
            self.services = [bulk, self.loop]
        self.life = life
        self.admission = admission
        self.received: dict[bytes, float] = {}  # flood message id -> virtual time it was delivered here
        self.listed_late = dict(listed_late or {})
        self.started_at = clock.monotonic()
        self._tasks: list[asyncio.Task] = []
        self.up = False

    def direct(self, peer: str) -> bool:
        lag = self.listed_late.get(peer)
        return (peer in self.neighbours and self.transport.net.direct(self.peer_id, peer)
                and (lag is None or self.clock.monotonic() - self.started_at > lag))

    def members(self) -> list[str]:
        return [p for p in sorted(self.neighbours) if self.transport.net.reachable(self.peer_id, p)]

    async def start(self) -> None:
        self.started_at = self.clock.monotonic()
        await self.transport.start()
        await serve_ping(self.transport)
        if self.replicator is not None:
            await self.replicator.start()
        await self.gossip.start(self.ctx)
        sub = self.gossip.subscribe(TOPIC, max_size=1024, queue_size=4096)
        loop = asyncio.get_running_loop()

        async def consume() -> None:
            async for message in sub:
                self.received.setdefault(message.id, loop.time())

        self._tasks = [loop.create_task(self.gossip.run()), loop.create_task(consume())]
        if self.replicator is not None:
            self._tasks.append(loop.create_task(self.replicator.run()))
        for svc in self.services:
            await svc.start(self.ctx)
            self._tasks.append(loop.create_task(svc.run()))
        self.up = True

    async def stop(self) -> None:
        """Stop at once, as ``kill -9`` does: tasks cancelled, streams cut; what the op log and the data dir hold
        stays."""
        self.up = False
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.gossip.close()
        for svc in self.services:
            await svc.close()
        await self.transport.close()


async def until(cond, timeout: float, what: str, step: float) -> float:
    """Virtual seconds until ``cond()`` holds (checked every ``step``); raises TimeoutError after ``timeout``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not cond():
        if loop.time() - start > timeout:
            raise TimeoutError(f"simulation: {what} not reached within {timeout} s of simulated time")
        await asyncio.sleep(step)
    return loop.time() - start


def _seed(seed: int, i: int) -> bytes:
    return hashlib.blake2b(f"swarmd-sim/{seed}/{i}".encode(), digest_size=32).digest()
