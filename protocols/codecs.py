"""Tensor codecs for updates exchanged between peers (CPU, torch): the wire format, its strict parser, the dense
codecs (none, fp16, bf16), error feedback and the registry of every codec by id and name. Never pickle, never
torch.load. The blockwise-scaled codecs (int8, e3m0, sign) are in ``protocols/blockcodecs.py``, the top-k ones in
``protocols/sparse.py``, what they all build on (``Encoded``, ``Codec``) in ``protocols/codecbase.py``; their
names are importable from here too.

Wire format (msgpack map, keys in this order; stable, with golden byte fixtures in tests/fixtures/codecs/)::

    {"v": 1, "codec": int, "dtype": int, "shape": [int, ...], "block": int, "k": int, "scales": bytes, "data": bytes}

- ``dtype``: the tensor's dtype, from an allow-list (float32, float16, bfloat16); decoding returns that dtype.
- ``block``: elements per scale block (int8, e3m0); ``k``: kept entries (topk); 0 where unused.
- ``scales``: little-endian float32 (int8) or bfloat16 (e3m0; fp16 would lose tiny scales to its subnormal
  range) per block; ``data``: the codes.

| id | codec | bits/elem | error bound (per element, x finite) |
|---|---|---|---|
| 0 | none | 32 (or the dtype's) | exact |
| 1 | fp16 | 16 | fp16 rounding: abs(x'-x) <= 2^-11 abs(x) for abs(x) in fp16's normal range; larger values are clamped to +-65504 |
| 2 | bf16 | 16 | abs(x'-x) <= 2^-8 abs(x) |
| 3 | int8 | 8 + 32/block | blockwise absmax s: abs(x'-x) <= s/254 (half a quantization step) |
| 4 | e3m0 | 4 + 16/block | sign + 3-bit exponent, x' = +-s*2^-e, e in 0..7 (Streaming DiLoCo's FP4); abs(x'-x) <= (sqrt(2)-1)*abs(x) + s*2^-7 |
| 5 | topk | 64*k/n | keeps the k largest magnitudes exactly (fp32), drops the rest; with error feedback the dropped part is carried into the next encode |
| 6 | sign | 1 + 16/block | sign x the block's mean magnitude |
| 7 | topk2 | (k/chunk) x (log2(chunk) + bits) + 16 x 2^(bits-1) / chunk | per-chunk top-k, each kept value a sign and one of the chunk's levels (``protocols/sparse.py``) |

``encode_into(x, out)`` writes the wire bytes straight into a preallocated buffer (the same bytes
``encode(x).to_wire()`` gives), ``encode_wire(x)`` into a new bytearray (one copy of the data, not three), and
``decode(payload, out=buffer)`` decodes into a preallocated float32 tensor, reading the data where it lies in the
payload.

Non-finite input (NaN, +-inf) is refused by ``encode`` (an update holding them is a bug or an attack), and a
payload that decodes to a non-finite value is refused by ``decode``. Every payload is checked before any large
allocation: allow-listed dtype, element count under ``max_elements``, section sizes that match the shape.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# the names importers use from here: the encoded form, the codec interface, every codec class
from swarmd.protocols.blockcodecs import (_E3M0_PAIRS, _E3M0_VALUES, _SQRT2, E3M0_ENCODER,  # noqa: F401
                                          BlockCodec, E3M0Codec, Int8Codec, SignCodec)
from swarmd.protocols.codecbase import (DTYPE_IDS, DTYPES, MAX_ELEMENTS, Codec, CodecError,  # noqa: F401
                                        Encoded, _check_finite, _copy_from, _copy_half, _flat32, _need, _out,
                                        _scale_blocks, all_finite)
from swarmd.protocols.sparse import SparseCodec, TopKCodec
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.framing import unpack

MAX_NDIM = 8
MAX_BLOCK = 1 << 20  # elements per scale block (the encoders use 128-256)

KEYS = ("v", "codec", "dtype", "shape", "block", "k", "scales", "data")

_HEAD_MAX = 128 + 9 * MAX_NDIM  # the bytes of the map's fields before "scales" at most (small ints, a shape)
_BIN = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack's bin8/16/32: the bytes of their length


def _bin_at(payload, i: int) -> tuple[int, int] | None:
    """(length, where its bytes start) of the msgpack bin at ``payload[i]``; None if there is none."""
    if i >= len(payload) or (width := _BIN.get(payload[i])) is None or i + 1 + width > len(payload):
        return None
    return int.from_bytes(payload[i + 1:i + 1 + width], "big"), i + 1 + width


def _in_place(payload) -> dict | None:
    """The payload's map with "data" a view of its bytes in the payload (no copy of the data: msgpack copied it
    into a new bytes object, a fresh allocation of every part decoded), where the payload is laid out as our
    encoder writes it: the fields, "scales" then "data" last. The fields before the data are parsed as they
    are, strictly, with an empty data; None where that layout is not found (``from_wire`` then parses the whole)."""
    at = bytes(payload[:_HEAD_MAX]).find(b"\xa6scales")
    scales = _bin_at(payload, at + 7) if at >= 0 else None
    if scales is None:
        return None
    end = scales[1] + scales[0]
    data = _bin_at(payload, end + 5) if payload[end:end + 5] == b"\xa4data" else None
    if data is None or data[1] + data[0] != len(payload):
        return None
    try:  # every byte but the data's, the data's bin an empty one: the same map, parsed the same way
        obj = unpack(bytes(payload[:end + 5]) + b"\xc4\x00", what="tensor payload")
    except MalformedMessage:
        return None
    if not isinstance(obj, dict) or tuple(obj) != KEYS or obj["data"] != b"":
        return None
    obj["data"] = memoryview(payload)[data[1]:].toreadonly()
    return obj


def from_wire(payload: bytes, *, max_elements: int = MAX_ELEMENTS) -> Encoded:
    """Strictly parse the wire format. Raises CodecError. The data, a view into ``payload`` where it is laid out
    as our encoder writes it (``_in_place``), is valid while ``payload`` is."""
    obj = _in_place(payload)
    if obj is None:
        try:
            obj = unpack(payload, what="tensor payload")
        except MalformedMessage as e:
            raise CodecError(str(e)) from None
    if not isinstance(obj, dict) or tuple(obj) != KEYS or obj["v"] != 1:
        raise CodecError("tensor payload must be a v1 map with keys " + ", ".join(KEYS))
    codec, dtype, shape, block, k = obj["codec"], obj["dtype"], obj["shape"], obj["block"], obj["k"]
    if type(codec) is not int or codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    if type(dtype) is not int or dtype not in DTYPES:
        raise CodecError(f"dtype {dtype!r} is not allowed")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise CodecError("bad shape")
    if math.prod(shape) > max_elements:
        raise CodecError(f"{math.prod(shape)} elements exceed the limit of {max_elements}")
    if any(d > max_elements for d in shape):  # an empty tensor with an absurd dimension
        raise CodecError("bad shape")
    if type(block) is not int or type(k) is not int or not 0 <= block <= MAX_BLOCK or k < 0:
        raise CodecError(f"bad block or k (block at most {MAX_BLOCK})")
    if not isinstance(obj["scales"], bytes) or not isinstance(obj["data"], (bytes, memoryview)):
        raise CodecError("scales and data must be bytes")
    return Encoded(codec, DTYPES[dtype], tuple(shape), block, k, obj["scales"], obj["data"])


class NoneCodec(Codec):
    id, name = 0, "none"
    lossless = True

    def _parts(self, x: torch.Tensor):
        _flat32(x)
        data = x.detach().contiguous().reshape(-1)
        raw = data.view(torch.int16) if data.dtype == torch.bfloat16 else data
        return Encoded(self.id, x.dtype, tuple(x.shape), 0, 0, b"", b""), raw.view(torch.uint8)

    def decode_flat(self, enc: Encoded, out):
        n = math.prod(enc.shape)
        size = torch.finfo(enc.dtype).bits // 8
        _need(len(enc.data), n * size, "data")
        result = _out(enc, out)
        if n and enc.dtype == torch.float32:
            _copy_from(result, enc.data, np.float32)
        elif n:
            _copy_half(result, enc.data, enc.dtype)
        return result


class Fp16Codec(Codec):
    id, name = 1, "fp16"
    wire_dtype = torch.float16

    def _parts(self, x: torch.Tensor):
        flat = _flat32(x)
        limit = torch.finfo(self.wire_dtype).max
        half = flat.clamp(-limit, limit).to(self.wire_dtype)
        raw = half.view(torch.int16) if self.wire_dtype == torch.bfloat16 else half
        return Encoded(self.id, x.dtype, tuple(x.shape), 0, 0, b"", b""), raw.contiguous().view(torch.uint8)

    def decode_flat(self, enc: Encoded, out):
        n = math.prod(enc.shape)
        _need(len(enc.data), 2 * n, "data")
        result = _out(enc, out)
        if n:
            _copy_half(result, enc.data, self.wire_dtype)
        return result


class Bf16Codec(Fp16Codec):
    id, name = 2, "bf16"
    wire_dtype = torch.bfloat16


class ErrorFeedback:
    """Wraps a lossy codec with error feedback: encode(x) sends C(x + r) and keeps r <- x + r - D(C(x + r)).

    Over many rounds the sum of what was decoded equals the sum of the inputs minus the final residual. With
    ``decay`` below 1 the residual is carried as decay x r (SparseLoCo's error feedback: an old residual fades)."""

    def __init__(self, codec: Codec, decay: float = 1.0):
        self.codec = codec
        self.decay = decay
        self.residual: torch.Tensor | None = None

    def encode(self, x: torch.Tensor) -> Encoded:
        flat = _flat32(x)
        if self.residual is None or self.residual.shape != flat.shape:
            self.residual = torch.zeros_like(flat)
        corrected = flat + self.residual if self.decay == 1.0 else flat + self.decay * self.residual
        enc = self.codec.encode(corrected.view(x.shape))
        self.residual = corrected - self.codec.decode_flat(enc, None)
        return enc


CODECS: dict[int, Codec] = {c.id: c for c in (NoneCodec(), Fp16Codec(), Bf16Codec(), Int8Codec(), E3M0Codec(),
                                              TopKCodec(), SignCodec(), SparseCodec())}
BY_NAME: dict[str, Codec] = {c.name: c for c in CODECS.values()}


def get(name: str, **params: Any) -> Codec:
    """A codec by name, e.g. get("e3m0", block=64), get("topk", ratio=0.001)."""
    base = BY_NAME.get(name)
    if base is None:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(BY_NAME))}")
    return type(base)(**params) if params else base


