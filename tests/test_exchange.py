"""The reduce-scatter + all-gather update exchange (issue 15): its pure arithmetic, and real node processes that
exchange by it: the same weights everywhere, about 2x an update moved per peer, a lying reducer caught, a peer
killed in the middle of the exchange costs one deadline."""

import collections
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmd.protocols import codecs, exchange, outer, screen
from swarmproc import REPO, Swarm, loop_config, wait_for

CONFIG = """
[loops.diloco]
run = "{run}"
task = "{task}"
rounds = {rounds}
inner_steps = {h}
min_peers = {peers}
inner_lr = 1e-3
deadline_low = 2.0
exchange = "{mode}"
parts = 8
audit = {audit}
checkpoint_every = 0
[loops.diloco.task_options]
d = 128
layers = 2
batch = 8  # the update's size is the model's; the batch only costs CPU
"""


# ------------------------------------------------------------------ the arithmetic
@pytest.mark.beside
def test_parts_cover_the_update_and_every_peer_orders_a_round_the_same_way():
    n = 1_000_003
    k = exchange.part_count(n, 64)
    bounds = exchange.part_bounds(n, k)
    assert k == 61 and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b and b == c for (a, b), (c, _) in zip(bounds, bounds[1:]))
    assert exchange.part_count(100, 64) == 1
    members = [f"peer{i}" for i in range(5)]
    ordered = exchange.order("run", 3, 0, members)
    assert ordered == exchange.order("run", 3, 0, list(reversed(members)))  # not the order we hold them in
    assert ordered != exchange.order("run", 4, 0, members)  # a new order every round
    owners = [exchange.reducer_of(ordered, k) for k in range(10)]
    assert all(owners.count(m) == 2 for m in members)
    plan = exchange.audit_plan("run", 3, 0, ordered, 10, 1.0)
    assert sorted(plan) == list(range(10)) and all(plan[k] != exchange.reducer_of(ordered, k) for k in plan)
    drawn = [exchange.audited_parts("run", r, 0, 10, 0.25) for r in range(2000)]  # 2.5 a round: a fixed count
    assert all(len(d) in (2, 3) for d in drawn) and 4800 < sum(map(len, drawn)) < 5200  # 2.5 a round on average
    assert 400 < sum(0 in d for d in drawn) < 600  # each part in about a quarter of the rounds
    assert exchange.audited_parts("run", 1, 0, 10, 1.0) == list(range(10))
    few = [exchange.audited_parts("run", r, 0, 2, 0.25) for r in range(2000)]  # under one a round: each on its own
    assert any(len(d) == 2 for d in few) and 900 < sum(map(len, few)) < 1100
    assert not exchange.audited_parts("run", 1, 0, 10, 0)


@pytest.mark.beside
def test_parts_go_by_the_rates_the_others_measured_only_slow_peers_reduce_fewer():
    """Who reduces how many parts (``reducers``) from the receive rates the members' announcements report
    (``rate_weights``): equal peers, or no reports, keep the round robin; a peer the others receive 40x slower
    from reduces nothing; a peer 8x slower about half its share; rate noise within 4x moves nothing; one liar
    cannot make a fast peer slow or a slow one fast (the median of the others' reports)."""
    members = [f"peer{i}" for i in range(4)]
    ordered = exchange.order("run", 1, 0, members)
    short = str.encode
    round_robin = [exchange.reducer_of(ordered, k) for k in range(16)]
    assert exchange.reducers(ordered, 16) == round_robin == exchange.reducers(ordered, 16, {})
    assert exchange.rate_weights(members, {}, short) == {}

    def reports(rate_of: dict[str, int], liar: str | None = None, lie: dict[str, int] | None = None):
        out = {m: {short(x): rate_of[x] for x in members if x != m} for m in members}
        if liar is not None:
            out[liar].update({short(x): v for x, v in lie.items()})
        return out

    noisy = {"peer0": 2000, "peer1": 900, "peer2": 1500, "peer3": 700}  # within 4x of the fastest: all full
    weights = exchange.rate_weights(members, reports(noisy), short)
    assert set(weights.values()) == {exchange.WEIGHT_FULL}
    assert exchange.reducers(ordered, 16, weights) == round_robin
    slow = {"peer0": 2000, "peer1": 2000, "peer2": 2000, "peer3": 50}
    weights = exchange.rate_weights(members, reports(slow), short)
    assert weights["peer3"] == 0 and exchange.reducers(ordered, 16, weights).count("peer3") == 0
    assert sorted(collections.Counter(exchange.reducers(ordered, 16, weights)).values()) == [5, 5, 6]
    half = {**slow, "peer3": 250}  # 8x slower: half weight, about half a share (16 x 8 / 56)
    weights = exchange.rate_weights(members, reports(half), short)
    assert weights["peer3"] == exchange.WEIGHT_FULL // 2
    assert exchange.reducers(ordered, 16, weights).count("peer3") == 2
    # two slow of four: the reference is the fast ones (the 3rd quartile), not the median
    two = {"peer0": 2000, "peer1": 2000, "peer2": 50, "peer3": 50}
    assert exchange.reducers(ordered, 16, exchange.rate_weights(members, reports(two), short)).count("peer2") == 0
    # one liar: calls a fast peer slow, the slow one fast; the others' median stands
    lied = reports(slow, liar="peer1", lie={"peer0": 1, "peer3": 10**6})
    assert exchange.rate_weights(members, lied, short) == exchange.rate_weights(members, reports(slow), short)
    # a peer nobody measured (a newcomer) is taken as full; all weights 0 falls back to the round robin
    assert exchange.rate_weights(members, {"peer0": {b"peer1": 5}}, short)["peer2"] == exchange.WEIGHT_FULL
    assert exchange.reducers(ordered, 16, {m: 0 for m in members}) == round_robin
    # the audit plan follows the owners: no part is audited by the peer that reduced it
    owners = exchange.reducers(ordered, 16, exchange.rate_weights(members, reports(slow), short))
    plan = exchange.audit_plan("run", 1, 0, ordered, 16, 1.0, owners)
    assert sorted(plan) == list(range(16)) and all(plan[k] != owners[k] for k in plan)


