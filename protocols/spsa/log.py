"""The log of signed batches: served in parts, read and verified whole, replayed onto the base (a late joiner, a
restart, a resync)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from swarmd.protocols import rounds
from swarmd.protocols.gossip import SIGN_DOMAIN as PUBSUB_DOMAIN
from swarmd.protocols.gossip import Message, decode_message
from swarmd.protocols.spsa.codes import screen_window
from swarmd.protocols.spsa.wire import (
    BATCH,
    CARRIER,
    JOIN,
    LOG_PART,
    LOG_PART_BYTES,
    LOG_REQUEST,
    LOG_SPEC,
    MAX_LOG_BYTES,
    _batch_bytes,
    _batch_hash,
)
from swarmd.protocols.standing import next_fresh_round
from swarmd.transport.base import Stream
from swarmd.transport.errors import MalformedMessage, ProtocolViolation, TransportError
from swarmd.transport.identity import verify
from swarmd.transport.wire import WIRE, UnknownKind

logger = logging.getLogger("swarmd.protocols.spsa")  # one logger for the package


def read_log(entries: Any, *, topic: str, window: int, accepts: Callable[[str, dict], bool]
             ) -> list[tuple[int, dict[str, Message]]]:
    """A peer's log as it serves it (``[[w, [signed batch message, ...]], ...]``, windows contiguous from 0),
    verified whole before a joiner takes anything from it: every entry a message on ``topic`` signed by its author,
    a batch of its window with ``window`` steps, that ``accepts(author, body)`` (the run's task tag). Returns
    [(w, {author: message})]; raises ValueError naming the first fault. Pure: no I/O, no state."""
    if not isinstance(entries, list) or [e[0] if isinstance(e, list) and len(e) == 2 else None
                                         for e in entries] != list(range(len(entries))):
        raise ValueError("spsa-log: windows must be [w, batches] contiguous from 0")
    out = []
    for w, wires in entries:
        if not isinstance(wires, list):
            raise ValueError("spsa-log: batches must be a list")
        batches: dict[str, Message] = {}
        for wire in wires:
            message = decode_message(wire)
            if message.topic != topic or not verify(message.author, PUBSUB_DOMAIN + message.body, message.sig):
                raise ValueError("spsa-log: an entry does not verify")
            try:
                kind, body = WIRE.unpack(CARRIER, message.data)
            except (MalformedMessage, UnknownKind):
                raise ValueError("spsa-log: an entry is not a batch") from None
            if kind is not BATCH or not accepts(message.author, body) or body["w"] != w or len(body["b"]) != window:
                raise ValueError("spsa-log: an entry is not a batch of its window")
            batches[message.author] = message
        out.append((w, batches))
    return out


def _window_bytes(wires: list) -> int:
    """What a window of a log counts against a part's size and a joiner's budget: its signed batches, and 16 B of
    its own (so windows without batches still count: a part holds at most part_bytes / 16 of them, and a peer
    cannot stream empty windows past the budget)."""
    return 16 + sum(len(m["b"]) + len(m["s"]) + 8 for m in wires)


def log_parts(log: list, part_bytes: int | None = None) -> Iterator[tuple[int, list, bool]]:
    """A log as it is served: (first window, whole windows, more follow), each part about ``part_bytes``
    (``_window_bytes``; default LOG_PART_BYTES; at least one window; an empty log is one empty part): at most
    part_bytes / 16 windows (its schema's bound: 2**20)."""
    part_bytes = part_bytes or LOG_PART_BYTES
    first, size = 0, 0
    for i, (_, wires) in enumerate(log):
        size += _window_bytes(wires)
        if size >= part_bytes:
            yield first, log[first:i + 1], i + 1 < len(log)
            first, size = i + 1, 0
    if first < len(log) or not log:
        yield first, log[first:], False


async def read_log_parts(stream: Stream, max_bytes: int = MAX_LOG_BYTES) -> list:
    """A peer's log from its parts (``log_parts``): each part must start where the last ended, and the whole may
    hold at most ``max_bytes`` (``_window_bytes``: checked part by part, so a peer that streams forever, empty
    windows included, costs one part beyond it). Raises MalformedMessage; the caller verifies the windows
    (``read_log``)."""
    entries: list = []
    size = 0
    while True:
        part = await asyncio.wait_for(stream.read_required(), 60)
        if part.kind != LOG_PART.code:
            raise MalformedMessage("spsa-log: a part of the log expected")
        body = part.body  # its schema checked by the stream: [w, [{b, s}]] windows, bounded
        if body["w"] != len(entries):
            raise MalformedMessage(f"spsa-log: a part from window {body['w']} after {len(entries)} windows")
        size += sum(_window_bytes(wires) for _, wires in body["windows"])
        if size > max_bytes:
            raise MalformedMessage(f"spsa-log: more than {max_bytes} B of batches")
        entries += body["windows"]
        if not body["more"]:
            return entries


def log_contributors(windows: list[tuple[int, dict[str, Message]]],
                     screen: Callable[[int, dict[str, bytes]], tuple[set[str], int]] | None = None
                     ) -> list[set[str]]:
    """Each window's contributors as standing records them: its batches less those ``screen`` (``screen_window``,
    or a cached one taking the window too) refuses as out of scale, so a joiner counts the peers the live ones
    counted."""
    out = []
    for w, batches in windows:
        raw = {a: _batch_bytes(m) for a, m in batches.items()}
        extreme, _ = screen(w, raw) if screen is not None else screen_window(raw)
        out.append(set(batches) - extreme)
    return out


class LogMixin:
    """SPSALoop's log: serving it and replaying a peer's."""

    def _reset_to_base(self) -> None:
        """Back to the base weights with an empty log (before replaying a peer's log)."""
        for c, b in zip(self.weights.canonical, self.base.tensors):
            c.copy_(b)
        self.weights._load(None, 0.0)
        self.book.reset()
        self.window = 0
        self.final = False

    async def _resync(self, peers: list[str]) -> None:
        """Back to the base weights, then replay a majority peer's log (bit-exact: ``peers``' first, in order),
        then rejoin."""
        peers = list(peers)
        # then the other counting peers we reach directly: the majority's holders may be out of our reach, and a
        # log that is not the majority's is found out at the next hash check
        me = self._ctx.identity.peer_id
        peers += sorted(p for p in self.standing.counting(set(self.book.applied.get(self.window - 1, {})) - {me})
                        if self._ctx.direct(p) and p not in peers)
        closed = self.window  # windows 0 .. closed - 1: a log that stops short of them would lose the last ones
        self._reset_to_base()
        self.counters["resyncs"] += 1
        if not await self._replay_from(peers, rejoin=True, at_least=closed):
            raise RuntimeError("spsa: no majority peer served a usable log to resync from")  # restart: from base

    async def _replay_from(self, peers: list[str], rejoin: bool = False, at_least: int = 0) -> bool:
        """Replay the first usable log the peers serve; False if none did. A late joiner contributes from two
        windows on (announced with a join, so everyone expects it from then); a peer that resyncs (``rejoin``:
        the others still wait for its batches) contributes again at once, from the first window it has not sent a
        batch for (a second, different batch for a window would be equivocation). ``at_least``: a log with fewer
        windows is waited on (a peer a moment behind), at most ``deadline`` seconds."""
        self.state = "replaying"
        started = time.perf_counter()
        trusted = set(peers)  # (a peer whose log we could not use is still one we trust)
        found = await self._first_usable_log(list(peers), trusted, at_least)
        if found is None:
            self.counters["replay_failed"] += 1
            return False
        replayed, leads = found
        self.replay_seconds = time.perf_counter() - started
        self.counters["replayed_windows"] = len(replayed)
        if rejoin:
            self.join_at = max(self.window, self._sent_up_to + 1)
            # who counts, as the log's windows say: the others' view, our own place included (a peer that was cut
            # off and missed their windows is a newcomer to them, and must see itself as one, or it would take its
            # own batches where they do not)
            self.standing.rebuild(self.start_state.initial, replayed)
        else:
            self._join_late(trusted, leads)
        self.state = "running"
        logger.info("spsa: replayed %d windows in %.2f s, following from window %d, contributing from %d",
                    len(replayed), self.replay_seconds, self.window, self.join_at)
        return True

    async def _first_usable_log(self, peers: list[str], trusted: set[str], at_least: int
                                ) -> tuple[list[set[str]], bool | None] | None:
        """The peers asked in order until one serves a log we can use, replayed (its windows' contributors, and
        whether it leads where the others said: ``_log_leads_where_they_said``); None if none did. While a peer is
        behind (fewer than ``at_least`` windows), asked again, at most ``deadline`` seconds."""
        until = self.clock.monotonic() + self.cfg.deadline
        while True:
            behind = 0
            for peer_id in list(peers):
                try:
                    found = await self._replay_log_of(peer_id, trusted, at_least)
                except (TransportError, ProtocolViolation, asyncio.TimeoutError, ValueError) as e:
                    logger.warning("could not replay the spsa log from %s: %s", peer_id, e)
                    peers.remove(peer_id)  # not asked again while we wait for a peer that is behind
                    self._reset_to_base()
                    continue
                if found is None:  # it has not closed every window we had: ours would be lost
                    behind += 1
                    continue
                self.resyncs.replayed_from = peer_id
                return found
            if not (behind and self.clock.monotonic() < until):
                return None
            await asyncio.sleep(0.2)  # a peer a few moments behind us closes the window soon

    async def _replay_log_of(self, peer_id: str, trusted: set[str], at_least: int
                             ) -> tuple[list[set[str]], bool | None] | None:
        """Replay ``peer_id``'s log onto its base (ours, or its own); None where it has fewer than ``at_least``
        windows. Raises where its base, its log or where the log leads is not usable."""
        base_taken = await self.base.take_from(peer_id)  # the log replays onto its base: ours, or its own
        async with await self._ctx.transport.open_stream(peer_id, LOG_SPEC, timeout=10) as stream:
            await stream.send(LOG_REQUEST.code, None)
            entries = await read_log_parts(stream)
        if len(entries) < at_least:
            return None
        replayed = await self._replay(entries, from_base=base_taken)
        # the log we replayed led to the weights the others said they held; None: nothing told
        leads = await asyncio.to_thread(self._log_leads_where_they_said, trusted - {peer_id})
        if self.faults:  # a test's: nothing tells (the others said nothing of its last window)
            leads = self.faults.altered("replay-leads", self, leads, source=peer_id)
        if leads is False:
            self.counters["log_inconsistent"] += 1
            raise ValueError("its windows do not lead to the weights the others said they held there")
        return replayed, leads

    def _join_late(self, trusted: set[str], leads: bool | None) -> None:
        """After a late start's replay: contribute two windows after the live one, and say so now, so everyone
        expects us from then on; and whose word counts, as far as the log can tell."""
        self.join_at = next_fresh_round(max(self.window, max(self.book.open, default=self.window)) + 2)
        self._publish(JOIN, {"w": self.join_at, "join": True})
        # the peers we replayed on, and the authors of the log's window before its last where the log leads to
        # the weights they said they held after it (_log_leads_where_they_said: which batches a window holds
        # is its server's word alone; a server that added six fresh keys' batches would have them credited
        # as founders, for good, and their votes would outweigh the run's); the last window's authors earn credit as
        # newcomers do, unless they are among those. Where nothing told (its server is the one peer we trust,
        # a bootstrap peer the user chose, or the others said nothing of that window: we started after it),
        # the authors of its last two windows: without them we would not wait for the peers the
        # others wait for, and close windows without them
        windows = sorted(self.book.applied)
        before_last = set(self.book.applied[windows[-2]]) if len(windows) >= 2 else set()
        listed = set(self.book.applied[windows[-1]]) | before_last if windows else set()
        confirmed = before_last if leads else listed
        self.counters["log_authors_unconfirmed"] += len(listed - confirmed - trusted - {self._ctx.identity.peer_id})
        self.standing.found(trusted | confirmed)

    def _log_leads_where_they_said(self, peers: set[str]) -> bool | None:
        """Whether the log we just replayed leads to the weights most of ``peers`` said they held at its last
        window (each of their batches there carries their weights' hash, signed; else their votes for it as they
        reached us): its windows' batches are each signed by their author, but which ones a window holds is its
        server's word alone, and a batch added or left out moves the weights. None where none of them said
        anything of that window (nothing to tell by)."""
        last = max(self.book.applied, default=None)
        said = {a: _batch_hash(m)[:16] for a, m in self.book.applied.get(last, {}).items() if a in peers}
        if not said:  # none of theirs in the log's last window (left out?): what they said there, as it reached us
            live = self.book.hashes.get(last, {})
            said = {p: live[p] for p in peers if p in live}
        if not said:
            return None
        # (a tie as the hash check breaks one: rounds.majority, the voter drawn first for the run and window)
        return rounds.majority(said, f"{self.cfg.run}/{last}") == self.weights.hash()[:16]

    async def _replay(self, entries: list, from_base: bool = False) -> list[set[str]]:
        """Verify a log's closed windows (all of them, before anything changes), take them as applied, and apply
        their steps to the weights in a worker thread (the node keeps serving; ``/status`` shows how far it is);
        the last window is left to the live loop (one-window lag). Where the log begins with ours (we resumed from
        our own checkpoint: its weights have every window of our log but the last applied), only the windows after
        ours are applied, so a restart costs the windows it missed, not the whole run; otherwise we start from the
        base weights (always, ``from_base``: we just took another peer's base). Returns each window's contributors,
        as standing records them (its batches less the ones refused as out of scale)."""
        verified = read_log(entries, topic=self.topic, window=self.cfg.window,
                            accepts=lambda author, body: self._foreign(author, body) is None)
        kept = 0 if from_base else self._kept_prefix(entries)
        if not kept:
            self._reset_to_base()
        for w, batches in verified:
            self.book.applied[w] = batches
            if w >= kept:
                self.book.log.append([w, [m.wire() for _, m in sorted(batches.items())]])
        contributors = log_contributors(verified, self._screen)
        self.window = len(entries)
        start, todo = max(0, kept - 1), max(0, len(entries) - 1)
        self.counters["replay_windows_kept"] = start
        with self.work.track("log replay", total=todo - start, unit="windows") as work:
            def apply() -> None:
                for w in range(start, todo):
                    for i in range(self.cfg.window):
                        self.weights.apply(self.cfg.run, w * self.cfg.window + i, self._bytes_for(w, i), self.cfg.lr)
                    work.update(w + 1 - start)
            await asyncio.to_thread(apply)
        return contributors

    def _kept_prefix(self, entries: list) -> int:
        """How many windows of our own log the served log begins with, byte for byte (0: none, or it differs)."""
        ours = len(self.book.log)
        if not ours or ours > len(entries):
            return 0
        packed = msgpack.packb(self.book.log, use_bin_type=True)
        return ours if msgpack.packb(entries[:ours], use_bin_type=True) == packed else 0

    async def _serve_log(self, stream: Stream) -> None:
        message = await asyncio.wait_for(stream.read_required(), 10)
        if message.kind != LOG_REQUEST.code:
            raise MalformedMessage("spsa-log: expected a request")
        log = list(self.book.log)  # as it is now: a log only grows, but a resync may start it again meanwhile
        if self.faults:  # a log a test has us serve otherwise
            log = self.faults.altered("serve-log", self, log, source=stream.peer_id)
        for first, windows, more in log_parts(log):
            await stream.send(LOG_PART.code, {"w": first, "windows": windows, "more": more})
