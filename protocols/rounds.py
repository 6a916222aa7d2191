"""Round logic the three loops share, as plain state machines: no I/O, no asyncio, no clock of their own.

Each loop is a thin shell around these: it feeds them what arrived and the time (``now``, from its injected clock),
and does what they answer (publish, wait so long, close the round, resync from these peers). So the rules can be
read in one place and tested with a fake clock in microseconds (tests/test_rounds.py); the loops' own tests and the
simulator (node/sim.py) drive the same code through the shells.

- :class:`StartBarrier`: when to announce readiness and when to start, together with the peers that are ready.
- :class:`RoundWait` and :func:`plan_wait`: whom a round waits for (the peers whose word counts, and a few newcomers
  in slots drawn the same way everywhere), and how long (the deadline; a newcomer only a grace, unless its
  contribution is on its way); a round that would close with ours alone waits on while the peers it waits for
  are still heard from (:meth:`RoundWait.hold_alone`).
- :class:`MemberAgreement`: which peers' updates a round combines, the same at every peer (the round's coordinator's
  view), so a peer whose update reached some peers by their deadline and others not is in everyone's round or in
  no one's.
- :func:`hash_verdict`: after a round, do our weights agree with the majority of the counted peers', and if not,
  whom to resync from.
- :func:`new_items` and :func:`draw`: SAPO's round close: which peers' shared items are new to us, and which of
  their informative groups we train on (J at random, at most so many from one peer).
- :class:`Sources`: SAPO's tally of what our verifier made of each peer's completions, and which peers are
  useless (nothing right for so long that an honest policy a quarter as good as the typical peer's would not).
"""

from __future__ import annotations

import collections
import hashlib
import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from swarmd.protocols.standing import Standing


def keep_latest(entries: dict, key, value, cap: int) -> None:
    """``entries[key] = value`` as its newest entry (a dict's insertion order is its age), the oldest dropped past
    ``cap``: the loops' bounded memories of peers (whom we served lately, whose state led us astray)."""
    entries.pop(key, None)
    entries[key] = value
    while len(entries) > cap:
        del entries[next(iter(entries))]


def take_listed(held: dict, listed) -> list[tuple]:
    """The entries of ``held`` whose key ``listed`` now holds for, removed from it, oldest first: a start barrier's
    "ready"s heard from authors our connection list did not show as direct then (the list lags our links, and a
    peer stops announcing once it starts), counted once it does (kept meanwhile with ``keep_latest``, bounded)."""
    taken = [(key, held[key]) for key in held if listed(key)]
    for key, _ in taken:
        del held[key]
    return taken


def linked(ctx):
    """Whether a peer can found a run with us (a predicate on peer ids): connected, directly or through a relay.
    A peer we reach only through a relay (behind a symmetric NAT, or one punching failed for) still counts in
    every round: its contributions come through the members we both reach directly (a DiLoCo update is pulled
    from them, SPSA batches and SAPO items are gossiped through them), never as bulk bytes over the relay. The
    member list is read once per predicate, and only for a peer not directly connected."""
    members: set[str] | None = None

    def linked(peer: str) -> bool:
        nonlocal members
        if ctx.direct(peer):
            return True
        if members is None:
            members = set(ctx.members())
        return peer in members
    return linked


def hear_ready(ready: dict, unlisted: dict, author: str, value, listed: bool, cap: int, unlisted_cap: int) -> None:
    """A start barrier's "ready" from ``author``: only peers we are connected to (``linked``) can found a run with
    us, so only theirs count (first come, ``cap`` of them); one whose author is not listed yet is held in
    ``unlisted`` (the newest ``unlisted_cap``) until ``count_listed`` finds it listed."""
    if not listed:
        keep_latest(unlisted, author, value, unlisted_cap)
    elif author in ready or len(ready) < cap:
        ready[author] = value
        unlisted.pop(author, None)


