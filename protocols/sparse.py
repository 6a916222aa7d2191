"""Sparse outer updates: per-chunk top-k, each kept value in 2 bits (SparseLoCo's class of codec; codec id 7,
``"topk2"``), the plain top-k it refines (codec id 5, ``"topk"``: the largest magnitudes of the whole tensor, kept
exactly), and the bit accounting of what a peer sends.

Why: SparseLoCo (arXiv 2508.15706: top-1.56% of each 4096-long chunk, 2-bit values, 12-bit indices, about 0.23 bits a
parameter a sync, error feedback in place of outer momentum) reports better loss than full-precision DiLoCo at
H = 15..250 on a 512M model, at ~4,400x fewer bytes than data parallelism. On a small model and a short run
(bench_diloco_sim.py's h30-topk2 rows, 14 syncs) it is well behind today's sign + error feedback at H = 4: error
feedback needs many syncs to deliver what a sparse update leaves out. The loop's error feedback
(``DilocoConfig.error_feedback``, on by default for this codec) carries what a sync leaves out into the next one, so
over rounds nothing of a peer's steps is lost, only delayed.

The encoding of n values, cut into chunks of ``chunk`` (a power of two) consecutive values, the last one shorter
where n is not a multiple:

- each chunk keeps its k = round(density x chunk) largest magnitudes, their offsets in the chunk in increasing order
  (a chunk's offsets are distinct: the encoding of a tensor is unique); a last, shorter chunk of m values keeps
  ceil(k x m / chunk) of them, as dense as the others (the loop cuts an update into parts at any value, so every part
  ends in one);
- each kept value is a sign and one of the chunk's L = 2^(bits - 1) magnitude levels, the levels chosen by a few
  rounds of Lloyd's algorithm on the kept magnitudes (each level the mean of the magnitudes it stands for: a
  statistical scale per chunk, as MuLoCo's and SparseLoCo's quantizers keep one per row);
- decoding puts sign x level at each kept offset and zero elsewhere.

Wire (the codec registry's map, ``protocols/codecs.py``): ``block`` = chunk, ``k`` = kept per full chunk,
``scales`` = the chunks' levels, L bfloat16 each (L is the scales' size over the chunks': 1, 2, 4 or 8),
``data`` = the offsets, log2(chunk) bits each, then the codes, ``bits`` each (bit 0 the sign, 1 = negative, the
bits above it the level), each a little-endian bit stream (the first value in the lowest bits) padded with zero bits
to a whole byte. At the defaults (4096, 1/64, 2 bits): 64 x (12 + 2) + 32 = 928 bits a chunk, 0.2266 bits a value.

Decoding is refused (``CodecError``) unless: the chunk is a power of two from MIN_CHUNK to MAX_CHUNK, 1 <= k <= chunk,
every section has exactly the size the shape, chunk, k and L give (checked before anything is allocated), the padding
bits are zero, each chunk's offsets increase and lie inside the chunk, and every level is finite and not negative.
What a payload allocates is proportional to its size: the offsets and codes to the data's bits, the output to the
element count, at most MAX_CHUNK / 2 values per byte of scales (and the caller's ``max_elements``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarmd.protocols.codecbase import Codec, CodecError, Encoded, _check_finite, _flat32, _need, _out

MIN_CHUNK, MAX_CHUNK = 16, 1 << 14
LEVELS = {1: 1, 2: 2, 4: 3, 8: 4}  # magnitude levels per chunk -> bits per value (sign included)
LLOYD_ROUNDS = 4  # Lloyd iterations on a chunk's kept magnitudes
DEFAULT_DENSITY, DEFAULT_CHUNK, DEFAULT_BITS = 1 / 64, 4096, 2


def check_chunk(chunk: int) -> int:
    if type(chunk) is not int or not MIN_CHUNK <= chunk <= MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"chunk: a power of two from {MIN_CHUNK} to {MAX_CHUNK}")
    return chunk


class TopKCodec(Codec):
    """Top-k sparsification: the k = ceil(ratio * n) largest magnitudes, as uint32 indices + float32 values.

    Stateless here; ``codecs.ErrorFeedback`` adds Deep Gradient Compression's error feedback (carry what was dropped
    into the next round)."""

    id, name = 5, "topk"

    def __init__(self, ratio: float = 0.01):
        if not 0 < ratio <= 1:
            raise ValueError("ratio must be in (0, 1]")
        self.ratio = ratio

    def _parts(self, x: torch.Tensor):
        flat = _flat32(x)
        n = flat.numel()
        k = min(n, max(1, math.ceil(self.ratio * n))) if n else 0
        if k:
            _, idx = torch.topk(flat.abs(), k, sorted=False)
            idx, _ = torch.sort(idx)
        else:
            idx = torch.zeros(0, dtype=torch.int64)
        values = flat[idx]
        return (Encoded(self.id, x.dtype, tuple(x.shape), 0, k, idx.to(torch.int32).numpy().tobytes(), b""),
                values.contiguous().view(torch.uint8))

    def decode_flat(self, enc: Encoded, out):
        n, k = math.prod(enc.shape), enc.k
        if k > n:
            raise CodecError("topk: k exceeds the element count")
        _need(len(enc.scales), 4 * k, "indices")
        _need(len(enc.data), 4 * k, "values")
        result = _out(enc, out)
        result.zero_()
        if k:
            idx = torch.frombuffer(bytearray(enc.scales), dtype=torch.int32).to(torch.int64)
            if bool((idx < 0).any()) or bool((idx >= n).any()):
                raise CodecError("topk: index out of range")
            values = torch.frombuffer(bytearray(enc.data), dtype=torch.float32)
            _check_finite(values)
            result.index_put_((idx,), values, accumulate=False)
        return result


class SparseCodec(Codec):
    """Per-chunk top-k with ``bits``-bit values (sign + level) and packed offsets: see the module's docstring."""

    id, name = 7, "topk2"
    finite_by_construction = True  # every value is +-a level, and the levels are checked finite

    def __init__(self, density: float = DEFAULT_DENSITY, chunk: int = DEFAULT_CHUNK, bits: int = DEFAULT_BITS):
        if not 0 < density <= 1:
            raise ValueError("density must be in (0, 1]")
        if bits not in LEVELS.values():
            raise ValueError("bits: 1 to 4 (a sign and 2^(bits - 1) magnitude levels)")
        self.chunk = check_chunk(chunk)
        self.k = max(1, min(chunk, round(density * chunk)))
        self.bits, self.levels, self.density = bits, 1 << (bits - 1), density

    def _parts(self, x: torch.Tensor):
        flat = _flat32(x)
        n, c = flat.numel(), self.chunk
        full, rem = divmod(n, c)
        offsets, codes, levels = [], [], []
        tail = last_kept(self.k, rem, c)
        for rows, k in ((flat[: full * c].view(full, c), self.k), (flat[full * c:].view(1, rem), tail)):
            if rows.numel() == 0:
                continue
            idx = torch.sort(torch.topk(rows.abs(), k, dim=1, sorted=False).indices, dim=1).values
            vals = torch.gather(rows, 1, idx)
            lv, code = quantize(vals, self.levels)
            offsets.append(idx.reshape(-1))
            codes.append(code.reshape(-1))
            levels.append(lv.reshape(-1))
        scales = torch.cat(levels).to(torch.bfloat16).view(torch.int16).numpy().tobytes() if levels else b""
        data = np.concatenate([pack(torch.cat(offsets).numpy(), c.bit_length() - 1),
                               pack(torch.cat(codes).numpy(), self.bits)]) if offsets else np.zeros(0, np.uint8)
        return (Encoded(self.id, x.dtype, tuple(x.shape), c, self.k, scales, b""), torch.from_numpy(data))

    def decode_flat(self, enc: Encoded, out):
        n, c, k = math.prod(enc.shape), enc.block, enc.k
        if c < MIN_CHUNK or c > MAX_CHUNK or c & (c - 1):
            raise CodecError(f"{self.name}: chunk must be a power of two from {MIN_CHUNK} to {MAX_CHUNK}")
        if not 1 <= k <= c:
            raise CodecError(f"{self.name}: k must be from 1 to the chunk")
        full, rem = divmod(n, c)
        chunks = full + (rem > 0)
        if not chunks:
            _need(len(enc.scales), 0, "scales")
            _need(len(enc.data), 0, "data")
            return _out(enc, out)
        levels = len(enc.scales) // (2 * chunks)
        if len(enc.scales) != 2 * chunks * levels or levels not in LEVELS:
            raise CodecError(f"{self.name}: scales must hold 1, 2, 4 or 8 bfloat16 levels per chunk")
        bits, width = LEVELS[levels], c.bit_length() - 1
        last = last_kept(k, rem, c)
        kept = full * k + last
        at = -(-kept * width // 8)
        _need(len(enc.data), at + -(-kept * bits // 8), "data")
        raw = np.frombuffer(enc.data, dtype=np.uint8)
        offsets = unpack(raw[:at], kept, width)
        codes = unpack(raw[at:], kept, bits)
        if offsets is None or codes is None:
            raise CodecError(f"{self.name}: nonzero padding bits")
        # each chunk's offsets strictly increasing: one comparison over the rows of whole chunks, one for the last
        if full and k > 1 and not bool((np.diff(offsets[: full * k].reshape(full, k), axis=1) > 0).all()):
            raise CodecError(f"{self.name}: a chunk's offsets must increase")
        if last:
            tail = offsets[full * k:]
            if int(tail[-1]) >= rem or (last > 1 and not bool((np.diff(tail) > 0).all())):
                raise CodecError(f"{self.name}: an offset outside the last chunk, or not increasing")
        table = bf16_to_f32(np.frombuffer(enc.scales, dtype=np.uint16)).reshape(chunks, levels)
        if not (np.isfinite(table).all() and (table >= 0).all()):
            raise CodecError(f"{self.name}: levels must be finite and not negative")
        row = np.repeat(np.arange(chunks, dtype=np.int64), [k] * full + ([last] if last else []))
        values = table[row, codes >> 1] * (1.0 - 2.0 * (codes & 1)).astype(np.float32)
        result = _out(enc, out)
        result.zero_()
        result.numpy()[row * c + offsets] = values
        return result

    def kept_fraction(self, n: int) -> float:
        """The fraction of ``n`` values an encoding keeps."""
        full, rem = divmod(n, self.chunk)
        return (full * self.k + last_kept(self.k, rem, self.chunk)) / n if n else 0.0


def last_kept(k: int, rem: int, chunk: int) -> int:
    """The values a last, shorter chunk of ``rem`` values keeps: ceil(k x rem / chunk), at least one (none of none)."""
    return min(rem, max(1, -(-k * rem // chunk))) if rem else 0


def quantize(vals: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's magnitude levels (rows x ``levels``, ascending, rounded to bfloat16 as they travel) and each value's
    code (sign in bit 0, the nearest level's index above it): Lloyd's algorithm from equal-count groups of the sorted
    magnitudes, each level the mean of the magnitudes nearest to it."""
    mags = vals.abs()
    rows, k = mags.shape
    if levels == 1:
        table = mags.mean(dim=1, keepdim=True)
    else:
        ordered = torch.sort(mags, dim=1).values
        group = (torch.arange(k) * levels // k).expand(rows, k)
        table = _group_means(ordered, group, levels, torch.zeros(rows, levels))
        for _ in range(LLOYD_ROUNDS):
            table = _group_means(mags, _nearest(mags, table), levels, table)
    table = table.to(torch.bfloat16).to(torch.float32)
    which = _nearest(mags, table) if levels > 1 else torch.zeros_like(mags, dtype=torch.int64)
    return table, ((which << 1) | (vals < 0).to(torch.int64)).to(torch.uint8)


def _nearest(mags: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The index of the level nearest to each magnitude (the lowest on a tie)."""
    return torch.argmin((mags[:, :, None] - table[:, None, :]).abs(), dim=2)


def _group_means(mags: torch.Tensor, group: torch.Tensor, levels: int, previous: torch.Tensor) -> torch.Tensor:
    """Per row, the mean magnitude of each group; a group with no member keeps its previous level."""
    sums = torch.zeros(mags.shape[0], levels).scatter_add_(1, group, mags)
    counts = torch.zeros(mags.shape[0], levels).scatter_add_(1, group, torch.ones_like(mags))
    return torch.where(counts > 0, sums / counts.clamp(min=1), previous)


def pack(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``values`` (each < 2^width) as one little-endian bit stream, ``width`` bits each, zero-padded to a
    whole byte."""
    bits = (values.astype(np.int64)[:, None] >> np.arange(width)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


def unpack(data: np.ndarray, count: int, width: int) -> np.ndarray | None:
    """``pack``'s ``count`` values back (int64), from exactly -(-count * width // 8) bytes; None where the padding
    bits are not zero (an encoding is unique)."""
    bits = np.unpackbits(data, bitorder="little")
    if bits[count * width:].any():
        return None
    return (bits[: count * width].reshape(count, width).astype(np.int64) << np.arange(width)).sum(axis=1)


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def bits_per_param_step(wire_bytes: int, params: int, inner_steps: int) -> float:
    """The field's unit of communication: bits a peer put on the wire per parameter per inner step (a data-parallel
    fp32 exchange every step is 32). ``wire_bytes``: what it sent over the run or a round, headers included."""
    return 8 * wire_bytes / (params * inner_steps) if params and inner_steps else 0.0
