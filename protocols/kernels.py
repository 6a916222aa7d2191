"""Single passes over an update's values, compiled (numba): what the codecs and the exchange would do in a dozen
torch passes each, one loop that reads each value once. Each gives the bits of its torch equivalent, bit for bit
(tests/test_kernels.py compares them on every kind of value): peers compare reduced parts byte for byte, so a node
with these kernels and a node without them must agree.

- IEEE arithmetic only: numba's ``fastmath`` is off, so no operation is reordered and no multiply and add are fused
  into one rounding (a fused multiply-add rounds once where torch's separate passes round twice).
- Compiled where this module is imported (typed signatures), into numba's cache beside this file (or the user's
  cache where this folder is not writable): about 2 s the first time on a machine, then a load of about 0.1 s. A
  round never waits for a compiler.
- The GIL is released (``nogil``), so a worker thread's kernel runs beside the event loop.
- Every index a loop reads or writes is bounded by the sizes of the arrays it was given, checked at its start; a
  caller's wrong size raises ValueError, never a read or write out of bounds (the arrays' own bounds checks are off
  for speed, so the kernels check once).
"""

from __future__ import annotations

import numpy as np
from numba import float32, float64, int64, njit, types, uint8, uint16, void


def _ro(dtype):
    """A contiguous 1-d array that the kernel only reads (a writable one is taken too): received bytes are read
    where they lie, in a read-only buffer."""
    return types.Array(dtype, 1, "C", readonly=True)


_OPTS = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}


_ENCODED = types.Tuple((types.boolean, float64, float64))


@njit(_ENCODED(_ro(float32), int64, float32, uint16[::1], uint8[::1], types.boolean, types.boolean, _ro(float32),
               float32[::1], float32[::1]), **_OPTS)
