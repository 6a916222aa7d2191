import logging

import pytest

from swarmd.transport.penalties import PeerPenalties, RateLimitedLog

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_ban_after_threshold_and_expiry():
    clock = Clock()
    p = PeerPenalties(ban_threshold=100, ban_seconds=60, half_life=60, clock=clock)
    p.penalize("A", "bad_signature")
    assert not p.is_banned("A")
    p.penalize("A", "bad_signature")
    assert p.is_banned("A") and p.banned() == ["A"]
    assert p.offences("A") == {"bad_signature": 2} and p.totals["bad_signature"] == 2
    clock.t += 61
    assert not p.is_banned("A")
    assert not p.is_banned("B")


def test_score_decays():
    clock = Clock()
    p = PeerPenalties(half_life=10, clock=clock)
    p.penalize("A", "malformed")  # weight 10
    clock.t += 10
    assert abs(p.score("A") - 5.0) < 1e-6
    # slow offenders never reach the ban threshold
    for _ in range(100):
        clock.t += 60
        p.penalize("A", "malformed")
    assert not p.is_banned("A")


def test_rate_limited_log(caplog):
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("t"), interval=10, clock=clock)
    with caplog.at_level(logging.WARNING):
        assert log.log(logging.WARNING, "k", "bad thing")
        for _ in range(5):
            assert not log.log(logging.WARNING, "k", "bad thing")
        assert log.log(logging.WARNING, "other", "other thing")
        clock.t += 11
        assert log.log(logging.WARNING, "k", "bad thing")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad thing", "other thing", "bad thing (5 similar suppressed)"]


def test_peer_table_is_bounded():
    p = PeerPenalties(max_peers=100, clock=Clock())
    for i in range(1000):
        p.penalize(f"P{i}", "malformed")
    assert len(p._peers) <= 100


def test_token_buckets_refill_bound_their_keys_and_refuse_new_ones_when_full():
    from swarmd.transport.penalties import TokenBuckets

    now = [0.0]
    b = TokenBuckets(rate=1.0, burst=2.0, max_keys=2, clock=lambda: now[0])
    assert [b.allow("a") for _ in range(3)] == [True, True, False]
    now[0] += 1.0
    assert b.allow("a") and not b.allow("a")  # one token back per second
    assert b.allow("b") and not b.allow("c")  # two keys at most: a third is refused while both are in use
    now[0] += 10.0  # both refilled: pruned to make room
    assert b.allow("c") and len(b) == 1
