"""Outer-step primitives for DiLoCo and Streaming DiLoCo (``docs/loops/diloco.md``): fragments, the outer
Nesterov optimizer, robust combination of peers' pseudo-gradients, adaptive round deadlines, and the wait every
loop's round (DiLoCo, SPSA, SAPO) closes with.

Everything is deterministic given its inputs: peers are always combined in sorted peer-id order, each operation
rounded on its own in a fixed order (``exchange.reduce_part``), so every node that combines the same set of updates
gets bit-identical global weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import statistics
from collections import deque
from typing import Callable

import numpy as np
import torch

from swarmd.protocols import codecs, exchange, kernels
from swarmd.protocols.bulk import hasher
from swarmd.protocols.rounds import TICK
from swarmd.transport import clock

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")


def fragments(names: list[str], count: int) -> list[list[int]]:
    """Split parameters (given in a fixed order) into ``count`` fragments, strided by block: block i goes to
    fragment i % count, as Streaming DiLoCo does; parameters outside the blocks (embeddings, final norm, head) go
    to fragment 0. Every parameter is in exactly one fragment."""
    if count < 1:
        raise ValueError("count must be >= 1")
    out: list[list[int]] = [[] for _ in range(count)]
    for index, name in enumerate(names):
        m = _BLOCK.search(name)
        out[int(m.group(1)) % count if m else 0].append(index)
    return out


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 tensor on the CPU, wherever the parameters live: the global weights, the outer momentum and
    every combination stay on the CPU (bit-identical across peers whatever their device, and off the GPU's memory)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors]) if tensors else torch.zeros(0)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"{flat.numel()} values for {offset} parameters")


def pseudo_gradient(global_params: list[torch.Tensor], local_params: list[torch.Tensor]) -> torch.Tensor:
    """Delta = global - local, flat fp32 (what a peer sends after its inner steps)."""
    return flatten(global_params) - flatten(local_params)


# the hash of a run's weights (``params_hash``): peers compare it every round, so it is part of a run's fingerprint
# (DilocoConfig.shared): peers that hash otherwise are told they run another config, not left to disagree
WEIGHTS_HASH = "blake3-128"


def _fp32_bytes(tensors: list[torch.Tensor]):
    """Each tensor's fp32 values as a uint8 array of its own buffer, in order (a bytes copy of each would be a
    transient the size of the weights)."""
    for t in tensors:
        yield t.detach().to("cpu", torch.float32).contiguous().view(-1).view(torch.uint8).numpy()


def params_hash(tensors: list[torch.Tensor]) -> str:
    """The weights' hash: BLAKE3 of their fp32 bytes in order, 16 bytes as hex, on every core from the bulk store's
    threshold (``bulk.hasher``). Computed every round on the whole model (and once more on the fragment that
    changed), while the training loop waits: BLAKE3 takes 7.5 ms for 100 MB of weights on a 2-core machine, BLAKE2b
    72 ms (about 3 s a round for a 1B-parameter model)."""
    h = hasher(4 * sum(t.numel() for t in tensors))
    for data in _fp32_bytes(tensors):
        h.update(data)
    return h.hexdigest(length=16)


def params_hash_before_blake3(tensors: list[torch.Tensor]) -> str:
    """The weights' hash that older versions saved in place of WEIGHTS_HASH (BLAKE2b-128 of the same bytes): only
    to check a checkpoint saved by one, which a node still resumes from (``DilocoLoop._resume_own``)."""
    h = hashlib.blake2b(digest_size=16)
    for data in _fp32_bytes(tensors):
        h.update(data)
    return h.hexdigest()


# how the outer step rounds: the new weights' bits depend on it, so it is part of a run's fingerprint
# (DilocoConfig.shared): peers of versions that step otherwise never meet in one run
OUTER_STEP = "nesterov, each product and sum rounded on its own, no fused multiply-add (2)"
STEP_SLICE = 1 << 16  # values of a fragment the outer step takes at a time (its product buffer: 256 KB)


class OuterNesterov:
    """SGD with Nesterov momentum on flat fragments, as torch.optim.SGD(nesterov=True): buf = mu*buf + g;
    theta -= lr * (g + mu*buf). Defaults from DiLoCo: lr 0.7, momentum 0.9."""

    def __init__(self, sizes: list[int], lr: float = 0.7, momentum: float = 0.9):
        self.lr = lr
        self.momentum = momentum
        self.buffers = [torch.zeros(n) for n in sizes]

    def step(self, fragment: int, params_flat: torch.Tensor, grad: torch.Tensor, consume: bool = False) -> torch.Tensor:
        """The new weights of ``fragment`` (a new tensor; ``params_flat`` is left as it is). With ``consume``,
        ``grad`` is not needed afterwards: the new weights are computed in it (no temporary; the same values)."""
        buf = self.buffers[fragment]
        if grad.shape != buf.shape or params_flat.shape != buf.shape:
            raise ValueError("fragment size mismatch")
        step = grad if consume else torch.empty_like(grad)
        if all(_kernel_ready(t) for t in (buf, grad, params_flat)):
            # one compiled pass, the same operations in the same order (kernels.nesterov), where the torch path
            # below takes 6 passes and a hundred slices' torch calls
            kernels.nesterov(buf.numpy(), grad.numpy(), params_flat.numpy(), np.float32(self.momentum),
                             np.float32(-self.lr), step.numpy())
            return step
        buf.mul_(self.momentum).add_(grad)
        # g + mu * buf as a product, then a sum, then -lr x that plus theta: each operation rounded on its own.
        # torch's add(alpha=) is one fused multiply-add in its AVX2 and AVX-512 kernels and a product and a sum in
        # its scalar ones (CPUs without AVX2), so peers on other CPUs would step to other bits from the same update.
        # Slice by slice, through one small product buffer: no temporary the size of the fragment
        product = torch.empty(min(STEP_SLICE, buf.numel()), dtype=buf.dtype, device=buf.device)
        for start in range(0, buf.numel(), STEP_SLICE):
            end = min(start + STEP_SLICE, buf.numel())
            into = product[:end - start]
            torch.mul(buf[start:end], self.momentum, out=into)
            out = torch.add(grad[start:end], into, out=step[start:end])
            torch.mul(out, -self.lr, out=into)
            torch.add(into, params_flat[start:end], out=out)
        return step


def _kernel_ready(t: torch.Tensor) -> bool:
    """A tensor the compiled kernels take as it is: 1-d, contiguous float32 on the CPU, outside autograd."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous() \
        and not t.requires_grad


