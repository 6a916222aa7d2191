"""Screening a round's updates, the same rule at every peer: whose updates a round combines from their
announcements (``screen_members``: wrong part counts, norm outliers), which updates point nowhere the others do
(``uncorrelated``), and the exact dot products and norms those decisions read (``gram``, ``gram_norms``): integers,
the same bits on every CPU and thread count, so every peer that screens the same members refuses the same ones.
``protocols/exchange.py`` re-exports these names.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np
import torch

from swarmd.protocols import kernels

# screening a round's updates (the same rule at every peer, from the round's own data only, so every peer that
# combines the same members refuses the same ones): an update whose announced norm is more than OUTLIER_NORM x the
# median is refused, not only clipped; one whose direction is no closer to the others' than random noise of its size
# would be (cosine below NOISE_SIGMAS / sqrt(n)) is refused as noise
OUTLIER_NORM = 10.0
NOISE_SIGMAS = 5.0


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


def _flat_f32(x: torch.Tensor):
    """A contiguous 1-d float32 CPU tensor's values as a numpy array (its memory, no copy), for the kernels; None
    for anything else (the torch passes take it)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or not x.is_contiguous() \
            or x.requires_grad:
        return None
    return x.numpy()
