"""The round logic the loops share (protocols/rounds.py), driven by hand with a fake clock: no event loop, no I/O.

The loops' shells around it are tested by tests/test_rounds_sim.py (DiLoCo on the simulator) and the loops' own
multi-process tests."""

import collections

import pytest

from swarmd.protocols import rounds
from swarmd.protocols.rounds import RoundWait, StartBarrier, hash_verdict, plan_wait
from swarmd.protocols.standing import Standing

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def test_majority_vote_breaks_ties_by_a_draw_of_the_voters_for_the_round_not_by_the_hashes():
    assert rounds.majority({"a": "x", "b": "y", "c": "y"}) == "y"
    # a tie: the side of the voter drawn first for the salt, whatever order the votes came in and whatever hashes
    # the two sides hold (a peer cannot win ties by nudging its weights, and the pick is the same on every CPU)
    votes = {"a": "x", "b": "y"}
    first = min(votes, key=lambda v: rounds._tie_rank("run/3/0", v))
    flipped = dict(reversed(votes.items()))
    assert rounds.majority(votes, "run/3/0") == rounds.majority(flipped, "run/3/0") == votes[first]
    assert rounds.majority({"a": "y", "b": "x"}, "run/3/0") == ("y" if first == "a" else "x")
    # over rounds, each voter's side wins some ties
    wins = collections.Counter(rounds.majority({"a": "x", "b": "y"}, f"run/{r}/0") for r in range(64))
    assert wins["x"] > 16 and wins["y"] > 16, wins


def test_start_barrier_announces_every_second_and_starts_a_grace_after_enough_are_ready():
    b = StartBarrier(3, grace=1.0, repeat=1.0)
    assert b.announce(0.0) and not b.announce(0.5) and b.announce(1.01) and not b.announce(1.5)
    assert not b.start(0.0, 1) and not b.start(5.0, 2)  # too few: no start however long
    assert not b.start(5.0, 3)  # enough from now: the grace begins
    assert not b.start(5.5, 3)
    assert not b.start(5.9, 2)  # a peer went quiet: the grace, once begun, stands
    assert b.start(6.0, 2)


def test_start_weights_take_the_majority_and_spend_a_bounded_number_of_asks_on_other_hashes():
    ours, honest, fake = "b" * 32, "c" * 32, "a" * 32
    start = rounds.StartWeights(per_hash=2, total=3)
    assert start.choice(ours, {"h1": honest, "x1": ours}) is None  # most hold ours (us included)
    assert start.choice(ours, {"h1": honest, "h2": honest}) == honest
    assert start.choice(ours, {"h1": honest}) is None and start.choice(honest, {"x1": ours}) == ours  # ties: smaller
    # five fresh keys on one hash: two of its holders are asked, then it no longer counts
    flood = {f"s{i}": fake for i in range(5)}
    assert start.choice(ours, flood) == fake and start.holders(fake, flood) == sorted(flood)
    assert start.ask("s0", fake) and start.ask("s1", fake) and not start.ask("s2", fake)
    assert not start.ask("s0", fake)  # a holder once
    assert start.choice(ours, flood) is None
    # all hashes together: ``total`` asks, then we stay with ours whatever others hold
    assert start.choice(ours, {"h1": honest, "h2": honest}) == honest and start.ask("h1", honest)
    assert start.asks == 3 and start.choice(ours, {"h2": honest, "h3": honest, "h4": honest}) is None
    # the holders of our own hash count with us, asked or not; one we took from may be asked again
    start = rounds.StartWeights(per_hash=1, total=8)
    assert start.ask("h1", honest)
    assert start.choice(honest, {"h1": honest, "x1": ours}) is None  # 2 against 1
    assert start.holders(fake, {"h1": fake}) == []
    start.taken("h1")
    assert start.holders(fake, {"h1": fake}) == ["h1"]

