"""Audits: re-probing a few of the others' steps each window, and convicting a peer whose bytes are not what its step
gives (or that keeps probing other weights than the majority's so as not to be audited)."""

from __future__ import annotations

import math

from swarmd.protocols import rounds
from swarmd.protocols.gossip import Message
from swarmd.protocols.spsa.book import Window
from swarmd.protocols.spsa.codes import G0, decode_grad
from swarmd.protocols.spsa.wire import MAX_PEER_ENTRIES, NEWCOMER_GRACE, _batch_bytes, _batch_hash
from swarmd.protocols.standing import fresh_round

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


class AuditsMixin:
    """SPSALoop's audits."""

    def _plan_audits(self, w: int, me: str) -> dict[int, list[str]]:
        """Which of window w's steps we re-probe, and whose (step in window -> peers): up to ``audit_peers`` of the
        peers we expect in it, ``audit_steps`` steps each, drawn by our own secret generator."""
        if not self.per_step or not self.cfg.audit_peers:
            return {}
        # the peers the window will take batches from (those whose word counts and the newcomers holding its
        # slots, as _close_window picks them), not every key that announced a join: a hundred fresh keys that join
        # and never deliver would take our re-probes
        wait = rounds.plan_wait(self.standing, self._expected(w), f"{self.cfg.run}/{w}", fresh=fresh_round(w),
                                now=0.0, deadline=self.cfg.deadline, grace=NEWCOMER_GRACE)
        peers = sorted((wait.expected | wait.slots) - {me})
        plan: dict[int, list[str]] = {}
        for peer in self.audits.rng.sample(peers, min(self.cfg.audit_peers, len(peers))):
            for i in self.audits.rng.sample(range(self.cfg.window), min(self.cfg.audit_steps, self.cfg.window)):
                plan.setdefault(i, []).append(peer)
        return plan

    def _other_weights(self, w: int, batches: dict[str, Message]) -> set[str]:
        """The authors of window w's ``batches`` probed at weights other than ours; counts, per author, the windows
        in a row it did so while ours were the weights of most of the window's batches."""
        mine = self.book.my_hashes[w][:16]
        hashes = {a: _batch_hash(m) for a, m in batches.items()}
        other = {a for a, h in hashes.items() if h != mine}
        majority = len(hashes) - len(other) > len(hashes) / 2
        for peer in [p for p in self.audits.off_weights if p not in other]:
            del self.audits.off_weights[peer]
        for peer in other:
            self.audits.off_weights[peer] += int(majority)
        self.counters["batches_other_weights"] += len(other)
        return other

    def _judge_audits(self, window: Window, batches: dict[str, Message]) -> set[str]:
        """The peers of ``window`` whose bytes failed a re-probe of ours (they are convicted: refused from then
        on)."""
        w, failed = window.w, set()
        for peer, probes in window.probes.items():
            message = batches.get(peer)
            if message is None:
                continue  # its batch did not come: nothing to judge
            sent = _batch_bytes(message)
            self.counters["audited_steps"] += len(probes)
            wrong = [(i, plus, minus) for i, plus, minus in probes
                     if not audit_agrees(sent[i], plus, minus, self.cfg.eps, self.cfg.clip)]
            if not wrong:
                continue
            i, plus, minus = wrong[0]
            failed.add(peer)
            self._convict(peer, w, f"spsa window {w} step {w * self.cfg.window + i}: sent "
                          f"{decode_grad(sent[i]):+.4g}, re-probing the step gives "
                          f"{(plus - minus) / (2 * self.cfg.eps):+.4g} ({len(wrong)} of {len(probes)} audited steps "
                          "wrong)")
        return failed

    def _convict(self, peer: str, w: int, why: str) -> None:
        self.audits.convicted[peer] = w
        while len(self.audits.convicted) > MAX_PEER_ENTRIES:
            self.audits.convicted.popitem(last=False)
        self.counters["rejected_audit"] += 1
        self._ctx.transport.penalties.penalize(peer, "invalid_message", f"{why}; its bytes are refused from now on")

    def _audit_state(self) -> str | None:
        if self.weights is None:
            return None  # not built yet
        if not self.per_step:
            return "off: the task has no batch_at(), so no peer can re-probe another's step"
        return "on" if self.cfg.audit_peers else "off: audit_peers = 0"