def count_listed(ready: dict, unlisted: dict, listed, cap: int) -> None:
    """The held "ready"s whose authors are listed now (``listed``: a predicate such as ``linked``'s), counted (a
    newer one heard since stands)."""
    for author, value in take_listed(unlisted, listed):
        if author not in ready and len(ready) < cap:
            ready[author] = value


def majority(votes: Mapping[str, str], salt: str = "") -> str:
    """The weight hash most voters report (``votes``: voter -> hash). A tie goes to the side of the voter drawn
    first for ``salt`` (the run and round): every peer picks the same side, no peer picks it by what it sends, and
    the pick does not hang on the weights' bytes. (Were ties to go to the larger hash, a peer could win every tie
    by nudging its weights, and since a hash differs with the CPU's float kernels, runs would take other sides on
    other machines.)"""
    counts = collections.Counter(votes.values())
    top = max(counts.values())
    tied = {h for h, c in counts.items() if c == top}
    if len(tied) == 1:
        return next(iter(tied))
    return votes[min((v for v, h in votes.items() if h in tied), key=lambda v: _tie_rank(salt, v))]


def _tie_rank(salt: str, voter: str) -> bytes:
    return hashlib.blake2b(f"tie/{salt}/{voter}".encode(), digest_size=16).digest()


class StartBarrier:
    """Start together with the peers that are ready.

    Readiness is announced every ``repeat`` s while waiting (peers whose links form later must hear it too). Once
    ``min_peers`` (us included) are ready, the start comes ``grace`` s later, so peers that became ready at the same
    moment are in everyone's first round; the grace, once begun, is not withdrawn."""

    def __init__(self, min_peers: int, *, grace: float = 1.0, repeat: float = 1.0):
        self.min_peers, self.grace, self.repeat = min_peers, grace, repeat
        self._announced: float | None = None
        self._start_at: float | None = None

    def announce(self, now: float) -> bool:
        """Whether to announce our readiness now (the caller then does)."""
        if self._announced is None or now - self._announced > self.repeat:
            self._announced = now
            return True
        return False

    def start(self, now: float, ready: int) -> bool:
        """Whether to start now, with ``ready`` peers ready (us included)."""
        if ready >= self.min_peers and self._start_at is None:
            self._start_at = now + self.grace
        return self._start_at is not None and now >= self._start_at


class FounderAnswers:
    """Whom a running founder says its "ready" again to: a founder still at its barrier without ours.

    The peer that completes a start barrier last can miss a founder's "ready": its links form after the founder's
    announcements, a "ready" said again is forwarded by no one, and the founder stops announcing once it starts.
    That peer's repeats reach the founder over its own links, so the founder answers over its own, once per
    founder. A "ready" sent before its author's own start crosses ours within a grace and a repeat of the barrier
    (``AFTER``): those are not answered, so a start that went well costs no message."""

    AFTER = 2.0  # s: StartBarrier's default grace + repeat

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.answered: set[str] = set()  # bounded by the founders

    def due(self, author: str, ready: str, start: str | None, founders: Collection[str], now: float) -> bool:
        """Whether to say our "ready" (``start``) again for this one from ``author`` (then counted as answered)."""
        if self.started_at is None or now - self.started_at <= self.AFTER or ready != start:
            return False
        if author not in founders or author in self.answered:
            return False
        self.answered.add(author)
        return True


