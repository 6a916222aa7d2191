"""What every tensor codec builds on: the encoded form (``Encoded``) and its wire bytes, the ``Codec`` interface
(encode into the wire bytes, into a preallocated buffer or a new bytearray; decode into a preallocated float32
buffer), the dtype allow-list and the element limit, and the checked primitives the codecs share: finite checks,
flat float32 views, blockwise scaling, section sizes, copies from the received bytes where they lie.

The wire format, its strict parser and the registry of codecs: ``protocols/codecs.py``; the codecs themselves:
there (the dense ones), ``protocols/blockcodecs.py`` (a scale per block: int8, e3m0, sign) and
``protocols/sparse.py`` (top-k). Nothing here imports a codec, so each of those modules can be imported first.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

MAX_ELEMENTS = 1 << 30  # hard limit on decoded element count (4 GiB of fp32)

DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
DTYPE_IDS = {v: k for k, v in DTYPES.items()}


class CodecError(ValueError):
    """Malformed, oversized or non-finite tensor data."""


@dataclass(frozen=True)
class Encoded:
    """A codec's output, before or after the wire."""

    codec: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    block: int
    k: int
    scales: bytes
    data: bytes | memoryview  # from the wire: a view of the payload's bytes (``from_wire``)

    def to_wire(self) -> bytes:
        return msgpack.packb(
            {
                "v": 1,
                "codec": self.codec,
                "dtype": DTYPE_IDS[self.dtype],
                "shape": list(self.shape),
                "block": self.block,
                "k": self.k,
                "scales": self.scales,
                "data": self.data,
            },
            use_bin_type=True,
        )

    @property
    def nbytes(self) -> int:
        return len(self.scales) + len(self.data)


def _wire_prefix(head: Encoded, data_len: int) -> bytes:
    """The wire bytes up to the data payload: the map with every field, "data" last, and its bin header."""
    packed = dataclasses.replace(head, data=b"").to_wire()
    assert packed.endswith(b"\xc4\x00")  # "data": empty bin8
    if data_len < 1 << 8:
        header = b"\xc4" + data_len.to_bytes(1, "big")
    elif data_len < 1 << 16:
        header = b"\xc5" + data_len.to_bytes(2, "big")
    else:
        header = b"\xc6" + data_len.to_bytes(4, "big")
    return packed[:-2] + header



def all_finite(x: torch.Tensor) -> bool:
    """No NaN and no infinity in ``x``: one pass of min and max, which NaN propagates through (40x faster than
    ``torch.isfinite(x).all()``, which builds a bool tensor of every value: 3 ms against 133 ms for 25M values)."""
    if x.numel() == 0 or not x.is_floating_point():
        return True
    low, high = torch.aminmax(x.detach().reshape(-1))
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _check_finite(x: torch.Tensor) -> None:
    if not all_finite(x):
        raise CodecError("tensor holds NaN or infinity")


def _flat32(x: torch.Tensor, check: bool = True) -> torch.Tensor:
    """``x`` as one contiguous float32 vector; refused where its dtype is not allowed, it is too large, or (with
    ``check``; an encoder that checks in its own pass says no) it holds NaN or infinity."""
    if x.dtype not in DTYPE_IDS:
        raise CodecError(f"dtype {x.dtype} is not allowed")
    if x.numel() > MAX_ELEMENTS:
        raise CodecError("tensor too large")
    flat = x.detach().reshape(-1).to(torch.float32).contiguous()
    if check:
        _check_finite(flat)
    return flat