def test_a_round_waits_for_every_counted_peer_to_its_deadline():
    w = RoundWait(frozenset({"a", "b"}), frozenset(), end=10.0, grace=1.0)
    assert w.remaining(0.0, set()) == 10.0
    assert w.remaining(4.0, {"a"}) == 6.0
    assert w.remaining(4.5, {"a", "b"}) is None  # all in: close at once
    assert RoundWait(frozenset({"a", "b"}), frozenset(), end=10.0, grace=1.0).remaining(10.0, {"a"}) is None
    assert w.waited == {"a", "b"}
    # a hair before the end is the end: an event loop fires a timer that close at once, and on virtual time the
    # clock would never get there (found by the SPSA simulation, which spun on it)
    assert RoundWait(frozenset({"a"}), frozenset(), end=10.0, grace=1.0).remaining(10.0 - 1e-12, set()) is None


def test_a_quiet_newcomer_costs_the_grace_and_one_on_its_way_the_deadline():
    quiet = RoundWait(frozenset({"a"}), frozenset({"n"}), end=10.0, grace=1.0)
    assert quiet.remaining(0.0, set()) == 10.0  # a counted peer is missing: the newcomer is not the reason
    assert quiet.remaining(2.0, {"a"}) == 1.0  # a is in: the newcomer's grace begins
    assert quiet.remaining(2.5, {"a"}) == pytest.approx(0.5)
    assert quiet.remaining(3.0, {"a"}) is None  # never announced: not waited for longer
    assert quiet.newcomers_not_waited({"a"}) == 1

    coming = RoundWait(frozenset({"a"}), frozenset({"n"}), end=10.0, grace=1.0)
    assert coming.remaining(2.0, {"a"}, {"n"}) == 1.0
    assert coming.remaining(3.0, {"a"}, {"n"}) == 7.0  # announced, being pulled: to the deadline
    assert coming.remaining(4.0, {"a"}, set()) is None  # its pull failed: close now
    assert coming.newcomers_not_waited({"a"}) == 1
    arrived = RoundWait(frozenset({"a"}), frozenset({"n"}), end=10.0, grace=1.0)
    assert arrived.remaining(2.0, {"a"}) == 1.0
    assert arrived.remaining(2.2, {"a", "n"}) is None and arrived.newcomers_not_waited({"a", "n"}) == 0
    # near the deadline the grace is what is left of it
    late = RoundWait(frozenset({"a"}), frozenset({"n"}), end=10.0, grace=1.0)
    assert late.remaining(9.6, {"a"}) == pytest.approx(0.4)
    assert late.remaining(10.0, {"a"}, {"n"}) is None


def test_a_round_with_no_one_but_us_waits_on_for_peers_still_heard_from_up_to_the_longest_wait():
    # began at 100, deadline 3 (end 103), deadline_high 10: "a" was heard 5 s ago, "b" never
    alone = RoundWait(frozenset({"a", "b"}), frozenset(), end=103.0, grace=1.0)
    assert alone.hold_alone(set(), {"a": 98.0}, now=103.0, began=100.0, longest=10.0) == 1
    assert alone.end == 110.0 and alone.remaining(103.0, set()) == pytest.approx(7.0)
    # someone's contribution came: the hold is over; only contributions on their way are waited for still
    assert alone.remaining(104.0, {"a"}, {"a", "b"}) == pytest.approx(6.0)
    assert alone.remaining(104.0, {"a"}, {"a"}) is None  # "b" never announced (killed meanwhile)
    assert alone.remaining(104.0, set(), {"b"}) == pytest.approx(6.0)  # still alone
    assert alone.hold_alone(set(), {"a": 98.0}, now=110.0, began=100.0, longest=10.0) == 0  # held once, no more
    # someone's contribution is here: not alone, the round closes as it would have
    some = RoundWait(frozenset({"a", "b"}), frozenset(), end=103.0, grace=1.0)
    assert some.hold_alone({"b"}, {"a": 98.0}, now=103.0, began=100.0, longest=10.0) == 0 and some.end == 103.0
    # the peers we wait for went quiet over 2 x deadline_high ago (gone for good) or were never heard: close now
    gone = RoundWait(frozenset({"a", "b"}), frozenset(), end=103.0, grace=1.0)
    assert gone.hold_alone(set(), {"a": 82.9}, now=103.0, began=100.0, longest=10.0) == 0 and gone.end == 103.0
    # a newcomer's slot counts as someone to wait for too
    slot = RoundWait(frozenset(), frozenset({"n"}), end=103.0, grace=1.0)
    assert slot.hold_alone(set(), {"n": 102.0}, now=103.0, began=100.0, longest=10.0) == 1