class StartWeights:
    """Which peer's initial weights (DiLoCo) or base model (SPSA) to start from where they are not ours, and what
    asking for them may cost.

    The choice is the hash most of the directly connected ready peers and we hold (ties: the smallest), over the
    holders not asked yet. Anyone can announce a hash (a fresh key's costs nothing, and one that is asked may stall
    until the ask times out), so a start asks a hash of at most ``per_hash`` holders and all hashes together of at
    most ``total``, each holder once: a flood of fresh keys costs a start at most ``total`` asks, then we stay with
    our own weights and start with the peers that hold them."""

    def __init__(self, per_hash: int = 2, total: int = 8):
        self.per_hash, self.total = per_hash, total
        self.asked_peers: set[str] = set()  # asked, and not taken from (bounded by the ready peers a loop keeps)
        self.asked: collections.Counter = collections.Counter()  # hash -> holders asked
        self.asks = 0

    def choice(self, ours: str, ready: dict[str, str]) -> str | None:
        """The hash to ask for, given the directly connected ready peers' (peer -> hash), or None (stay with ours)."""
        if self.asks >= self.total:
            return None
        held = collections.Counter({ours: 1})
        for peer, h in ready.items():
            if h == ours or (peer not in self.asked_peers and self.asked[h] < self.per_hash):
                held[h] += 1
        top = min(held, key=lambda h: (-held[h], h))
        return None if top == ours else top

    def holders(self, target: str, ready: dict[str, str]) -> list[str]:
        return sorted(p for p, h in ready.items() if h == target and p not in self.asked_peers)

    def ask(self, peer: str, target: str) -> bool:
        """Whether ``peer`` may be asked for ``target`` now (then it counts as asked)."""
        if self.asks >= self.total or self.asked[target] >= self.per_hash or peer in self.asked_peers:
            return False
        self.asks += 1
        self.asked[target] += 1
        self.asked_peers.add(peer)
        return True

    def taken(self, peer: str) -> None:
        """We took ``peer``'s weights: its hash is ours now, and it counts with us again."""
        self.asked_peers.discard(peer)


TICK = 1e-6  # waits shorter than this count as over (here and in outer.wait_until): an event loop fires a timer
#              that close at once, and on virtual time (the simulator) the clock would then never reach the end


@dataclass
class RoundWait:
    """Whom one round waits for, and how long.

    Every peer in ``expected`` (the peers whose word counts) is waited for up to ``end``. Once they are all in, a
    newcomer holding one of the round's ``slots`` gets ``grace`` s more, and then the rest of the deadline only if
    its contribution is on its way (``coming``: announced and not failed): a fresh key that joined and went quiet
    costs the grace, not the deadline."""

    expected: frozenset[str]
    slots: frozenset[str]
    end: float
    grace: float
    _grace_end: float | None = field(default=None, repr=False)
    _held: bool = field(default=False, repr=False)  # ``hold_alone`` extended the wait

    @property
    def waited(self) -> frozenset[str]:
        return self.expected | self.slots

    def remaining(self, now: float, have: set[str], coming: set[str] = frozenset()) -> float | None:
        """Seconds to wait more (until something arrives), or None: close the round now."""
        if now >= self.end - TICK:
            return None
        if not self.expected <= have:
            if self._held and have & self.waited and not (self.expected - have) & coming:
                # held past the deadline because no one's contribution was here, and now one is: the hold is over,
                # and only contributions on their way are waited for still. Were it to wait on for every expected peer,
                # a peer whose uplink serves a joiner's checkpoint (so its pulls come after the deadline) would wait
                # for a peer killed meanwhile to deadline_high, close after the others have stopped waiting for its
                # view, and resync (the simulator shows it)
                return None
            return self.end - now
        quiet = self.slots - have
        if not quiet:
            return None
        if self._grace_end is None:
            self._grace_end = min(self.end, now + self.grace)
        if now < self._grace_end - TICK:
            return self._grace_end - now
        if quiet & coming:
            return self.end - now
        return None

    def hold_alone(self, have: set[str], heard: Mapping[str, float], *, now: float, began: float,
                   longest: float) -> int:
        """A round about to close with no one's contribution but ours (nothing of ``waited`` in ``have``) waits on
        until ``longest`` s after it ``began`` while peers it waits for are still in the run (``heard``: when a
        message of each last came; within 2 x ``longest``), and once someone's contribution is here, only for those on
        their way (``remaining``'s ``coming``). Returns how many such peers (0: close now). A round
        closed alone gives the others nothing to follow: a swarm with two slow uplinks of 4 splits into solo runs,
        each peer taking a checkpoint from one that has moved on by the time it comes. Peers gone for good are not
        heard from, so a peer left alone closes its rounds again at the deadline."""
        if have & self.waited or self.end >= began + longest:
            return 0
        alive = sum(1 for a in self.waited if now - heard.get(a, -math.inf) <= 2 * longest)
        if alive:
            self.end, self._held = began + longest, True
        return alive

    def newcomers_not_waited(self, have: set[str], coming: set[str] = frozenset()) -> int:
        """Newcomers whose slot was cut short by the grace (counted by the loops)."""
        return 0 if self._grace_end is None else len(self.slots - have - coming)


