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

This module holds the choice of exchange (``fewer_bytes``, ``auto_parts``), the reduction (``reduce_part``,
``clip_factors``, ``chunk_ok``, the ``REDUCE_RULE`` every peer of a run shares) and the round's decisions on what
arrived over the wire (the DiLoCo loop is the I/O around them: pulls, publishes, waits): the members' bitmaps and
digest (``pack_set``, ``members_digest``), whether a reducer's part is one to take (``take_reduced``), what an audit
or a dispute concludes (``audit_verdict``, ``settle_dispute``), and whether to conform a part to the coordinator's
(``conform_action``). Its siblings hold the rest, and their names are importable from here too: who reduces and
audits which part (``protocols/assign.py``), link rates and the probe (``protocols/linkrates.py``), whose updates a
round combines (``protocols/screen.py``).
"""

from __future__ import annotations

import hashlib
import statistics

import torch

from swarmd.protocols import codecs, kernels
# the names importers use from here: the exchange's pure rules, one module each
from swarmd.protocols.assign import (MAX_PARTS, MAX_UNREACHED_REPORTS, PART_MIN, audit_plan,  # noqa: F401
                                     audited, audited_parts, barred, cut_members, order, part_bounds, part_count,
                                     reducer_of, reducers)
from swarmd.protocols.linkrates import (MAX_RATE_REPORTS, MIN_BUSY, PROBE_SECONDS, PROBE_SIZES,  # noqa: F401
                                        REFERENCE_QUANTILE, SLOW_FACTOR, SLOW_SOURCE, WEIGHT_FULL, RateMeter,
                                        fastest_first, measured_rates, probe_payload, probe_rate, probe_sizes,
                                        rate_weights, slow_last, slow_source, transfer_wait)
from swarmd.protocols.screen import (GRAM_BITS, GRAM_BLOCK, GRAM_FLUSH, GRAM_FLUSH_VALUES, GRAM_TINY,  # noqa: F401
                                     GRAM_WINDOW, NOISE_SIGMAS, OUTLIER_NORM, _flat_f32, gram, gram_norms,
                                     norm_outliers, screen_members, uncorrelated, uncorrelated_in)

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