def test_plan_wait_waits_for_counted_peers_and_gives_the_same_newcomer_slots_everywhere():
    def standing(me):
        s = Standing(me)
        s.found({"a", "b", "c", "d"})
        s.record({"a", "b", "c", "d", "old-newcomer"})  # it contributed once: a streak, no standing yet
        return s

    base = {"a", "b", "c", "d", "old-newcomer", "fresh1", "fresh2"}
    plans = [plan_wait(standing(me), base, "run/7/0", fresh=False, now=100.0, deadline=5.0, grace=1.0, me=me)
             for me in ("a", "b")]
    assert plans[0].expected == {"b", "c", "d"} and plans[1].expected == {"a", "c", "d"}
    # one slot (a quarter of 3, at least one), outside a fresh round only to a peer that contributed before
    assert plans[0].slots == plans[1].slots == {"old-newcomer"}
    assert plans[0].end == 105.0
    fresh = plan_wait(standing("a"), base - {"old-newcomer"}, "run/8/0", fresh=True, now=0.0, deadline=5.0, grace=1.0,
                      me="a")
    assert len(fresh.slots) == 1 and fresh.slots <= {"fresh1", "fresh2"}
    again = plan_wait(standing("b"), base - {"old-newcomer"}, "run/8/0", fresh=True, now=0.0, deadline=5.0,
                      grace=1.0, me="b")
    assert again.slots == fresh.slots  # the same draw at every peer
    # without me: a loop that waits for its own contribution too (SPSA's window holds our batch as anyone's)
    assert "a" in plan_wait(standing("a"), base, "run/7/0", fresh=False, now=0.0, deadline=5.0, grace=1.0).expected


def test_hash_verdict_counts_only_the_peers_whose_word_counts():
    assert hash_verdict("x", {}, me="m", salt="s") is None
    assert hash_verdict("x", {"f1": "y", "f2": "y"}, counts=lambda a: not a.startswith("f"), me="m", salt="s") is None
    v = hash_verdict("x", {"a": "x", "b": "y", "c": "y", "d": "y", "f": "x", "g": "x"}, counts=lambda a: a < "f",
                     me="m", salt="s")  # f and g do not count: 3 to 2, not 3 to 4
    assert not v.agrees and v.majority == "y" and v.holders == ("b", "c", "d")
    # our own hash is a vote too: a tie, decided by the draw, the same side at every peer
    v = hash_verdict("x", {"b": "y"}, me="m", salt="s")
    assert v.majority == rounds.majority({"m": "x", "b": "y"}, "s")
    assert v.agrees == (v.majority == "x")
    there = hash_verdict("y", {"m": "x"}, me="b", salt="s")  # the same round, seen from b
    assert there.majority == v.majority
    assert hash_verdict("x", {"a": "x", "b": "y"}, me="m", salt="s").agrees
    v = hash_verdict("y", {"a": "x", "b": "y"}, me="m", salt="s")
    assert v.agrees and v.holders == ("b",)
    # our own id among theirs (a message of ours that came back) is still one vote, ours
    assert hash_verdict("y", {"m": "x", "a": "x", "b": "y"}, me="m", salt="s").agrees


def test_every_peer_takes_the_coordinators_view_whatever_its_own():
    # the chain is drawn from the last round's members (agreed, so the same everywhere), not from this round's own
    # view: d, which missed c's update this round, still has c's coordinator first, and so do c itself and the rest
    from swarmd.protocols.exchange import order
    last = {"a", "b", "c", "d"}
    chain = tuple(order("run", 3, 0, last))
    coordinator = chain[0]
    for me in sorted(last):
        agreement = rounds.MemberAgreement(me, chain, end=5.0)
        if me == coordinator:
            assert agreement.remaining(0.0, set()) is None and agreement.coordinator(set()) == me
        else:
            assert agreement.remaining(0.0, set()) == 5.0  # its view is waited for
            assert agreement.remaining(1.0, {coordinator}) is None
            assert agreement.coordinator({coordinator, *chain[1:]}) == coordinator
    assert order("run", 4, 0, last)[0] != coordinator or order("run", 5, 0, last)[0] != coordinator  # it rotates