# how far a peer's initial weights (DiLoCo) or base model (SPSA) may be from ours for us to start from them, relative
# to each parameter's largest magnitude: torch draws the same seed's initial weights with other low bits under other
# CPU kernels (about 1e-6 of that measured, scalar against AVX2); weights a peer chose are further
ROUNDING = 1e-5


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor, sizes: list[int]) -> float:
    """The largest difference between two flat fragments of the parameters of ``sizes``, each parameter's relative
    to its largest magnitude in ``ours``: 0 for the same values; inf where theirs are not finite, or differ from a
    parameter of ours that is all zeros (zeros are drawn alike by every CPU)."""
    if ours.shape != theirs.shape or sum(sizes) != ours.numel():
        raise ValueError("fragment size mismatch")
    worst, offset = 0.0, 0
    for n in sizes:
        a, b = ours[offset:offset + n], theirs[offset:offset + n]
        offset += n
        if not n:
            continue
        if not codecs.all_finite(b):
            return math.inf
        apart = float((a - b).abs().max())
        if apart:
            scale = float(a.abs().max())
            worst = max(worst, apart / scale if scale else math.inf)
    return worst


def combine(updates: dict[str, torch.Tensor], size: int, *, method: str = "clipped_mean", clip: float = 2.0,
            trim: float = 0.2, screen: bool = True,
            senders: bool = False) -> tuple[torch.Tensor | None, dict[str, str]]:
    """Combine peers' pseudo-gradients robustly. Returns (combined or None, {peer: rejection reason}).

    Rejected before combining: wrong size, non-finite values; with ``screen`` (3 updates or more, the rules of
    ``protocols.exchange``) an update whose norm is more than 10x the median ("norm_outlier") and one no closer in
    direction to the others than noise ("uncorrelated"). ``clipped_mean``: each update's L2 norm is clipped to
    ``clip`` x the median norm, then averaged. ``trimmed_mean``: per coordinate, the ``trim`` fraction of the
    largest and of the smallest values are dropped, the rest averaged (needs >= 3 updates to trim anything).

    ``senders`` (the clipped mean of sparse updates, ``DilocoConfig.outer_average``): each coordinate's sum divided
    by the number of updates not zero there, not by all of them. A peer's error feedback forgets what it sent, so a
    value only one peer sent and the mean divided by N is (N - 1) / N lost, neither applied nor carried; templar's
    SparseLoCo (``TopKCompressor.batch_decompress``: a scatter mean over the indices sent) averages this way."""
    rejected: dict[str, str] = {}
    good: dict[str, torch.Tensor] = {}
    for peer in sorted(updates):
        u = updates[peer]
        if not isinstance(u, torch.Tensor) or u.dim() != 1 or u.numel() != size:
            rejected[peer] = "wrong_shape"
        elif not codecs.all_finite(u):
            rejected[peer] = "non_finite"
        else:
            good[peer] = u.to(torch.float32)
    norms: dict[str, float] = {}
    if method == "clipped_mean" and good:
        # one exact pass gives every norm and every pair's product: the same floats on every peer's CPU, so the
        # peers of an all-to-all round clip and screen alike and end on the same bytes
        peers = sorted(good)
        g, shifts = exchange.gram([good[peer] for peer in peers])
        norms = dict(zip(peers, exchange.gram_norms(g, shifts)))
        rows = dict(zip(peers, range(len(peers))))
        if screen:
            for peer in exchange.norm_outliers(norms):
                rejected[peer] = "norm_outlier"
                del good[peer], norms[peer], rows[peer]
            for peer in exchange.uncorrelated_in(g, rows, size):
                rejected[peer] = "uncorrelated"
                del good[peer], norms[peer]
    if not good:
        return None, rejected
    if method == "clipped_mean":
        # the scatter exchange's rule on whole updates (``exchange.reduce_part``): the same bits whichever way a
        # round combines, and no stacked copies (a stack, its scaled copy and the mean hold 2N + 1 updates at
        # once: 28 GB for 3 peers of a 1B model)
        return exchange.reduce_part(good, exchange.clip_factors(norms, clip), size, senders), rejected
    stacked = torch.stack([good[peer] for peer in sorted(good)])
    if method == "trimmed_mean":
        k = int(math.floor(trim * len(good)))
        if k == 0 or len(good) - 2 * k < 1:
            return stacked.mean(0), rejected
        ordered, _ = torch.sort(stacked, dim=0)
        return ordered[k : len(good) - k].mean(0), rejected
    raise ValueError(f"unknown method {method!r}")


