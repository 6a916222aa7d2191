"""Simulated swarms: the real gossip and CRDT replication code, many nodes in one process, on virtual time.

Each :class:`SimNode` is what a node runs above its transport (the same :class:`~protocols.gossip.Gossip`, the same
:class:`~node.replication.Replicator`, each with its own seeded random generator and the loop's virtual clock) on a
:class:`~transport.memory.MemoryTransport`. Discovery is a static graph: every node connects to ``degree`` random
others, as a large swarm's nodes hold a bounded set of connections (``discovery.max_peers``). The op log is kept in
memory. Everything else is production code, so what the simulator measures (dissemination latency and bytes, CRDT
convergence after a partition heals) is what those modules do, on links of a chosen latency, bandwidth and loss.

This module is a composition root (like ``node/cli.py``): it may plug ``protocols/`` into the node's parts.
``swarmd sim`` runs it; ``bench/bench_sim.py`` prints the table for 100, 1,000 and 10,000 peers.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from swarmd.crdt.admission import Admission
from swarmd.node.oplog import MemoryOpLog
from swarmd.node.replication import Replicator
from swarmd.node.services import NodeContext
from swarmd.protocols.gossip import PUBSUB_SPEC, Gossip
from swarmd.protocols.faults import FaultPlan
from swarmd.transport.clock import Clock, current
from swarmd.transport.errors import TransportError
from swarmd.transport.identity import Identity
from swarmd.transport.memory import LinkSpec, MemoryNetwork, MemoryTransport, run_virtual
from swarmd.transport.ping import serve_ping

logger = logging.getLogger(__name__)

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
    (``loop``: its config and task; the node's data dir then holds its checkpoints, so a restarted node resumes)."""

    def __init__(self, net: MemoryNetwork, identity: Identity, admission: Admission, cfg: SimConfig, clock: Clock,
                 *, neighbours: set[str] | None = None, log: MemoryOpLog | None = None, data_dir: Path = SIM_DIR,
                 loop: Callable | None = None, life: int = 0):
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
        self._tasks: list[asyncio.Task] = []
        self.up = False

    def direct(self, peer: str) -> bool:
        return peer in self.neighbours and self.transport.net.direct(self.peer_id, peer)

    def members(self) -> list[str]:
        return [p for p in sorted(self.neighbours) if self.transport.net.reachable(self.peer_id, p)]

    async def start(self) -> None:
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


@dataclass
class ChurnConfig:
    rounds: int = 12
    inner_steps: int = 10
    step_seconds: float = 0.1  # simulated compute per inner step (a round is at least inner_steps x this)
    churn: float = 0.10  # share of the swarm down at any time, a different share every churn_every seconds
    churn_every: float = 5.0
    dim: int = 256  # the regression task's size
    exchange: str = "auto"


def _paced(cls, step_seconds: float):
    """A DiLoCo loop whose inner steps take ``step_seconds`` of simulated time (the real compute costs none)."""
    class Paced(cls):
        async def _train_step(self) -> None:
            await super()._train_step()
            await asyncio.sleep(step_seconds)
    return Paced


def lists_direct_late(cls, peer: str, seconds: float):
    """A loop whose node lists ``peer`` as directly connected only ``seconds`` after it starts, as a real node's
    connection list lags its links (the daemon's listing is read every 2 s)."""
    class ListsLate(cls):
        async def start(self, ctx):
            listed, since = ctx.direct, ctx.clock.monotonic()
            ctx.direct = lambda p: listed(p) and (p != peer or ctx.clock.monotonic() - since > seconds)
            await super().start(ctx)
    return ListsLate