def test_a_coordinator_that_never_says_its_view_costs_one_deadline_and_the_next_one_is_taken():
    agreement = rounds.MemberAgreement("d", ("a", "b", "d"), end=5.0)
    assert agreement.remaining(0.0, {"b"}) == 5.0  # b's view is in, but a (first) is waited for
    assert agreement.remaining(4.0, {"b"}) == 1.0
    assert agreement.remaining(5.0, {"b"}) is None and agreement.coordinator({"b"}) == "b"
    assert agreement.coordinator(set()) == "d"  # no view before ours: our own
    assert rounds.MemberAgreement("d", (), end=5.0).remaining(0.0, set()) is None  # nobody counted: our own
    assert rounds.MemberAgreement("d", (), end=5.0).coordinator(set()) is None


def test_a_coordinator_whose_view_comes_a_span_after_most_of_the_others_takes_the_next_coordinators():
    chain, span = ("a", "b", "c", "d"), 2.0
    came = {"b": 10.0, "c": 10.5, "d": 13.0}  # when each one's view reached a
    # at 12.4 no one has waited a whole span for ours: we coordinate
    assert not rounds.too_late_to_coordinate("a", chain, 12.4, came, span)
    # at 12.5 b and c have (their wait began when they published, before their views reached us): most of three
    assert rounds.too_late_to_coordinate("a", chain, 12.5, came, span)
    assert not rounds.too_late_to_coordinate("a", chain, 12.5, {"b": 10.0, "d": 13.0}, span)  # one of three
    assert not rounds.too_late_to_coordinate("a", ("a",), 99.0, {}, span)  # alone: nobody to follow
    late = rounds.MemberAgreement("a", chain, end=14.5).after(12.5)
    assert late.remaining(12.5, set()) is None  # decided now, not after a span more
    assert late.coordinator({"c", "d"}) == "c" and late.coordinator({"b", "c"}) == "b"  # the others' choice
    assert late.coordinator(set()) == "a"  # none of theirs held: ours after all


def test_a_view_names_peers_by_short_ids_and_counts_the_names_it_cannot_resolve():
    known = {rounds.short_id(p): p for p in ("a", "b")}
    assert len(rounds.short_id("a")) == 8 and rounds.short_id("a") != rounds.short_id("b")
    assert rounds.resolve_view([rounds.short_id("a"), rounds.short_id("b")], known) == ({"a", "b"}, 0)
    assert rounds.resolve_view([rounds.short_id("a"), rounds.short_id("zz"), bytes(8)], known) == ({"a"}, 2)


# ---------------------------------------------------------------------- SAPO's draw
def test_sapo_takes_each_peers_items_once_and_never_its_own():
    from swarmd.protocols.rounds import new_items

    inbox = {"me": (3, ["mine"]), "a": (2, ["a2"]), "b": (5, ["b5"])}
    used = {"b": 5}
    assert new_items(inbox, used, "me") == [("a", 2, ["a2"])]  # b's round 5 was drawn from already
    assert used == {"a": 2, "b": 5}
    assert new_items(inbox, used, "me") == []  # nothing new until a peer shares a newer round
    inbox["a"] = (3, ["a3"])
    assert new_items(inbox, used, "me") == [("a", 3, ["a3"])]


def test_sapo_draws_j_at_random_and_caps_each_source():
    import random

    from swarmd.protocols.rounds import draw

    flood = {"flooder": [f"f{i}" for i in range(100)], "a": ["a0", "a1"], "b": ["b0"]}
    chosen, capped = draw(flood, want=6, per_source=2, rng=random.Random(0))
    by = collections.Counter(author for author, _ in chosen)
    assert len(chosen) == 5 and by == {"flooder": 2, "a": 2, "b": 1}  # the flood fills 2 slots, not all 6
    assert capped == 98  # every other flooder group was passed over
    few, capped = draw({"a": ["a0"]}, want=4, per_source=2, rng=random.Random(0))
    assert few == [("a", "a0")] and capped == 0
    # the same rng, the same draw; over many draws, every group of a source comes up alike (uniform)
    assert draw(flood, 6, 2, random.Random(7)) == draw(flood, 6, 2, random.Random(7))
    counts = collections.Counter(g for seed in range(2000)
                                 for _, g in draw({"a": ["x", "y", "z"]}, 1, 1, random.Random(seed))[0])
    assert set(counts) == {"x", "y", "z"} and min(counts.values()) > 550



