"""A bounded, seeded fuzz run over every decoder reachable from the network or the HTTP endpoint (issue 14): each
input either decodes or is refused with the decoder's declared exception, within a small multiple of its size.
``bench/bench_fuzz.py`` runs the same targets with 10^5 inputs each."""

import random
import tracemalloc

import pytest

from fuzz_targets import all_targets, inputs

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)

N = 1500  # inputs per decoder here (seeds first, then seeded mutations)
FLOOR = 64 << 10  # allocations below this are bookkeeping, not amplification


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    found = all_targets(tmp_path_factory.mktemp("fuzz"))
    yield {t.name: t for t in found}
    for t in found:
        t.close()


NAMES = ["frame", "crdt op", "crdt state", "crdt sync", "dht record", "dht entry", "gossip message", "bulk request",
         "bulk announcement", "tensor codec", "diloco message", "spsa message", "sapo message"]


def test_every_decoder_has_a_target(targets):
    assert sorted(targets) == sorted(NAMES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_decoder_refuses_only_with_declared_errors_within_budget(targets, name):
    target = targets[name]
    rng = random.Random(f"fuzz/{name}")
    undeclared, worst = [], (0.0, b"")
    tracemalloc.start()
    try:
        for data in inputs(target, N, rng):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            try:
                target.call(data)
            except target.declared:
                pass
            except Exception as e:  # noqa: BLE001 - any other exception is the finding
                undeclared.append((type(e).__name__, str(e)[:120], data[:64]))
            ratio = (tracemalloc.get_traced_memory()[1] - before) / max(len(data), FLOOR)
            if ratio > worst[0]:
                worst = (ratio, data[:64])
    finally:
        tracemalloc.stop()
    assert not undeclared, undeclared[:5]
    assert worst[0] <= 16, f"one input allocated {worst[0]:.1f}x its size: {worst[1]!r}"
