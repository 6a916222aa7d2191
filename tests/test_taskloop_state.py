"""What every training loop keeps about its task and run (protocols.taskloop) lives in a few holders of one concern
each (protocols.loopstate), so a loop class stays small: the fingerprints, why it stopped (with a refusal's
evidence), the checkpoint, the round timeline with its offenders, the progress writes. The holders keep their
bounds."""

import pytest

from swarmd.protocols.diloco import DilocoConfig
from swarmd.protocols.loopstate import (
    MAX_MISMATCHED, MAX_OFFENDERS, TIMELINE_PEERS, Fingerprints, Halt, RoundTimeline,
)
from swarmd.protocols.task import load
from swarmd.protocols.taskloop import TaskLoop

pytestmark = [pytest.mark.beside, pytest.mark.timeout(60)]  # pure computation (tests/conftest.py)


class _Probe(TaskLoop):
    name = "probe"


def test_the_task_state_is_a_few_holders():
    cfg = DilocoConfig(run="probe", task="tinygpt")
    probe = _Probe()
    probe._init_task(load(cfg.task, cfg.options(), "diloco"))
    # task, runtime, fingerprints, halt, checkpoint, work, round timeline, progress (standing comes at start)
    assert len(vars(probe)) <= 8, sorted(vars(probe))
    assert probe.fp is None and probe.error is None and probe.refused is None
    assert probe.saved is None and probe.resumed is None
    assert list(probe.timeline) == [] and dict(probe.offenders) == {}


def test_a_refusals_evidence_keeps_the_most_recent_peers():
    halt = Halt()
    for i in range(MAX_MISMATCHED + 6):
        halt.saw(f"p{i}", ["layout", str(i)])
    halt.saw("p10", ["layout", "again"])  # seen again: the most recent
    assert len(halt.mismatched) == MAX_MISMATCHED
    assert "p0" not in halt.mismatched and list(halt.mismatched)[-1] == "p10"
    assert halt.mismatched["p10"] == ["layout", "again"]


def test_the_fingerprint_tag_is_layout_and_config():
    assert Fingerprints(own={"layout": "L", "config": "C"}).tag() == ["L", "C"]


def test_the_timeline_records_rounds_offenders_and_late_peers():
    log = RoundTimeline()
    log.record(1, None, 10.12345, 1.5, 4.0, {"a", "b"}, {"c"}, {"b": "norm", "d": "base"}, sent=1000)
    log.record(2, None, 11.0, 1.0, 4.0, {"a"}, set(), {"b": "hash"}, sent=1500)
    first, second = log.rounds
    assert first["bytes_sent"] == 1000 and second["bytes_sent"] == 500  # each round's own bytes
    assert first["closed_at"] == 10.123 and first["rejected"] == 2 and first["peers"]["missing"] == ["c"]
    # "base" is no one's fault: only b offended, twice, last in round 2
    assert log.offenders_view() == {"b": {"refused": {"norm": 1, "hash": 1}, "last_round": 2}}
    log.late(1, "c")
    log.late(1, "c")  # once per peer
    log.late(7, "e")  # a round no longer (or never) recorded: nothing
    assert first["late"] == 1 and first["peers"]["late"] == ["c"] and second["late"] == 0


def test_the_timeline_keeps_its_bounds():
    log = RoundTimeline()
    many = {f"p{i:03}" for i in range(TIMELINE_PEERS + 10)}
    log.record(1, 0, 0.0, 0.0, 1.0, many, set(), {p: "norm" for p in many}, sent=0)
    entry = log.rounds[0]
    assert entry["participants"] == len(many) and len(entry["peers"]["participants"]) == TIMELINE_PEERS
    for p in sorted(many):
        log.late(1, p, 0)
    assert entry["late"] == len(many) and len(entry["peers"]["late"]) == TIMELINE_PEERS
    for i in range(MAX_OFFENDERS + 10):
        log.offended(f"q{i}", "norm", 2)
    assert len(log.offenders) == MAX_OFFENDERS and list(log.offenders)[-1] == f"q{MAX_OFFENDERS + 9}"
    assert next(iter(log.offenders_view())) == f"q{MAX_OFFENDERS + 9}"  # the most recent first
