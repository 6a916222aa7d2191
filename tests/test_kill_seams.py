"""The kill bench's seams (tests/dying_peer.py) against the code they wrap: each kill point of
``bench/bench_chaos.py --part kill`` sets up its fault plan and patches in a process that then only prints swarmd's
help, and each kill point at a loop's phase fires in a simulated swarm. A seam that names what the code no longer has
fails here, not in a bench run hours later (the checkpoint phase patched ``protocols.checkpoint.os`` for a day after
the checkpoint's writes moved to ``transport.files``: every run of that phase stopped at its first restart)."""

import random
import subprocess
import sys

import pytest

from bench.bench_chaos import PHASES
from dying_peer import LOOP_PHASES, kill_plan
from swarmd.node.sim import ChurnConfig, DilocoSim, SapoSim, SimConfig, SpsaSim
from swarmd.transport.memory import run_virtual
from swarmproc import REPO

pytestmark = pytest.mark.beside  # subprocesses with no deadline to meet (tests/conftest.py)

POINTS = [f"kill:{loop}:{phase}" for loop, phases in PHASES.items() for phase in phases] + ["reducing", "published"]


@pytest.mark.timeout(170)
def test_every_kill_point_sets_up_its_seams_on_the_current_code():
    failed = {}
    for i in range(0, len(POINTS), 4):  # 4 at a time: each imports torch
        procs = {point: subprocess.Popen([sys.executable, str(REPO / "tests" / "dying_peer.py"), point, "--help"],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for point in POINTS[i:i + 4]}
        for point, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            if proc.returncode != 0 or "Usage" not in out:
                failed[point] = (proc.returncode, err[-800:])
    assert not failed, failed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop,phase", [(loop, phase) for loop, phases in LOOP_PHASES.items() for phase in phases])
def test_every_kill_point_at_a_loop_phase_fires_once_a_round_closed(tmp_path, loop, phase):
    """The kill point's plan on one peer of four (dying_peer.kill_plan, as the bench's victim has it): armed once
    that peer closed a round (an SPSA window), it dies at its phase, here by saying so, before the run ends."""
    assert set(LOOP_PHASES[loop]) <= set(PHASES[loop])

    async def main():
        sim = {"diloco": DilocoSim, "spsa": SpsaSim, "sapo": SapoSim}[loop](
            SimConfig(peers=4, seed=7), ChurnConfig(rounds=4, inner_steps=8, dim=64), tmp_path)
        victim, deaths = sim.peers[3], []
        armed = kill_plan(sim.faults, loop, phase, deaths.append, deaths.append, peer=victim, rng=random.Random(1))
        async with sim:
            await sim.start_all()
            await sim.until(lambda: deaths or sim.finished(), 300, "the kill point or the run's end")
            return armed["on"], deaths, sim.loop(victim).state

    armed, deaths, state = run_virtual(main())
    assert armed and deaths and state != "done", (armed, deaths, state)
