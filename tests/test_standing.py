"""Standing (protocols/standing.py): who counts when identities are free, and who is remembered after a partition."""

import pytest

from protocols.standing import EARN, Standing


@pytest.mark.timeout(30)
def test_a_fresh_key_earns_standing_only_by_contributing_and_loses_it_by_missing_rounds():
    s = Standing("me")
    assert not s.counts("fresh") and not s.vouched("fresh")
    for _ in range(EARN - 1):
        s.record({"fresh"})
    assert not s.counts("fresh") and not s.vouched("fresh")
    s.record({"fresh"})
    assert s.counts("fresh")
    s.record(set())
    assert not s.counts("fresh")  # one missed round after just earning it
    assert s.vouched("fresh")  # but its word counted once: its hashes still weigh in choosing the weights


@pytest.mark.timeout(30)
def test_the_other_side_of_a_partition_stays_vouched_for_and_first_in_line_for_a_slot():
    s = Standing("me")
    s.found({"a", "b"})
    for _ in range(10):  # the cut: they miss every round
        s.record(set())
    assert not s.counts("a") and s.vouched("a") and s.vouched("b")
    # in a round that is not for brand-new keys, the remembered peers still get the slots, before any fresh key
    picked = s.newcomers({"a", "fresh1", "fresh2"}, "run/5/0", 2, fresh_ok=False)
    assert picked == ["a"]
    picked = s.newcomers({"a", "b", "fresh1"}, "run/4/0", 2, fresh_ok=True)
    assert set(picked) == {"a", "b"}


@pytest.mark.timeout(30)
def test_a_closed_run_vouches_only_for_its_list():
    s = Standing("me", allow={"a"})
    s.found({"a", "intruder"})
    assert s.vouched("a") and not s.vouched("intruder") and not s.counts("intruder")
