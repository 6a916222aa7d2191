"""CRDT pushes over kept streams (node.replication: KEPT_*), on the in-memory network in virtual time: a node's
small pushes to a peer reuse one stream, a kept stream to a peer that restarted is given up for a new one
(nothing is lost), and a stream unused for KEPT_IDLE is closed by us before the responder's
30 s read timeout would end it as a failure."""

import asyncio

import pytest

from swarmd.node.crdt_push import KEPT_IDLE
from swarmd.node.sim import SimConfig, SimSwarm
from swarmd.transport.memory import run_virtual


def _with_swarm(scenario):
    """``scenario(swarm)`` on 3 started nodes, all linked, in virtual time (anti-entropy every 5 s, as the default
    config: it also closes idle kept streams); returns what it returns."""
    async def main():
        swarm = SimSwarm(SimConfig(peers=3, degree=2, latency=0.005, bandwidth=None, seed=7))
        await swarm.start()
        try:
            return await scenario(swarm)
        finally:
            await swarm.stop()

    return run_virtual(main())


async def _write_everywhere(swarm: SimSwarm, node, i: int) -> None:
    await node.replicator.write("progress", {"step": i, "samples": i, "loss": 1.0, "bytes": 0, "round": i})
    await swarm.until(lambda: swarm.converged(), 30, f"write {i} everywhere")


def _failed_streams(swarm: SimSwarm) -> list[int]:
    return [n.transport.stats.errors["stream_failed"] for n in swarm.nodes]


@pytest.mark.timeout(60)
def test_small_pushes_to_a_peer_reuse_one_stream():
    async def scenario(swarm):
        a = swarm.nodes[0]
        opened = {n.peer_id: n.transport.stats.streams_out for n in swarm.nodes}
        for i in range(20):
            await _write_everywhere(swarm, a, i)
        return ({n.peer_id: n.transport.stats.streams_out - opened[n.peer_id] for n in swarm.nodes},
                a.peer_id, sorted(a.replicator._kept), _failed_streams(swarm), a.replicator.counters["ops_sent"])

    opened, author, kept, failed, sent = _with_swarm(scenario)
    # 20 writes of the author, each pushed to both peers (and relayed between them; a stream a push, 40 and more
    # streams from the author before): at most one new stream from a node to each peer for the pushes over the
    # whole run (none where the swarm's forming already kept one), and an anti-entropy sync's stream or two
    assert all(n <= 4 for n in opened.values()), opened
    assert len(kept) == 2 and author not in kept
    assert sent >= 40 and failed == [0, 0, 0]


@pytest.mark.timeout(60)
def test_a_kept_stream_to_a_restarted_peer_is_replaced_and_nothing_is_lost():
    async def scenario(swarm):
        a, b, _ = swarm.nodes
        await _write_everywhere(swarm, a, 0)
        assert b.peer_id in a.replicator._kept
        b = await swarm.restart(b)  # as kill -9 and a start: the stream a kept to it ends with the old process
        await _write_everywhere(swarm, a, 1)
        steps = {n.replicator.store.value("progress")[a.peer_id]["step"] for n in swarm.nodes}
        return a.replicator.counters["kept_push_failed"], steps, b.peer_id in a.replicator._kept

    failed, steps, kept_again = _with_swarm(scenario)
    assert failed == 1  # the push over the dead stream failed once, and went over a new one, now kept
    assert steps == {1} and kept_again


@pytest.mark.timeout(60)
def test_an_idle_kept_stream_is_closed_before_the_responder_times_it_out():
    async def scenario(swarm):
        a = swarm.nodes[0]
        await _write_everywhere(swarm, a, 0)
        held = len(a.replicator._kept)
        await asyncio.sleep(KEPT_IDLE + 10.0)  # the anti-entropy loop (every 4-6 s) closes what is idle
        return held, len(a.replicator._kept), _failed_streams(swarm)

    held, left, failed = _with_swarm(scenario)
    assert held == 2 and left == 0
    assert failed == [0, 0, 0]  # closed by us: a clean end at the responder, not its 30 s timeout