@pytest.mark.beside
def test_no_part_is_reduced_or_audited_across_a_missing_direct_path_a_member_announces():
    """Bulk bytes never cross a relay, so a member that reaches another only through one cannot take its chunks:
    the members at both ends of a path either announces as missing reduce and audit nothing (while someone else
    can), every other member's share grows, and a claim cuts the claimant too (it cannot make itself a reducer)."""
    members = [f"peer{i}" for i in range(6)]

    def short(x: str) -> bytes:
        return x.encode()[-8:].rjust(8, b"-")
    # a (peer4) and b (peer5) reach each other through a relay only; b's announcement says so, a's does not
    reports = {"peer5": [short("peer4"), short("stranger")], "peer0": []}
    cut = exchange.cut_members(members, reports, short)
    assert cut == {"peer4", "peer5"} and exchange.barred(members, cut) == cut
    for r in range(20):
        ordered = exchange.order("run", r, 0, members)
        weights = {a: 0 if a in cut else exchange.WEIGHT_FULL for a in members}
        owners = exchange.reducers(ordered, 16, weights)
        assert not cut & set(owners) and set(owners) == set(members) - cut
        assert max(collections.Counter(owners).values()) - min(collections.Counter(owners).values()) <= 1
        plan = exchange.audit_plan("run", r, 0, ordered, 16, 1.0, owners, cut)
        assert sorted(plan) == list(range(16)) and not cut & set(plan.values())
        assert all(plan[k] != owners[k] for k in plan)
    # a liar claiming every path missing cuts everyone, itself included: then no one is barred (as without reports)
    lie = {"peer0": [short(x) for x in members]}
    assert exchange.cut_members(members, lie, short) == set(members)
    assert exchange.barred(members, exchange.cut_members(members, lie, short)) == set()
    # and one claiming a path to a single member missing bars itself with it
    assert exchange.cut_members(members, {"peer1": [short("peer2")]}, short) == {"peer1", "peer2"}
    # two members, one cut pair: no one left to reduce, so the plan is the one without reports
    pair = members[:2]
    assert exchange.barred(pair, exchange.cut_members(pair, {"peer0": [short("peer1")]}, short)) == set()


