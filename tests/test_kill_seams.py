"""The kill bench's seams (tests/dying_peer.py) against the code they wrap: each kill point of
``bench/bench_chaos.py --part kill`` sets up its patches in a process that then only prints swarmd's help. A seam
that names what the code no longer has fails here, not in a bench run hours later (the checkpoint phase patched
``protocols.checkpoint.os`` for a day after the checkpoint's writes moved to ``transport.files``: every run of
that phase stopped at its first restart)."""

import subprocess
import sys

import pytest

from bench.bench_chaos import PHASES
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
