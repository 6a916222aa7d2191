"""The simulator (node/sim.py): the real gossip, CRDT and DiLoCo code, many nodes in one process on virtual time.

Each test is a swarm of its own in this process: seconds of wall time for minutes of simulated time."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd.node.sim import ChurnConfig, SimConfig, SimSwarm, diloco_churn, simulate
from swarmd.transport.memory import run_virtual

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_gossip_reaches_everyone_and_a_healed_partition_converges():
    report = simulate(SimConfig(peers=40, degree=4))
    gossip, cut = report.rows["gossip"], report.rows["partition"]
    assert gossip["delivered"] == 1.0
    # a message crosses a sparse graph in a few hops of 25 ms each
    assert 25 <= gossip["p50_ms"] <= gossip["p99_ms"] < 1000
    assert cut["converged_after_heal_s"] < 60 and cut["ops"] >= 40 + 2 * 10  # members + the writes of the cut


@pytest.mark.timeout(120)
def test_a_simulation_is_the_same_every_time():
    cfg = SimConfig(peers=20, degree=3, seed=5)
    assert simulate(cfg, ("gossip",)).rows == simulate(cfg, ("gossip",)).rows


@pytest.mark.timeout(120)
def test_ops_cross_a_sparse_graph_by_relay_not_only_by_anti_entropy():
    """A write reaches most replicas of a sparse swarm within a second (pushed on by each replica that receives it
    new, to 3 random peers), long before the anti-entropy interval (10 s here) carries it, and all of them by then:
    relaying is probabilistic, anti-entropy is the guarantee."""
    async def main():
        swarm = SimSwarm(SimConfig(peers=30, degree=2, sync_interval=10.0))
        await swarm.start()
        try:
            writer = swarm.nodes[0]
            op = await writer.replicator.write("kv", {"k": f"{writer.peer_id}/x", "v": 1})
            await asyncio.sleep(1.0)
            quickly = sum(op.id in n.replicator.store.ops for n in swarm.nodes)
            took = 1.0 + await swarm.until(swarm.converged, 30, "the write to reach every replica", step=0.05)
            relayed = sum(n.replicator.counters["ops_relayed"] for n in swarm.nodes)
            return quickly, took, relayed
        finally:
            await swarm.stop()

    quickly, took, relayed = run_virtual(main())
    assert quickly >= 27 and took < 15.0 and relayed >= quickly - 1


@pytest.mark.timeout(180)
def test_diloco_under_churn_ends_with_every_peer_on_the_same_weights(tmp_path):
    cfg = SimConfig(peers=10, seed=3)
    result = run_virtual(diloco_churn(cfg, ChurnConfig(rounds=8, churn=0.1, churn_every=4.0, dim=2048), tmp_path))
    assert result["kills"] >= 2 and result["restarts"] == result["kills"]
    assert result["done"] == 10 and result["same_final_weights"] == 10
    assert result["loss_end"] < 0.5 * result["loss_start"]  # and they learned


@pytest.mark.timeout(120)
def test_swarmd_sim_prints_its_table():
    out = subprocess.run([sys.executable, "-m", "swarmd", "sim", "--peers", "12", "--degree", "3", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads(out.stdout)
    assert row["peers"] == 12 and row["gossip"]["delivered"] == 1.0 and row["wall_s"] > 0


def test_virtual_time_survives_a_crashing_node_task():
    """A scenario coroutine that raises ends the simulation with that error, not a hang."""
    async def main():
        await asyncio.sleep(10)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_virtual(main())


@pytest.mark.timeout(120)
def test_a_long_writer_is_compacted_everywhere_and_a_restart_or_a_fresh_replica_rebuilds_its_state():
    """An author's total in the op log was unbounded (issue 14). A node writes 2,600 ops here (its bases are its
    ops #1000 and #2000): every replica keeps only the ops after the last base, each op log is rewritten without
    the rest, and a restart from the compacted log, or a replica that starts empty, ends with the same state."""
    from swarmd.crdt.store import BASE_EVERY

    async def main():
        swarm = SimSwarm(SimConfig(peers=4, degree=3, sync_interval=5.0))
        await swarm.start()
        try:
            writer, late = swarm.nodes[0], swarm.nodes[3]
            await late.stop()
            me = writer.peer_id
            for batch in range(26):
                await writer.replicator.write_many(
                    [("events", {"n": 1})] * 50
                    + [("kv", {"k": f"{me}/k{i % 7}", "v": batch * 100 + i}) for i in range(49)]
                    + [("progress", {"step": batch, "samples": batch, "loss": 1.0 / (batch + 1), "bytes": 0,
                                     "round": batch})])
                await asyncio.sleep(16.0)  # 100 ops every 16 s: inside the quota (500 a minute)
            up = swarm.nodes[:3]
            await swarm.until(lambda: swarm.converged(up), 60, "the three replicas to converge")
            await swarm.until(lambda: all(n.log.records == len(n.replicator.store.ops) for n in up), 60,
                              "every op log to be compacted")
            stores = [n.replicator.store for n in up]
            kept = [sum(1 for o in s.ops.values() if o.author == me) for s in stores]
            compacted = [s.compacted for s in stores]
            values = stores[0].values()
            restarted = await swarm.restart(writer)
            rebuilt = await swarm.restart(late, wipe=True)
            await swarm.until(lambda: swarm.converged(), 60, "the restarted and the fresh replica to converge")
            return (kept, compacted, values, [n.replicator.store.values() for n in (restarted, rebuilt)],
                    restarted.replicator.store.last_seq(me), [n.log.records for n in up])
        finally:
            await swarm.stop()

    kept, compacted, values, after, last, records = run_virtual(main())
    assert last == 26 * 100 + 2 + 1  # 2,600 writes, its member op and two bases
    assert kept == [last - 2 * BASE_EVERY + 1] * 3 and all(c >= 2 * BASE_EVERY - 1 for c in compacted)
    assert values["events"]["total"] == 1300 and len(values["kv"]) == 7
    assert after == [values, values]
    assert all(r < BASE_EVERY for r in records)
