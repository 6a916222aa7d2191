"""A round's exchange, one interface (``Exchange``) with two implementations: all-to-all (``AllToAllRound``, here:
every member pulls every member's whole update and combines them itself) and reduce-scatter + all-gather
(``scatter.ScatterRound``). ``Round`` picks one by the mode of its fragment (``DilocoLoop._mode``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import torch
from swarmd.protocols import outer
from swarmd.protocols.diloco.pending import Redo
from swarmd.protocols.diloco.scatter import ScatterRound
from swarmd.protocols.diloco.wire import MAX_LATE_PULLS

if TYPE_CHECKING:
    from swarmd.protocols.diloco.round import Round


class Exchange(Protocol):
    """One round's exchange, made for the round's agreed ``members`` (from weights of hash ``base``; begun at
    ``started``): ``combine`` returns the combined update (None: nothing to combine) and the refused members with
    why."""

    def __init__(self, rnd: Round, members: set[str], base: str, started: float) -> None: ...

    async def combine(self) -> tuple[torch.Tensor | None, dict[str, str]]: ...


class AllToAllRound:
    """The members' whole updates, pulled before the close (``Round._gather``, ``Round._agree``), combined here;
    what the combination took is kept on the fragment for a redo (``Redo``) where it fits ``redo_bytes``."""

    def __init__(self, rnd: Round, members: set[str], base: str, started: float) -> None:
        self.rnd, self.members, self.base, self.started = rnd, members, base, started

    async def combine(self) -> tuple[torch.Tensor | None, dict[str, str]]:
        rnd, members, base = self.rnd, self.members, self.base
        lp, pending, frag = rnd.loop, rnd.pending, rnd.frag
        updates = {a: pending.updates[a] for a in members}
        if lp.faults:
            await lp.faults.enter("reduce", lp, r=rnd.r, p=rnd.p)
        combined, rejected = await asyncio.to_thread(outer.combine, updates, frag.numel(), senders=lp.cfg.senders())
        lp.timings.phases["combine"].append(lp.clock.monotonic() - self.started)
        if (len(updates) + 2 + MAX_LATE_PULLS) * 4 * frag.numel() <= lp.cfg.redo_bytes:
            late = sorted((pending.arrivals[a], a) for a in members if a != rnd.me and a in pending.arrivals)
            redo = frag.redo = Redo(rnd.r, frozenset(members), updates, frag.weights, base,
                                    lp.replica.outer_opt.buffers[rnd.p].clone(), late[-1][1] if late else None)
            # counted peers' updates still being pulled: kept for a redo when they come
            on_way = sorted(a for a in pending.pulling - set(pending.updates) - pending.failed
                            if pending.announced.get(a) and pending.announced[a].base == base
                            and lp.standing.counts(a))
            redo.pulling.update(dict.fromkeys(on_way[:MAX_LATE_PULLS]))
        return combined, rejected


EXCHANGES: dict[str, type[Exchange]] = {"all-to-all": AllToAllRound, "scatter": ScatterRound}
