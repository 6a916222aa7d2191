"""The exchange's mode, its parts and their sizes, and the links' rates: measured, probed and turned
into a round's time (its span)."""

from __future__ import annotations

import asyncio
import logging
import statistics

import torch
from swarmd.protocols import exchange, rounds
from swarmd.protocols.bulk import BulkError, content_hash
from swarmd.protocols.diloco.pending import Announced, Pending, Received
from swarmd.protocols.diloco.wire import (
    MAX_VIEW,
    RATE_MIN_BYTES,
    _probe_hash,
)

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class LinksMixin:
    """DilocoLoop's links methods (the loop composes them; they share its state)."""

    def _mode(self, p: int) -> str:
        """How this round's updates move: the same answer at every peer that closed the last round with us (it
        depends on that round's participants and on the encoded sizes of an update and of the combined parts,
        which the codecs fix): scatter from ``scatter_min_peers`` and ``scatter_min_bytes``, where it moves fewer
        bytes than all-to-all (``exchange.fewer_bytes``: a sparse codec's all-gather moves less up to ~19 peers)."""
        if self.cfg.exchange != "auto":
            return self.cfg.exchange
        peers = len(self.fragments[p].last_members(self.start_state.initial))
        if peers < self.cfg.scatter_min_peers or self._update_bytes(p) < self.cfg.scatter_min_bytes:
            return "all-to-all"
        return exchange.fewer_bytes(peers, self._update_bytes(p), sum(self._part_bytes(p, reduced=True)))

    def _update_bytes(self, p: int) -> int:
        return sum(self._part_bytes(p))

    def _slowest_rate(self, members: list[str], announced: dict[str, Announced]) -> int | None:
        """The lowest rate (kB/s) at which the others received from one of the round's members last time, as their
        announcements report it (``exchange.measured_rates``); None if none was measured. A member measured at 0
        (it sent nothing: its pulls failed) is a stall, not a rate to wait on, and is left out."""
        rates = exchange.measured_rates(members, {a: dict(announced[a].rates) for a in members if a in announced},
                                        rounds.short_id)
        return min((rate for rate in rates.values() if rate > 0), default=None)

    def _span(self, p: int, slowest: int | None = None, members: int = 1) -> float:
        """The time a round's exchange step is given: the deadline, and each peer moving about 2 x one update at
        ``min_bandwidth``, or at the rate our last scatter steps measured where that is lower (that time capped at
        deadline_high, or at what ``min_bandwidth`` gives where that is more); a peer that stalls costs the others
        one span at most.

        Measured, not only configured: 4 peers on 200 kB/s links (the simulator) exchanging a 0.27 MB update with
        the default 10 MB/s get 0.05 s for seconds of transfers: over seeds 1-8, 4 runs end on 2 or 3 different
        weights, none has fewer than 5 resyncs (1.0 to 1.9 members a round); with the measured rate, 2 end
        split, 4 have 0-1 resyncs and 3.4-4 members; with the coordinator's minority parts replaced as well
        (``ConformStep._majority_parts``), all 8 end on one weights with no resync and 4 members a round
        (``bench/bench_sim.py --slow``).

        And, with ``slowest`` (kB/s: the slowest of the round's ``members`` members' rates, ``_slowest_rate``),
        that member sending each peer its chunks (about 1/N of an update each) at that rate: every peer's steps
        wait on it, not only ours. With our receive rate alone, the fast peers give their steps 1.5 s of a round
        that needs 4 s for a peer whose uplink has fallen to 50 kB/s, give up on its chunks at different times
        and end on different weights (the simulator; ``bench/bench_sim.py --uplink``)."""
        moved = self._update_bytes(p) + sum(self._part_bytes(p, reduced=True))  # the chunks in, the combined out
        need = moved / self._transfer_rate()
        if slowest:
            need = max(need, self._update_bytes(p) / max(1, members) / (slowest * 1000))
        # the measured rate is never above min_bandwidth, so this is never less than what min_bandwidth gives
        transfer = min(need, max(moved / self.cfg.min_bandwidth, self.cfg.deadline_high))
        return max(self.cfg.deadline_low, self.deadline.value()) + transfer

    def _transfer_rate(self) -> float:
        """Bytes/s: ``min_bandwidth``, or the median rate our last scatter steps received at where that is lower."""
        if not self.links.rates:
            return self.cfg.min_bandwidth
        return min(self.cfg.min_bandwidth, statistics.median(self.links.rates))

    def _fold_rates(self, meter: exchange.RateMeter) -> None:
        """A closed round's receive rates per source (kB/s) become the ones we report with our next updates."""
        rates = meter.rates()
        if len(self.links.source_rates) + len(rates) > 4 * MAX_VIEW:
            self.links.source_rates.clear()  # bounded: peers come and go; the next round measures again
        for peer, rate in rates.items():
            self.links.source_rates[peer] = min(2**31, int(rate // 1000))

    def _rates_now(self, pending: Pending, peers) -> dict[str, int]:
        """kB/s from each of ``peers`` as this round measured it so far (its pulls that ended), else as the last
        round did; one measured by neither is left out."""
        out = {}
        for a in peers:
            rate = pending.meter.so_far(a)
            if rate is not None:
                out[a] = int(rate // 1000)
            elif a in self.links.source_rates:
                out[a] = self.links.source_rates[a]
        return out

    def _chunk_source(self, pending: Pending, owner: str, first: str | None) -> str:
        """Whom to ask first for ``owner``'s chunk: ``first`` (a member that holds it) or its owner, whichever this
        round measured faster (``_rates_now``; one not measured counts as fast; a tie keeps ``first``)."""
        if first in (None, self._ctx.identity.peer_id, owner) or first not in pending.announced:
            return owner
        return exchange.fastest_first([first, owner], self._rates_now(pending, (first, owner)))[0]

    def _rate_reports(self, p: int) -> tuple[tuple[bytes, int], ...]:
        """What our announcement reports: the rates we measured from the last round's members (short ids, sorted)."""
        # round 0: the founders, as the link probe measured them
        last = self.fragments[p].last_members(self.start_state.initial)
        known = sorted((rounds.short_id(a), self.links.source_rates[a]) for a in last if a in self.links.source_rates)
        return tuple(known[:exchange.MAX_RATE_REPORTS])

    def _unreached_reports(self, p: int, r: int) -> tuple[bytes, ...]:
        """What our announcement names as reached only through a relay (short ids, sorted): the peers of the
        round (the last round's members, and those that announced for this one) we are connected to, but not
        directly (behind a symmetric NAT, or punching failed). Every peer keeps reducer and auditor roles off those
        paths (``_owners``). A peer we are not connected to at all (gone, or a partition) is not named: that says
        nothing about a path."""
        pending = self.book.pending.get((r, p))
        me, ctx = self._ctx.identity.peer_id, self._ctx
        peers = self.fragments[p].last_members(self.start_state.initial) | set(pending.announced if pending else ())
        peers.discard(me)
        relayed = [a for a in peers if not ctx.direct(a)]
        if not relayed:
            return ()
        connected = set(ctx.members())
        known = sorted(rounds.short_id(a) for a in relayed if a in connected)
        return tuple(known[:exchange.MAX_UNREACHED_REPORTS])

    def _relayed(self, peer: str) -> bool:
        """Connected to ``peer``, but only through a relay (not gone)."""
        return not self._ctx.direct(peer) and peer in self._ctx.members()

    def _barred(self, ordered: list[str], announced: dict[str, Announced]) -> set[str]:
        """The round's members that take no reducer or auditor role: at an end of a missing direct path the
        members' announcements name (``exchange.cut_members``, ``exchange.barred``)."""
        cut = exchange.cut_members(ordered, {a: announced[a].unreached for a in ordered if a in announced},
                                   rounds.short_id)
        return exchange.barred(ordered, cut)

    async def _serve_probe(self) -> None:
        """Hold the blobs the others' link probe pulls from us (``exchange.probe_payload``), from before the start
        barrier (a peer past it probes at once) until our first round closes."""
        me = self._ctx.identity.peer_id

        def make() -> list[tuple[bytes, bytearray]]:
            out = []
            for size in exchange.probe_sizes(self._update_bytes(0)):
                payload = bytearray(exchange.probe_payload(me, size))
                out.append((content_hash(payload), payload))
            return out

        for blob_hash, payload in await asyncio.to_thread(make):
            self.links.probe_blobs.append(self.bulk.keep_prepared(blob_hash, payload))

    async def _probe_links(self, peers: list[str]) -> None:
        """The founders' rates before round 0 (``exchange.PROBE_SIZES``): from each peer we started with, the
        probe blobs it serves, pulled in turn until one takes MIN_BUSY, all of them within PROBE_SECONDS, at once
        from every peer (as a round pulls). The rates become the ones our first update reports, so round 0's span
        already gives a slow uplink's chunks their time (``_span``), its parts follow the reports (``_owners``), and
        a checkpoint is taken from a fast holder (``exchange.fastest_first``)."""
        sizes = exchange.probe_sizes(self._update_bytes(0))
        end = self.clock.monotonic() + exchange.PROBE_SECONDS

        async def one(peer: str) -> None:
            pulls: list[tuple[int, float, bool]] = []
            for size in sizes:
                left = end - self.clock.monotonic()
                if left <= 0:
                    break
                blob = await asyncio.to_thread(_probe_hash, peer, size)
                t0 = self.clock.monotonic()
                # timed from the source's answer to the last byte: the stream's opening and the request's round
                # trip are latency, not the link's rate (timed from the request, a 16 KiB probe over 2 MB/s links
                # with 150 ms one way measured 35 kB/s in the simulator, under a slow uplink's 50)
                marks: list[float] = []
                try:
                    await self.bulk.pull_from(blob, size, peer, [], timeout=left,
                                              progress=lambda _: marks.append(self.clock.monotonic()))
                    pulls.append((size, marks[-1] - marks[0] if marks else self.clock.monotonic() - t0, True))
                except (BulkError, asyncio.TimeoutError):
                    if self.clock.monotonic() - t0 >= 0.9 * left:  # still coming at the end: at most that fast
                        pulls.append((size, self.clock.monotonic() - (marks[0] if marks else t0), False))
                    break  # anything else (it serves no probe: an older node, not reached directly): no rate
                finally:
                    self.bulk.drop([blob])
                if pulls[-1][1] >= exchange.MIN_BUSY:
                    break
            rate = exchange.probe_rate(pulls)
            if rate is not None:
                self.links.source_rates[peer] = min(2**31, int(rate // 1000))
                self.counters["links_probed"] += 1

        await asyncio.gather(*(one(peer) for peer in peers[:exchange.MAX_RATE_REPORTS]))
        measured = sorted((self.links.source_rates[a], a) for a in peers if a in self.links.source_rates)
        if measured:
            logger.info("diloco: link probe: %d of %d peer(s) measured, %d to %d kB/s (slowest: %s)", len(measured),
                        len(peers), measured[0][0], measured[-1][0], measured[0][1][-8:])

    def _owners(self, ordered: list[str], parts: int, announced: dict[str, Announced]) -> list[str]:
        """Who reduces each part this round: the round's order, weighted by the rates its members' announcements
        report (``exchange.rate_weights``: only peers the others receive slowly from reduce fewer parts), none to a
        member without a direct path to another (``_barred``: it could not take that member's chunks, and bulk
        bytes never cross a relay)."""
        weights = exchange.rate_weights(ordered, {a: dict(announced[a].rates) for a in ordered if a in announced},
                                        rounds.short_id)
        barred = self._barred(ordered, announced)
        if barred:
            weights = {a: 0 if a in barred else weights.get(a, exchange.WEIGHT_FULL) for a in ordered}
            if not any(weights.values()):  # every unbarred member measured too slow to reduce: they reduce all
                weights = {a: 0 if a in barred else exchange.WEIGHT_FULL for a in ordered}
        return exchange.reducers(ordered, parts, weights)

    def _measure_rate(self, moving: Received) -> None:
        """One scatter step's receive rate: the bytes of the chunks and parts that came, over the time from the
        step's start to the last of them (a peer that never sends adds no time)."""
        if moving.bytes < RATE_MIN_BYTES or moving.last <= moving.start:
            return
        self.links.rates.append(moving.bytes / (moving.last - moving.start))
        rate = self._transfer_rate()
        if rate < self.cfg.min_bandwidth / 2 and not self.links.slow_link_said:
            self.links.slow_link_said = True  # once a run: the rate itself is in /status
            logger.warning("diloco: transfers measured at %.0f kB/s, below min_bandwidth (%.0f kB/s): the exchange "
                           "now gets the measured time (loops.%s.min_bandwidth = your link's rate gives it from the "
                           "first round)", rate / 1e3, self.cfg.min_bandwidth / 1e3, self.name)

    def _want_parts(self, p: int) -> int:
        """How many parts we cut our next update of fragment p into: ``parts``, or with "auto" as many as the last
        round's participants call for (``exchange.auto_parts``: every peer that closed that round with the same
        members cuts its update the same way, as with the exchange's mode)."""
        n = self.fragments[p].numel()
        if self.cfg.parts != "auto":
            return exchange.part_count(n, self.cfg.parts)
        last = self.fragments[p].last_members(self.start_state.initial)
        return exchange.part_count(n, exchange.auto_parts(len(last), self.cfg.audit))

    def _part_counts(self, p: int) -> set[int]:
        """The part counts an announcement for fragment p may have: ours, or with "auto" any that "auto" gives."""
        n = self.fragments[p].numel()
        if self.cfg.parts != "auto":
            return {exchange.part_count(n, self.cfg.parts)}
        return {exchange.part_count(n, x) for x in exchange.AUTO_PARTS}

    def _round_parts(self, key: tuple[int, int]) -> int:
        """A round's part count: from its close on, the count most of its announcements have (``Round``);
        before, our announcement's if we sent one, else what we would cut an update into now. An announcement with
        another count (its author closed the last round with other members) is not counted in a scatter round, as
        one from other weights is not."""
        pending = self.book.pending.get(key)
        if pending is not None and pending.count is not None:
            return pending.count
        mine = pending.announced.get(self._ctx.identity.peer_id) if pending is not None else None
        return len(mine.parts) if mine is not None else self._want_parts(key[1])

    def _bounds(self, p: int, count: int) -> list[tuple[int, int]]:
        """The value ranges fragment p's update is cut into when it is cut into ``count`` parts."""
        return exchange.part_bounds(self.fragments[p].numel(), count)

    def _part_bytes(self, p: int, reduced: bool = False, count: int | None = None) -> list[int]:
        """The size of each encoded part of fragment p cut into ``count`` parts (default: ``_want_parts``; the codec
        fixes it): what a peer may announce, at most; with ``reduced``, of each combined part a reducer may publish
        (``reduced_codec``)."""
        codec = self.reduced_codec if reduced else self.codec
        count = self._want_parts(p) if count is None else count
        # one encoding of zeros per codec, count and part length (the parts of a count differ by one value at most:
        # two short encodings, not the whole fragment's); a run whose reduced_codec is its codec pays it once
        key = (p, codec.name, count)
        if key not in self.links.encoded_size:
            bounds = self._bounds(p, count)
            size = {m: len(codec.encode(torch.zeros(m)).to_wire()) for m in {b - a for a, b in bounds}}
            self.links.encoded_size[key] = [size[b - a] for a, b in bounds]
        return self.links.encoded_size[key]

