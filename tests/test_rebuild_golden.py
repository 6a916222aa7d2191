"""The DiLoCo and SPSA loops end on the same bits as recorded: seeded runs on the virtual-time simulator
(node/sim.py), 4 peers each with a fault or two, whose final weight hashes (and each round's participants) are kept
in tests/fixtures/golden_runs.json. A change to the loops' code that is meant to keep their behaviour (a rebuild,
a module split) must leave every run on the recorded bits; a change meant to alter it regenerates the fixture:
``WRITE_FIXTURE=1 .venv/bin/python -m pytest -n 0 -p no:randomly tests/test_rebuild_golden.py`` (and says why).

The faults come from outside the loop (kill -9 and restart, a partition, a link that slows down), so the runs do
not depend on the loops' private layout."""

import asyncio
import json
import os
from pathlib import Path

import pytest

from swarmd.node.sim import ChurnConfig, DilocoSim, SimConfig, SpsaSim
from swarmd.transport.memory import LinkSpec, run_virtual

pytestmark = pytest.mark.beside  # virtual time (tests/conftest.py)

FIXTURE = Path(__file__).parent / "fixtures" / "golden_runs.json"


def _outcome(sim, restarted: int | None = None) -> dict:
    """Each peer (by its index) -> its final weights' hash and its rounds' participant counts. A restarted peer's
    rounds are left out: when it is back depends on how long its checkpoint took to read in a worker thread (real
    time), which the virtual clock does not fix."""
    out = {}
    for i, peer in enumerate(sim.peers):
        node = sim.nodes.get(peer)
        lp = node.loop if node is not None else None
        out[str(i)] = {"final": lp.final_hash if lp is not None else None,
                       "participants": [] if i == restarted else [h["participants"] for h in getattr(lp, "history",
                                                                                                      [])]}
    return out


async def _kill_and_restart(sim, victim: str, after_round: int, down: float) -> None:
    await sim.until(lambda: sim.loop(victim).rounds_done[0] >= after_round and sim.loop(victim).step % 10 == 5, 300,
                    "the victim mid-round")
    await sim.kill(victim)
    await asyncio.sleep(down)
    await sim.start(victim, restart=True)


def _all_to_all(tmp_path: Path) -> dict:
    """Plain DiLoCo, every peer pulls every update; peer 3 is killed mid-round and restarted from its checkpoint."""
    async def main():
        sim = DilocoSim(SimConfig(peers=4, seed=7), ChurnConfig(rounds=8, dim=256), tmp_path, exchange="all-to-all",
                        min_peers=3)
        async with sim:
            await sim.start_all()
            await _kill_and_restart(sim, sim.peers[3], 2, 3.0)
            await sim.until(sim.finished, 600, "everyone to finish")
            return _outcome(sim, restarted=3)
    return run_virtual(main())


def _scatter(tmp_path: Path) -> dict:
    """Reduce-scatter + all-gather in 8 parts; peer 0's uplink falls to 200 kB/s after round 2, peer 2 is killed
    mid-round 4 and stays down."""
    async def main():
        cfg = SimConfig(peers=4, seed=7)
        sim = DilocoSim(cfg, ChurnConfig(rounds=8, dim=4096), tmp_path, exchange="scatter", parts=8, min_peers=3)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).rounds_done[0] >= 2 for p in sim.peers), 300, "round 2")
            sim.net.set_link(sim.peers[0], LinkSpec(latency=cfg.latency, up=200e3, down=cfg.bandwidth))
            victim = sim.peers[2]
            await sim.until(lambda: sim.loop(victim).rounds_done[0] >= 4 and sim.loop(victim).step % 10 == 5, 300,
                            "the victim mid-round")
            await sim.kill(victim)
            await sim.until(sim.finished, 600, "everyone to finish")
            return _outcome(sim)
    return run_virtual(main())


class DigitsSim(DilocoSim):
    """DilocoSim on the digits task (a small MLP: four tensors, so two fragments), for Streaming DiLoCo."""

    def _setup(self, settings: dict) -> None:
        super()._setup({"task": "digits", "task_options": {"hidden": 16, "batch": 16}, **settings})
        self.task = self.tasks.load("digits", {"hidden": 16, "batch": 16}, "diloco")


def _streaming(tmp_path: Path) -> dict:
    """Streaming DiLoCo: 2 fragments, 3 inner steps of overlap, sign updates with error feedback; a partition cuts
    peer 0 off for a few rounds, then heals."""
    async def main():
        sim = DigitsSim(SimConfig(peers=4, seed=7), ChurnConfig(rounds=8), tmp_path, exchange="all-to-all",
                        fragments=2, overlap=3, alpha=0.5, codec="sign", min_peers=3)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).rounds_done[0] >= 2 for p in sim.peers), 300, "round 2")
            sim.net.partition({sim.peers[0]}, set(sim.peers[1:]))
            await asyncio.sleep(4.0)
            sim.net.heal()
            await sim.until(sim.finished, 600, "everyone to finish")
            return _outcome(sim)
    return run_virtual(main())


def _spsa(tmp_path: Path) -> dict:
    """SPSA: peer 3 is killed at window 4 and restarted 3 s later (its checkpoint, then the others' log)."""
    async def main():
        sim = SpsaSim(SimConfig(peers=4, seed=11), ChurnConfig(rounds=12, inner_steps=16, dim=64), tmp_path)
        victim = sim.peers[3]
        async with sim:
            await sim.start_all()
            await sim.until(lambda: sim.loop(victim).window >= 4, 300, "window 4")
            await sim.kill(victim)
            await asyncio.sleep(3.0)
            await sim.start(victim, restart=True)
            await sim.until(sim.finished, 600, "everyone to finish")
            return _outcome(sim)
    return run_virtual(main())


RUNS = {"diloco-all-to-all": _all_to_all, "diloco-scatter": _scatter, "streaming-diloco": _streaming,
        "spsa": _spsa}


def _expected() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_seeded_simulated_run_ends_on_the_recorded_bits(tmp_path, name):
    got = RUNS[name](tmp_path)
    finals = {v["final"] for v in got.values() if v["final"] is not None}
    assert len(finals) == 1, got  # a golden run is one whose live peers agree
    if os.environ.get("WRITE_FIXTURE"):
        data = _expected()
        data[name] = got
        FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return
    assert got == _expected()[name]