def _out(enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
    n = math.prod(enc.shape)
    if out is None:
        return torch.empty(n, dtype=torch.float32)
    if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
        raise ValueError("out must be a contiguous float32 tensor with the decoded element count")
    return out.view(-1)


def _scale_blocks(result: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Multiply each block of ``block`` elements of ``result`` by its scale, in place: whole blocks as one broadcast
    over a (blocks, block) view, the last partial block apart. O(n) whatever the block size claims, and no index
    tensor (an int64 index per element cost more than the decode itself)."""
    n = result.numel()
    full = n // block
    if full:
        result[: full * block].view(full, block).mul_(scales[:full, None])
    if full * block < n:
        result[full * block:].mul_(scales[full])


def _blocked(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, as a (blocks, block) view."""
    n = flat.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float32)
    padded[:n] = flat
    return padded.view(-1, block)


def _copy_from(result: torch.Tensor, data: bytes, dtype: type) -> None:
    """``result`` (a float32 CPU tensor) <- the received ``data`` read as ``dtype`` values, converted, in one pass:
    numpy reads the bytes in place (torch would need a writable copy of them first; 7x slower for 100 MB)."""
    np.copyto(result.numpy(), np.frombuffer(data, dtype=dtype), casting="unsafe")


def _copy_half(result: torch.Tensor, data: bytes, dtype: torch.dtype) -> None:
    """``result`` <- the received ``data`` read as 2-byte floats of ``dtype`` (float16 through numpy in one pass;
    bfloat16, which numpy lacks, through a writable copy torch can view)."""
    if dtype == torch.float16:
        _copy_from(result, data, np.float16)
    else:
        result.copy_(torch.frombuffer(bytearray(data), dtype=torch.int16).view(dtype))


def _write_wire(prefix: bytes, data: torch.Tensor, out: bytearray | memoryview) -> int:
    """The wire bytes ``prefix`` (``_wire_prefix``) then ``data`` (flat uint8) written into ``out``; returns how
    many."""
    total = len(prefix) + data.numel()
    if len(out) < total:
        raise ValueError(f"out holds {len(out)} B, the encoding needs {total} B")
    view = memoryview(out)
    view[: len(prefix)] = prefix
    if data.numel():
        torch.frombuffer(view, dtype=torch.uint8, count=data.numel(), offset=len(prefix)).copy_(data)
    return total


def _need(actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise CodecError(f"{what} is {actual} bytes, expected {expected}")


class Codec:
    id = -1
    name = "?"
    # True where decode_flat's values are finite by construction once its own checks pass (decode then skips the
    # pass over every value that checks it)
    finite_by_construction = False
    # True where decode(encode(x)) is x bit for bit (float32 x): a caller has the decoded values without decoding
    lossless = False

    def _parts(self, x: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """The encoding without its data, and the data as a flat uint8 tensor (no copy to bytes yet)."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> Encoded:
        head, data = self._parts(x)
        return dataclasses.replace(head, data=data.numpy().tobytes())

    def wire_size(self, x: torch.Tensor) -> int:
        head, data = self._parts(x)
        return len(_wire_prefix(head, data.numel())) + data.numel()

    def encode_into(self, x: torch.Tensor, out: bytearray | memoryview) -> int:
        """Write the wire bytes of ``x`` into the preallocated ``out``; returns how many were written. The bytes are
        identical to ``encode(x).to_wire()``, without building the intermediate bytes objects."""
        head, data = self._parts(x)
        return _write_wire(_wire_prefix(head, data.numel()), data, out)

    def encode_wire(self, x: torch.Tensor) -> bytearray:
        """The wire bytes of ``x`` (``encode(x).to_wire()``) in a new bytearray, written once: no bytes object of
        the data and then of the whole message first (each a copy of the encoding: an update's bytes would be
        copied three times on their way to the bulk store)."""
        head, data = self._parts(x)
        prefix = _wire_prefix(head, data.numel())
        out = bytearray(len(prefix) + data.numel())
        _write_wire(prefix, data, out)
        return out

    def decode_flat(self, enc: Encoded, out: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode into ``out`` (a preallocated float32 buffer) or a new tensor; returns it shaped and typed as sent.
        With ``out`` given, the float32 result is left in ``out`` (no further allocation when dtype is float32)."""
        flat = self.decode_flat(enc, out)
        if not self.finite_by_construction:
            _check_finite(flat)
        result = flat.view(enc.shape)
        return result if enc.dtype == torch.float32 else result.to(enc.dtype)
