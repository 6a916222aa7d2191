"""A training loop's swarm in one process, on virtual time: :class:`LoopSim` and its DiLoCo, SPSA and SAPO kinds.

The nodes are :class:`~node.sim_node.SimNode` objects on a full mesh, each running the loop's own round code; a test
starts, kills, restarts and partitions them, and injects faults by peer, round and phase (``protocols/faults.py``).

This module is a composition root (like ``node/cli.py``): it may plug ``protocols/`` into the node's parts.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path

from swarmd.crdt.admission import Admission
from swarmd.node.oplog import MemoryOpLog
from swarmd.node.sim_node import SimConfig, SimNode, _seed, until
from swarmd.protocols.faults import FaultPlan
from swarmd.transport.clock import current
from swarmd.transport.errors import TransportError
from swarmd.transport.identity import Identity
from swarmd.transport.memory import LinkSpec, MemoryNetwork, run_virtual


@dataclass
class ChurnConfig:
    rounds: int = 12
    inner_steps: int = 10
    step_seconds: float = 0.1  # simulated compute per inner step (a round is at least inner_steps x this)
    churn: float = 0.10  # share of the swarm down at any time, a different share every churn_every seconds
    churn_every: float = 5.0
    dim: int = 256  # the regression task's size
    exchange: str = "auto"


class LoopSim:
    """A training loop's swarm in one process (a full mesh, as every real swarm within ``max_peers`` is): nodes can
    be started late, killed (as ``kill -9``: their op log and data dir stay), restarted, cut off by a partition,
    started with no loop (a peer whose words a test forges: ``say``), or list a peer as directly connected late
    (``list_late``); ``faults`` holds what fails where and when (protocols/faults.py). The round code is the loop's
    own, on virtual time. A subclass names the loop: ``_setup`` (its config, task and class), ``_make_loop`` and
    ``report``. ``async with sim:`` stops every node at the end."""

    def __init__(self, cfg: SimConfig, churn: ChurnConfig, root: Path, **settings):
        from swarmd.protocols import task as tasks

        self.cfg, self.churn, self.root = cfg, churn, root
        self.tasks = tasks
        # the faults a test injects by peer, round and phase (protocols/faults.py; every loop of the sim reads them),
        # and the simulated compute time the subclass's _setup puts there
        self.faults = FaultPlan()
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
        self.listing_lags: dict[str, dict[str, float]] = {}  # peer -> {neighbour: seconds it is listed late}
        self.nodes: dict[str, SimNode] = {}
        self.kills = self.restarts = 0

    def _setup(self, settings: dict) -> None:
        raise NotImplementedError

    def _make_loop(self, cls, gossip, bulk):
        """The loop of one node, with the swarm's faults (a loop that moves no bulk bytes: SPSA's, SAPO's)."""
        loop = cls(gossip, self.dcfg, self.task)
        loop.faults = self.faults
        return loop

    def report(self, took: float) -> dict:
        raise NotImplementedError

    async def __aenter__(self) -> LoopSim:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def loop(self, peer: str):
        return self.nodes[peer].loop

    def list_late(self, peer: str, other: str, seconds: float) -> None:
        """``peer``'s node lists ``other`` as directly connected only ``seconds`` after it starts (each start), as
        a real node's connection list lags its links."""
        self.listing_lags.setdefault(peer, {})[other] = seconds

    def say(self, peer: str, kind, body: dict) -> bytes:
        """Publish a message of the run's loop as ``peer``, through its node's gossip, tagged with the run's
        fingerprint (taken from a peer whose loop has built its model): words no honest loop would say, a Sybil's
        or a forger's. Returns the message id."""
        from swarmd.transport.wire import WIRE

        built = next(n.loop for n in self.nodes.values() if n.loop is not None and n.loop.fp is not None)
        gossip = self.nodes[peer].gossip
        if built.topic not in gossip.topics:
            gossip.subscribe(built.topic, max_size=1 << 20, queue_size=0)
        return gossip.publish(built.topic, WIRE.pack(kind, {**body, "t": [built.fp["layout"], built.fp["config"]]}))

    async def start(self, peer: str, *, restart: bool = False, loop: bool = True) -> SimNode:
        """Start ``peer``'s node (``restart``: a new life with the same identity, op log and data dir); ``loop``
        False: its node only (gossip, replication, transport), which runs no training loop."""
        self.dirs[peer].mkdir(parents=True, exist_ok=True)
        if restart:
            self.lives[peer] += 1
            self.restarts += 1
        node = SimNode(self.net, self._by_id[peer], self.admission, self.cfg, current(),
                       neighbours=set(self.peers) - {peer}, log=self.logs[peer], data_dir=self.dirs[peer],
                       loop=functools.partial(self._make_loop, self.loop_cls) if loop else None,
                       life=self.lives[peer], listed_late=self.listing_lags.get(peer))
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
        return all(n.loop.state in ("done", "failed") for n in self.live() if n.loop is not None)

    async def until(self, cond, timeout: float, what: str) -> float:
        return await until(cond, timeout, what, 0.1)

    def run_to_end(self, timeout: float = 300.0) -> list:
        """Start every peer and run the swarm on virtual time until every loop has ended (``timeout`` simulated
        seconds at most); the loops, in peer order."""
        async def main() -> list:
            async with self:
                await self.start_all()
                await self.until(self.finished, timeout, "everyone to finish")
                return [self.loop(p) for p in self.peers]
        return run_virtual(main())

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
        self.loop_cls = diloco.DilocoLoop
        # simulated compute: each inner step takes its peer's pace of virtual time (the real compute costs none)
        self.paces: dict[str, float] = {}
        self.faults.add("step", "enter", self._compute)

    def pace(self, peer: str, seconds: float) -> None:
        """``peer``'s inner steps take ``seconds`` of simulated time each (the others' ``churn.step_seconds``)."""
        self.paces[peer] = seconds

    async def _compute(self, event) -> None:
        await asyncio.sleep(self.paces.get(event.me, self.churn.step_seconds))

    def _make_loop(self, cls, gossip, bulk):
        loop = cls(gossip, bulk, self.dcfg, self.task)
        loop.faults = self.faults
        return loop

    def report(self, took: float) -> dict:
        loops = [n.loop for n in self.nodes.values() if n.loop is not None]
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
        self.loop_cls = spsa.SPSALoop
        self.faults.delay("close", self.dcfg.window * churn.step_seconds)  # a window's simulated compute

    def report(self, took: float) -> dict:
        loops = [n.loop for n in self.nodes.values() if n.loop is not None]
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
        self.loop_cls = sapo.SapoLoop
        self.faults.delay("close", churn.inner_steps * churn.step_seconds)  # a round's simulated compute

    def report(self, took: float) -> dict:
        loops = [n.loop for n in self.nodes.values() if n.loop is not None]
        return {"peers": self.cfg.peers, "rounds": self.churn.rounds, "kills": self.kills,
                "restarts": self.restarts, "simulated_s": took, "done": sum(lp.state == "done" for lp in loops),
                "items_used_external": sum(lp.counters.get("items_used_external", 0) for lp in loops),
                "deadline_missed": sum(lp.counters.get("deadline_missed", 0) for lp in loops)}


async def _reconnect(nodes: dict[str, SimNode], peer: str) -> None:
    """A restarted node dials the others that are up (discovery's job in a real node)."""
    for q in sorted(nodes):
        if q != peer and nodes[q].up:
            try:
                await nodes[peer].transport.connect_peer(q, [], timeout=2.0)
            except TransportError:
                pass
