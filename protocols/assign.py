"""Who does what in a scatter round, pure and deterministic (no I/O): how an update is cut into parts
(``part_count``, ``part_bounds``), the round's order of its participants (``order``), each part's reducer
(``reducers``: the round robin, weighted by the rates the members measured, ``protocols/linkrates.py``), the audited
parts and their auditors (``audit_plan``), and the members barred from either role for a missing direct path
(``cut_members``, ``barred``). Every peer computes the same assignment from the round and its agreed members.
``protocols/exchange.py`` re-exports these names (``docs/design/exchange.md``).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping, Sequence

from swarmd.protocols.linkrates import MAX_RATE_REPORTS

PART_MIN = 16_384  # values: a fragment smaller than this many values per part is cut into fewer parts
MAX_PARTS = 256


def part_count(n: int, want: int) -> int:
    """How many parts an update of ``n`` values is cut into (``want`` at most, each at least PART_MIN values)."""
    return max(1, min(want, MAX_PARTS, n // PART_MIN))


def part_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def order(run: str, r: int, p: int, members) -> list[str]:
    """The round's order of its participants: who reduces which part (k -> order[k % len]) changes every round,
    so no peer reduces the same part of every round, and no peer can choose its place (its key is fixed first)."""
    return sorted(members, key=lambda a: (hashlib.blake2b(f"{run}/{r}/{p}/{a}".encode(), digest_size=8).digest(), a))


def reducer_of(ordered: list[str], k: int) -> str:
    return ordered[k % len(ordered)]


MAX_UNREACHED_REPORTS = MAX_RATE_REPORTS  # peers an announcement names as reached only through a relay


def cut_members(members, reports: Mapping[str, Sequence[bytes]], short) -> set[str]:
    """The members at either end of a missing direct path between two members, as ``reports`` (member -> the short
    ids of the peers it reaches only through a relay, from its announcement) say: bulk bytes never cross a relay,
    so such a member can neither take the other's chunks (reduce or audit a part) nor be sure to get them. One
    end's report cuts both ends: a member that claims a missing path to others cuts itself too, so no claim makes
    the claimant a reducer, and a claim against every member cuts them all (``barred``: then no one is barred)."""
    by_short = {short(x): x for x in members}
    cut: set[str] = set()
    for m in sorted(members):
        for sid in tuple(reports.get(m, ()))[:MAX_UNREACHED_REPORTS]:
            x = by_short.get(sid)
            if x is not None and x != m:
                cut.update((m, x))
    return cut


def barred(members, cut: set[str]) -> set[str]:
    """Who takes no reducer or auditor role in a round: the ``cut`` members (``cut_members``), where at least one
    member is not cut (someone must reduce); else no one (each part then lacks the chunks its reducer cannot reach,
    as without the reports)."""
    return set(cut) if set(members) - set(cut) else set()


def reducers(ordered: list[str], parts: int, weights: dict[str, int] | None = None) -> list[str]:
    """The reducer of each part: each member gets its share of the parts by weight (largest remainders first, ties
    in the round's order), as a change from the plain round robin ``ordered[k % n]``: a member over its share gives
    up its last parts, and the members under theirs take them, in the round's order, lowest part first. So a change
    of one member's weight moves only the parts its share gained or lost, and a guess of the owners made before
    every member's rate report is in (the prefetch of a round's chunks) is still right for the others: with every
    part placed by a smooth weighted round robin, one weight under full reshuffles the whole interleaving (15 of
    16 parts move where a share loses 2), and 50 of 442 chunks prefetched in a run at N = 8 go unused. Equal
    weights, or none, or all 0: the plain round robin."""
    n = len(ordered)
    w = [max(0, int(weights.get(a, 0))) for a in ordered] if weights else [1] * n
    total = sum(w)
    if total <= 0:
        w, total = [1] * n, n
    quota = [parts * x // total for x in w]
    for i in sorted(range(n), key=lambda i: (-(parts * w[i] % total), i))[:parts - sum(quota)]:
        quota[i] += 1
    owner = [k % n for k in range(parts)]
    held = [range(i, parts, n) for i in range(n)]  # each member's parts in the round robin
    given_up = sorted((k for i in range(n) for k in held[i][quota[i]:]), reverse=True)
    for i in range(n):
        for _ in range(quota[i] - len(held[i])):
            owner[given_up.pop()] = i
    return [ordered[i] for i in owner]


def audit_plan(run: str, r: int, p: int, ordered: list[str], parts: int, fraction: float,
               owners: list[str] | None = None, barred: set[str] = frozenset()) -> dict[int, str]:
    """The round's audited parts (``audited_parts``) and their auditors: each by a peer other than its reducer, the
    first after it in the round's order that audits fewer than ceil(audited / N) parts (parts placed before move
    where that makes room), so no peer audits more than its share: an audit pulls its part's chunks, (N - 1)/parts
    x S more bytes in (with each part's auditor the peer after its reducer, the peer after one whose two parts are
    both drawn audits both, and its bytes in go from 2.2 to 2.6 x S at N = 8). Where every other peer already
    has its share (a reducer of many of the drawn parts), the least loaded other peer audits. A ``barred`` peer
    (``barred``: it lacks a direct path to a member, so it cannot take every chunk) audits nothing while another
    peer than the part's reducer can. Every peer computes the same plan from the round and its agreed order."""
    n = len(ordered)
    if n < 2:
        return {}
    drawn = audited_parts(run, r, p, parts, fraction)
    cap = -(-len(drawn) // n)
    index = {a: i for i, a in enumerate(ordered)}
    reducer = {k: k % n if owners is None else index[owners[k]] for k in drawn}
    held: list[list[int]] = [[] for _ in range(n)]  # peer -> the parts it audits
    # a peer that reduces more than an even share of the parts (its rate weight above others', or the others'
    # below: 8 processes on 2 cores measure each other several times apart) already takes in more chunks: it
    # audits last. Reducing 3 of 16 parts at N = 8 and auditing one, it takes in 2.56 x S; one of 2 parts, 2.19
    share = -(-parts // n)
    busy = collections.Counter(owners or ())

    def others(k: int) -> list[int]:
        after = [(reducer[k] + step) % n for step in range(1, n)]
        able = [j for j in after if ordered[j] not in barred]
        return sorted(able or after, key=lambda j: busy[ordered[j]] > share)  # stable: the round's order otherwise

    def place(k: int, seen: set[int]) -> bool:
        """Give part k an auditor under the cap, moving parts already placed along the way where that frees one
        (an augmenting path: a first-come choice left the last part of 16 with only its own reducer free)."""
        for j in others(k):
            if j in seen:
                continue
            seen.add(j)
            if len(held[j]) < cap:
                held[j].append(k)
                return True
            for moved in list(held[j]):
                held[j].remove(moved)
                if place(moved, seen):
                    held[j].append(k)
                    return True
                held[j].append(moved)
        return False

    for k in drawn:
        if not place(k, set()):
            held[min(others(k), key=lambda j: len(held[j]))].append(k)  # no room under the cap: the least loaded
    return {k: ordered[j] for j in range(n) for k in held[j]}


def audited_parts(run: str, r: int, p: int, parts: int, fraction: float) -> list[int]:
    """The parts of this round that are audited, drawn from the round, so every peer agrees and no reducer knows
    before the round closes (its parts come from the round's members) which of its parts will be checked. Where
    ``fraction`` x ``parts`` is one or more, exactly that many (rounded up or down at random, so that many on
    average): with each part drawn on its own, 64 parts at N = 16 have more than 16 audited in about 4 rounds of
    10, and then some peer audits two. Below one, each part on its own (``audited``): such a round audits at most
    one part or so either way."""
    if fraction >= 1.0:
        return list(range(parts))
    want = fraction * parts
    if want < 1.0:
        return [k for k in range(parts) if audited(run, r, p, k, fraction)]
    count = int(want) + (_draw(f"audit-count/{run}/{r}/{p}") < want - int(want))
    return sorted(sorted(range(parts), key=lambda k: _draw(f"audit/{run}/{r}/{p}/{k}"))[:count])


def audited(run: str, r: int, p: int, k: int, fraction: float) -> bool:
    """Whether part k of this round is drawn for an audit on its own (rounds with under one audited part on
    average: ``audited_parts``)."""
    if fraction >= 1.0:
        return True
    return _draw(f"audit/{run}/{r}/{p}/{k}") < fraction


def _draw(label: str) -> float:
    """A number in [0, 1) drawn from ``label`` (the same at every peer)."""
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "big") / 2**64