def merge_into(params: list[torch.Tensor], global_flat: torch.Tensor, alpha: float, broken: bool = False) -> None:
    """Set a fragment's parameters after its round: alpha * local + (1 - alpha) * global, or the global weights as
    they are when alpha is 0, when ``broken`` (our training went wrong) or when a local value is not finite (0 x a
    non-finite value is NaN, not 0: a peer whose weights blew up would never get them back)."""
    if alpha != 0.0 and (broken or not all(codecs.all_finite(t) for t in params)):
        alpha = 0.0  # (with alpha 0 the local values are not read: no pass over them to check)
    merged = global_flat if alpha == 0.0 else mix(flatten(params), global_flat, alpha)
    with torch.no_grad():
        unflatten_into(merged, params)


def mix(local: torch.Tensor, merged: torch.Tensor, alpha: float) -> torch.Tensor:
    """Streaming DiLoCo's merge of an overlapped fragment: alpha * local + (1 - alpha) * merged global."""
    return alpha * local + (1.0 - alpha) * merged


class AdaptiveDeadline:
    """How long a round waits for late peers, from observed arrival offsets (not a fixed timeout): the median plus
    ``k`` median absolute deviations of the last ``window`` offsets, clamped to [low, high] seconds."""

    def __init__(self, *, k: float = 4.0, window: int = 64, low: float = 1.0, high: float = 60.0,
                 initial: float = 10.0):
        self.k, self.low, self.high = k, low, high
        self.offsets: deque[float] = deque(maxlen=window)
        self.initial = initial

    def observe(self, offset: float) -> None:
        if math.isfinite(offset) and offset >= 0:
            self.offsets.append(offset)

    def value(self) -> float:
        if len(self.offsets) < 3:
            return max(self.low, min(self.high, self.initial))
        med = statistics.median(self.offsets)
        mad = statistics.median(abs(x - med) for x in self.offsets)
        return max(self.low, min(self.high, med + self.k * max(mad, 0.05 * med)))


async def wait_until(done: Callable[[], bool], arrived: asyncio.Event, timeout: float,
                     poll: float | None = None) -> bool:
    """Wait until ``done()`` holds, checking again each time ``arrived`` is set (and every ``poll`` seconds, for a
    ``done`` that can turn true without it), for at most ``timeout`` seconds. Returns whether it holds: False means
    the deadline passed first."""
    now = clock.current().monotonic
    deadline = now() + timeout
    while not done():
        remaining = deadline - now()
        if remaining <= TICK:
            return False
        await wait_event(arrived, remaining if poll is None else min(remaining, poll))
    return True


async def wait_event(arrived: asyncio.Event, timeout: float) -> None:
    """Wait until ``arrived`` is set anew (it is cleared first), for at most ``timeout`` seconds."""
    arrived.clear()
    try:
        await asyncio.wait_for(arrived.wait(), timeout)
    except asyncio.TimeoutError:
        pass
