"""The arithmetic of a round's reduce-scatter + all-gather, pure and deterministic (no I/O).

An update of ``n`` values is cut into ``part_count(n)`` parts of fixed element ranges (the same for every peer and
round), each encoded on its own. At a round's close the participants are put in an order drawn from the round
(``order``); part k is reduced by the k-th peer of that order (round robin; a peer the others measured slow gets
fewer parts: ``rate_weights``, ``reducers``) and audited, in a fraction of rounds, by a next one. A reducer
combines the participants' chunks of its part with the same rule as the all-to-all path (each update scaled by its
clip factor, from the norms every participant announced with its update, then the mean in sorted peer order),
encodes the result with the run's ``reduced_codec`` (its codec, or e3m0 for 1-bit sign updates) and everyone
adopts those bytes: every peer ends with the same combined
update, bit for bit, whoever reduced what (``docs/design/exchange.md``).

The round's decisions are here too, as functions of what arrived (the DiLoCo loop is the I/O around them: pulls,
publishes, waits): whose updates a round combines (``screen_members``), whether a reducer's part is one to take
(``take_reduced``), what an audit or a dispute concludes (``audit_verdict``, ``settle_dispute``), and whether to
conform a part to the coordinator's (``conform_action``).
"""

from __future__ import annotations

import collections
import hashlib
import math
import statistics
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from swarmd.protocols import codecs, kernels

# screening a round's updates (the same rule at every peer, from the round's own data only, so every peer that
# combines the same members refuses the same ones): an update whose announced norm is more than OUTLIER_NORM x the
# median is refused, not only clipped; one whose direction is no closer to the others' than random noise of its size
# would be (cosine below NOISE_SIGMAS / sqrt(n)) is refused as noise
OUTLIER_NORM = 10.0
NOISE_SIGMAS = 5.0
PART_MIN = 16_384  # values: a fragment smaller than this many values per part is cut into fewer parts
MAX_PARTS = 256


