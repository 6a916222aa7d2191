"""Standing (protocols/standing.py): who counts when identities are free, and who is remembered after a partition."""

import pytest

from swarmd.protocols.standing import EARN, Standing

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


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


@pytest.mark.timeout(30)
def test_a_peer_that_judges_itself_sees_its_place_as_the_others_do_after_replaying_their_history():
    """SPSA's rejoin after a partition: the minority replays the majority's windows, in which it was missing; it must
    see itself (and the other rejoiner) as newcomers, as the majority does, so both pick the same slots."""
    majority, rejoiner = Standing("a"), Standing("m1")
    rejoiner.judge_self = True
    founders = {"a", "b", "c", "m1", "m2"}
    history = [founders] * 3 + [{"a", "b", "c"}] * 6  # the cut: m1 and m2 are missing from the majority's windows
    majority.found(founders)
    for contributors in history:
        majority.record(contributors)
    rejoiner.found(founders)
    for _ in range(6):
        rejoiner.record({"m1", "m2"})  # its own side of the cut: the two counted each other
    assert rejoiner.counts("m1") and rejoiner.counts("m2")
    rejoiner.rebuild(founders, history)
    for peer in founders:
        assert rejoiner.counts(peer) == majority.counts(peer), peer
    assert not rejoiner.counts("m1")  # itself too, unlike a loop that always counts itself
    base = {"a", "b", "c", "m1", "m2"}
    assert rejoiner.newcomers(base, "run/9", 1, fresh_ok=False) == majority.newcomers(base, "run/9", 1, fresh_ok=False)
    assert Standing("me").counts("me")  # the default: our own word counts to us
