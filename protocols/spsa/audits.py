"""Audits: re-probing a few of the others' steps each window, and convicting a peer whose bytes are not what its step
gives (or that keeps probing other weights than the majority's so as not to be audited)."""

from __future__ import annotations

import collections
import math
import random
from typing import TYPE_CHECKING

from swarmd.protocols.gossip import Message
from swarmd.protocols.spsa.book import Window
from swarmd.protocols.spsa.codes import G0, decode_grad
from swarmd.protocols.spsa.wire import MAX_PEER_ENTRIES, _batch_bytes, _batch_hash

if TYPE_CHECKING:
    from swarmd.protocols.spsa.config import SpsaConfig

AUDIT_REL = 1e-5  # a loss re-computed on another device or by other kernels may differ by this much, relative
AUDIT_TOL_Q = 4  # quarter-octaves (2x) a peer's |g| may differ from ours re-probed, beyond that rounding
OFF_WEIGHTS_LIMIT = 2  # hash checks' worth of windows an author may probe weights other than the majority's
# (an honest one that diverged resyncs at the next check) before it is taken for dodging the audits


def audit_agrees(sent: int, plus: float, minus: float, eps: float, clip: float) -> bool:
    """Whether a peer's byte for a step is what we get re-probing that step (same weights, its batch, its seed):
    the sign, where the projected gradient is clear of the rounding another device may add to the two losses, and
    |g| within AUDIT_TOL_Q quarter-octaves beyond that rounding (and the quantisation). Where it is not clear of it,
    only a magnitude beyond it disagrees. A probe of ours that is not finite judges nothing (the honest byte is then
    the smallest step)."""
    if not (math.isfinite(plus) and math.isfinite(minus)):
        return True
    g = (plus - minus) / (2 * eps)
    noise = AUDIT_REL * max(abs(plus), abs(minus)) / eps  # what rounding in the losses can move g by
    factor = 2.0 ** (AUDIT_TOL_Q / 4)
    got = decode_grad(sent)
    hi = max(min(abs(g) + noise, clip) * factor, 2 * G0)
    if abs(g) <= noise:
        return abs(got) <= hi  # the sign is rounding's to decide: only the size can be wrong
    lo = min(abs(g) - noise, clip) / factor
    return (got < 0) == (g < 0) and lo <= abs(got) <= hi


class Auditor:
    """Re-probing a few of the others' steps each window, and convicting a peer whose bytes are not what its step
    gives (or that keeps probing other weights than the majority's so as not to be audited). It holds whom it
    convicted, who is off our weights and for how long, and the secret draw of which steps it re-probes; a window's
    own re-probes are its ``Window``'s."""

    def __init__(self, cfg: SpsaConfig, counters: collections.Counter) -> None:
        self._cfg, self._counters = cfg, counters
        self._penalties = None  # the node's, from start
        self.convicted: collections.OrderedDict[str, int] = collections.OrderedDict()  # peer -> window it failed
        # peer -> windows in a row it probed weights other than ours (the majority's)
        self.off_weights: collections.Counter = collections.Counter()
        self.rng = random.Random(0)  # seeded from our key at start: no one else can tell which steps

    def start(self, ctx) -> None:
        # which steps we audit must be ours alone to know (a peer that knew would be honest on those only): drawn
        # from a signature of ours (deterministic, secret)
        self.rng = random.Random(ctx.identity.sign(b"swarmd/spsa/audit/" + self._cfg.run.encode())[:16])
        self._penalties = ctx.transport.penalties

    def plan(self, peers: list[str]) -> dict[int, list[str]]:
        """Which steps of a window we re-probe, and whose (step in window -> peers): up to ``audit_peers`` of
        ``peers`` (the ones the window will take batches from, sorted), ``audit_steps`` steps each, drawn by our own
        secret generator."""
        plan: dict[int, list[str]] = {}
        window, steps = self._cfg.window, self._cfg.audit_steps
        for peer in self.rng.sample(peers, min(self._cfg.audit_peers, len(peers))):
            for i in self.rng.sample(range(window), min(steps, window)):
                plan.setdefault(i, []).append(peer)
        return plan

    def other_weights(self, mine: str, batches: dict[str, Message]) -> set[str]:
        """The authors of a window's ``batches`` probed at weights other than ours (``mine``: our weights' hash at
        its start); counts, per author, the windows in a row it did so while ours were the weights of most of the
        window's batches."""
        hashes = {a: _batch_hash(m) for a, m in batches.items()}
        other = {a for a, h in hashes.items() if h != mine[:16]}
        majority = len(hashes) - len(other) > len(hashes) / 2
        for peer in [p for p in self.off_weights if p not in other]:
            del self.off_weights[peer]
        for peer in other:
            self.off_weights[peer] += int(majority)
        self._counters["batches_other_weights"] += len(other)
        return other

    def dodging(self, other: set[str]) -> list[str]:
        """The authors of ``other`` that stayed off the majority's weights past any hash check (an honest one that
        diverged resyncs at the next): not resyncing, but claiming other weights so as not to be audited."""
        return sorted(a for a in other if self.off_weights[a] > OFF_WEIGHTS_LIMIT * self._cfg.hash_every)

    def judge(self, window: Window, batches: dict[str, Message]) -> set[str]:
        """The peers of ``window`` whose bytes failed a re-probe of ours (they are convicted: refused from then
        on)."""
        cfg, w, failed = self._cfg, window.w, set()
        for peer, probes in window.probes.items():
            message = batches.get(peer)
            if message is None:
                continue  # its batch did not come: nothing to judge
            sent = _batch_bytes(message)
            self._counters["audited_steps"] += len(probes)
            wrong = [(i, plus, minus) for i, plus, minus in probes
                     if not audit_agrees(sent[i], plus, minus, cfg.eps, cfg.clip)]
            if not wrong:
                continue
            i, plus, minus = wrong[0]
            failed.add(peer)
            self.convict(peer, w, f"spsa window {w} step {window.step(i)}: sent {decode_grad(sent[i]):+.4g}, "
                         f"re-probing the step gives {(plus - minus) / (2 * cfg.eps):+.4g} ({len(wrong)} of "
                         f"{len(probes)} audited steps wrong)")
        return failed

    def convict(self, peer: str, w: int, why: str) -> None:
        self.convicted[peer] = w
        while len(self.convicted) > MAX_PEER_ENTRIES:
            self.convicted.popitem(last=False)
        self._counters["rejected_audit"] += 1
        self._penalties.penalize(peer, "invalid_message", f"{why}; its bytes are refused from now on")

    def state(self, built: bool, per_step: bool) -> str | None:
        """For /status: whether we audit, and if not why."""
        if not built:
            return None
        if not per_step:
            return "off: the task has no batch_at(), so no peer can re-probe another's step"
        return "on" if self._cfg.audit_peers else "off: audit_peers = 0"