class LoopSim:
    """A training loop's swarm in one process (a full mesh, as every real swarm within ``max_peers`` is): nodes can
    be started late, killed (as ``kill -9``: their op log and data dir stay), restarted, cut off by a partition;
    ``classes`` may give a peer a subclass of the loop (a Byzantine peer, a slow one). The round code is the loop's
    own, on virtual time. A subclass names the loop: ``_setup`` (its config, task and class), ``_make_loop`` and
    ``report``. ``async with sim:`` stops every node at the end."""

    def __init__(self, cfg: SimConfig, churn: ChurnConfig, root: Path, **settings):
        from swarmd.protocols import task as tasks

        self.cfg, self.churn, self.root = cfg, churn, root
        self.tasks = tasks
        self._setup(settings)
        self.net = MemoryNetwork(link=LinkSpec(latency=cfg.latency, up=cfg.bandwidth, down=cfg.bandwidth,
                                               loss=cfg.loss), seed=cfg.seed)
        self.ids = [Identity.generate(_seed(cfg.seed, i)) for i in range(cfg.peers)]
        self.peers = [i.peer_id for i in self.ids]
        self._by_id = {i.peer_id: i for i in self.ids}
        self.admission = Admission("sim", allow=sorted(self.peers))
        self.logs = {p: MemoryOpLog() for p in self.peers}
        self.dirs = {p: root / p[-12:] for p in self.peers}
        self.lives = {p: 0 for p in self.peers}
        self.classes: dict[str, type] = {}  # peer -> its loop class, where it is not the honest one
        # the faults a test injects by peer, round and phase (protocols/faults.py; the DiLoCo and SPSA loops read them)
        self.faults = FaultPlan()
        self.nodes: dict[str, SimNode] = {}
        self.kills = self.restarts = 0

    def _setup(self, settings: dict) -> None:
        raise NotImplementedError

    def _make_loop(self, cls, gossip, bulk):
        raise NotImplementedError

    def report(self, took: float) -> dict:
        raise NotImplementedError

    async def __aenter__(self) -> LoopSim:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def loop(self, peer: str):
        return self.nodes[peer].loop

    async def start(self, peer: str, *, restart: bool = False) -> SimNode:
        self.dirs[peer].mkdir(parents=True, exist_ok=True)
        if restart:
            self.lives[peer] += 1
            self.restarts += 1
        node = SimNode(self.net, self._by_id[peer], self.admission, self.cfg, current(),
                       neighbours=set(self.peers) - {peer}, log=self.logs[peer], data_dir=self.dirs[peer],
                       loop=functools.partial(self._make_loop, self.classes.get(peer, self.loop_cls)),
                       life=self.lives[peer])
        self.nodes[peer] = node
        await node.start()
        await _reconnect(self.nodes, peer)
        return node

    async def start_all(self, peers: list[str] | None = None) -> None:
        for peer in peers or self.peers:
            await self.start(peer)

    async def kill(self, peer: str) -> None:
        await self.nodes[peer].stop()
        self.kills += 1

    def live(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.up]

    def finished(self) -> bool:
        return all(n.loop.state in ("done", "failed") for n in self.live())

    async def until(self, cond, timeout: float, what: str) -> float:
        return await until(cond, timeout, what, 0.1)

    async def stop(self) -> None:
        for n in self.nodes.values():
            if n.up:
                await n.stop()


class DilocoSim(LoopSim):
    """A DiLoCo swarm on the regression task: DilocoLoop's own round code on virtual time."""

    def _setup(self, settings: dict) -> None:
        from swarmd.protocols import diloco

        churn = self.churn
        self.task = self.tasks.load("regression", {"dim": churn.dim}, "diloco")
        # threads=1 here and in the SPSA and SAPO sims below: many simulated peers share this one process
        defaults = dict(run="sim", task="regression", task_options={"dim": churn.dim}, rounds=churn.rounds,
                        inner_steps=churn.inner_steps, min_peers=self.cfg.peers, checkpoint_every=1,
                        deadline_low=1.0, deadline_high=10.0, exchange=churn.exchange, codec="int8", inner_lr=0.05,
                        outer_lr=1.0, outer_momentum=0.0, device="cpu", threads=1)
        self.dcfg = diloco.DilocoConfig(**{**defaults, **settings})
        self.loop_cls = _paced(diloco.DilocoLoop, churn.step_seconds)

    def _make_loop(self, cls, gossip, bulk):
        loop = cls(gossip, bulk, self.dcfg, self.task)
        loop.faults = self.faults
        return loop

    def report(self, took: float) -> dict:
        loops = [n.loop for n in self.nodes.values()]
        finals = collections.Counter(lp.final_hash for lp in loops if lp.final_hash)
        parts = [h["participants"] for lp in loops for h in lp.history]
        return {
            "peers": self.cfg.peers, "rounds": self.churn.rounds, "kills": self.kills, "restarts": self.restarts,
            "simulated_s": took, "s_per_round": took / self.churn.rounds,
            "done": sum(lp.state == "done" for lp in loops),
            "same_final_weights": (finals.most_common(1)[0][1] if finals else 0),
            "participants_median": statistics.median(parts) if parts else 0,
            "participants_min": min(parts) if parts else 0,
            "participants_mean": statistics.mean(parts) if parts else 0,
            "resyncs": sum(lp.counters.get("resyncs", 0) for lp in loops),
            "deadline_missed": sum(lp.counters.get("deadline_missed", 0) for lp in loops),
            "counters": dict(sum((collections.Counter(lp.counters) for lp in loops), collections.Counter())),
            "loss_start": self.tasks.evaluate(self.task, self.task.obj.model()),
            "loss_end": statistics.median(lp.losses[-1][1] for lp in loops if lp.losses) if any(
                lp.losses for lp in loops) else None,
        }


