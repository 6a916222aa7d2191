"""Simulated swarms: the real gossip and CRDT replication code, many nodes in one process, on virtual time.

Each :class:`SimNode` is what a node runs above its transport (the same :class:`~protocols.gossip.Gossip`, the same
:class:`~node.replication.Replicator`, each with its own seeded random generator and the loop's virtual clock) on a
:class:`~transport.memory.MemoryTransport`. Discovery is a static graph: every node connects to ``degree`` random
others, as a large swarm's nodes hold a bounded set of connections (``discovery.max_peers``). The op log is kept in
memory. Everything else is production code, so what the simulator measures (dissemination latency and bytes, CRDT
convergence after a partition heals) is what those modules do, on links of a chosen latency, bandwidth and loss.

The simulated node is ``node/sim_node.py``; a training loop's swarm (DiLoCo, SPSA, SAPO) is ``node/sim_loops.py``,
and whole DiLoCo runs on it (churn, a far peer, links that change) are ``node/sim_runs.py``. This module holds the
swarm of simulated nodes, its scenarios and the table, and every name of the simulator stays importable from here.

This module is a composition root (like ``node/cli.py``): it may plug ``protocols/`` into the node's parts.
``swarmd sim`` runs it; ``bench/bench_sim.py`` prints the table for 100, 1,000 and 10,000 peers.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import dataclass, field

import msgpack

from swarmd.crdt.admission import Admission
from swarmd.node.sim_loops import ChurnConfig, DilocoSim, LoopSim, SapoSim, SpsaSim  # noqa: F401 (the simulator's API)
from swarmd.node.sim_node import SIM_DIR, TOPIC, SimConfig, SimNode, _seed, until  # noqa: F401 (the simulator's API)
from swarmd.node.sim_runs import (  # noqa: F401 (the simulator's API)
    diloco_churn,
    diloco_far,
    diloco_links_change,
    diloco_run,
    first_uplink_falls,
)
from swarmd.protocols.gossip import PUBSUB_SPEC
from swarmd.transport.clock import current
from swarmd.transport.identity import Identity
from swarmd.transport.memory import LinkSpec, MemoryNetwork, run_virtual

logger = logging.getLogger(__name__)


@dataclass
class SimReport:
    peers: int
    rows: dict = field(default_factory=dict)
    wall_s: float = 0.0


class SimSwarm:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        link = LinkSpec(latency=cfg.latency, up=cfg.bandwidth, down=cfg.bandwidth, loss=cfg.loss)
        self.net = MemoryNetwork(link=link, seed=cfg.seed)
        self.nodes: list[SimNode] = []

    async def start(self) -> None:
        clock = current()
        ids = [Identity.generate(_seed(self.cfg.seed, i)) for i in range(self.cfg.peers)]
        admission = Admission("sim", allow=[i.peer_id for i in ids])  # a closed swarm: no work tickets to mint
        self.nodes = [SimNode(self.net, i, admission, self.cfg, clock) for i in ids]
        by_id = {n.peer_id: n for n in self.nodes}
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            picks = self.rng.sample(range(n - 1), min(self.cfg.degree, n - 1))
            for j in picks:
                other = self.nodes[j if j < i else j + 1]
                node.neighbours.add(other.peer_id)
                other.neighbours.add(node.peer_id)
        for node in self.nodes:
            await node.start()
        for node in self.nodes:  # the connections discovery would have made
            for p in sorted(node.neighbours):
                if p > node.peer_id:
                    await node.transport.connect_peer(p, [], timeout=10.0)
        self.by_id = by_id
        # every node's member op has reached every other (the swarm is formed), and gossip links are up
        await self.until(lambda: all(len(x.gossip.links) >= len(x.neighbours) for x in self.nodes), 60,
                         "gossip links")
        if self.cfg.crdt:
            await self.until(self.converged, 300, "the member set to converge")

    async def stop(self) -> None:
        await asyncio.gather(*(n.stop() for n in self.nodes if n.up), return_exceptions=True)

    async def restart(self, node: SimNode, *, wipe: bool = False) -> SimNode:
        """Stop ``node`` as ``kill -9`` would (if it is up) and start it again from its op log, or from an empty one
        (``wipe``: a fresh replica of the same identity); it reconnects to its neighbours that are up."""
        if node.up:
            await node.stop()
        new = SimNode(self.net, node.identity, node.admission, self.cfg, current(), neighbours=node.neighbours,
                      log=None if wipe else node.log, life=node.life + 1)
        self.nodes[self.nodes.index(node)] = self.by_id[new.peer_id] = new
        await new.start()
        for p in sorted(new.neighbours):
            if self.by_id[p].up:
                await new.transport.connect_peer(p, [], timeout=10.0)
        return new

    def converged(self, nodes: list[SimNode] | None = None) -> bool:
        digests = {n.replicator.store.digest() for n in (nodes or self.nodes) if n.up}
        return len(digests) == 1

    async def until(self, cond, timeout: float, what: str, step: float = 0.05) -> float:
        return await until(cond, timeout, what, step)

    # -------------------------------------------------------------- scenarios
    async def dissemination(self, messages: int = 20, gap: float = 0.5) -> dict:
        """``messages`` flood messages from random nodes, ``gap`` seconds apart: delivery latency over every
        (message, receiver), the share delivered, and pubsub bytes sent per node."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3 * self.nodes[0].gossip.heartbeat)  # the topic's mesh forms in the first heartbeats
        before = {n.peer_id: n.transport.stats.bytes_out_by_protocol[PUBSUB_SPEC.id] for n in self.nodes}
        sent: dict[bytes, tuple[str, float]] = {}
        for k in range(messages):
            origin = self.rng.choice(self.nodes)
            mid = origin.gossip.publish(TOPIC, msgpack.packb({"k": k, "pad": b"\0" * 200}))
            sent[mid] = (origin.peer_id, loop.time())
            await asyncio.sleep(gap)
        want = {(m, n.peer_id) for m, (o, _) in sent.items() for n in self.nodes if n.peer_id != o}

        def delivered() -> int:
            return sum(1 for m, p in want if m in self.by_id[p].received)
        try:
            await self.until(lambda: delivered() == len(want), 60, "every flood message everywhere", step=0.1)
        except TimeoutError:
            pass
        lat = sorted(self.by_id[p].received[m] - sent[m][1] for m, p in want if m in self.by_id[p].received)
        out = [n.transport.stats.bytes_out_by_protocol[PUBSUB_SPEC.id] - before[n.peer_id] for n in self.nodes]
        return {"delivered": delivered() / max(1, len(want)),
                "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3,
                "max_ms": (lat[-1] if lat else 0) * 1e3,
                "bytes_per_node_per_msg": statistics.mean(out) / messages}

    async def partition_heal(self, cut: float = 30.0, writers: int = 10) -> dict:
        """Cut the swarm in halves for ``cut`` seconds while ``writers`` nodes on each side write; then heal and time
        until every replica holds the same state."""
        half = len(self.nodes) // 2
        order = list(self.nodes)
        self.rng.shuffle(order)
        a, b = order[:half], order[half:]
        self.net.partition({n.peer_id for n in a}, {n.peer_id for n in b})
        for side in (a, b):
            for n in self.rng.sample(side, min(writers, len(side))):
                await n.replicator.write("kv", {"k": f"{n.peer_id}/note", "v": "written during the cut"})
        loop = asyncio.get_running_loop()
        cut_at = loop.time()
        # when each side first agreed within itself (None: it did not during the cut, e.g. a side of a sparse
        # graph that the cut left in pieces)
        sides: list[float | None] = [None, None]
        while loop.time() - cut_at < cut and None in sides:
            for i, side in enumerate((a, b)):
                if sides[i] is None and self.converged(side):
                    sides[i] = loop.time() - cut_at
            await asyncio.sleep(0.05)
        await asyncio.sleep(max(0.0, cut - (loop.time() - cut_at)))
        self.net.heal()
        healed = loop.time()
        converged = await self.until(self.converged, 600, "the state to converge after the heal", step=0.1)
        return {"sides_converged_s": None if None in sides else max(sides),
                "converged_after_heal_s": converged,
                "healed_at": healed, "ops": len(self.nodes[0].replicator.store.ops)}


