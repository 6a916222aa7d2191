"""The FaultPlan (protocols/faults.py): which reported events a fault acts on, and what each kind of fault does."""

import asyncio
from types import SimpleNamespace

import pytest

from swarmd.protocols.faults import FaultPlan

pytestmark = pytest.mark.beside  # pure computation (tests/conftest.py)


def _loop(peer: str):
    """What a plan reads of a loop: its peer id."""
    return SimpleNamespace(_ctx=SimpleNamespace(identity=SimpleNamespace(peer_id=peer)))


A, B = _loop("peer-a"), _loop("peer-b")


@pytest.mark.timeout(10)
def test_an_empty_plan_is_falsy_and_changes_nothing():
    plan = FaultPlan()
    assert not plan
    assert plan.altered("update", A, 5, r=1, p=0) == 5 and not plan.drops("message", A, r=1)


@pytest.mark.timeout(10)
def test_a_fault_acts_only_on_the_peer_round_fragment_source_and_kind_it_names():
    plan = FaultPlan()
    plan.alter("update", lambda e, v: v * 10, peer="peer-a", round=2, fragment=1)
    plan.drop("message", source="peer-b", kind="reduced")
    assert plan
    assert plan.altered("update", A, 1, r=2, p=1) == 10
    assert plan.altered("update", A, 1, r=2, p=0) == 1  # another fragment
    assert plan.altered("update", A, 1, r=3, p=1) == 1  # another round
    assert plan.altered("update", B, 1, r=2, p=1) == 1  # another peer
    assert plan.altered("checkpoint", A, 1, r=2, p=1) == 1  # another phase
    assert plan.drops("message", A, source="peer-b", kind="reduced")
    assert not plan.drops("message", A, source="peer-b", kind="update")
    assert not plan.drops("message", A, source="peer-a", kind="reduced")


@pytest.mark.timeout(10)
def test_times_and_when_bound_how_often_a_fault_acts():
    plan = FaultPlan()
    seen = []
    plan.alter("update", lambda e, v: v + 1, times=2)
    plan.drop("message", when=lambda e: seen.append(e.r) or e.r >= 2)
    assert [plan.altered("update", A, 0) for _ in range(4)] == [1, 1, 0, 0]
    assert [plan.drops("message", A, r=r) for r in range(4)] == [False, False, True, True] and seen == [0, 1, 2, 3]


@pytest.mark.timeout(10)
def test_alters_of_one_phase_apply_in_the_order_they_were_added():
    plan = FaultPlan()
    plan.alter("checkpoint", lambda e, v: {**v, "step": 0})
    plan.alter("checkpoint", lambda e, v: {**v, "step": v["step"] + 1, "by": e.me})
    assert plan.altered("checkpoint", A, {"step": 7}) == {"step": 1, "by": "peer-a"}


@pytest.mark.timeout(10)
def test_enter_delays_signals_fails_and_hangs():
    async def main():
        plan = FaultPlan()
        signalled = []
        plan.delay("joined", 2.0, peer="peer-a")
        plan.signal("checkpoint-served", lambda e: signalled.append((e.me, e.source)))
        plan.fail("fetch", asyncio.TimeoutError, round=2)
        plan.hang("scatter", after=0.5, then=lambda e: signalled.append(("hung", e.r)))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await plan.enter("joined", A)
        waited = loop.time() - t0
        await plan.enter("joined", B)  # not its peer: at once
        await plan.enter("checkpoint-served", B, source="peer-a")
        with pytest.raises(asyncio.TimeoutError):
            await plan.enter("fetch", A, r=2, source="peer-b")
        await plan.enter("fetch", A, r=3, source="peer-b")
        hung = asyncio.ensure_future(plan.enter("scatter", A, r=4))
        await asyncio.sleep(1.0)
        assert not hung.done()
        hung.cancel()
        return waited, signalled

    from swarmd.transport.memory import run_virtual

    waited, signalled = run_virtual(main())
    assert 2.0 <= waited < 2.1 and signalled == [("peer-b", "peer-a"), ("hung", 4)]


@pytest.mark.timeout(10)
def test_a_watched_phase_is_logged_for_happened():
    plan = FaultPlan()
    plan.watch("publish")
    assert plan  # a watching plan reports events
    assert not plan.happened("publish", me="peer-a", kind="reduced", r=2)
    plan.note("publish", A, r=2, p=0, kind="reduced")
    plan.note("update-sent", A, r=2)  # not watched: not logged
    assert plan.happened("publish", me="peer-a", kind="reduced", r=2)
    assert not plan.happened("publish", me="peer-b", kind="reduced", r=2)
    assert len(plan.log) == 1


@pytest.mark.timeout(10)
def test_on_acts_at_once_where_the_loop_notes_a_phase_it_matches():
    plan = FaultPlan()
    acted = []
    plan.on("publish", lambda e: acted.append((e.me, e.r, e.info["body"])), kind="update", when=lambda e: e.r >= 1)
    assert plan
    plan.note("publish", A, r=0, kind="update", info={"body": "first"})  # before its round
    plan.note("publish", B, r=1, kind="reduced", info={"body": "reduced"})  # another kind
    plan.note("publish", B, r=1, kind="update", info={"body": "second"})
    assert acted == [("peer-b", 1, "second")] and not plan.log  # acting on a phase does not watch it