class SpsaSim(LoopSim):
    """An SPSA swarm in one process on the regression task: the loop's own windows, screens, hash checks, log
    replay and resync on virtual time. A window's steps take ``window x step_seconds`` of simulated time (their
    real compute runs in a worker thread, which the virtual clock waits for). ``churn.rounds`` is the windows."""

    def _setup(self, settings: dict) -> None:
        from swarmd.protocols import spsa

        churn = self.churn
        self.task = self.tasks.load("regression", {"dim": churn.dim}, "spsa")
        window = settings.get("window", churn.inner_steps)
        defaults = dict(run="sim", task="regression", task_options={"dim": churn.dim}, steps=churn.rounds * window,
                        window=window, min_peers=self.cfg.peers, checkpoint_every=1, deadline=2.0, hash_every=1,
                        eval_every=1, lr=0.002, eps=1e-2, device="cpu", threads=1)
        self.dcfg = spsa.SpsaConfig(**{**defaults, **settings})
        self.loop_cls = _closing_after(spsa.SPSALoop, "_close_window", self.dcfg.window * churn.step_seconds)

    def _make_loop(self, cls, gossip, bulk):
        loop = cls(gossip, self.dcfg, self.task)
        loop.faults = self.faults
        return loop

    def report(self, took: float) -> dict:
        loops = [n.loop for n in self.nodes.values()]
        finals = collections.Counter(lp.final_hash for lp in loops if lp.final_hash)
        return {"peers": self.cfg.peers, "windows": self.churn.rounds, "kills": self.kills,
                "restarts": self.restarts, "simulated_s": took, "done": sum(lp.state == "done" for lp in loops),
                "same_final_weights": (finals.most_common(1)[0][1] if finals else 0),
                "resyncs": sum(lp.counters.get("resyncs", 0) for lp in loops),
                "diverged": sum(lp.counters.get("diverged", 0) for lp in loops)}


class SapoSim(LoopSim):
    """A SAPO swarm in one process on the arithmetic task with a tiny policy: the loop's own rounds, sharing,
    re-scoring and per-source caps on virtual time. A round's rollouts and step take ``inner_steps x step_seconds``
    of simulated time (their real compute runs in a worker thread). ``churn.rounds`` is the rounds."""

    def _setup(self, settings: dict) -> None:
        from swarmd.protocols import sapo

        churn = self.churn
        options = settings.pop("task_options", {"d": 32, "layers": 1, "heads": 2})
        self.task = self.tasks.load("arith", options, "sapo")
        defaults = dict(run="sim", task="arith", task_options=options, rounds=churn.rounds, min_peers=self.cfg.peers,
                        questions=4, completions=4, local=2, external=2, deadline=2.0, checkpoint_every=2,
                        report_every=1, device="cpu", threads=1)
        self.dcfg = sapo.SapoConfig(**{**defaults, **settings})
        self.loop_cls = _closing_after(sapo.SapoLoop, "_close_round", churn.inner_steps * churn.step_seconds)

    def _make_loop(self, cls, gossip, bulk):
        return cls(gossip, self.dcfg, self.task)

    def report(self, took: float) -> dict:
        loops = [n.loop for n in self.nodes.values()]
        return {"peers": self.cfg.peers, "rounds": self.churn.rounds, "kills": self.kills,
                "restarts": self.restarts, "simulated_s": took, "done": sum(lp.state == "done" for lp in loops),
                "items_used_external": sum(lp.counters.get("items_used_external", 0) for lp in loops),
                "deadline_missed": sum(lp.counters.get("deadline_missed", 0) for lp in loops)}


def _closing_after(cls, close: str, seconds: float):
    """A loop class whose rounds take ``seconds`` of simulated time: its ``close`` method (the round's close) waits
    that long first. The round's real compute runs in worker threads, which cost no simulated time."""
    original = getattr(cls, close)

    async def paced(self, r: int) -> None:
        await asyncio.sleep(seconds)
        await original(self, r)

    return type(f"Paced{cls.__name__}", (cls,), {close: paced})


