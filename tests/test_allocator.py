"""node/allocator.py: what each mode does to a process's large blocks, measured in a fresh process (the settings
are process-wide) by the page faults of allocating the same 8 MB buffer twice."""

import subprocess
import sys

import pytest

from swarmd.node import allocator

PROBE = """
import resource, sys
from swarmd.node import allocator
applied = allocator.configure(sys.argv[1])
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(3):
    before = faults()
    block = bytearray(8 << 20)  # zero-filled: every page written
    counts.append(faults() - before)
    del block
print(applied["library"] or "", *counts)
"""

PAGES = (8 << 20) // 4096


def faults_of(mode: str) -> tuple[str, list[int]]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    *library, a, b, c = result.stdout.split()
    return " ".join(library), [int(a), int(b), int(c)]


@pytest.mark.timeout(120)
@pytest.mark.beside  # two short processes, no deadline to meet
def test_reuse_keeps_a_freed_block_for_the_next_allocation_and_release_gives_it_back():
    library, reuse = faults_of("reuse")
    if not library.startswith("glibc"):
        pytest.skip(f"the C library is not glibc ({library!r}): nothing is set")  # (CI and this machine: glibc)
    _, release = faults_of("release")
    assert reuse[0] >= PAGES * 0.9  # the first time, the pages are new either way
    assert max(reuse[1:]) < PAGES * 0.1, reuse  # then the same pages again
    assert min(release) >= PAGES * 0.9, release  # given back when freed: every page faulted in each time


@pytest.mark.beside
def test_an_unknown_mode_is_refused_and_nothing_is_applied_before_configure():
    with pytest.raises(ValueError):
        allocator.configure("lots")
    assert allocator.applied()["mode"] is None  # this test process never configured it
