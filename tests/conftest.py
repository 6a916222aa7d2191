import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests are derandomized: every run explores the same examples, so a red CI is reproducible and never a
# matter of luck. (Run with --hypothesis-profile=explore to search with fresh randomness.)
# No per-example deadline: a timing check would make a test's verdict depend on the machine's load (these tests run
# beside the real-time ones, at a lower CPU priority).
settings.register_profile("default", derandomize=True, print_blob=True, deadline=None)
settings.register_profile("explore", derandomize=False, max_examples=1000)
settings.load_profile("default")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarmproc import Swarm  # noqa: E402

# The suite runs in two pytest-xdist workers (pyproject's addopts: -n 2 --dist loadgroup). Every test that depends on
# real time (timeouts, deadlines, real sockets, node processes: by default, any test not marked `beside`) goes to
# one worker, which runs them one at a time, as each would run alone on the machine; the tests marked `beside` (pure
# computation, virtual time) go to the other, which lowers its CPU priority so that it takes only what the first
# leaves idle (the real-time tests keep ~1 of 2 cores busy on average) and cannot make a deadline there late.
BESIDE_NICE = 19  # a CFS weight of 15 against 1024: ~1.5% of a contended core


def _beside(item) -> bool:
    return item.get_closest_marker("beside") is not None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group into the test's id
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group("beside" if _beside(item) else "real-time"))
    # a stable sort: the tests marked first, then the rest in file order, then those marked last
    items.sort(key=lambda it: (it.get_closest_marker("last") is not None)
               - (it.get_closest_marker("first") is not None))


_niced = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _niced
    if _beside(item) and not _niced and os.environ.get("PYTEST_XDIST_WORKER"):
        os.nice(BESIDE_NICE)  # this worker only ever runs the `beside` group; what it starts inherits the priority
        _niced = True


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.close()
