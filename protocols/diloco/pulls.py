"""Pulling bytes from the other peers: whole updates (all-to-all), parts and chunks, each bounded by a
step's end and a per-source limit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch
from swarmd.protocols import codecs, rounds
from swarmd.protocols.bulk import BulkError
from swarmd.protocols.diloco.pending import Announced, Pending, StepEnd, _decode_part
from swarmd.protocols.diloco.wire import MAX_LATE_PULLS, MAX_PEER_ENTRIES

THROUGH_MEMBERS_AGAIN = 0.25  # s between asks of the members for an update we cannot pull from its author

logger = logging.getLogger("swarmd.protocols.diloco")  # one logger for the whole package


class PullsMixin:
    """DilocoLoop's pulls methods (the loop composes them; they share its state)."""

    def _start_pull(self, key: tuple[int, int], pending: Pending, peer: str) -> None:
        pending.pulling.add(peer)
        task = asyncio.get_running_loop().create_task(self._pull(key, peer, pending.announced[peer]))
        pending.pulls.add(task)
        task.add_done_callback(pending.pulls.discard)

    def _source(self, peer: str) -> asyncio.Semaphore:
        """At most two transfers from one peer at once (a peer serves four to one requester at most)."""
        sem = self.links.sources.get(peer)
        if sem is None:
            if len(self.links.sources) > 4096:
                self.links.sources.clear()
            sem = self.links.sources[peer] = asyncio.Semaphore(2)
        return sem

    async def _by(self, end: StepEnd, awaitable):
        """``awaitable``'s result, or TimeoutError once ``end`` has passed (re-read as arrivals move it)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                remaining = end.at - self.clock.monotonic()
                if remaining <= 0:
                    raise asyncio.TimeoutError()
                try:
                    return await asyncio.wait_for(asyncio.shield(task), max(0.05, remaining))
                except asyncio.TimeoutError:
                    if task.done():
                        return task.result()  # (its own TimeoutError raised again)
                    if end.at - self.clock.monotonic() <= rounds.TICK:
                        raise
        finally:
            if not task.done():  # as wait_for: cancelled, and its end awaited
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _pulls_end(self, key: tuple[int, int], at: float, grace: float) -> StepEnd:
        """An end for pulls of the scatter step ``key`` made from ``at``: arrivals in the step move it by ``grace``
        after each, up to deadline_high from now (or ``at`` where that is later)."""
        now = self.clock.monotonic()
        end = StepEnd(at, cap=max(at, now + self.cfg.deadline_high), grace=grace)
        if (moving := self.book.moving.get(key)) is not None:
            moving.ends.append(end)
        return end

    async def _fetch_part(self, key: tuple[int, int], peer: str, blob: bytes, size: int, addrs, elements: int,
                          timeout: float | StepEnd, holders: list[tuple[str, tuple]] | Callable = (),
                          counter: str = "chunks_from_other_holders", out: torch.Tensor | None = None,
                          decode: bool = True, again: float = 0.0) -> torch.Tensor | bytearray:
        """One encoded part that ``peer`` named, pulled and decoded (off the event loop when large): from ``peer``,
        and if it fails us (gone: killed mid-round), from each of ``holders`` in turn ((peer, addrs): the round's
        other members, any of which may have pulled it already: a pulled blob is kept and served, and its hash is
        the one ``peer`` signed), all within ``timeout``; a part that came from a holder is counted as ``counter``.
        Without the holders, a member that pulled a dead peer's chunk (the part's auditor, a prefetch) combines it
        and the others cannot: the round splits (found by the simulator, and seen as the kill bench's survivors
        diverging); and a reducer that dies after serving its part to some members leaves the others without it.
        With ``out`` (a float32 view of ``elements`` values) the part is decoded into it, not into a new tensor;
        without ``decode``, the (hash-checked) bytes are returned as they came, to be decoded when used. A
        ``StepEnd`` as the timeout: its time, as arrivals move it. With ``again`` (seconds), the holders are asked
        again every ``again`` s until the end: they may pull the part only after we first ask them."""
        if self.faults:
            await self.faults.enter("fetch", self, r=key[0], p=key[1], source=peer)
        end = timeout if isinstance(timeout, StepEnd) else StepEnd(self.clock.monotonic() + max(0.05, timeout))
        found = holders if callable(holders) else (lambda: holders)
        sources = [(peer, addrs), *[(h, a) for h, a in found() if h != peer]]
        body, failure = None, None
        meter = pending.meter if (pending := self.book.pending.get(key)) is not None else None
        order, i = sources, -1
        while True:
            for source, where in order:
                i += 1
                if end.at - self.clock.monotonic() <= 0:
                    break
                got = 0
                if meter is not None:
                    meter.start(source, self.clock.monotonic())
                try:
                    async with self._source(source):
                        body = await self._by(end, self.bulk.pull_from(blob, size, source, list(where)))
                    got = size
                except (BulkError, asyncio.TimeoutError) as e:
                    failure = failure or e
                    continue
                finally:
                    if meter is not None:
                        meter.end(source, self.clock.monotonic(), got)
                if i:
                    self.counters[counter] += 1
                break
            if body is not None or not again or end.at - self.clock.monotonic() <= again:
                break
            await asyncio.sleep(again)  # the holders may have it by now, and more may have announced
            order = [(h, a) for h, a in found() if h != peer]
        if body is None:
            raise failure or asyncio.TimeoutError()
        self.book.blobs[key].add(blob)
        self.counters["bytes_received"] += size
        if (moving := self.book.moving.get(key)) is not None:
            moving.bytes += size
            moving.last = self.clock.monotonic()
            for step_end in moving.ends:
                step_end.arrived(moving.last)
        if not decode:
            return body
        # the held blob itself (never changed, only dropped), not a copy
        if size > 1 << 18:
            return await asyncio.to_thread(_decode_part, body, elements, out)
        return _decode_part(body, elements, out)

    def _pull_late(self, r: int, p: int, peer: str, ann: Announced) -> None:
        """A counted peer's update for the round we closed last, computed from the weights we closed it from, came
        after the close: pulled all the same (a few a round) for a redo of that close (see ``_redo_last_close``)."""
        redo = self.fragments[p].redo
        if redo is None or redo.round != r or peer in redo.members or peer in redo.pulling or ann.base != redo.base \
                or len(redo.pulling) >= MAX_LATE_PULLS or not self.standing.counts(peer):
            return
        redo.pulling[peer] = asyncio.get_running_loop().create_task(self._pull((r, p), peer, ann, into=redo.late))

    def _through_members(self, key: tuple[int, int], peer: str) -> tuple[Callable | list, float, float]:
        """Where an update of ``peer`` comes from besides ``peer`` itself (all-to-all): nowhere while we reach it
        directly. Without a direct path (it is behind a symmetric NAT, or punching failed) its bytes never cross a
        relay; the round's members we reach directly pull it too (they reach it: it dialed them), keep it and serve
        it under the hash it signed, so we ask them, again every THROUGH_MEMBERS_AGAIN s, up to the round's longest
        deadline (the members read afresh each time: they announce after us, some of them)."""
        if self._ctx is None or self._ctx.direct(peer):
            return [], 0.0, 300.0
        me = self._ctx.identity.peer_id

        def holders() -> list[tuple[str, tuple]]:
            pending = self.book.pending.get(key)
            announced = pending.announced if pending is not None else {}
            return [(m, a.addrs) for m, a in announced.items() if m not in (peer, me) and self._ctx.direct(m)]
        self.counters["pulls_through_members"] += 1
        through = self.links.through_members
        if peer in through or len(through) < MAX_PEER_ENTRIES:
            through[peer] = through.get(peer, 0) + 1
        return holders, THROUGH_MEMBERS_AGAIN, self.cfg.deadline_high

    async def _pull(self, key: tuple[int, int], peer: str, ann: Announced,
                    into: dict[str, torch.Tensor] | None = None) -> None:
        """All-to-all: the whole update of ``peer``, every part (into its round's pending updates, or ``into``)."""
        try:
            if len(ann.parts) not in self._part_counts(key[1]):
                raise codecs.CodecError(f"{len(ann.parts)} parts, not one of {sorted(self._part_counts(key[1]))}")
            # (whatever the count, the parts decoded one after another make the whole update)
            bounds = self._bounds(key[1], len(ann.parts))
            holders, again, timeout = self._through_members(key, peer)
            chunks = await asyncio.gather(*(self._fetch_part(key, peer, h, size, ann.addrs, b - a, timeout,
                                                             holders=holders, counter="via_members", again=again)
                                            for h, size, (a, b) in zip(ann.parts, ann.sizes, bounds)))
            update = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            if update.dim() != 1:
                raise codecs.CodecError("an update must be a flat vector")
        except (BulkError, codecs.CodecError, asyncio.TimeoutError) as e:
            self.counters["pull_failed"] += 1
            logger.warning("diloco update from %s unusable: %s", peer, e)
            if key in self.book.pending:  # not 'on its way' any more: its round stops waiting for it
                self.book.pending[key].failed.add(peer)
                if isinstance(e, codecs.CodecError):  # the bytes it announced, hash-checked: the sender's fault
                    self.book.pending[key].refused[peer] = "undecodable"
                self._event.set()
            return
        if into is not None:
            into[peer] = update
            return
        pending = self.book.pending.get(key)
        if pending is None:
            redo = self.fragments[key[1]].redo
            if redo is not None and redo.round == key[0] and peer in redo.pulling:  # on its way when we closed
                redo.late[peer] = update
            return
        pending.updates[peer] = update
        pending.arrivals[peer] = self.clock.monotonic()
        self._event.set()