def test_sapo_local_groups_are_the_informative_ones_first():
    import random
    from types import SimpleNamespace

    from swarmd.protocols.rounds import pick_local

    own = [SimpleNamespace(name=f"g{i}", informative=i in (1, 5, 6)) for i in range(8)]
    for seed in range(50):
        chosen = pick_local(own, 4, random.Random(seed))
        assert len(chosen) == 4 and len(set(map(id, chosen))) == 4
        assert {g.name for g in chosen[:3]} == {"g1", "g5", "g6"}  # every informative group, before any other
        assert not chosen[3].informative
    assert {g.name for g in pick_local(own, 2, random.Random(0))} <= {"g1", "g5", "g6"}
    assert sorted(g.name for g in pick_local(own, 8, random.Random(0))) == sorted(g.name for g in own)  # I = G: all
    assert pick_local(own, 0, random.Random(0)) == []
    # within a kind the order is random: which uninformative group fills the 4th slot varies with the seed
    assert len({pick_local(own, 4, random.Random(seed))[3].name for seed in range(50)}) == 5

# ---------------------------------------------------------------------- SAPO's useless sources
def _feed(sources, rates: dict, rounds: int, rng, per_round: int = 32, group: int = 4, narrow=()
          ) -> list[tuple[int, str]]:
    """Every source (author -> its policy's chance of a right answer) shares per_round completions a round, in
    groups; returns (round, author) of every penalty, as the loop takes them at each round's close. A ``narrow``
    source's right answers fall on whole questions: each of its items is all right with its chance, else all wrong
    (a small policy that knows some answers and not others)."""
    penalties = []
    for r in range(rounds):
        for author, p in rates.items():
            for _ in range(per_round // group):
                if author in narrow:
                    sources.scored(author, [float(rng.random() < p)] * group)
                else:
                    sources.scored(author, [float(rng.random() < p) for _ in range(group)])
        penalties += [(r, a) for a in rates if sources.to_penalise(a)]
    return penalties


def test_a_source_that_never_scores_is_judged_useless_once_an_honest_policy_4x_weaker_would_have():
    import math
    import random

    from swarmd.protocols.rounds import Sources

    s = Sources("me")
    rates = {"me": 0.3, "a": 0.2, "b": 0.1, "garbage": 0.0}
    penalties = _feed(s, rates, 200, random.Random(1))
    assert {a for _, a in penalties} == {"garbage"}  # no honest source, ever
    # the median of the others' recent hit rates (items with a right answer, 4 completions each): a's 1 - 0.8 ** 4
    bar = s.bar("garbage")
    assert 0.45 < bar < 0.72
    need = math.log(1e-6) / math.log1p(-bar / 4)  # the zero streak an honest policy at bar / 4 reaches w.p. 1e-6
    first = penalties[0][0]
    assert (first + 1) * 8 >= need * 0.8 and first * 8 <= need * 1.25  # 8 items a round
    # penalised when first judged and each time its streak doubled since: log2-many, not one a round
    # (its streak at round r's close is 8 (r + 1) items): 5 in 200 rounds, not one a round
    at = [r for r, _ in penalties]
    assert len(at) == 5 and all(b + 1 == 2 * (a + 1) for a, b in zip(at, at[1:]))
    assert s.useless("garbage") and not s.useless("me")  # we never judge ourselves
    # one right answer ends the streak: no longer useless until a new streak gets that long again
    s.scored("garbage", [0.0, 1.0])
    assert s.get("garbage").streak == 0 and not s.useless("garbage")


@pytest.mark.parametrize("seed", range(5))
def test_an_honest_policy_whose_right_answers_fall_on_whole_questions_is_never_judged(seed):
    """Completions of one question are not independent trials. A narrow policy (every completion right on 30% of
    the questions, all wrong on the rest: mean reward 0.3) next to broad ones (each completion right half the time)
    misses 13 questions in a row, 104 completions, about once in 100 tries. Counting completions, the first rule
    judged it useless there (a policy at a quarter of the median reward, 0.125, would score something in 104
    completions w.p. 1 - 1e-6): in each of these 5 seeds, 1 to 3 times in 300 rounds. Counting questions, it takes
    49 misses in a row (a quarter of the median hit rate, 1 - 0.5 ** 8), about once in 4e7 tries."""
    import random

    from swarmd.protocols.rounds import Sources

    s = Sources("me")
    rates = {"me": 0.5, "a": 0.5, "b": 0.5, "narrow": 0.3}
    assert _feed(s, rates, 300, random.Random(seed), per_round=64, group=8, narrow={"narrow"}) == []
    assert s.get("narrow").items == 2400 and 0.15 < s.get("narrow").hits < 0.45


@pytest.mark.parametrize("seed", range(5))
def test_an_honest_policy_a_third_of_the_median_is_never_judged_and_the_start_of_a_run_judges_nobody(seed):
    import random

    from swarmd.protocols.rounds import Sources

    rng = random.Random(seed)
    s = Sources("me")
    # the start of a run: everyone scores 0 (nothing to compare with), then the others learn
    assert _feed(s, {"me": 0.0, "a": 0.0, "weak": 0.0}, 100, rng) == []
    rates = {"me": 0.45, "a": 0.3, "strong": 0.9, "weak": 0.1}
    assert _feed(s, rates, 300, rng) == []  # 9,600 completions of the weak one, never judged
    # a flood of sources that score nothing does not lower the bar for anyone (a median: it raises nobody's risk)
    flood = {f"zero{i}": 0.0 for i in range(8)}
    penalties = _feed(s, {**rates, **flood}, 100, rng)
    assert {a for _, a in penalties} <= set(flood)


def test_sources_are_bounded():
    from swarmd.protocols.rounds import Sources

    s = Sources("me", max_sources=8)
    for i in range(100):
        s.scored(f"p{i}", [0.0, 1.0])
        s.scored("me", [1.0, 1.0])
    assert len(s.by_peer) == 8 and "me" in s.by_peer  # the one with the fewest items scored gives way


def test_keep_latest_moves_a_key_to_the_newest_and_drops_the_oldest_past_the_cap():
    entries: dict = {}
    for key in "abc":
        rounds.keep_latest(entries, key, key.upper(), 3)
    rounds.keep_latest(entries, "a", "again", 3)  # a is the newest now: b is the oldest
    rounds.keep_latest(entries, "d", "D", 3)
    assert list(entries.items()) == [("c", "C"), ("a", "again"), ("d", "D")]


def test_readys_of_authors_not_listed_yet_are_kept_bounded_and_taken_once_listed():
    held: dict = {}
    for i in range(70):  # a flood of fresh keys that never connect: only the newest 64 stay
        rounds.keep_latest(held, f"k{i}", f"h{i}", 64)
    rounds.keep_latest(held, "b", "hb", 64)
    assert len(held) == 64 and "k0" not in held and "k6" not in held and "k7" in held
    listed = {"b", "k10", "nobody"}
    assert rounds.take_listed(held, listed.__contains__) == [("k10", "h10"), ("b", "hb")]
    assert "b" not in held and "k10" not in held and len(held) == 62
    assert rounds.take_listed(held, listed.__contains__) == []


def test_a_running_founder_answers_a_founder_still_at_its_barrier_once_and_not_a_ready_crossing_its_start():
    answers = rounds.FounderAnswers()
    founders = {"a", "b", "me"}
    assert not answers.due("b", "h", "h", founders, 0.0)  # not started yet
    answers.started_at = 10.0
    assert not answers.due("b", "h", "h", founders, 10.0 + answers.AFTER)  # sent before its own start: crosses ours
    assert not answers.due("b", "other", "h", founders, 20.0)  # ready with other weights: not our run's start
    assert not answers.due("stranger", "h", "h", founders, 20.0)  # not a founder: a fresh key gets no answer
    assert answers.due("b", "h", "h", founders, 20.0)
    assert not answers.due("b", "h", "h", founders, 21.0)  # once
    assert answers.answered == {"b"}
