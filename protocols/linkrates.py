"""Link rates, pure (the caller passes the times): what a round measured from each source (``RateMeter``), the
link probe before a run's first round, the members' rate weights in the part assignment (``rate_weights``, from the
rates the others report), and what a slow source changes: coordinators last (``slow_last``), checkpoints from the
fastest first (``fastest_first``), a longer wait for its bytes (``transfer_wait``). ``protocols/exchange.py``
re-exports these names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

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