HEADER = (f"{'peers':>6} | {'formed s':>8} | {'delivered':>9} | {'gossip p50 ms':>13} | {'p99 ms':>7} | "
          f"{'B/node/msg':>10} | {'cut: sides s':>12} | {'heal -> same s':>14} | {'simulated s':>11} | {'wall s':>7}")


def format_row(report: SimReport) -> str:
    """One line of the simulator's table (``HEADER`` names the columns)."""
    g, p = report.rows.get("gossip", {}), report.rows.get("partition", {})

    def f(value, fmt):
        width = int(fmt.split(".")[0] or 0)
        return format(value, fmt) if value is not None else "-".rjust(width)
    return (f"{report.peers:>6} | {f(report.rows.get('formed_s'), '8.1f')} | "
            f"{f(g.get('delivered') and 100 * g['delivered'], '8.1f')}% | {f(g.get('p50_ms'), '13.0f')} | "
            f"{f(g.get('p99_ms'), '7.0f')} | {f(g.get('bytes_per_node_per_msg'), '10.0f')} | "
            f"{f(p.get('sides_converged_s'), '12.1f')} | {f(p.get('converged_after_heal_s'), '14.1f')} | "
            f"{f(report.rows.get('simulated_s'), '11.0f')} | {report.wall_s:>7.1f}")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


async def _simulate(cfg: SimConfig, scenarios: tuple[str, ...]) -> SimReport:
    report = SimReport(cfg.peers)
    swarm = SimSwarm(cfg)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await swarm.start()
    report.rows["formed_s"] = loop.time() - t0
    try:
        if "gossip" in scenarios:
            report.rows["gossip"] = await swarm.dissemination()
        if "partition" in scenarios and cfg.crdt:
            report.rows["partition"] = await swarm.partition_heal()
    finally:
        await swarm.stop()
    report.rows["simulated_s"] = loop.time() - t0
    return report


def simulate(cfg: SimConfig, scenarios: tuple[str, ...] = ("gossip", "partition")) -> SimReport:
    """Run the scenarios on a fresh virtual-time loop; ``wall_s`` is the real time the simulation took."""
    started = time.monotonic()
    report = run_virtual(_simulate(cfg, scenarios))
    report.wall_s = time.monotonic() - started
    return report