def plan_wait(standing: Standing, base: set[str], round_key: str, *, fresh: bool, now: float, deadline: float,
              grace: float, me: str | None = None) -> RoundWait:
    """The wait of a round whose candidates are ``base`` (last round's participants and the joins): the peers whose
    word counts, and newcomer slots (a quarter of them, at least one) drawn from ``round_key`` the same way at
    every peer, brand-new keys only in ``fresh`` rounds. A fresh key can neither add itself to the set every round
    waits for nor stall many rounds. ``me``, if given, is left out (a loop that holds its own contribution)."""
    mine = {me} if me is not None else set()
    expected = standing.counting(base) - mine
    slots = standing.newcomers(base - expected - mine, round_key, max(1, len(expected) // 4), fresh_ok=fresh)
    return RoundWait(frozenset(expected), frozenset(slots), now + deadline, grace)


def short_id(peer: str) -> bytes:
    """A peer's 8-byte name in a member view (a view of 16 peers is 16 x 9 bytes on the wire, not 16 x 53)."""
    return hashlib.blake2b(peer.encode(), digest_size=8).digest()


@dataclass
class MemberAgreement:
    """Whose view fixes a round's members.

    At its close each peer publishes its view: the members it would combine (the peers whose contribution it holds
    and waited for). ``chain`` is the last round's members whose word counts, in this round's order (drawn from the
    round: no peer chooses its place; the DiLoCo loop puts the members the others measured slow last, by the rates
    of the last round's announcements); its first is the round's coordinator and every peer adopts the coordinator's
    view, ours included. The last round's members were agreed the same way, so the chain, and the coordinator, are
    the same at every peer, whichever updates reached it in time this round: peers that closed with different
    members (an update that reached one by its deadline and another just after it) still combine the same ones and
    end with the same weights. If the coordinator's view has not come by ``end`` (it died, or is cut off), the first
    peer of the chain whose view we hold is taken (or ours, if we come first): every peer that lost the coordinator
    takes the same next one."""

    me: str
    chain: tuple[str, ...]
    end: float

    def remaining(self, now: float, views: Collection[str]) -> float | None:
        """Seconds to wait more for the coordinator's view, or None: decide now (``coordinator``)."""
        if not self.chain or self.chain[0] == self.me or self.chain[0] in views or now >= self.end - TICK:
            return None
        return self.end - now

    def coordinator(self, views: Collection[str]) -> str | None:
        """The peer whose view is the round's members (``me``: our own), None when the chain is empty."""
        for peer in self.chain:
            if peer == self.me or peer in views:
                return peer
        return None

    def after(self, now: float) -> MemberAgreement:
        """Ours when the others have stopped waiting for our view (``too_late_to_coordinate``): the first of the
        rest of the chain whose view we hold, decided now, ours only if we hold none of theirs."""
        return MemberAgreement(self.me, tuple(a for a in self.chain if a != self.me) + (self.me,), now)


def too_late_to_coordinate(me: str, chain: Sequence[str], now: float, view_at: Mapping[str, float],
                           span: float) -> bool:
    """We come first in the chain (the round's coordinator) and are about to publish our view at ``now``: whether
    most of the others in the chain have already stopped waiting for it. Each peer publishes its own view when it
    closes the round and waits one ``span`` for the coordinator's; one whose view came to us (``view_at``) a span
    or more ago has, by its clock, run out of that wait before ours could reach it, and taken the next peer of the
    chain whose view it holds. We then take that one too (``MemberAgreement.after``), not our own view, which no
    one else follows: a coordinator that closed late (an update announcement that never reached it, waited for
    to its deadline) combined its own members alone, diverged and resynced. Spans differ a little from peer to
    peer (each one's deadline adapts); a peer whose span is longer than ours may still take our view: only a
    majority of the chain past its wait moves us."""
    others = [a for a in chain if a != me]
    past = sum(1 for a in others if a in view_at and now >= view_at[a] + span)
    return 2 * past > len(others)


def resolve_view(view: Iterable[bytes], known: Mapping[bytes, str]) -> tuple[set[str], int]:
    """The peers a view names, among ``known`` (short id -> peer, the peers whose contribution we hold), and how
    many of its names we cannot resolve."""
    peers, unknown = set(), 0
    for h in view:
        if h in known:
            peers.add(known[h])
        else:
            unknown += 1
    return peers, unknown


@dataclass(frozen=True)
class HashVerdict:
    majority: str
    agrees: bool
    holders: tuple[str, ...]  # the counted peers holding the majority's hash, sorted: whom to resync from


def hash_verdict(ours: str, theirs: Mapping[str, str], counts=lambda peer: True, *, me: str, salt: str
                 ) -> HashVerdict | None:
    """Our weights' hash after a round against the hashes peers published for it, only those of peers that
    ``counts`` (a fresh key's word does not); None when no counted peer published one. ``me``: our peer id (our
    hash is a vote too), ``salt``: the run and round, for a tie (``majority``)."""
    counted = {a: h for a, h in theirs.items() if a != me and counts(a)}
    if not counted:
        return None
    top = majority({**counted, me: ours}, salt)
    return HashVerdict(top, top == ours, tuple(sorted(a for a, h in counted.items() if h == top)))


T = TypeVar("T")


def new_items(inbox: Mapping[str, tuple[int, T]], used: dict[str, int], me: str) -> list[tuple[str, int, T]]:
    """SAPO: the peers' items we have not drawn from yet (``inbox``: author -> (its round, its items), in arrival
    order; ``used``: author -> the newest of its rounds we drew from, updated here), as (author, round, items).
    Our own items are never external."""
    out = []
    for author, (rr, items) in list(inbox.items()):  # a snapshot: the validator may add to it meanwhile
        if author == me or rr <= used.get(author, -1):
            continue
        used[author] = rr
        out.append((author, rr, items))
    return out


def draw(candidates: Mapping[str, Sequence[T]], want: int, per_source: int, rng: random.Random
         ) -> tuple[list[tuple[str, T]], int]:
    """SAPO: ``want`` of the candidates (author -> its informative groups) drawn uniformly at random, at most
    ``per_source`` from any one author, so no peer (or flood of one peer's items) fills a round. Returns the chosen
    (author, group) in the order drawn, and how many draws were passed over for their author's cap."""
    pool = [(author, g) for author, groups in candidates.items() for g in groups]
    rng.shuffle(pool)
    chosen: list[tuple[str, T]] = []
    taken: collections.Counter = collections.Counter()
    capped = 0
    for author, group in pool:
        if len(chosen) == want:
            break
        if taken[author] >= per_source:
            capped += 1
            continue
        taken[author] += 1
        chosen.append((author, group))
    return chosen, capped


def pick_local(own: Sequence[T], want: int, rng: random.Random, informative=lambda g: g.informative) -> list[T]:
    """SAPO: the ``want`` (I) of our own groups we train on: the informative ones first (a group whose completions
    all scored alike has zero advantage and carries no gradient), in random order, then the others, so I < G never
    leaves an informative group of ours out while an uninformative one is in. With I = G it is all of them."""
    shuffled = list(own)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=lambda g: not informative(g))[:want]  # sorted is stable: random within each kind


USELESS_FACTOR = 4.0  # a source is judged against a policy this many times worse than the others' median
USELESS_ALPHA = 1e-6  # ... which misses every item of the source's zero streak with at most this probability
RECENT = 64  # items a source's recent hit rate is over (an exponential average past the first ones)
MIN_ITEMS = 16  # a source's recent hit rate counts in the median once we scored this many of its items


@dataclass
class Source:
    items: int = 0  # item sets (questions) of its we scored
    completions: int = 0
    reward: float = 0.0  # the sum of our verifier's rewards of its completions
    hits: float = 0.0  # the fraction of its last ~RECENT items with a completion that scored above 0
    used: int = 0  # its groups we trained on
    streak: int = 0  # its latest items whose completions all scored 0 (the run since its last one that did not)
    penalised_at: int = 0  # the streak at which it was last judged useless (0: not in this streak)


class Sources:
    """SAPO: what our verifier made of each peer's completions (``scored``), and which peers are useless.

    Items, not completions, are the trials: the G completions of one question are not independent (a small policy
    knows an answer or it does not: an honest policy whose right answers all fall on one kind of question scores 0
    on every completion of the others), while the questions are drawn independently. An item *hits* when one of its
    completions scores above 0. A source is *useless* when its last ``streak`` items all missed, and an honest policy
    whose hit rate is a quarter of the median of the other sources' recent hit rates (our own policy's included)
    would miss that many in a row with probability below ``USELESS_ALPHA``: ``(1 - median / 4) ** streak < 1e-6``.
    That bound holds however a policy's right answers are spread over questions (counting completions as trials
    is exact only for a policy whose every completion is right at random, independently).
    Garbage and wrong answers get there; so does an honest policy more than 4x weaker than the typical peer's,
    whose completions teach nobody anything either (a group whose completions all score 0 carries no advantage).
    A median, so one strong peer does not make the others useless, and a flood of sources that score nothing
    lowers the bar for nobody. Nothing is judged while the others score nothing too (the start of a run), and one
    completion scored above 0 ends the streak. Bounded: at most ``max_sources`` peers (the one with the fewest
    items scored gives way)."""

    def __init__(self, me: str, max_sources: int = 256):
        self.me = me
        self.max_sources = max_sources
        self.by_peer: dict[str, Source] = {}

    def get(self, author: str) -> Source:
        if author not in self.by_peer and len(self.by_peer) >= self.max_sources:
            self.by_peer.pop(min(self.by_peer, key=lambda a: self.by_peer[a].items))
        return self.by_peer.setdefault(author, Source())

    def scored(self, author: str, rewards: Sequence[float]) -> None:
        """One item of ``author`` (our own included, as ``me``) scored by our verifier."""
        s = self.get(author)
        s.items += 1
        s.completions += len(rewards)
        s.reward += sum(rewards)
        hit = any(r > 0 for r in rewards)
        s.hits += (hit - s.hits) / min(s.items, RECENT)
        if hit:
            s.streak = s.penalised_at = 0
        else:
            s.streak += 1

    def bar(self, author: str) -> float | None:
        """The median of the other sources' recent hit rates (those we scored enough items of), or None."""
        others = sorted(s.hits for a, s in self.by_peer.items() if a != author and s.items >= MIN_ITEMS)
        if not others:
            return None
        k = len(others) // 2
        return others[k] if len(others) % 2 else (others[k - 1] + others[k]) / 2

    def useless(self, author: str) -> bool:
        s = self.by_peer.get(author)
        if author == self.me or s is None or s.streak == 0:
            return False
        bar = self.bar(author)
        if not bar:
            return False
        q = min(1.0, bar) / USELESS_FACTOR
        return s.streak * math.log1p(-q) < math.log(USELESS_ALPHA)

    def to_penalise(self, author: str) -> bool:
        """Useless, and first judged so in this streak or its streak doubled since: a penalty each time (a
        statistical judgement that a weak honest peer can get too: so many items, log2-many penalties)."""
        if not self.useless(author):
            return False
        s = self.by_peer[author]
        if s.penalised_at and s.streak < 2 * s.penalised_at:
            return False
        s.penalised_at = s.streak
        return True