async def diloco_churn(cfg: SimConfig, churn: ChurnConfig, root: Path) -> dict:
    """A DiLoCo run of ``cfg.peers`` nodes while ``churn.churn`` of them are down at any time: every
    ``churn_every`` simulated seconds that many live nodes are killed (as ``kill -9``: the op log and checkpoints in
    their data dir stay) and the ones killed before come back with their identity and data dir. Reports the rounds
    the swarm closed, who took part, resyncs, whether the nodes agree on the weights, and the validation loss."""
    loop = asyncio.get_running_loop()
    rng = random.Random(cfg.seed)
    sim = DilocoSim(cfg, churn, root)
    async with sim:
        await sim.start_all()
        t0 = loop.time()
        down: list[str] = []
        next_churn = t0 + churn.churn_every
        k = max(1, round(churn.churn * cfg.peers)) if churn.churn > 0 else 0
        while not sim.finished():
            if loop.time() - t0 > 3600:
                raise TimeoutError("simulation: the DiLoCo run did not finish within an hour of simulated time")
            if k and loop.time() >= next_churn:
                next_churn += churn.churn_every
                running = [n for n in sim.live() if n.loop.state not in ("done", "failed")]
                victims = rng.sample(running, min(k, len(running)))
                for n in victims:
                    await sim.kill(n.peer_id)
                for peer in down:
                    await sim.start(peer, restart=True)
                down = [n.peer_id for n in victims]
            await asyncio.sleep(0.1)
        for peer in down:  # the last ones killed come back and finish too (they must end on the swarm's weights)
            await sim.start(peer, restart=True)
        try:
            await sim.until(sim.finished, 600, "the restarted peers to finish")
        except TimeoutError:
            pass
        return sim.report(loop.time() - t0)


async def diloco_far(cfg: SimConfig, churn: ChurnConfig, root: Path, latency: float, **settings) -> dict:
    """A DiLoCo run of ``cfg.peers`` nodes, one of them ``latency`` s away one way (the others at cfg.latency):
    its update reaches the others late in some rounds, theirs reach it late in others. Reports as
    ``diloco_churn``, plus the rounds the far peer closed (``far_closed``)."""
    loop = asyncio.get_running_loop()
    sim = DilocoSim(cfg, churn, root, **settings)
    async with sim:
        await sim.start_all()
        t0 = loop.time()
        far = sim.peers[-1]
        sim.net.set_link(far, LinkSpec(latency=latency, up=cfg.bandwidth, down=cfg.bandwidth, loss=cfg.loss))
        await sim.until(sim.finished, 3600, "the run to finish")
        report = sim.report(loop.time() - t0)
        report["far_closed"] = len(sim.loop(far).history)
        return report


async def diloco_links_change(cfg: SimConfig, churn: ChurnConfig, root: Path, change, after: int = 2) -> dict:
    """A DiLoCo run of ``cfg.peers`` nodes on ``cfg``'s links; once every peer closed ``after`` rounds,
    ``change(sim, cfg)`` sets links (a link that falls, an uplink that slows). Returns each peer's loop
    (``loops``), the final hashes (``finals``), what ``change`` returned (``changed``) and the simulated seconds
    at the run's end (``seconds``)."""
    sim = DilocoSim(cfg, churn, root)
    async with sim:
        await sim.start_all()
        await sim.until(lambda: all(sim.loop(p).rounds_done[0] >= after for p in sim.peers), 300,
                        f"{after} rounds before the change")
        changed = change(sim, cfg)
        await sim.until(sim.finished, 3000, "everyone to finish")
        return {"loops": {p: sim.loop(p) for p in sim.peers}, "finals": {n.loop.final_hash for n in sim.nodes.values()},
                "changed": changed, "seconds": asyncio.get_running_loop().time()}


def first_uplink_falls(rate: float, count: int = 1):
    """A ``change`` for ``diloco_links_change``: the first peer's (by id) uplink falls to ``rate`` bytes/s (the
    first ``count`` peers'), their downlinks and the others' links stay. The change returns the first of them."""

    def change(sim, cfg: SimConfig) -> str:
        slow = sorted(sim.peers)[:count]
        for peer in slow:
            sim.net.set_link(peer, LinkSpec(latency=cfg.latency, up=rate, down=cfg.bandwidth, loss=cfg.loss))
        return slow[0]

    return change


async def diloco_run(cfg: SimConfig, churn: ChurnConfig, root: Path, **settings) -> dict:
    """A DiLoCo run of ``cfg.peers`` nodes on ``cfg``'s links, no faults (``settings``: the loop's config, e.g.
    ``min_bandwidth``). Reports as ``diloco_churn``."""
    loop = asyncio.get_running_loop()
    sim = DilocoSim(cfg, churn, root, **settings)
    async with sim:
        await sim.start_all()
        t0 = loop.time()
        await sim.until(sim.finished, 3600, "the run to finish")
        return sim.report(loop.time() - t0)


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


async def _reconnect(nodes: dict[str, SimNode], peer: str) -> None:
    """A restarted node dials the others that are up (discovery's job in a real node)."""
    for q in sorted(nodes):
        if q != peer and nodes[q].up:
            try:
                await nodes[peer].transport.connect_peer(q, [], timeout=2.0)
            except TransportError:
                pass


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
