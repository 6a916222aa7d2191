"""SPSA's window logic, the loop's own code, in one process on virtual time (node/sim.py SpsaSim): a peer killed
and restarted, a peer whose weights drift, a partition and its heal. Seconds each; test_spsa.py's multi-process
tests stay as the end-to-end layer."""

import asyncio

import pytest
import torch

from node.sim import ChurnConfig, SimConfig, SpsaSim
from protocols import spsa
from transport.memory import run_virtual


def _sim(tmp_path, peers: int, windows: int = 12, **settings) -> SpsaSim:
    return SpsaSim(SimConfig(peers=peers, seed=11), ChurnConfig(rounds=windows, inner_steps=16, dim=64), tmp_path,
                   **settings)


def _finals(sim: SpsaSim) -> set:
    return {n.loop.final_hash for n in sim.nodes.values()}


@pytest.mark.timeout(120)
def test_four_peers_end_bit_identical_and_learn(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4)
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            loops = [sim.loop(p) for p in sim.peers]
            return _finals(sim), [lp.losses for lp in loops], sim.report(0.0), \
                [(len(lp.applied), len(lp.my_hashes), len(lp.log)) for lp in loops]

    finals, losses, report, kept = run_virtual(main())
    assert len(finals) == 1 and report["diverged"] == 0
    assert all(lo[-1][1] < 0.5 * lo[0][1] for lo in losses)
    # the decoded batches of the last few windows only (every window's, before: memory that grew with the run);
    # the log keeps every window's bytes for joiners
    assert all(applied <= spsa.KEEP_APPLIED + 1 and hashes <= 3 and log == 12 for applied, hashes, log in kept), kept


@pytest.mark.timeout(120)
def test_a_peer_killed_and_restarted_resumes_and_ends_with_the_others(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4, windows=16)
        victim = sim.peers[3]
        async with sim:
            await sim.start_all()
            await sim.until(lambda: sim.loop(victim).window >= 4, 120, "window 4")
            await sim.kill(victim)  # kill -9: its data dir (checkpoint) stays
            await asyncio.sleep(3.0)  # the others close a window or two without it
            await sim.start(victim, restart=True)
            await sim.until(sim.finished, 300, "everyone to finish")
            return _finals(sim), sim.loop(victim).resumed, [sim.loop(p).counters for p in sim.peers[:3]]

    finals, resumed, survivors = run_virtual(main())
    assert len(finals) == 1
    assert resumed and resumed["round"] >= 4  # from its own checkpoint, then the others' log
    assert all(c.get("deadline_missed", 0) >= 1 and c.get("diverged", 0) == 0 for c in survivors)


@pytest.mark.timeout(120)
def test_a_peer_whose_weights_drift_resyncs_from_the_majority(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).window >= 3 for p in sim.peers), 120, "window 3")
            d = sim.loop(sim.peers[0])
            for c in d.weights.canonical:
                c.add_(0.01 * torch.randn(c.shape))
            d.weights._load(None, 0.0)
            await sim.until(sim.finished, 300, "everyone to finish")
            return d.counters, _finals(sim), [sim.loop(p).counters.get("diverged", 0) for p in sim.peers[1:]]

    counters, finals, others = run_virtual(main())
    assert counters["diverged"] >= 1 and len(finals) == 1 and others == [0, 0, 0]


@pytest.mark.timeout(120)
def test_a_partition_splits_the_windows_and_after_the_heal_the_minority_takes_the_majoritys_log(tmp_path):
    async def main():
        sim = _sim(tmp_path, 5, windows=20)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).window >= 3 for p in sim.peers), 120, "window 3")
            minority, majority = sim.peers[:2], sim.peers[2:]
            sim.net.partition(set(minority), set(majority))
            await asyncio.sleep(8.0)  # windows apart: each side applies only its own batches
            split = {sim.loop(p).weights.hash() for p in sim.peers}
            sim.net.heal()
            await sim.until(sim.finished, 600, "everyone to finish")
            return split, _finals(sim), {p: sim.loop(p).counters.get("diverged", 0) for p in sim.peers}

    split, finals, diverged = run_virtual(main())
    assert len(split) >= 2  # the sides did part
    assert len(finals) == 1
    assert all(diverged[p] >= 1 for p in list(diverged)[:2])  # the minority saw it was off and replayed