@pytest.mark.beside
def test_a_change_of_one_members_weight_moves_only_the_parts_its_share_gained_or_lost():
    """``reducers`` starts from the round robin and moves only what the shares change: a member over its share
    gives up its last parts, the members under theirs take them. So one member's weight going down (a report that
    came late in the round says it is slow) moves the parts it lost and nothing else, and every member keeps its
    round-robin parts unless its own share fell: what ``DilocoLoop._prefetch`` pulls before the close (the parts
    ours in both the round robin and the weights so far) is still ours at the close. The smooth weighted round
    robin it replaces moved most parts for one such change (15 of 16 where a share lost 2; 50 of 442 prefetched
    chunks unused in a run at N = 8 on loopback)."""
    for n, parts in ((4, 16), (6, 16), (8, 16), (8, 32), (9, 32), (16, 64)):
        members = [f"peer{i}" for i in range(n)]
        for r in range(40):
            ordered = exchange.order("run", r, 0, members)
            full = {a: exchange.WEIGHT_FULL for a in members}
            before = exchange.reducers(ordered, parts, full)
            assert before == [exchange.reducer_of(ordered, k) for k in range(parts)]
            slow = ordered[r % n]
            for weight in (exchange.WEIGHT_FULL // 2, exchange.WEIGHT_FULL // 4, 0):
                after = exchange.reducers(ordered, parts, {**full, slow: weight})
                moved = [k for k in range(parts) if before[k] != after[k]]
                lost = before.count(slow) - after.count(slow)
                assert len(moved) == lost and all(before[k] == slow for k in moved), (n, parts, weight, moved)
                # shares as even as the weights allow: the others differ by one part at most
                counts = collections.Counter(after)
                assert max(counts[a] for a in members if a != slow) - \
                    min(counts[a] for a in members if a != slow) <= 1, counts
                # the prefetch's guess: ours in the round robin and under these weights; still ours under any
                # later weights that lower only someone else's
                for me in members:
                    if me == slow:
                        continue
                    guess = {k for k in range(parts) if after[k] == me and before[k] == me}
                    final = exchange.reducers(ordered, parts, {**full, slow: 0})
                    assert all(final[k] == me for k in guess), (me, guess, final)


@pytest.mark.beside
def test_members_measured_slow_come_last_in_the_chain_of_coordinators_in_their_order():
    chain = ("a", "b", "c", "d", "e")
    full = exchange.WEIGHT_FULL
    assert exchange.slow_last(chain, {}) == chain  # nothing measured: the round's order
    assert exchange.slow_last(chain, {"a": full, "b": full, "c": full}) == chain
    assert exchange.slow_last(chain, {"b": 3, "d": 1, "a": full}) == ("a", "c", "e", "b", "d")
    assert exchange.slow_last(chain, {p: 0 for p in chain}) == chain  # all slow: the round's order again


@pytest.mark.beside
def test_a_members_rate_is_the_lower_median_of_what_the_others_measured_from_it():
    """What a round's span waits on (its slowest member at this rate) and what the part weights come from: one
    reporter cannot raise a member's rate, a member's report of itself counts for nothing, an unknown id is
    ignored, and a member nobody reported is left out."""
    members = ["a", "b", "c", "d"]

    def short(x):
        return x.encode() * 8

    reports = {"a": {short("b"): 50, short("c"): 2000, short("a"): 9999, b"zzzzzzzz": 1},
               "c": {short("b"): 40, short("a"): 1900},
               "d": {short("b"): 99_999, short("a"): 2100, short("c"): 1800}}
    assert exchange.measured_rates(members, reports, short) == {"b": 50, "c": 1800, "a": 1900}
    assert exchange.measured_rates(members, {}, short) == {}


@pytest.mark.beside
def test_a_checkpoint_is_taken_from_the_fastest_source_first_and_an_unmeasured_one_is_not_taken_for_slow():
    rates = {"slow": 50, "fast": 2000, "mid": 400}
    assert exchange.fastest_first(["slow", "mid", "fast"], rates) == ["fast", "mid", "slow"]
    # not measured: as fast as the fastest, in the given order among equals; nothing measured: the given order
    assert exchange.fastest_first(["slow", "new", "fast"], rates) == ["new", "fast", "slow"]
    assert exchange.fastest_first(["b", "a"], {}) == ["b", "a"] and exchange.fastest_first([], rates) == []


@pytest.mark.beside
def test_the_link_probe_times_the_last_pull_that_completed_or_else_the_first_one_still_coming():
    # the sizes: the same at every peer of a run, none over 1/16 of an update
    assert exchange.probe_sizes(100 << 20) == list(exchange.PROBE_SIZES)
    assert exchange.probe_sizes(1 << 20) == [1 << 14, 1 << 16] and exchange.probe_sizes(153_656) == [9_603]
    assert exchange.probe_sizes(1) == [1]
    # each peer serves its own bytes (none is held already by the peer that pulls it), the same each time
    assert exchange.probe_payload("a", 64) == exchange.probe_payload("a", 64) != exchange.probe_payload("b", 64)
    assert len(exchange.probe_payload("a", 1 << 14)) == 1 << 14
    # a fast source: the small pull measured latency, the larger one the link
    assert exchange.probe_rate([(1 << 14, 0.02, True), (1 << 18, 0.5, True)]) == (1 << 18) / 0.5
    # a slow one: the first pull took MIN_BUSY, so it was the only one
    assert exchange.probe_rate([(1 << 14, 1.0, True)]) == 1 << 14
    # the larger pull was cut by the probe's time: the completed one counts
    assert exchange.probe_rate([(1 << 14, 0.02, True), (1 << 18, 1.9, False)]) == (1 << 14) / 0.02
    # none completed in the probe's time: at most that fast
    assert exchange.probe_rate([(1 << 14, 2.0, False)]) == (1 << 14) / 2.0
    assert exchange.probe_rate([]) is None


@pytest.mark.beside
def test_a_rate_meter_counts_concurrent_pulls_from_a_source_once():
    meter = exchange.RateMeter()
    meter.start("a", 0.0)
    meter.start("a", 0.5)  # two chunks from a at once: they share its link
    meter.end("a", 1.0, 100_000)
    meter.start("b", 0.0)
    meter.end("b", 0.01, 100_000)  # a transfer this fast is timed as MIN_BUSY: no bottleneck, no rate from noise
    assert meter.rates() == {"b": 100_000 / exchange.MIN_BUSY}  # a is still pulling: no rate yet
    meter.end("a", 2.0, 100_000)
    meter.start("c", 1.0)
    meter.end("c", 5.0, 0)  # a pull that failed: its time, no bytes
    meter.end("d", 5.0, 10)  # an end without a start is ignored
    assert meter.rates() == {"a": 100_000.0, "b": 100_000 / exchange.MIN_BUSY, "c": 0.0}


@pytest.mark.beside
def test_a_rate_meter_gives_a_sources_rate_so_far_while_pulls_from_it_are_still_under_way():
    meter = exchange.RateMeter()
    assert meter.so_far("a") is None  # nothing ended: not measured
    meter.start("a", 0.0)
    meter.end("a", 2.0, 100_000)
    meter.start("a", 3.0)  # another pull from a under way: rates() leaves a out, so_far counts what ended
    assert "a" not in meter.rates() and meter.so_far("a") == 50_000.0
    meter.start("b", 0.0)
    meter.end("b", 1.0, 0)  # failed: measured at 0
    assert meter.so_far("b") == 0.0
    meter.start("c", 0.0)
    meter.end("c", 0.001, 16_384)  # too fast to time: not a rate (as MIN_BUSY it would read 64 kB/s, "slow")
    assert meter.so_far("c") is None


@pytest.mark.beside
def test_pulls_from_a_slow_source_wait_up_to_the_cap_and_others_one_span():
    """Pulls from a source this round measured sending at under a quarter of the typical rate complete together at
    the end of its queue: they get the cap (deadline_high); a fast source, one not measured, and one measured at 0
    (a stall) get the span."""
    typical, span, cap = 1e6, 1.5, 10.0
    assert exchange.transfer_wait({}, {}, typical, span, cap) == span
    assert exchange.transfer_wait({"a": 16_000}, {"a": 900e3}, typical, span, cap) == span
    assert exchange.transfer_wait({"a": 16_000}, {}, typical, span, cap) == span  # not measured
    assert exchange.transfer_wait({"a": 16_000}, {"a": 0.0}, typical, span, cap) == span  # a stall
    # one chunk from a slow source: its rate to us would bring it within the span, but others' pulls are ahead
    assert exchange.transfer_wait({"a": 16_000, "b": 50_000}, {"a": 18e3, "b": 900e3}, typical, span, cap) == cap
    assert exchange.transfer_wait({"a": 0}, {"a": 18e3}, typical, span, cap) == span  # nothing needed from it
    assert exchange.transfer_wait({"a": 16_000}, {"a": 18e3}, typical, 12.0, cap) == 12.0  # never below the span


@pytest.mark.beside
def test_audits_are_spread_so_no_peer_audits_many_parts():
    """Each audited part has an auditor other than its reducer, and no peer audits more than its share: an audit
    pulls that part's chunks, so two audits put a peer at 2.6 x S in at N = 8 instead of 2.2. Every peer computes
    the same plan."""
    ordered = exchange.order("run", 0, 0, [f"peer{i}" for i in range(8)])
    crowded = 0
    for r in range(300):
        plan = exchange.audit_plan("run", r, 0, ordered, 16, 0.25)
        assert plan == exchange.audit_plan("run", r, 0, list(ordered), 16, 0.25)
        assert sorted(plan) == exchange.audited_parts("run", r, 0, 16, 0.25) and len(plan) == 4
        assert all(plan[k] != exchange.reducer_of(ordered, k) for k in plan)
        loads = collections.Counter(plan.values())
        assert max(loads.values(), default=0) <= -(-len(plan) // 8)
        # the peer after each part's reducer, the rule before: a peer whose successor's two parts were both drawn
        before = collections.Counter(ordered[(k + 1) % 8] for k in plan)
        crowded += max(before.values(), default=0) > max(loads.values(), default=0)
    assert crowded > 30  # rounds in which the old rule gave one peer more audits than the plan does


@pytest.mark.beside
def test_a_peer_that_reduces_more_than_an_even_share_audits_last_so_no_peer_passes_the_byte_budget():
    """Rate weights can give a peer more than an even share of the parts (one peer measured 4x slower at N = 8:
    it reduces 1 part of 16, one other 3). An audit pulls its part's chunks: the peer with 3 parts that also
    audited took in 2.56 x S (its 3 parts' chunks, the other 13 parts, and the audited part's 7 chunks), over the
    2.2 budget; it now audits only where no one else can, and the busiest peer takes in 2.19 x S."""
    n, parts = 8, 16
    members = [f"peer{i}" for i in range(n)]
    for r in range(200):
        ordered = exchange.order("run", r, 0, members)
        weights = {a: exchange.WEIGHT_FULL for a in members} | {ordered[r % n]: exchange.WEIGHT_FULL // 4}
        owners = exchange.reducers(ordered, parts, weights)
        reduces = collections.Counter(owners)
        assert max(reduces.values()) == 3 and min(reduces.values()) == 1
        plan = exchange.audit_plan("run", r, 0, ordered, parts, 0.25, owners)
        audits = collections.Counter(plan.values())
        assert all(plan[k] != owners[k] for k in plan)

        def bytes_in(a: str) -> float:  # x S
            return (reduces[a] * (n - 1) + (parts - reduces[a]) + audits[a] * (n - 1)) / parts

        assert max(bytes_in(a) for a in members) <= exchange.BYTES_BUDGET, (owners, plan)


@pytest.mark.beside
def test_at_sixteen_peers_and_sixty_four_parts_every_peer_audits_one_part_and_a_lone_other_audits_them_all():
    """``parts = "auto"`` gives 64 parts at N = 16: 16 audited parts a round (a fixed share), one per peer, so no
    peer pulls two audited parts' chunks (0.23 x S each). Where every drawn part is one peer's and there is only
    one other, that one audits them all (over its share: there is no one else)."""
    ordered = exchange.order("run", 0, 0, [f"peer{i}" for i in range(16)])
    for r in range(100):
        plan = exchange.audit_plan("run", r, 0, ordered, 64, 0.25)
        assert len(plan) == 16 and set(collections.Counter(plan.values()).values()) == {1}
        assert all(plan[k] != exchange.reducer_of(ordered, k) for k in plan)
    pair = ["peer0", "peer1"]
    plan = exchange.audit_plan("run", 0, 0, pair, 4, 1.0, owners=["peer0"] * 4)
    assert plan == {k: "peer1" for k in range(4)}


@pytest.mark.beside
def test_auto_parts_follow_the_swarm_so_the_busiest_peer_moves_at_most_the_budget():
    """``parts = "auto"``: 16 parts up to N = 8 (as the fixed default was), more beyond, so that a round's busiest
    peer, one audited part's chunks included, takes in at most BYTES_BUDGET x S; without audits 16 whatever N."""
    assert [exchange.auto_parts(n, 0.25) for n in (1, 2, 4, 8, 9, 12, 13, 16, 32, 64)] == \
        [16, 16, 16, 16, 32, 32, 64, 64, 128, 256]
    for n in range(2, 45):
        parts = exchange.auto_parts(n, 0.25)
        assert 2 * (n - 1) / n + (n - 1) / parts <= exchange.BYTES_BUDGET
        assert parts == 16 or 2 * (n - 1) / n + (n - 1) / (parts // 2) > exchange.BYTES_BUDGET  # the fewest
    assert exchange.auto_parts(16, 0.0) == 16
    assert exchange.auto_parts(1000, 0.25) == exchange.MAX_PARTS


@pytest.mark.beside
def test_the_exchange_with_fewer_bytes_is_all_to_all_for_sparse_updates_up_to_about_nineteen_peers():
    """``exchange = "auto"`` takes the exchange that moves fewer bytes per peer: the codecs' own encoded sizes of a
    1M-value update and of its combined parts (a scatter round's combined parts travel in e3m0 for topk2 and sign)."""
    from swarmd.protocols import sparse  # noqa: F401  (registers topk2)

    n = 1 << 20
    size = {name: len(codecs.get(name).encode(torch.zeros(n)).to_wire()) for name in ("none", "e3m0", "sign", "topk2")}
    assert 17 < size["e3m0"] / size["topk2"] < 20  # SparseLoCo's ~14 bits per kept value at 1/64
    # dense updates, combined in the same codec: scatter whatever N (at 2 peers the bytes tie; scatter_min_peers
    # keeps small rounds all-to-all)
    assert {exchange.fewer_bytes(k, size["e3m0"], size["e3m0"]) for k in (2, 3, 4, 8, 64)} == {"scatter"}
    assert exchange.fewer_bytes(4, size["none"], size["none"]) == "scatter"
    # sparse updates: the all-gather of the sparse updates up to 19 peers, scatter (dense combined parts) beyond
    modes = {k: exchange.fewer_bytes(k, size["topk2"], size["e3m0"]) for k in range(2, 40)}
    assert {k for k, m in modes.items() if m == "scatter"} == set(range(20, 40)), modes
    # sign (1 bit) combined in e3m0 (4 bits): all-to-all at 4 peers, scatter from 5
    assert [exchange.fewer_bytes(k, size["sign"], size["e3m0"]) for k in (4, 5)] == ["all-to-all", "scatter"]
    for k in range(2, 40):  # the rule is the bytes each peer takes in
        a2a, sc = (k - 1) * size["topk2"], (k - 1) / k * (size["topk2"] + size["e3m0"])
        assert (modes[k] == "scatter") == (sc <= a2a)


@pytest.mark.beside
def test_parts_reduced_apart_give_the_clipped_mean_of_the_whole_updates():
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(10_000, generator=g)
    updates = {f"p{i}": (signal + torch.randn(10_000, generator=g)) * (1 + 4 * (i == 3)) for i in range(5)}
    # all-to-all's norms, from the exact products (a scatter round's are the ones each peer announced)
    norms = dict(zip(sorted(updates), exchange.gram_norms(*exchange.gram([updates[a] for a in sorted(updates)]))))
    assert all(math.isclose(norms[a], float(u.norm()), rel_tol=1e-5) for a, u in updates.items())
    factors = exchange.clip_factors(norms)
    assert factors["p3"] < 1 and all(factors[a] == 1 for a in norms if a != "p3")
    whole, rejected = outer.combine(updates, 10_000)
    bounds = exchange.part_bounds(10_000, 4)
    parts = torch.cat([exchange.reduce_part({a: u[a0:b0] for a, u in updates.items()}, factors, b0 - a0)
                       for a0, b0 in bounds])
    assert not rejected and torch.equal(parts, whole)  # all-to-all's combination is the same rule, bit for bit
    assert exchange.reduce_part({}, factors, 7).equal(torch.zeros(7))


@pytest.mark.beside
def test_a_part_reduces_to_the_same_bits_however_the_update_is_cut():
    """Peers compare reduced parts by hash: each value of a reduction must depend on its own inputs only, not on
    how large a part is. (torch's mean over a stack of 8 chunks summed parts of 7 values in another order than
    parts of 390,625: the same values gave other bits.)"""
    g = torch.Generator().manual_seed(1)
    chunks = {f"p{i}": torch.randn(1_003, generator=g) * (i + 1) for i in range(16)}
    factors = {a: 0.25 + i / 20 for i, a in enumerate(sorted(chunks))}
    whole = exchange.reduce_part(chunks, factors, 1_003)
    for cut in (1, 7, 64, 333):
        pieces = [exchange.reduce_part({a: c[i:i + cut] for a, c in chunks.items()}, factors, min(cut, 1_003 - i))
                  for i in range(0, 1_003, cut)]
        assert torch.cat(pieces).equal(whole), cut
    # the rule: the fp32 products summed in sorted peer order, then divided by the count
    expected = torch.zeros(1_003)
    for a in sorted(chunks):
        expected = expected + chunks[a] * torch.tensor(factors[a], dtype=torch.float32)
    assert whole.equal(expected / 16)


@pytest.mark.beside
def test_a_part_names_the_members_whose_chunks_it_combines_in_a_bitmap_and_a_minority_is_not_a_part():
    ordered = exchange.order("run", 3, 0, [f"peer{i}" for i in range(11)])
    some = frozenset(ordered[i] for i in (0, 3, 8, 10))
    bits = exchange.pack_set(ordered, some)
    assert len(bits) == 2 and exchange.unpack_set(ordered, bits) == some
    assert exchange.unpack_set(ordered, bits + b"\x00") is None  # a bitmap over another member list
    assert exchange.unpack_set(ordered, bytes([bits[0], bits[1] | 0x80])) is None  # a bit past the members
    assert exchange.unpack_set(ordered[:8], b"\xff") == frozenset(ordered[:8])
    assert not exchange.majority(some, ordered) and exchange.majority(ordered[:6], ordered)
    assert not exchange.majority(ordered[:2], ordered[:4])  # half is no majority


@pytest.mark.beside
def test_a_rounds_decisions_are_functions_of_what_arrived():
    """The round's decisions without a loop or a network (the DiLoCo loop is the I/O around them)."""
    members, refused = exchange.screen_members(
        {"a": (8, 1.0), "b": (8, 1.2), "c": (8, 0.9), "d": (7, 1.0), "e": (8, float("nan")), "f": (8, 500.0)}, 8)
    assert members == {"a", "b", "c"} and refused == {"d": "wrong_shape", "e": "wrong_shape", "f": "norm_outlier"}

    ordered = ["a", "b", "c", "d"]
    most, few = frozenset("abc"), frozenset("ab")
    assert exchange.take_reduced("m", "m", most, ordered)
    assert not exchange.take_reduced("m", "m", few, ordered)  # half is no majority: not a part to take
    assert not exchange.take_reduced("m", "m", None, ordered)  # names none of our members
    assert exchange.take_reduced("other", "m", None, ordered)  # another member view: taken, conformed later

    assert exchange.audit_verdict("m", "m", b"x", b"x") and not exchange.audit_verdict("m", "m", b"x", b"y")
    assert exchange.audit_verdict("m", "m", b"x", None)  # a chunk it names did not come to us: no dispute
    assert exchange.audit_verdict("other", "m", b"x", b"y")  # another member view: nothing to compare

    assert exchange.settle_dispute(b"x", b"x") == "auditor"  # the reducer's bytes are right: the auditor lied
    assert exchange.settle_dispute(b"x", b"y") == "reducer"
    assert exchange.settle_dispute(b"x", None) == "unknown"

    whose = exchange.unpack_set(ordered, exchange.pack_set(ordered, most))
    assert exchange.conform_action(whose, ordered, b"h", b"h") == "conform"
    assert exchange.conform_action(whose, ordered, b"g", b"h") == "mismatch"
    assert exchange.conform_action(whose, ordered, None, b"h") == "not_conformed"  # a chunk it names did not come
    assert exchange.conform_action(exchange.unpack_set(ordered, exchange.pack_set(ordered, few)), ordered, b"h",
                                   b"h") == "not_followed"
    assert exchange.conform_action(exchange.unpack_set(ordered, b"\xff\xff"), ordered, b"h", b"h") == "not_followed"


@pytest.mark.beside
def test_a_chunk_larger_than_its_announced_norm_is_refused():
    chunk = torch.ones(100)
    assert exchange.chunk_ok(chunk, 100, 10.0) is None
    assert exchange.chunk_ok(chunk, 100, 5.0) == "norm_understated"
    assert exchange.chunk_ok(chunk, 99, 10.0) == "wrong_shape"
    assert exchange.chunk_ok(torch.full((100,), float("nan")), 100, 10.0) == "non_finite"


def _numpy_vectors(k: int, n: int, seed: int) -> list[torch.Tensor]:
    """k vectors that share a direction, drawn by numpy (torch's randn draws other values with other CPU kernels:
    these are the same bits wherever the test runs)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n, dtype=np.float32)
    return [torch.from_numpy(base + 3 * rng.standard_normal(n, dtype=np.float32)) for _ in range(k)]


@pytest.mark.beside
@pytest.mark.parametrize("k,n", [(3, 100), (8, exchange.GRAM_BLOCK), (8, 3 * exchange.GRAM_BLOCK + 17), (16, 70_001)])
def test_the_screens_dot_products_are_the_exact_products_of_the_values_quantized(k, n, monkeypatch):
    vectors = _numpy_vectors(k, n, k * n)
    vectors[1] = vectors[1] * 2.0 ** -40  # another scale: its own shift
    g, shifts = exchange.gram(vectors)
    # the reference: each vector rounded to integers of at most 2**19 by numpy, multiplied in int64 (exact)
    q = []
    for v, shift in zip(vectors, shifts):
        a = v.numpy().astype(np.float64)
        assert shift == math.frexp(float(np.abs(a).max()))[1] - exchange.GRAM_BITS
        q.append(np.round(np.ldexp(a, -shift)).astype(np.int64))
        assert np.abs(q[-1]).max() <= 2 ** exchange.GRAM_BITS
    exact = np.stack(q) @ np.stack(q).T
    assert g == [[int(x) for x in row] for row in exact]  # the products of the integers, not close to them: equal
    real = torch.stack(vectors).double()
    real = (real @ real.T).tolist()
    for i in range(k):
        for j in range(k):
            value = math.ldexp(g[i][j], shifts[i] + shifts[j])  # back in the values' own units
            scale = math.sqrt(real[i][i] * real[j][j])
            assert abs(value - real[i][j]) <= 1e-5 * scale
    norms = exchange.gram_norms(g, shifts)
    assert all(math.isclose(norms[i], math.sqrt(real[i][i]), rel_tol=1e-5) for i in range(k))
    monkeypatch.setattr(screen, "GRAM_FLUSH", 2)  # the int64 sums handed to Python integers every 2 blocks
    assert exchange.gram(vectors) == (g, shifts)
    # and the screen on them refuses what it refused before: one vector of noise among those that agree
    noise = torch.randn(n, generator=torch.Generator().manual_seed(n))
    named = {f"p{i}": v for i, v in enumerate(vectors)}
    assert set(exchange.uncorrelated({**named, "noise": noise})) == ({"noise"} if n > 100 else set())


@pytest.mark.beside
def test_a_vector_of_zeros_too_small_or_not_finite_has_no_products():
    ones = torch.ones(1000)
    for odd in (torch.zeros(1000), torch.full((1000,), exchange.GRAM_TINY / 2), torch.full((1000,), math.inf)):
        g, shifts = exchange.gram([ones, odd])
        assert shifts == [-18, 0] and g == [[1000 * 2 ** 36, 0], [0, 0]]
    assert exchange.gram([]) == ([], [])
    assert exchange.gram([torch.ones(0)]) == ([[0]], [0])


# what the other process computes: the screen's products and an all-to-all combination with a clipped update
_SAME_EVERYWHERE = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_exchange import _screened
print(json.dumps(_screened()))
"""


def _screened() -> dict:
    vectors = _numpy_vectors(16, 98_321, 7)
    vectors[3] = vectors[3] * 5  # clipped in the combination
    g, shifts = exchange.gram(vectors)
    named = {f"p{i:02}": v for i, v in enumerate(vectors)}
    combined, rejected = outer.combine(named, vectors[0].numel())
    return {"gram": g, "shifts": shifts, "norms": [x.hex() for x in exchange.gram_norms(g, shifts)],
            "rejected": rejected, "combined": hashlib.sha256(combined.numpy().tobytes()).hexdigest()}


@pytest.mark.beside
@pytest.mark.timeout(120)
def test_the_screen_and_an_all_to_all_combination_are_the_same_bits_with_any_threads_and_cpu_kernels():
    """Peers run on other CPUs and thread counts: the screen's products and the all-to-all's norms must not follow
    them (plain float32 products differ between 1 and 2 threads for 16 vectors, and between MKL's SSE4.2, AVX2
    and AVX-512 kernels). Here: 1 and 2 threads, and another process whose MKL and ATen use
    their SSE4.2 and scalar kernels."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _screened()
        torch.set_num_threads(2)
        two = _screened()
    finally:
        torch.set_num_threads(before)
    assert one == two
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SAME_EVERYWHERE], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    other = json.loads(out.stdout)
    assert other == json.loads(json.dumps(one))  # (JSON: the rejections' dict as the other process wrote it)


@pytest.mark.beside
def test_a_chunk_the_codec_decoded_skips_the_finite_check_the_codec_made_but_not_the_norm_check():
    nan = torch.full((100,), float("nan"))
    assert exchange.chunk_ok(nan, 100, 10.0) == "non_finite"
    # ``checked``: codecs.decode refused such values already; the norm check still runs
    assert exchange.chunk_ok(torch.ones(100), 100, 5.0, checked=True) == "norm_understated"
    assert exchange.chunk_ok(torch.ones(100), 100, 10.0, checked=True) is None
    with pytest.raises(codecs.CodecError):
        codecs.decode(codecs.get("none").encode_wire(torch.ones(100)).replace(
            torch.ones(1).numpy().tobytes(), nan[:1].numpy().tobytes(), 1))


def built_loop(**settings):
    """A DiLoCo loop on tinygpt with its model, fragments and optimizers built (no node around it)."""
    from types import SimpleNamespace

    from swarmd.protocols import diloco
    from swarmd.protocols.bulk import BulkService
    from swarmd.protocols.task import load
    from swarmd.transport.identity import Identity

    cfg = diloco.DilocoConfig(**{"run": "t", "task": "tinygpt", **settings})
    loop = diloco.DilocoLoop(None, BulkService(None), cfg, load(cfg.task, cfg.options(), "diloco"))
    loop._ctx = SimpleNamespace(identity=Identity.generate())
    loop._build()
    return loop


@pytest.mark.beside
def test_an_update_claiming_parts_larger_than_the_codec_makes_is_refused_before_any_pull():
    loop = built_loop(parts=4)
    sizes = loop._part_bytes(0)
    body = {"parts": [bytes(32)] * len(sizes), "sizes": list(sizes), "base": "b", "norm": 1.0, "addrs": []}
    assert loop._announced(body, 0) is not None
    assert loop._announced({**body, "sizes": [sizes[0] + 10**6, *sizes[1:]]}, 0) is None  # we would allocate it
    assert loop._announced({**body, "parts": body["parts"] + [bytes(32)], "sizes": sizes + [8]}, 0) is None
    assert loop._announced({**body, "norm": float("nan")}, 0) is None
    # parts = "auto" (the default): a count "auto" gives for some swarm size is taken, any other is not
    auto = built_loop(task="regression", task_options={"dim": 64 * exchange.PART_MIN})
    counts = sorted(auto._part_counts(0))
    assert counts == [16, 32, 64] and auto._want_parts(0) == 16  # (no more than 64 parts of PART_MIN values)
    for count in counts:
        sizes = auto._part_bytes(0, False, count)
        assert auto._announced({**body, "parts": [bytes(32)] * count, "sizes": sizes}, 0) is not None
    body["sizes"] = auto._part_bytes(0, False, 16)
    odd = auto._part_bytes(0, False, 17)
    assert auto._announced({**body, "parts": [bytes(32)] * len(odd), "sizes": odd}, 0) is None


@pytest.mark.beside
@pytest.mark.parametrize("codec", ["int8", "none"])
def test_an_update_prepared_for_scatter_is_not_kept_decoded_and_can_still_be_decoded_whole(codec):
    # (none: lossless, so the update is not decoded at all; what the others decode must still be it, bit for bit)
    from swarmd.protocols import diloco

    loop = built_loop(parts=4, codec=codec)
    with torch.no_grad():
        for param in loop.replica.params:
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.01)
    payloads, hashes, mine, norm, _ = loop._prepare_update(0, whole=True)
    payloads2, hashes2, none, norm2, _ = loop._prepare_update(0, whole=False)
    assert none is None and hashes2 == hashes and norm2 == norm  # scatter: the same bytes, nothing decoded kept
    assert math.isclose(norm, float(mine.norm()), rel_tol=1e-5)  # measured part by part
    pending = diloco.Pending()
    pending.announced[loop._ctx.identity.peer_id] = diloco.Announced(tuple(hashes), tuple(map(len, payloads)), "b",
                                                                     norm, ())
    for h, payload in zip(hashes, payloads):
        loop.bulk.keep_prepared(h, payload)
    assert torch.equal(loop._own_update(pending), mine)  # a round that switched to all-to-all decodes it whole
    loop.bulk.drop(hashes[1:2])
    assert loop._own_update(pending) is None  # a part the store no longer holds: no update, not a wrong one
    if codec == "none":  # the pseudo-gradient, computed without a flat copy of our weights first
        local = torch.cat([loop.replica.params[i].detach().reshape(-1) for i in loop.frag_index[0]])
        assert torch.equal(mine, loop.global_flat[0] - local)


@pytest.mark.beside
@pytest.mark.parametrize("codec", ["e3m0", "none"])
def test_an_update_from_weights_that_are_not_finite_is_not_prepared(codec):
    loop = built_loop(parts=4, codec=codec)
    with torch.no_grad():
        loop.replica.params[-1].view(-1)[0] = float("inf")
    assert loop._prepare_update(0, whole=False) is None  # the codec's own check: no pass of ours before it


# ------------------------------------------------------------------ real nodes
def swarm_of(tmp_path: Path, **params) -> Swarm:
    defaults = dict(run="x", rounds=3, h=10, peers=4, mode="scatter", audit=0.0,
                    task=f"{REPO / 'examples' / 'my_task.py'}:make_task")
    config = loop_config(tmp_path / "diloco.toml", CONFIG.format(**{**defaults, **params}))
    return Swarm(tmp_path / "nodes", config=config)


def d(node) -> dict:
    return node.status()["services"]["diloco"]


def history(node) -> list[tuple]:
    return [(h["round"], h["global_hash"], h["participants"]) for h in d(node)["history"]]


@pytest.mark.swarm
@pytest.mark.timeout(200)
def test_four_peers_exchange_by_reduce_scatter_and_each_moves_about_twice_its_update(tmp_path):
    swarm = swarm_of(tmp_path)
    try:
        nodes = swarm.start_chain(4, members_within=None)
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes], 170,
                         "4 nodes to finish 3 rounds")
        assert history(nodes[0]) == history(nodes[1]) == history(nodes[2]) == history(nodes[3])
        assert [p for _, _, p in history(nodes[0])] == [4, 4, 4]
        for s in final:
            assert s["exchange"]["mode"] == "scatter" and s["exchange"]["members"] == 4
            # who reduced how many parts (by the rates the peers measured: on loopback all within 4x, so all 4)
            assert s["exchange"]["members_reducing"] == 4 and s["exchange"]["parts_reducing"] >= 1, s["exchange"]
            # the span its steps waited, and the slowest member's rate it took into account (measured since round 1)
            assert s["exchange"]["span_seconds"] >= 2.0 and s["exchange"]["slowest_member_kBps"] > 0, s["exchange"]
            assert set(s["exchange"]["phase_seconds_median"]) == {"wait", "agree", "reduce", "conform"}
            assert s.get("parts_fallback", 0) == 0 and s.get("rejected_wrong_shape", 0) == 0
            assert s.get("chunks_prefetched", 0) > 0  # chunks of the parts we reduce move before the close
        bulk = [n.status()["services"]["bulk"] for n in nodes]
        update = final[0]["bytes_sent"] / 3  # one encoded update
        for b in bulk:
            # reduce-scatter: 3 of 4 chunks of our 2 parts in; all-gather: 6 reduced parts in (1.5 x in all), and
            # as much out; the all-to-all would pull 3 whole updates
            assert b["bytes_pulled"] <= 2.2 * 3 * update, (b["bytes_pulled"], update)
            assert b["bytes_served"] <= 2.2 * 3 * update
        assert sum(b["bytes_pulled"] for b in bulk) >= 4 * 1.2 * 3 * update
        # a source's connection carries the next pulls from it (its reduced parts after its chunks, at least):
        # taken from the pool by the pullers, and served as a kept connection's next request by the sources
        assert sum(b.get("connections_reused", 0) for b in bulk) > 0, bulk
        assert sum(b.get("served_on_kept_connections", 0) for b in bulk) > 0, bulk
        for b in bulk:
            # held after the last close (round 2): all of round 2's blobs (our update, 3 x 2 chunks and 6 parts of
            # U/8 pulled, our 2 reductions: 2.75 U) and of round 1 only our own (1.25 U), none of round 0
            assert b["bytes"] <= 4.2 * update, (b["bytes"], update)
            assert b.get("blobs_evicted", 0) == 0
        losses = [loss for _, loss in final[0]["losses"]]
        assert losses[-1] < losses[0]
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(200)
def test_a_lying_reducer_is_caught_and_the_round_closes_with_the_honest_weights(tmp_path):
    swarm = swarm_of(tmp_path, run="liar", audit=1.0)
    try:
        honest = swarm.start_chain(3, members_within=None)
        liar = swarm.start("liar", bootstrap=[honest[-1].tcp_addr], entry=[str(REPO / "tests" / "lying_reducer.py")])
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in honest) and [d(n) for n in honest], 170,
                         "the honest nodes to finish")
        assert history(honest[0]) == history(honest[1]) == history(honest[2])
        assert sum(s.get("lying_reducers", 0) for s in final) >= 1
        # every part the liar reduced was audited and replaced by the auditor's, and the liar penalised for it
        assert all(s.get("parts_audited", 0) > 0 for s in final)
        scores = [{p["peer_id"]: p["penalty_score"] for p in n.status()["peers"]} for n in honest]
        assert any(score.get(liar.peer_id, 0) > 0 for score in scores)
        assert sum(n.status()["penalties"].get("bad_data", 0) for n in honest) >= 1
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(200)
def test_a_peer_killed_while_reducing_costs_the_others_a_deadline_not_the_run(tmp_path):
    """kill -9 while the victim reduces its parts (after its announcement: its chunks were served, its reduced parts
    never come). Killed before announcing: a deadline, as a slow peer's (tests/test_rounds_sim.py); after publishing
    a reduced part: the same fallback as here (bench/bench_chaos.py --part kill covers every phase)."""
    swarm = swarm_of(tmp_path, run="kill", rounds=5)
    try:
        nodes = swarm.start_chain(3, members_within=None)
        victim = swarm.start("victim", bootstrap=[nodes[-1].tcp_addr],
                             entry=[str(REPO / "tests" / "dying_peer.py"), "reducing"])
        wait_for(lambda: victim.proc.poll() is not None, 120, "the victim to die")
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes], 160,
                         "the survivors to finish")
        assert final[0]["final_hash"] == final[1]["final_hash"] == final[2]["final_hash"]
        assert final[0]["history"][-1]["participants"] == 3 and final[0]["history"][-1]["round"] == 4
        assert max(h["participants"] for h in final[0]["history"]) == 4
        # the victim's parts of the round it died in: reduced by a survivor itself, or taken from one that did (an
        # honest fallback has the victim's bytes, so its hash: another survivor may pull it from there)
        assert all(s.get("parts_fallback", 0) + s.get("parts_from_other_holders", 0) >= 1 for s in final)
        assert sum(s.get("parts_fallback", 0) for s in final) >= 1
        assert sum(s.get("resyncs", 0) for s in final) == 0
        # the deadline was spent once, not every round
        assert sum(s.get("deadline_missed", 0) for s in final) <= 3
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(200)
# a noise update in scatter mode: tests/test_rounds_sim.py (the same round code, in one process)
@pytest.mark.parametrize("behaviour,mode,reason", [("same", "all-to-all", "replayed")])
def test_a_byzantine_update_is_refused_penalised_and_shown_and_the_honest_peers_agree(tmp_path, behaviour, mode,
                                                                                      reason):
    swarm = swarm_of(tmp_path, run=f"byz-{behaviour}", mode=mode, audit=1.0, rounds=4)
    try:
        honest = swarm.start_chain(3, members_within=None)
        byz = swarm.start("byz", bootstrap=[honest[-1].tcp_addr],
                          entry=[str(REPO / "tests" / "byzantine_peer.py"), f"diloco:{behaviour}"])
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in honest) and [d(n) for n in honest], 170,
                         "the honest nodes to finish")
        assert history(honest[0]) == history(honest[1]) == history(honest[2])
        # refused (a replay from its second round on), after which it has lost its standing and is no longer
        # waited for; no honest peer was ever refused
        for s in final:
            assert set(s["offenders"]) == {byz.peer_id}, s["offenders"]
            assert s["offenders"][byz.peer_id]["refused"].get(reason, 0) >= 1
            assert s.get("lying_reducers", 0) == 0 and s.get("lying_auditors", 0) == 0
            assert all(h["participants"] == 3 for h in s["history"][1:])
        scores = [{p["peer_id"]: p["penalty_score"] for p in n.status()["peers"]} for n in honest]
        assert all(score.get(byz.peer_id, 0) > 0 for score in scores)
        assert all(score.get(n.peer_id, 0) == 0 for score in scores for n in honest)
        losses = [loss for _, loss in final[0]["losses"]]
        assert losses[-1] < losses[0]
    finally:
        swarm.close()
