"""The blockwise-scaled codecs: a scale per block of values, then a few bits per value (``BlockCodec``): int8
(blockwise absmax, id 3), e3m0 (4-bit sign and exponent, id 4: Streaming DiLoCo's FP4, the default codec, and the
one the combined parts of a sign or topk2 run travel in) and sign (1 bit a value times its block's mean magnitude,
id 6). Their wire layout and error bounds: the table in ``protocols/codecs.py``, which registers them. e3m0's encode
and decode are single compiled passes (``protocols/kernels.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from swarmd.protocols import kernels
from swarmd.protocols.codecbase import (MAX_ELEMENTS, Codec, CodecError, Encoded, _blocked, _check_finite,
                                        _copy_from, _flat32, _need, _out, _scale_blocks, _wire_prefix, _write_wire)


class BlockCodec(Codec):
    """A codec with a scale per block of ``block`` values (int8, e3m0, sign)."""

    default_block = 128

    def __init__(self, block: int | None = None):
        self.block = self.default_block if block is None else block

    def _blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int, torch.Tensor]:
        """``x`` as flat float32 values, their count, the block size, and the values zero-padded to whole blocks
        as a (blocks, block) view."""
        flat = _flat32(x)
        return flat, flat.numel(), self.block, _blocked(flat, self.block)


class Int8Codec(BlockCodec):
    """Blockwise absmax int8: per block of ``block`` elements, s = max abs, q = round(127 x / s)."""

    id, name = 3, "int8"
    default_block = 256

    def _parts(self, x: torch.Tensor):
        flat, n, b, view = self._blocks(x)
        scales = view.abs().amax(dim=1)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(view * (127.0 / safe).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
        return (Encoded(self.id, x.dtype, tuple(x.shape), b, 0, scales.numpy().tobytes(), b""),
                q.reshape(-1)[:n].view(torch.uint8))

    def decode_flat(self, enc: Encoded, out):
        n, b = math.prod(enc.shape), enc.block
        if b <= 0:
            raise CodecError("int8: block must be positive")
        blocks = -(-n // b)
        _need(len(enc.data), n, "data")
        _need(len(enc.scales), 4 * blocks, "scales")
        result = _out(enc, out)
        if n:
            scales = torch.frombuffer(bytearray(enc.scales), dtype=torch.float32)
            _check_finite(scales)
            _copy_from(result, enc.data, np.int8)
            _scale_blocks(result, scales / 127.0, b)
        return result


def _e3m0_pairs() -> torch.Tensor:
    """byte -> the values of its two codes (low nibble, high nibble): sign * 2^-e, e = bits 0-2, sign = bit 3."""
    codes = torch.arange(16, dtype=torch.uint8)
    values = torch.pow(2.0, -(codes & 0x07).to(torch.float32)) * (1.0 - 2.0 * (codes >> 3).to(torch.float32))
    return torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=1).contiguous()


_E3M0_PAIRS = _e3m0_pairs()
_E3M0_VALUES = np.ascontiguousarray(_E3M0_PAIRS[:16, 0].numpy())  # code -> sign * 2^-e (float32)
_SQRT2 = torch.tensor(2.0).sqrt().item()  # sqrt(2) as an fp32 value (what the encoder multiplies by)
_SQRT2_F32 = np.float32(_SQRT2)
# how e3m0 picks a value's code: peers compare reduced parts (in the run's reduced codec) byte for byte, so it is part
# of a run's fingerprint where that codec is e3m0 (DilocoConfig.shared): nodes of two encoders never mix in a run
E3M0_ENCODER = "exponent bits of |x| sqrt(2) / s"


def _decode_by_table(enc: Encoded, out: torch.Tensor | None, name: str, table: torch.Tensor) -> torch.Tensor:
    """A blockwise code with bfloat16 scales (e3m0, sign) decoded through ``table``: byte -> the values of the
    codes it packs (``table.shape[1]`` a byte, the first in the lowest bits), then each block times its scale."""
    n, b, per_byte = math.prod(enc.shape), enc.block, table.shape[1]
    if b <= 0:
        raise CodecError(f"{name}: block must be positive")
    _need(len(enc.data), -(-n // per_byte), "data")
    _need(len(enc.scales), 2 * -(-n // b), "scales")
    result = _out(enc, out)
    if n:
        scales = torch.frombuffer(bytearray(enc.scales), dtype=torch.int16).view(torch.bfloat16).to(torch.float32)
        _check_finite(scales)
        # each byte's values written straight into the result, the bytes read where they lie: numpy's take with
        # the uint8 codes as indices (mode "clip" clips nothing, a byte always names one of the table's 256 rows,
        # and lets numpy write into ``out`` unbuffered): 3x faster than torch's index_select on the codes widened
        # to int32, into a new tensor, then copied
        codes, values, rows = np.frombuffer(enc.data, dtype=np.uint8), result.numpy(), table.numpy()
        full = n // per_byte
        np.take(rows, codes[:full], axis=0, out=values[: full * per_byte].reshape(full, per_byte), mode="clip")
        if full * per_byte < n:  # the last byte's first codes
            values[full * per_byte:] = rows[codes[full]][: n - full * per_byte]
        _scale_blocks(result, scales, b)
    return result


class E3M0Codec(BlockCodec):
    """4-bit sign + exponent: x' = sign * s * 2^-e, e in 0..7, s the block's absmax stored as bfloat16.

    Code layout: bit 3 is the sign (1 = negative), bits 0-2 the exponent; two codes per byte, low nibble first.
    E3M0 has no zero: anything below s*2^-7.5 (zeros included) becomes +-s*2^-7 (as in Streaming DiLoCo)."""

    id, name = 4, "e3m0"
    finite_by_construction = True  # every |value| is at most its block's scale, and the scales are checked finite

    def _parts(self, x: torch.Tensor):
        """The exponent is e = round(-log2(|x| / s)), taken from the float's own exponent bits: with
        y = |x| * (sqrt(2) / s), e = 127 - (y's biased exponent), clamped to 0..7 (zeros and subnormals give 7).
        One IEEE multiply, then integer operations: the same bytes on every CPU (a vectorized log2 is not
        correctly rounded, and an auditor's reduction is compared with its reducer's byte for byte), and 2x
        faster than the log2 (which takes 1.1 s for a 109M-parameter update, the biggest item of a node's round).
        One compiled pass (``kernels.e3m0_encode``): 25 MB of values in 3.2 ms on one core, against 17-19 ms for
        a dozen torch passes over cached slices; the same bytes (tests/test_kernels.py keeps the torch encoder and
        compares)."""
        flat = _flat32(x, check=False)  # (the kernel checks the values in its pass)
        n, b = flat.numel(), self.block
        scales16 = np.empty(-(-n // b), dtype=np.uint16)
        data = np.empty((n + 1) // 2, dtype=np.uint8)
        if not kernels.e3m0_encode(flat.numpy(), b, _SQRT2_F32, scales16, data):
            raise CodecError("tensor holds NaN or infinity")
        return (Encoded(self.id, x.dtype, tuple(x.shape), b, 0, scales16.tobytes(), b""), torch.from_numpy(data))

    def encode_wire_measured(self, x: torch.Tensor, decoded: torch.Tensor | None = None) -> tuple[bytearray, float]:
        """The wire bytes of ``x`` (as ``encode_wire``) and, from the same pass (``kernels.e3m0_encode_measured``),
        the sum of the squares of what a decoder gets from them (float64), the decoded values written into
        ``decoded`` where given: a sender's norm of its update as the others see it, without decoding its own bytes
        again and a norm pass over them (for a DiLoCo round's update, 25 MB decoded and measured, that pass costs 6%
        of a node's worker CPU at N = 8). ``x``: a contiguous 1-d float32 CPU tensor, only read. Where ``x`` holds
        NaN or infinity: CodecError."""
        scales16, data, into = self._one_pass_buffers(x, decoded, "encode_wire_measured")
        finite, kept = kernels.e3m0_encode_measured(x.detach().numpy(), self.block, _SQRT2_F32, scales16, data,
                                                    _E3M0_VALUES, into)
        return self._one_pass_wire(x, finite, scales16, data), kept

    def encode_wire_residual(self, x: torch.Tensor,
                             decoded: torch.Tensor | None = None) -> tuple[bytearray, float, float]:
        """Error feedback's encode in one pass (``kernels.e3m0_encode_residual``): the wire bytes of ``x`` (as
        ``encode_wire``), with ``x`` (a contiguous 1-d float32 CPU tensor) left holding what the codec dropped of
        it (x minus its decoded values, as ``x - decode(...)``) and the decoded values written into ``decoded``
        where given. Returns (the bytes, the sum of the decoded values' squares, the sum of the residual's), in
        float64. Where ``x`` holds NaN or infinity: CodecError (``x`` then holds nothing of use)."""
        if x.requires_grad:
            raise ValueError("encode_wire_residual takes a contiguous 1-d float32 CPU tensor")
        scales16, data, into = self._one_pass_buffers(x, decoded, "encode_wire_residual")
        finite, kept, dropped = kernels.e3m0_encode_residual(x.numpy(), self.block, _SQRT2_F32, scales16, data,
                                                             _E3M0_VALUES, into)
        return self._one_pass_wire(x, finite, scales16, data), kept, dropped

    def _one_pass_buffers(self, x: torch.Tensor, decoded: torch.Tensor | None, name: str):
        """The one-pass encoders' checks of their inputs and their output arrays: (scales, codes, decoded values'
        array, empty where not wanted)."""
        if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"{name} takes a contiguous 1-d float32 CPU tensor")
        if x.numel() > MAX_ELEMENTS:
            raise CodecError("tensor too large")
        if decoded is not None and (decoded.dtype != torch.float32 or decoded.numel() != x.numel()
                                    or not decoded.is_contiguous()):
            raise ValueError("decoded must be a contiguous float32 tensor of x's size")
        n = x.numel()
        into = decoded.view(-1).numpy() if decoded is not None else np.empty(0, dtype=np.float32)
        return np.empty(-(-n // self.block), dtype=np.uint16), np.empty((n + 1) // 2, dtype=np.uint8), into

    def _one_pass_wire(self, x: torch.Tensor, finite: bool, scales16: np.ndarray, data: np.ndarray) -> bytearray:
        """A one-pass encoder's wire bytes (as ``encode_wire``'s), or CodecError where a value was not finite."""
        if not finite:
            raise CodecError("tensor holds NaN or infinity")
        head = Encoded(self.id, x.dtype, tuple(x.shape), self.block, 0, scales16.tobytes(), b"")
        codes = torch.from_numpy(data)
        prefix = _wire_prefix(head, codes.numel())
        out = bytearray(len(prefix) + codes.numel())
        _write_wire(prefix, codes, out)
        return out

    def decode_flat(self, enc: Encoded, out):
        # each code's value (sign * 2^-e, exact) times its block's scale, low nibble first: one compiled pass
        # (``kernels.nibble_decode``), the products of the table lookup and the blockwise scaling before it
        n, b = math.prod(enc.shape), enc.block
        if b <= 0:
            raise CodecError(f"{self.name}: block must be positive")
        _need(len(enc.data), (n + 1) // 2, "data")
        _need(len(enc.scales), 2 * -(-n // b), "scales")
        result = _out(enc, out)
        # (the bfloat16 scales read where they lie, checked finite and widened in the kernel)
        if n and not kernels.nibble_decode(np.frombuffer(enc.data, dtype=np.uint8),
                                           np.frombuffer(enc.scales, dtype=np.uint16), b, _E3M0_VALUES,
                                           result.numpy()):
            raise CodecError("tensor holds NaN or infinity")
        return result


class SignCodec(BlockCodec):
    """1-bit sign + a scale per block: x' = s * sign(x), s the block's mean absolute value stored as bfloat16 (the
    scale that minimises the block's squared error for a sign code, as in signSGD with error feedback and 1-bit
    Adam). About 1.1 bits a value at the default block (3.7x fewer bytes than e3m0), so a run may sync 3.7x as often
    for the same bytes; it drops a value's magnitude, so pair it with error feedback (DiLoCo's ``error_feedback``).

    Code layout: one bit per value, 1 = negative, eight values per byte, the first in the lowest bit. A zero is sent as
    +s. A decoded block's norm is s * sqrt(block), at most the block's own norm (mean |x| <= its root mean square; up
    to the scale's rounding to bfloat16)."""

    id, name = 6, "sign"
    finite_by_construction = True  # every |value| is its block's scale, and the scales are checked finite

    def _parts(self, x: torch.Tensor):
        flat, n, b, view = self._blocks(x)
        counts = torch.full((view.shape[0],), float(b))
        if n % b:
            counts[-1] = n % b  # the last block's mean over its own values, not its zero padding
        scales16 = (view.abs().sum(dim=1) / counts).to(torch.bfloat16)
        # the signs eight to a byte, the first in the lowest bit, the last byte's unused bits 0: numpy's comparison
        # and packbits (25 MB of values: 1.9 ms against 21.6 for torch's comparison, shifts and sums)
        packed = torch.from_numpy(np.packbits(flat.numpy() < 0, bitorder="little"))
        return (Encoded(self.id, x.dtype, tuple(x.shape), b, 0, scales16.view(torch.int16).numpy().tobytes(), b""),
                packed)

    def decode_flat(self, enc: Encoded, out):
        # one table lookup per byte gives its eight values (+-1, lowest bit first)
        return _decode_by_table(enc, out, self.name, _SIGN_OCTETS)


_SIGN_OCTETS = (1.0 - 2.0 * ((torch.arange(256, dtype=torch.int32)[:, None] >> torch.arange(8)) & 1)).to(
    torch.float32).contiguous()