def part_count(n: int, want: int) -> int:
    """How many parts an update of ``n`` values is cut into (``want`` at most, each at least PART_MIN values)."""
    return max(1, min(want, MAX_PARTS, n // PART_MIN))


# ``parts = "auto"``: the number of parts follows the swarm. A scatter round's busiest peer takes in (N - 1)/N x S of
# chunks for the parts it reduces, as much of the others' combined parts, and, when it audits a part, that part's
# N - 1 chunks: (N - 1)/parts x S more. With 16 parts at N = 16 that audit alone is about S (2.50 x S in at the
# busiest peer, bench_exchange); so the parts double until the whole fits BYTES_BUDGET x S: 16 (AUTO_PARTS_MIN) up
# to N = 8, 32 to N = 12, 64 to N = 22, 128 to N = 44, then MAX_PARTS
AUTO_PARTS_MIN = 16
AUTO_PARTS = tuple(AUTO_PARTS_MIN << i for i in range((MAX_PARTS // AUTO_PARTS_MIN).bit_length()))  # 16 ... 256
BYTES_BUDGET = 2.2  # x S, a scatter round's bytes in at its busiest peer, audits included


def auto_parts(peers: int, audit: float) -> int:
    """How many parts ``parts = "auto"`` cuts an update into for a round of about ``peers`` participants (the last
    round's: every peer that closed it with the same members gets the same answer) when a fraction ``audit`` of the
    reduced parts is audited: the fewest of AUTO_PARTS that keep a round within BYTES_BUDGET x S (above)."""
    if audit <= 0 or peers < 2:
        return AUTO_PARTS_MIN  # no audit: every peer moves 2 (N - 1)/N x S whatever the parts
    for parts in AUTO_PARTS:
        if 2 * (peers - 1) / peers + (peers - 1) / parts <= BYTES_BUDGET:
            return parts
    return MAX_PARTS


def fewer_bytes(peers: int, update: int, reduced: int) -> str:
    """The exchange that moves fewer bytes through each peer's link in a round of ``peers`` participants, for
    encoded updates of ``update`` bytes whose combined parts are encoded in ``reduced`` bytes in all: all-to-all
    takes in (and serves) each other peer's update, (N - 1) x U; scatter takes in the chunks of the parts a peer
    reduces and the others' combined parts, (N - 1)/N x (U + R), and serves as much. With a dense codec R is U and
    scatter moves less from 3 peers up; with a sparse one (``topk2``: U about R / 18, since a sum of sparse updates is
    not sparse and its parts travel dense) all-to-all, the all-gather of the sparse updates, moves less up to about
    N = 19 (bench/bench_exchange.py, ``--codec topk2``). A tie goes to scatter (the busiest peer's bytes stay flat in
    N). Pure: every peer that closed the last round with the same members gets the same answer."""
    return "scatter" if (peers - 1) * (update + reduced) <= peers * (peers - 1) * update else "all-to-all"


def part_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def order(run: str, r: int, p: int, members) -> list[str]:
    """The round's order of its participants: who reduces which part (k -> order[k % len]) changes every round,
    so no peer reduces the same part of every round, and no peer can choose its place (its key is fixed first)."""
    return sorted(members, key=lambda a: (hashlib.blake2b(f"{run}/{r}/{p}/{a}".encode(), digest_size=8).digest(), a))


def reducer_of(ordered: list[str], k: int) -> str:
    return ordered[k % len(ordered)]


# who reduces how many parts, from the receive rates the members report in their announcements (``rate_weights``):
# a member's weight is WEIGHT_FULL where the median of what the others measured from it is at least 1/SLOW_FACTOR
# of the REFERENCE_QUANTILE of those medians (a typical fast member), less in proportion below, and 0 under
# 1/(8 x SLOW_FACTOR) of it (no part at all, not a remainder's one). Only members several times slower lose
# parts (equal members keep the round robin, and the noise of rates measured on a busy machine moves nothing),
# and a member cannot claim a rate: others measure it. A transfer is timed as MIN_BUSY at least: one that fast is
# no bottleneck, and shorter times are the event loop's and the link's latency, not the rate
WEIGHT_FULL = 16
SLOW_FACTOR = 4
MIN_BUSY = 0.25
REFERENCE_QUANTILE = 0.75
MAX_RATE_REPORTS = 64  # peers an announcement reports rates for


class RateMeter:
    """The receive rate from each source in one round: its bytes over the time at least one pull from it was under
    way (concurrent pulls from one source share its link: their overlap counts once). A pull that fails adds its
    time and no bytes. Pure: the caller passes the times."""

    def __init__(self) -> None:
        self.active: dict[str, int] = {}
        self.since: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.bytes: dict[str, int] = {}

    def start(self, peer: str, now: float) -> None:
        if not self.active.get(peer):
            self.since[peer] = now
        self.active[peer] = self.active.get(peer, 0) + 1

    def end(self, peer: str, now: float, nbytes: int) -> None:
        if not self.active.get(peer):
            return
        self.active[peer] -= 1
        if not self.active[peer]:
            self.busy[peer] = self.busy.get(peer, 0.0) + max(0.0, now - self.since.pop(peer))
        self.bytes[peer] = self.bytes.get(peer, 0) + nbytes

    def so_far(self, peer: str) -> float | None:
        """Bytes/s from ``peer`` over its pulls that ended so far (one still under way is not counted); None if
        none has ended, or if they took under MIN_BUSY in all: too fast to time, so not a slow source (a 16 KiB
        chunk in 1 ms timed as MIN_BUSY is 64 kB/s, which would call every fast peer slow)."""
        if self.busy.get(peer, 0.0) < MIN_BUSY:
            return None
        return self.bytes.get(peer, 0) / self.busy[peer]

    def rates(self) -> dict[str, float]:
        """Bytes/s per source whose pulls have all ended (a source still pulling is left out), its time taken as
        MIN_BUSY at least."""
        return {peer: self.bytes.get(peer, 0) / max(busy, MIN_BUSY) for peer, busy in self.busy.items()
                if not self.active.get(peer)}


# the link probe before a run's first round: each founder times pulls of blobs the others serve for it (derived
# from the server's id: nothing to announce, and no two peers' alike, so none is already held), PROBE_SIZES in
# turn, until one takes MIN_BUSY (it timed the link, not the latency) or PROBE_SECONDS are spent. Without it round 0
# has no rates: peers behind 50 kB/s uplinks get parts to reduce and the others' spans are a guess, the round
# ends on 4 weights, and a run with two such uplinks of 4 never comes back together (the simulator). Small: it
# only has to tell a slow uplink from the others (a fast link's rate, latency and all, is still far above it), and
# its bytes are on top of the exchange's (sizes up to 1/2 and 4 MiB cost a 4-peer run of a 0.15 MB update 1.8
# updates a peer, past the exchange test's bound of 2.2 x its update a round)
PROBE_SIZES = (1 << 14, 1 << 18)
PROBE_SECONDS = 2.0


def probe_sizes(update_bytes: int) -> list[int]:
    """The probe blobs' sizes for a run whose encoded update is ``update_bytes`` (every peer of a run computes the
    same): PROBE_SIZES, none over 1/16 of an update."""
    cap = max(1, update_bytes // 16)
    return sorted({min(size, cap) for size in PROBE_SIZES})


def probe_payload(peer: str, size: int) -> bytes:
    """The ``size`` bytes ``peer`` serves for the others to time its uplink with."""
    return hashlib.shake_256(f"swarmd/link-probe/{peer}/{size}".encode()).digest(size)


def probe_rate(pulls: Sequence[tuple[int, float, bool]]) -> float | None:
    """Bytes/s from one source's probe pulls, in order ((size, seconds, completed)): the last completed one's rate
    (the largest: the least latency in it); if none completed, the first one's size over its time (it was still
    coming: the link is at most that fast); None without a pull."""
    done = [(size, seconds) for size, seconds, completed in pulls if completed]
    if done:
        size, seconds = done[-1]
        return size / max(seconds, 1e-3)
    if pulls:
        size, seconds, _ = pulls[0]
        return size / max(seconds, 1e-3)
    return None


def slow_last(chain, weights: dict[str, int]) -> tuple[str, ...]:
    """A round's chain of coordinators with the members measured slow (a rate weight under WEIGHT_FULL) moved to
    its end, each group in its order: a coordinator publishes the parts list after its own pulls, which a congested
    uplink holds up behind its uploads (in the simulator a slow coordinator's parts combine a minority's chunks)."""
    return tuple(sorted(chain, key=lambda a: weights.get(a, WEIGHT_FULL) < WEIGHT_FULL))


def measured_rates(members, reports: dict[str, dict[bytes, int]], short) -> dict[str, int]:
    """The rate (kB/s) the others received from each member at, as ``reports`` (member -> {short id: the receive
    rate it measured from that peer in its last exchange}) say: the lower median of the others' reports, so one
    reporter cannot raise it, and a peer cannot report its own. Members nobody reported are left out."""
    members = sorted(members)
    by_short = {short(x): x for x in members}
    values: dict[str, list[int]] = {}
    for m in members:  # each report once (at most MAX_RATE_REPORTS a member): not every member x every reporter
        for sid, rate in reports.get(m, {}).items():
            x = by_short.get(sid)
            if x is not None and x != m:
                values.setdefault(x, []).append(rate)
    return {x: sorted(v)[(len(v) - 1) // 2] for x, v in values.items()}


def fastest_first(peers: Sequence[str], rates: Mapping[str, int]) -> list[str]:
    """``peers`` in the order to take a checkpoint from them: by ``rates`` (what we last received from each in a
    round), the fastest first; a peer not measured counts as fast as the fastest (nothing says it is slow), and
    ties keep the given order. A checkpoint is the whole model: taken from a peer behind a slow uplink it takes 47 s
    in the simulator (2 MB at 50 kB/s), the rounds move on meanwhile, and that uplink, busy serving it, holds up
    the peer's own round too."""
    known = [rates[a] for a in peers if a in rates]
    top = max(known, default=0)
    return sorted(peers, key=lambda a: -rates.get(a, top))


SLOW_SOURCE = 0.25  # a source sending to us at under this fraction of our typical rate is a slow one


def slow_source(rate: float | None, typical: float) -> bool:
    """Whether a source measured at ``rate`` bytes/s (None: not measured; 0: its pulls failed, a stall, not a rate)
    sends to us at under SLOW_SOURCE of our ``typical`` rate."""
    return 0 < (rate or 0) < SLOW_SOURCE * typical


def transfer_wait(need: Mapping[str, int], rates: Mapping[str, float], typical: float, span: float,
                  cap: float) -> float:
    """The time to give pulls of ``need`` (source -> bytes we still need from it) when ``rates`` (source -> the
    bytes/s this round measured from it) say how fast each sends to us: ``span``, or ``cap`` where a source sends
    at under SLOW_SOURCE of the ``typical`` rate (the one ``span`` was planned with). Pulls from a slow source
    complete together at the end of its queue (its uplink serves every requester at once, the others' pulls ahead
    of ours), so neither arrivals nor our own bytes at its rate say when ours come. A source not measured, or
    measured at 0 (its pulls failed: a stall, not a rate), is given ``span``."""
    slow = any(slow_source(rates.get(a), typical) for a, n in need.items() if n > 0)
    return max(span, cap) if slow else span


def rate_weights(members, reports: dict[str, dict[bytes, int]], short) -> dict[str, int]:
    """Each member's weight in the part assignment (``reducers``), from ``reports`` (member -> {short id: the
    receive rate it measured from that peer in its last exchange}); ``short`` maps a peer id to its short id. A
    member nobody reported weighs WEIGHT_FULL. Empty when nothing was reported (the plain round robin)."""
    members = sorted(members)
    measured = measured_rates(members, reports, short)
    if not measured:
        return {}
    ranked = sorted(measured.values())
    reference = ranked[min(len(ranked) - 1, int(REFERENCE_QUANTILE * len(ranked)))]
    if reference <= 0:
        return {}
    weights = {x: (min(WEIGHT_FULL, (SLOW_FACTOR * WEIGHT_FULL * measured[x]) // reference) if x in measured
                   else WEIGHT_FULL) for x in members}
    # under 1/8 of a full weight (over 32x slower than the reference): no parts at all, not a remainder's one
    return {x: w if w >= WEIGHT_FULL // 8 else 0 for x, w in weights.items()}


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


def pack_set(ordered: list[str], subset) -> bytes:
    """A subset of the round's ordered members as a bitmap (bit i: ``ordered[i]``), so a message can say which
    members' chunks a reduced part combines in len(ordered) / 8 bytes."""
    bits = bytearray((len(ordered) + 7) // 8)
    for i, a in enumerate(ordered):
        if a in subset:
            bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def unpack_set(ordered: list[str], bits: bytes) -> frozenset[str] | None:
    """The members a bitmap names (None: not a bitmap over ``ordered``: another length, or a bit past its end)."""
    if len(bits) != (len(ordered) + 7) // 8 or (len(ordered) % 8 and bits[-1] >> (len(ordered) % 8)):
        return None
    return frozenset(a for i, a in enumerate(ordered) if bits[i // 8] >> (i % 8) & 1)


def majority(subset, members) -> bool:
    """Whether a reduced part combines more than half of the round's members' chunks: a part combining fewer is
    not taken from anyone (a reducer or a coordinator naming a few peers, itself among them, would make the part
    theirs)."""
    return 2 * len(subset) > len(members)


def members_digest(members) -> str:
    return hashlib.blake2b("\n".join(sorted(members)).encode(), digest_size=8).hexdigest()


def screen_members(announced: dict[str, tuple[int, float]], parts: int) -> tuple[set[str], dict[str, str]]:
    """Whose updates a round combines, from their announcements alone (``{peer: (its part count, its norm)}``), so
    every peer refuses the same ones before the member digest: an update cut into another number of parts than the
    round's, or with a norm that is not a finite non-negative number (``wrong_shape``), then the norm outliers
    (``norm_outlier``). Returns (members, {refused peer: why})."""
    rejected = {a: "wrong_shape" for a, (n_parts, norm) in sorted(announced.items())
                if n_parts != parts or not math.isfinite(norm) or norm < 0}
    members = set(announced) - set(rejected)
    for a in norm_outliers({a: announced[a][1] for a in members}):
        rejected[a] = "norm_outlier"
    return members - set(rejected), rejected


def names_majority(whose: frozenset[str] | None, members) -> bool:
    """Whether a part's set of members (None: a bitmap naming none of ours) is a majority of the round's: only then
    is the part one to take or to reduce again."""
    return whose is not None and majority(whose, members)


def take_reduced(their_digest: str, digest: str, whose: frozenset[str] | None, members) -> bool:
    """Whether a reducer's published part is one to pull and take. One over our members (``their_digest`` ==
    ``digest``) must name a majority of them (``whose``: the members whose chunks it combines; None: a bitmap that
    names no members of ours); one over another view of the members is taken as it is (the coordinator's
    conformance settles it later)."""
    return their_digest != digest or names_majority(whose, members)


def audit_verdict(their_digest: str, digest: str, theirs: bytes, ours: bytes | None) -> bool:
    """An auditor's verdict on a part it took from its reducer: ``ours`` is the hash of our reduction of exactly
    the chunks the reducer names (None: one of those chunks did not come to us, or its members are another view:
    nothing to compare, so no dispute). True: agreed (or not comparable)."""
    return their_digest != digest or ours is None or ours == theirs


def settle_dispute(theirs: bytes, ours: bytes | None) -> str:
    """A part its auditor disputed, judged by reducing the chunks the reducer names ourselves (``ours``: that
    reduction's hash; None: we could not, a chunk did not come): ``"auditor"`` lied (the reducer's bytes are
    right: keep them), ``"reducer"`` lied (take our reduction), or ``"unknown"`` (take our own reduction)."""
    if ours is None:
        return "unknown"
    return "auditor" if ours == theirs else "reducer"


def conform_action(whose: frozenset[str] | None, members, ours: bytes | None, theirs: bytes) -> str:
    """What to do with a part whose bytes differ from the coordinator's (``whose``: the members whose chunks the
    coordinator's part combines; ``ours``: the hash of our reduction of exactly those chunks, None if one did not
    come to us): ``"not_followed"`` (it names no majority of our members), ``"not_conformed"`` (a chunk it names
    did not come to us), ``"mismatch"`` (its bytes are not what those chunks give: ours kept) or ``"conform"``
    (take it)."""
    if not names_majority(whose, members):
        return "not_followed"
    if ours is None:
        return "not_conformed"
    return "conform" if ours == theirs else "mismatch"


def clip_factors(norms: dict[str, float], clip: float = 2.0) -> dict[str, float]:
    """Each update's scale: its announced L2 norm clipped to ``clip`` x the median norm (the lower median, as
    torch.median takes), as ``outer.combine``'s clipped mean does."""
    if not norms:
        return {}
    limit = clip * statistics.median_low(norms.values())
    if limit <= 0:
        return {a: 1.0 for a in norms}
    return {a: min(1.0, limit / max(v, 1e-30)) for a, v in norms.items()}


def norm_outliers(norms: dict[str, float], limit: float = OUTLIER_NORM) -> set[str]:
    """The peers whose announced norm is more than ``limit`` x the median norm (the lower median; needs 3 peers:
    with 2, which of them is the outlier is a guess)."""
    if len(norms) < 3:
        return set()
    med = statistics.median_low(norms.values())
    if not med > 0:
        return set()
    return {a for a, v in norms.items() if v > limit * med}


GRAM_BLOCK = 1 << 15  # values of each vector a step of ``gram`` multiplies at once (8 x 256 KB: in the cache)
GRAM_BITS = 19  # each value quantized to an integer of at most 2**19: a block's products sum to at most 2**53
GRAM_TINY = 2.0 ** -100  # a vector whose every value is smaller counts as zeros (its integers' scale: 2**119 at most)
GRAM_FLUSH = 1000  # blocks summed in int64 before they are added to Python integers (1000 x 2**53 < 2**63)
GRAM_WINDOW = 1 << 14  # values of each vector the compiled pass copies into one array at a time (8 x 64 KB)
GRAM_FLUSH_VALUES = 1 << 23  # values summed in int64 there before they go to Python integers (2**23 x 2**38 < 2**63)


def gram(vectors: Sequence[torch.Tensor]) -> tuple[list[list[int]], list[int]]:
    """Every pair's dot product, the squared norms on the diagonal, bit for bit the same on every CPU and with any
    thread count. Returns (G, shifts): G is a symmetric k x k matrix of Python integers, the exact dot products of
    the vectors quantized, each to ``round(v * 2**-shift)`` (``shift`` from its largest magnitude, so that value
    becomes an integer of at most 2**GRAM_BITS: about 6 significant digits of it), and ``G[i][j] * 2**(shifts[i] +
    shifts[j])`` is within that quantization of the dot product of the vectors themselves. Why exact: a peer's
    screen must decide as every other peer's does (an auditor that screens otherwise than a part's reducer disputes
    an honest part). A float dot product's low bits follow its summation order, which BLAS chooses by thread count
    and CPU vector width (float32 products differ between 1 and 2 threads for 16 vectors, and between MKL's
    SSE4.2, AVX2 and AVX-512 kernels), and a cosine within rounding of the limit would then fall
    either side.
    Here every product and every partial sum of a block is an integer below 2**53, exact in float64 whatever the
    order; the blocks' sums are added as integers. Block by block over the values (GRAM_BLOCK of each vector in one
    k x GRAM_BLOCK float64 matrix, which one matrix product multiplies by its transpose): each vector is read from
    memory once, not once per pair. A vector of zeros (or of no values) has shift 0 and zero products."""
    k = len(vectors)
    if not k:
        return [], []
    n = vectors[0].numel()
    shifts, scales = [], []
    for v in vectors:
        low, high = torch.aminmax(v) if n else (torch.zeros(()), torch.zeros(()))  # one pass, no |v| copy
        top = max(float(high), -float(low))
        if not (GRAM_TINY <= top < math.inf):  # not finite, zeros, or too small to point anywhere: no products
            shifts.append(0)
            scales.append(0.0)
            continue
        shift = math.frexp(top)[1] - GRAM_BITS  # top < 2**(shift + GRAM_BITS): its integer is at most 2**GRAM_BITS
        shifts.append(shift)
        scales.append(math.ldexp(1.0, -shift))  # a power of two: the scaling itself is exact
    total = [[0] * k for _ in range(k)]
    used = [i for i in range(k) if scales[i]]
    flat = [_flat_f32(v) for v in vectors]  # numpy views of float32 vectors (None: the torch passes)
    if n and all(x is not None for x in flat):
        # one compiled pass a window (kernels.gram_rows): the window's values of each vector copied into one k x
        # GRAM_WINDOW float32 array (in the cache), quantized and multiplied there a tile at a time, every pair's
        # product exact; the int64 sums handed to Python integers every GRAM_FLUSH_VALUES values
        window = np.zeros((k, min(GRAM_WINDOW, n)), np.float32)
        sums = np.zeros((k, k), np.int64)
        factors = np.array(scales, dtype=np.float64)  # 0: the vector's products are not taken
        pending = 0
        for start in range(0, n, GRAM_WINDOW):
            width = min(GRAM_WINDOW, n - start)
            rows = window if width == window.shape[1] else np.zeros((k, width), np.float32)
            for i in used:
                rows[i] = flat[i][start:start + width]
            kernels.gram_rows(rows, factors, sums)
            pending += width
            if pending >= GRAM_FLUSH_VALUES:
                _add_into(total, sums)
                pending = 0
        _add_into(total, sums)
        return total, shifts
    acc = torch.zeros(k, k, dtype=torch.int64)
    block = torch.zeros(k, min(GRAM_BLOCK, n), dtype=torch.float64)  # a vector without products: its row stays 0
    for index, start in enumerate(range(0, n, GRAM_BLOCK)):
        rows = block[:, :min(GRAM_BLOCK, n - start)]
        for i in used:
            # times a power of two (exact), then half to even: the same integers everywhere; one compiled pass
            # (as three passes, the float64 copy, the scaling and the rounding take 7 of a call's 13 ms for 8 x 780K
            # values)
            if flat[i] is not None:
                kernels.quantize(flat[i][start:start + rows.shape[1]], scales[i], rows[i].numpy())
            else:
                rows[i].copy_(vectors[i][start:start + rows.shape[1]]).mul_(scales[i]).round_()
        acc += torch.mm(rows, rows.T).to(torch.int64)  # integers below 2**53: exact, as is their conversion
        if (index + 1) % GRAM_FLUSH == 0:
            _add_into(total, acc)
    _add_into(total, acc)
    return total, shifts


def _add_into(total: list[list[int]], acc) -> None:
    """acc's (int64, a tensor or a numpy array) sums added into ``total``'s Python integers, acc then zeroed."""
    for row, values in zip(total, acc.tolist()):
        for j, value in enumerate(values):
            row[j] += value
    acc.fill(0) if isinstance(acc, np.ndarray) else acc.zero_()


def uncorrelated(vectors: dict[str, torch.Tensor], sigmas: float = NOISE_SIGMAS) -> dict[str, float]:
    """The peers whose vector is no closer in direction to the others' than noise: the upper median of its cosines
    with each other peer is below ``sigmas`` / sqrt(n) (random noise of n values has a cosine of about
    +-1 / sqrt(n) with anything), so an update must point the same way as at least half of the others. Pairwise,
    not against the sum of the others: one large update pointing the wrong way would turn that sum against every
    honest peer. Only in a round where more than half of the updates pass (there is a common direction to judge
    by): where most honest updates are mostly noise, nobody is refused. Returns {peer: that median}. Needs 3 peers
    (with 2, neither is more suspect than the other) and enough values for noise to be told apart (n >= 100); the
    dot products from ``gram`` (exact: every peer decides alike), no stacked copy of the vectors."""
    peers = sorted(vectors)
    n = vectors[peers[0]].numel() if peers else 0
    if len(peers) < 3 or _noise_limit(n, sigmas) is None:
        return {}  # (no products needed)
    g, _ = gram([vectors[a] for a in peers])
    return uncorrelated_in(g, dict(zip(peers, range(len(peers)))), n, sigmas)


def _noise_limit(n: int, sigmas: float) -> float | None:
    """The cosine a vector of n values must reach: sigmas / sqrt(n); None where that is over 0.5 (too few values to
    tell noise from an update)."""
    limit = sigmas / math.sqrt(max(n, 1))
    return None if limit > 0.5 else limit


def uncorrelated_in(g: list[list[int]], rows: dict[str, int], n: int, sigmas: float = NOISE_SIGMAS) -> dict[str, float]:
    """``uncorrelated`` on the peers ``rows`` names, from ``gram``'s integers (``rows``: each peer's row in ``g``;
    a caller that took them for every update screens a subset of them without another pass over the values). The
    cosines are IEEE operations on those integers, correctly rounded: the same on every machine."""
    limit = _noise_limit(n, sigmas)
    if len(rows) < 3 or limit is None:
        return {}
    peers = sorted(rows)
    index = [rows[a] for a in peers]
    sq = [g[i][i] for i in index]
    cos: dict[int, list[float]] = {x: [] for x in range(len(peers))}
    for x in range(len(peers)):
        for y in range(x + 1, len(peers)):
            if sq[x] > 0 and sq[y] > 0:
                c = float(g[index[x]][index[y]]) / math.sqrt(float(sq[x]) * float(sq[y]))
                cos[x].append(c)
                cos[y].append(c)
    medians = {a: statistics.median_high(cos[x]) for x, a in enumerate(peers) if sq[x] > 0 and cos[x]}
    # a round whose updates mostly point nowhere in common (small models, noisy data, few inner steps: a peer's
    # update is mostly its own noise) has no direction to measure anyone against: refuse nobody. Only where most
    # updates agree is one that does not an outlier
    if sum(m >= limit for m in medians.values()) * 2 <= len(medians):
        return {}
    return {a: round(m, 5) for a, m in medians.items() if m < limit}


def gram_norms(g: list[list[int]], shifts: list[int]) -> list[float]:
    """Each vector's L2 norm from ``gram``: sqrt(G[i][i]) x 2**shift, correctly rounded operations on exact
    integers, so every machine gets the same float (torch's norm sums in an order that its kernels choose by
    CPU); within the quantization (about 1e-6 relative) of the norm of the values themselves."""
    return [math.ldexp(math.sqrt(g[i][i]), shift) for i, shift in enumerate(shifts)]


# the rule that turns a part's chunks into its combined bytes, and who audits which part: peers compare reduced
# parts by hash and wait for a part's auditor, so every peer of a run must do both alike; it is part of the run's
# fingerprint (DilocoConfig.shared), and a change of either changes it, so peers of two versions never mix in a run
REDUCE_RULE = ("clip-scaled, summed in sorted peer order, divided by the count (2); audits spread by audit_plan, "
               "a fixed share of parts, reducers of over an even share last (7); all-to-all combines by the same "
               "rule (4); parts assigned by reported rates (5); the screen's dot products exact, on values "
               "quantized to 19 bits (gram, 2); all-to-all's norms from them (gram_norms, 1); no part reduced or "
               "audited across a missing direct path the members announce (cut_members, 1)")

# the rule's text of the older version whose screen takes its dot products by blocks, not exactly: a checkpoint
# that version saved is resumed (DilocoLoop._build's earlier fingerprints), while its nodes never join ours in a round
REDUCE_RULE_BEFORE_EXACT = ("clip-scaled, summed in sorted peer order, divided by the count (2); audits spread by "
                            "audit_plan, a fixed share of parts, reducers of over an even share last (7); all-to-all "
                            "combines by the same rule (4); parts assigned by reported rates (5); the screen's dot "
                            "products by blocks (gram, 1)")


def reduce_part(chunks: dict[str, torch.Tensor], factors: dict[str, float], size: int,
                senders: bool = False) -> torch.Tensor:
    """The combined part: the clip-scaled chunks summed one by one in sorted peer order, then divided by their
    count (zeros if none arrived). Elementwise operations only, in a fixed order, no reduction kernel whose
    summation order depends on the shape (torch's mean over a stack sums small parts in another order than
    large ones), and no stacked copy of every chunk (5.7x faster for 8 chunks of 3.1M values).

    ``senders``: each value divided by the number of chunks not zero there instead (the mean over the peers that
    sent it; ``outer.combine``'s ``senders``)."""
    if not chunks:
        return torch.zeros(size)
    if senders:
        return _sender_mean(chunks, factors)
    peers = sorted(chunks)
    scale = torch.tensor([factors[a] for a in peers], dtype=torch.float32)  # the factors rounded to fp32, once
    flat = [_flat_f32(chunks[a]) for a in peers]
    if all(x is not None and x.size == flat[0].size for x in flat):
        # one compiled pass a chunk, each product rounded, then added (no fused multiply-add): the bits of the
        # torch passes below, in 3 memory streams a chunk where those take 5 (a product buffer written and read)
        out, factor = torch.empty(flat[0].size, dtype=torch.float32), scale.numpy()
        kernels.scaled_copy(out.numpy(), flat[0], factor[0])
        for i in range(1, len(peers)):
            kernels.scaled_add(out.numpy(), flat[i], factor[i])
        return out.div_(len(peers))
    out = chunks[peers[0]].to(torch.float32) * scale[0]
    product = torch.empty_like(out) if len(peers) > 1 else None  # one buffer for every product, not one each
    for i, a in enumerate(peers[1:], 1):
        torch.mul(chunks[a].to(torch.float32), scale[i], out=product)
        out.add_(product)  # a product, then a sum: no fused multiply-add
    return out.div_(len(peers))


def _sender_mean(chunks: dict[str, torch.Tensor], factors: dict[str, float]) -> torch.Tensor:
    """``reduce_part`` with ``senders``: the clip-scaled chunks summed in sorted peer order (a product, then a sum),
    each value divided by how many chunks are not zero there (left zero where none is)."""
    peers = sorted(chunks)
    scale = torch.tensor([factors[a] for a in peers], dtype=torch.float32)
    out = chunks[peers[0]].to(torch.float32) * scale[0]
    count = (chunks[peers[0]] != 0).to(torch.float32)
    for i, a in enumerate(peers[1:], 1):
        chunk = chunks[a].to(torch.float32)
        out.add_(chunk * scale[i])
        count.add_(chunk != 0)
    return out.div_(count.clamp_(min=1))


def _flat_f32(x: torch.Tensor):
    """A contiguous 1-d float32 CPU tensor's values as a numpy array (its memory, no copy), for the kernels; None
    for anything else (the torch passes take it)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or not x.is_contiguous() \
            or x.requires_grad:
        return None
    return x.numpy()


def chunk_ok(chunk: torch.Tensor, size: int, norm: float, checked: bool = False) -> str | None:
    """Why a participant's chunk cannot be used (None: it can): wrong shape, non-finite values, or a part whose
    own norm exceeds the whole update's announced norm (a peer that understated its norm to dodge clipping).
    ``checked``: the chunk comes from ``codecs.decode``, which refuses non-finite values itself (no second pass)."""
    if chunk.dim() != 1 or chunk.numel() != size:
        return "wrong_shape"
    if not checked and not codecs.all_finite(chunk):
        return "non_finite"
    if float(chunk.norm()) > norm * (1 + 1e-3) + 1e-6:
        return "norm_understated"
    return None
