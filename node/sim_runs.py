"""Whole DiLoCo runs on the simulator, as the benchmarks and tests drive them: under churn, with a far peer,
with links that change mid-run, and plain. Each builds a :class:`~node.sim_loops.DilocoSim` and reports what the
swarm did."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from swarmd.node.sim_loops import ChurnConfig, DilocoSim
from swarmd.node.sim_node import SimConfig
from swarmd.transport.memory import LinkSpec


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