def _e3m0(x, block, sqrt2, scales16, data, feedback, measure, values, decoded, left):
    """e3m0's codes of ``x`` (``e3m0_encode``); with ``measure``, in the same pass, each value's decoded value
    v = values[code] * s (the decoder's product), summed squared and written into ``decoded`` (where that holds
    x.size values); with ``feedback`` (which measures too), error feedback: x - v into ``left`` (x.size values; it
    may be ``x``'s own memory: each value is read before it is written). Returns (every value finite, the sum of
    v^2, the sum of (x - v)^2; the sums in float64, 0 where not measured)."""
    n = x.size
    if block <= 0:
        raise ValueError("block must be positive")
    nb = (n + block - 1) // block
    if scales16.size != nb or data.size != (n + 1) // 2:
        raise ValueError("e3m0_encode: output sizes")
    measure = measure or feedback
    if measure and (values.size != 16 or (decoded.size != 0 and decoded.size != n)):
        raise ValueError("e3m0_encode_measured: sizes")
    if feedback and left.size != n:
        raise ValueError("e3m0_encode_residual: sizes")
    write = decoded.size != 0
    kept = 0.0
    dropped = 0.0
    xi = x.view(np.uint32)
    sbits = np.empty(1, np.uint32)
    sf = sbits.view(np.float32)
    y = np.zeros(block + 1, np.float32)
    yi = y.view(np.int32)
    sign = np.zeros(block + 1, np.int32)
    codes = np.zeros(block + 1, np.uint8)
    even = block % 2 == 0
    top = np.uint32(0)
    for j in range(nb):
        a = j * block
        k = min(block, n - a)
        m = np.uint32(0)
        for i in range(k):  # |x|'s bits: for finite floats, their order is the values' order
            m = max(m, xi[a + i] & np.uint32(0x7FFFFFFF))
        top = max(top, m)
        r = (m + np.uint32(0x7FFF) + ((m >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)  # to bfloat16, RNE
        scales16[j] = np.uint16(r)
        sbits[0] = r << np.uint32(16)
        s = sf[0]
        f = (np.float32(1.0) / s) * sqrt2 if s > np.float32(0.0) else sqrt2
        for i in range(k):
            y[i] = abs(x[a + i]) * f
            sign[i] = np.int32(x[a + i] < np.float32(0.0)) << np.int32(3)
        for i in range(k, block):  # the last block's padding: zeros
            y[i] = np.float32(0.0)
            sign[i] = np.int32(0)
        if even:
            h = a // 2
            pairs = min(block // 2, data.size - h)
            for q in range(pairs):
                c0 = min(max(np.int32(127) - (yi[2 * q] >> np.int32(23)), np.int32(0)), np.int32(7)) | sign[2 * q]
                c1 = min(max(np.int32(127) - (yi[2 * q + 1] >> np.int32(23)), np.int32(0)), np.int32(7)) \
                    | sign[2 * q + 1]
                data[h + q] = np.uint8(c0 | (c1 << np.int32(4)))
        else:  # codes straddle bytes across blocks: nibble by nibble
            for i in range(block):
                codes[i] = np.uint8(min(max(np.int32(127) - (yi[i] >> np.int32(23)), np.int32(0)), np.int32(7))
                                    | sign[i])
            for i in range(block):
                g = a + i
                byte = g >> 1
                if byte >= data.size:
                    break
                if g & 1:
                    data[byte] = np.uint8(data[byte] | (codes[i] << np.uint8(4)))
                else:
                    data[byte] = codes[i]
        if feedback:
            for i in range(k):  # what the others decode, and what is left of ours
                c = min(max(np.int32(127) - (yi[i] >> np.int32(23)), np.int32(0)), np.int32(7)) | sign[i]
                v = values[c] * s
                kept += np.float64(v) * np.float64(v)
                rest = x[a + i] - v
                left[a + i] = rest
                dropped += np.float64(rest) * np.float64(rest)
                if write:
                    decoded[a + i] = v
        elif measure:  # (its own loop: with the feedback test inside one loop, this path takes 5% longer)
            for i in range(k):  # what the others decode: its squares, and the values where asked
                c = min(max(np.int32(127) - (yi[i] >> np.int32(23)), np.int32(0)), np.int32(7)) | sign[i]
                v = values[c] * s
                kept += np.float64(v) * np.float64(v)
                if write:
                    decoded[a + i] = v
    if n % 2 == 1 and nb * block == n:  # an odd count of codes, every one a value's: the last high nibble is 0
        data[data.size - 1] = np.uint8(data[data.size - 1] & np.uint8(0x0F))
    return top < np.uint32(0x7F800000), kept, dropped  # below infinity's bits: no infinity, no NaN


_NONE = np.empty(0, np.float32)


def e3m0_encode(x, block, sqrt2, scales16, data) -> bool:
    """e3m0's codes of ``x`` (codecs.E3M0Codec): per block of ``block`` values its absmax rounded to bfloat16 (the
    bits into ``scales16``), and for each value, with y = |x| * (1 / s * sqrt2) in float32, the code
    clamp(127 - (y's bits as int32 >> 23), 0, 7), plus 8 where x < 0 (-0.0 is not), two codes a byte, low nibble
    first, into ``data``. Values past the end of ``x`` in its last block are zeros (code 7); where the blocks hold
    an odd count, the last byte's high nibble is 0. As torch does it: a bfloat16 subnormal scale gives 1 / s = inf,
    y = inf (code 0) or, for a zero, NaN (x86's default NaN, bits 0xFFC00000: code 7). Returns whether every
    value was finite (the same pass: where one is not, the codes mean nothing and the caller refuses the input)."""
    return _e3m0(x, block, sqrt2, scales16, data, False, False, _NONE, _NONE, _NONE)[0]


def e3m0_encode_measured(x, block, sqrt2, scales16, data, values, decoded):
    """``e3m0_encode`` with, in the same pass, what the others will decode of it: each value's decoded value
    v = values[code] * s written into ``decoded`` where that holds ``x.size`` values (empty: not written), and
    the sum of v^2. Returns (every value finite, the sum of v^2 in float64); ``x`` is only read."""
    finite, kept, _ = _e3m0(x, block, sqrt2, scales16, data, False, True, values, decoded, _NONE)
    return finite, kept


def e3m0_encode_residual(x, block, sqrt2, scales16, data, values, decoded):
    """``e3m0_encode`` with error feedback in the same pass: each value's decoded value v = values[code] * s (the
    decoder's product) is subtracted from it where it lies, so ``x`` ends as what the codec dropped (float32,
    x - v), and v is written into ``decoded`` where that holds ``x.size`` values (empty: not written). Returns
    (every value finite, the sum of v^2, the sum of the residuals' squares), the sums in float64."""
    return _e3m0(x, block, sqrt2, scales16, data, True, True, values, decoded, x)


@njit(types.boolean(_ro(uint8), _ro(uint16), int64, _ro(float32), float32[::1]), **_OPTS)
def nibble_decode(data, scales16, block, values, out):
    """Values of two 4-bit codes a byte (low nibble first), each ``values[code] * scale`` in float32 (its block's
    scale, from its bfloat16 bits in ``scales16``), into ``out`` (as codecs' table decode followed by its blockwise
    scaling: the same product, rounded once). Returns False, having written nothing, where a scale is not finite
    (a peer's bytes: refused)."""
    n = out.size
    if block <= 0:
        raise ValueError("block must be positive")
    nb = (n + block - 1) // block
    if data.size < (n + 1) // 2 or scales16.size < nb or values.size != 16:
        raise ValueError("nibble_decode: input sizes")
    for j in range(nb):
        if scales16[j] & np.uint16(0x7F80) == np.uint16(0x7F80):  # an exponent of all ones: infinity or NaN
            return False
    sbits = np.empty(1, np.uint32)
    sf = sbits.view(np.float32)
    for j in range(nb):
        a = j * block
        k = min(block, n - a)
        sbits[0] = np.uint32(scales16[j]) << np.uint32(16)
        s = sf[0]
        if a % 2 == 0:
            h = a // 2
            for q in range(k // 2):
                byte = data[h + q]
                out[a + 2 * q] = values[byte & np.uint8(15)] * s
                out[a + 2 * q + 1] = values[byte >> np.uint8(4)] * s
            if k % 2 == 1:
                out[a + k - 1] = values[data[h + k // 2] & np.uint8(15)] * s
        else:
            for i in range(k):
                g = a + i
                byte = data[g >> 1]
                out[g] = values[(byte >> np.uint8(4)) if g & 1 else (byte & np.uint8(15))] * s
    return True


@njit(void(float32[::1], _ro(float32), float32), **_OPTS)
def scaled_add(out, x, factor):
    """out += x * factor: the product rounded to float32, then the sum (two roundings, as torch's mul then add)."""
    if out.size != x.size:
        raise ValueError("scaled_add: sizes")
    for i in range(out.size):
        out[i] = out[i] + x[i] * factor


@njit(void(float32[::1], _ro(float32), float32), **_OPTS)
def scaled_copy(out, x, factor):
    """out = x * factor (float32)."""
    if out.size != x.size:
        raise ValueError("scaled_copy: sizes")
    for i in range(out.size):
        out[i] = x[i] * factor


@njit(**_OPTS)
def _quantize_into(x, scale, out):
    """out = rint(float64(x) * scale), half to even (``quantize``'s and ``gram_rows``'s loop; 1-d slices: indexing
    the 2-d rows value by value in the loop takes 3.5x as long)."""
    for t in range(x.size):
        out[t] = np.rint(np.float64(x[t]) * scale)


@njit(void(_ro(float32), float64, float64[::1]), **_OPTS)
def quantize(x, scale, out):
    """out = rint(float64(x) * scale), half to even (exchange.gram's integers; ``scale`` a power of two)."""
    if out.size != x.size:
        raise ValueError("quantize: sizes")
    _quantize_into(x, scale, out)


@njit(void(float32[::1], _ro(float32), _ro(float32), float32, float32, float32[::1]), **_OPTS)
def nesterov(buf, grad, theta, momentum, neg_lr, out):
    """The outer step's Nesterov SGD (outer.OuterNesterov), each product and sum rounded on its own: buf = buf * mu
    + g, then out = (g + buf * mu) * -lr + theta. ``out`` may be ``grad`` itself (each value is read before it is
    written)."""
    n = buf.size
    if grad.size != n or theta.size != n or out.size != n:
        raise ValueError("nesterov: sizes")
    for i in range(n):
        g = grad[i]
        b = buf[i] * momentum + g
        buf[i] = b
        out[i] = (g + b * momentum) * neg_lr + theta[i]


GRAM_TILE = 2048  # values of each row ``gram_rows`` quantizes and multiplies at once: k x 2048 float64 in the cache


@njit(float64(float64[:, ::1], int64, int64, int64), **_OPTS, fastmath={"reassoc", "contract"})
def _tile_dot(tile, i, j, m):
    """The dot product of rows i and j of ``tile`` over their first m values. Every value is an integer of at most
    2**19 in magnitude and m at most GRAM_TILE, so each product and every partial sum is an integer below 2**53,
    exact in float64 in any order and with any fusing: the sum may be reordered and fused (``fastmath``'s reassoc
    and contract, so that it vectorizes) and still gives the same integer everywhere."""
    acc = 0.0
    for t in range(m):
        acc += tile[i, t] * tile[j, t]
    return acc


@njit(void(types.Array(float32, 2, "C", readonly=True), _ro(float64), int64[:, ::1]), **_OPTS)
def gram_rows(x, scales, out):
    """``exchange.gram``'s integer products of the rows of ``x`` (k x n), added into ``out`` (k x k): each value
    quantized to rint(float64(v) * scale) (its row's scale, a power of two; a scale of 0 leaves its row and column
    as they are), then every pair's dot product, exactly, a tile of GRAM_TILE values at a time (quantized into
    the cache: no float64 copy of the rows for a matrix product to read back). The quantization is IEEE (no
    fastmath). The caller keeps n x 2**38 under 2**62 (``out`` is int64) and each |v x scale| at most 2**19."""
    k, n = x.shape
    if scales.size != k or out.shape[0] != k or out.shape[1] != k:
        raise ValueError("gram_rows: sizes")
    tile = np.zeros((k, GRAM_TILE), np.float64)
    for a in range(0, n, GRAM_TILE):
        m = min(GRAM_TILE, n - a)
        for i in range(k):
            _quantize_into(x[i, a:a + m], scales[i], tile[i, :m])
        for i in range(k):
            if scales[i] == 0.0:
                continue
            for j in range(i, k):
                if scales[j] == 0.0:
                    continue
                d = np.int64(_tile_dot(tile, i, j, m))
                out[i, j] += d
                if j != i:
                    out[j, i] += d