def configured(name: str, options: dict) -> Codec:
    """A codec by name with a config's options (e.g. "topk2", {"density": 0.03125}); ValueError where the name or
    an option is unknown or out of range."""
    try:
        return get(name, **options)
    except TypeError as e:
        raise ValueError(f"codec {name!r}: {e}") from None


def encode(x: torch.Tensor, codec: str | Codec = "e3m0") -> bytes:
    return (get(codec) if isinstance(codec, str) else codec).encode(x).to_wire()


def decode(payload: bytes, *, out: torch.Tensor | None = None, max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """Bytes from the network -> tensor. Raises CodecError on anything malformed (and only CodecError: whatever
    torch says about a crafted payload is the sender's fault too); ValueError for a wrong ``out`` (ours)."""
    enc = from_wire(payload, max_elements=max_elements)
    if out is not None and (out.dtype != torch.float32 or out.numel() != math.prod(enc.shape)
                            or not out.is_contiguous()):
        raise ValueError("out must be a contiguous float32 tensor with the decoded element count")
    try:
        return CODECS[enc.codec].decode(enc, out)
    except CodecError:
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError) as e:
        raise CodecError(f"undecodable tensor ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None


def report(codec: str | Codec, x: torch.Tensor) -> dict:
    """Compression ratio (original bytes / wire bytes) and relative error ||x' - x|| / ||x|| on ``x``."""
    c = get(codec) if isinstance(codec, str) else codec
    wire = c.encode(x).to_wire()
    y = decode(wire).to(torch.float32)
    xf = x.to(torch.float32)
    norm = float(xf.norm())
    return {
        "codec": c.name,
        "ratio": x.numel() * x.element_size() / len(wire),
        "rel_error": float((y - xf).norm()) / norm if norm else float((y - xf).norm()),
        "wire_bytes": len(wire),
    }
