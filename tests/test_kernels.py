"""The compiled kernels (protocols/kernels.py) give the bits of the plain torch passes they stand for: peers compare
reduced parts byte for byte and screen on exact integers, so a kernel that differs in one bit splits a run. The
plain torch code is kept here as the reference; each kernel is compared with it on every kind of value
(random, zeros and -0.0, subnormals, extremes, a block whose scale is a bfloat16 subnormal), every block size and
count parity, and the kernels refuse arrays of the wrong size instead of reading or writing past them."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.protocols import codecs as C
from swarmd.protocols import exchange, kernels, screen

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------- torch references
def _torch_e3m0(flat: torch.Tensor, b: int) -> tuple[bytes, bytes]:
    """The plain torch e3m0 encoder (codecs.E3M0Codec._slice on the whole vector): scales' bytes, codes' bytes."""
    n = flat.numel()
    if n % b == 0:
        view = flat.view(-1, b)
    else:
        padded = torch.zeros(-(-n // b) * b, dtype=torch.float32)
        padded[:n] = flat
        view = padded.view(-1, b)
    magnitude = view.abs()
    scales16 = magnitude.amax(dim=1).to(torch.bfloat16) if n else torch.zeros(0, dtype=torch.bfloat16)
    scales = scales16.to(torch.float32)
    factor = torch.where(scales > 0, C._SQRT2 / scales, torch.full_like(scales, C._SQRT2)).unsqueeze(1)
    exponent_bits = magnitude.mul_(factor).view(torch.int32) >> 23
    codes = exponent_bits.neg_().add_(127).clamp_(0, 7).to(torch.uint8)
    sign = torch.from_numpy(view.numpy() < 0).view(torch.uint8)
    sign <<= 3
    codes |= sign
    codes = codes.reshape(-1)
    if codes.numel() % 2:
        codes = torch.cat([codes, torch.zeros(1, dtype=torch.uint8)])
    packed = (codes[0::2] | (codes[1::2] << 4))[: (n + 1) // 2]
    return scales16.view(torch.int16).numpy().tobytes(), packed.numpy().tobytes()


def _torch_e3m0_decode(enc: C.Encoded) -> torch.Tensor:
    """The plain e3m0 decode: numpy's take through the 256-row pairs table, then each block times its
    scale (blockcodecs._decode_by_table)."""
    n, b = math.prod(enc.shape), enc.block
    result = torch.empty(n, dtype=torch.float32)
    if not n:
        return result
    scales = torch.frombuffer(bytearray(enc.scales), dtype=torch.int16).view(torch.bfloat16).to(torch.float32)
    codes, values, rows = np.frombuffer(enc.data, dtype=np.uint8), result.numpy(), C._E3M0_PAIRS.numpy()
    full = n // 2
    np.take(rows, codes[:full], axis=0, out=values[: full * 2].reshape(full, 2), mode="clip")
    if full * 2 < n:
        values[full * 2:] = rows[codes[full]][: n - full * 2]
    C._scale_blocks(result, scales, b)
    return result


def _torch_reduce(chunks: dict[str, torch.Tensor], factors: dict[str, float]) -> torch.Tensor:
    peers = sorted(chunks)
    scale = torch.tensor([factors[a] for a in peers], dtype=torch.float32)
    out = chunks[peers[0]].to(torch.float32) * scale[0]
    product = torch.empty_like(out)
    for i, a in enumerate(peers[1:], 1):
        torch.mul(chunks[a].to(torch.float32), scale[i], out=product)
        out.add_(product)
    return out.div_(len(peers))


def _torch_gram(vectors: list[torch.Tensor]) -> tuple[list[list[int]], list[int]]:
    """exchange.gram's integers, by the definition: each vector quantized whole (float64, times 2**-shift, half to
    even), every pair's dot product summed as Python integers."""
    shifts, ints = [], []
    for v in vectors:
        top = float(v.abs().max()) if v.numel() else 0.0
        if not (exchange.GRAM_TINY <= top < math.inf):
            shifts.append(0)
            ints.append(None)
            continue
        shift = math.frexp(top)[1] - exchange.GRAM_BITS
        shifts.append(shift)
        ints.append((v.double() * math.ldexp(1.0, -shift)).round().to(torch.int64).tolist())
    k = len(vectors)
    g = [[0] * k for _ in range(k)]
    for i in range(k):
        for j in range(k):
            if ints[i] is not None and ints[j] is not None:
                g[i][j] = sum(a * b for a, b in zip(ints[i], ints[j]))
    return g, shifts


# ------------------------------------------------------------------------------------------------------ inputs
def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor([struct.unpack("<f", struct.pack("<I", x))[0] for x in bits], dtype=torch.float32)


def _hard_values(n: int, seed: int) -> torch.Tensor:
    """Any sign and mantissa over 40 binades, with zeros, -0.0, the smallest subnormals, extremes, and (where n
    allows) a run of -0.0 and a run whose absmax is a bfloat16 subnormal."""
    rng = random.Random(seed)
    x = _from_bits([(rng.getrandbits(32) & 0x807FFFFF) | ((107 + rng.randrange(40)) << 23) for _ in range(n)])
    special = [0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38]
    x[: min(n, len(special))] = torch.tensor(special[:n])
    if n >= 400:
        x[128:256] = -0.0
        x[256:384] = torch.tensor([1e-39, -1e-39, 5e-40, 0.0] * 32)
    return x


BLOCKS = [128, 256, 127, 7, 3, 2, 1]
COUNTS = [0, 1, 2, 3, 127, 128, 129, 255, 256, 257, 1000, 4097]


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", COUNTS)
def test_e3m0_kernel_gives_the_torch_encoders_bytes(block, n):
    codec = C.E3M0Codec(block=block)
    for x in (_hard_values(n, n * 31 + block), torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3):
        enc = codec.encode(x)
        assert (enc.scales, enc.data) == _torch_e3m0(x, block), (block, n)
        assert bytes(codec.encode_wire(x)) == enc.to_wire()


@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=600), st.sampled_from(BLOCKS))
@settings(max_examples=150, deadline=None)
def test_e3m0_kernel_matches_on_any_finite_bits(bits, block):
    x = _from_bits(bits)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # the encoder refuses the others
    enc = C.E3M0Codec(block=block).encode(x)
    assert (enc.scales, enc.data) == _torch_e3m0(x, block)
    got = C.decode(enc.to_wire())
    assert torch.equal(got.view(torch.int32), _torch_e3m0_decode(enc).view(torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -float("nan")])
@pytest.mark.parametrize("at", [0, 127, 128, 300])
def test_e3m0_kernel_refuses_non_finite_values_anywhere(bad, at):
    x = torch.randn(301)
    x[at] = bad
    with pytest.raises(C.CodecError, match="NaN or infinity"):
        C.encode(x, "e3m0")


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", COUNTS)
def test_e3m0_decode_kernel_gives_the_table_decodes_bits(block, n):
    enc = C.E3M0Codec(block=block).encode(_hard_values(n, n + 7 * block))
    got = C.decode(enc.to_wire())
    want = _torch_e3m0_decode(enc)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: -0.0 and subnormals too
    out = torch.full((n,), 7.0)
    C.decode(enc.to_wire(), out=out)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("bits", [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81])
def test_decode_kernel_refuses_a_non_finite_scale_before_writing(bits):
    n, b = 300, 128
    scales = np.array([0x3F80, bits, 0x3F80], dtype=np.uint16).tobytes()  # 1.0, then infinity or NaN
    enc = C.Encoded(C.E3M0Codec.id, torch.float32, (n,), b, 0, scales, bytes((n + 1) // 2))
    out = torch.full((n,), 5.0)
    with pytest.raises(C.CodecError, match="NaN or infinity"):
        C.decode(enc.to_wire(), out=out)
    assert bool((out == 5.0).all())  # nothing written into the caller's buffer


def test_decode_kernel_reads_every_byte_a_peer_could_send():
    # any data bytes and any finite scales: every byte names two table entries, nothing is read past the arrays
    rng = np.random.default_rng(5)
    n, b = 1001, 128
    scales = torch.tensor(rng.uniform(-3, 3, -(-n // b)), dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    data = rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8).tobytes()
    enc = C.Encoded(C.E3M0Codec.id, torch.float32, (n,), b, 0, scales, data)
    assert torch.equal(C.decode(enc.to_wire()).view(torch.int32), _torch_e3m0_decode(enc).view(torch.int32))


@pytest.mark.parametrize("peers", [1, 2, 3, 8, 16])
def test_reduce_kernel_gives_the_torch_passes_bits(peers):
    g = torch.Generator().manual_seed(peers)
    n = 10_001
    chunks = {f"p{i:02d}": torch.randn(n, generator=g) * 10.0 ** (i % 5 - 2) for i in range(peers)}
    chunks["p00"][:50] = _hard_values(50, 3)[:50]
    factors = {a: (1.0 if i % 3 else 0.3 + i / 7) for i, a in enumerate(sorted(chunks))}
    got = exchange.reduce_part(chunks, factors, n)
    assert torch.equal(got.view(torch.int32), _torch_reduce(chunks, factors).view(torch.int32))
    # a chunk of another dtype or layout takes the torch passes: the same bits
    mixed = dict(chunks)
    mixed["p00"] = chunks["p00"].double()
    assert torch.equal(exchange.reduce_part(mixed, factors, n).view(torch.int32),
                       _torch_reduce(mixed, factors).view(torch.int32))


@pytest.mark.parametrize("n", [0, 1, 1000, exchange.GRAM_WINDOW + 3, exchange.GRAM_BLOCK + 3])
@pytest.mark.parametrize("contiguous", [True, False])
def test_gram_kernel_gives_the_exact_integers(n, contiguous, monkeypatch):
    g = torch.Generator().manual_seed(n)
    vectors = [torch.randn(n, generator=g) * 10.0 ** (i - 3) for i in range(5)]
    if n:
        vectors.append(torch.zeros(n))
        vectors.append(_hard_values(n, 9).clamp(-1e30, 1e30))
        vectors.append(torch.full((n,), math.inf))  # no products, as a vector of zeros
        if not contiguous:
            vectors.append(torch.randn(2 * n, generator=g)[::2])  # one not contiguous: the torch passes for all
    want = _torch_gram(vectors)
    assert exchange.gram(vectors) == want
    # (the compiled pass) its int64 sums handed to Python integers after every window: the same integers
    monkeypatch.setattr(screen, "GRAM_FLUSH_VALUES", 1)
    assert exchange.gram(vectors) == want


def test_kernels_refuse_wrong_sizes_instead_of_overrunning():
    f32, u8, u16 = np.float32, np.uint8, np.uint16
    with pytest.raises(ValueError):
        kernels.e3m0_encode(np.ones(300, f32), 128, f32(1.4), np.empty(2, u16), np.empty(150, u8))  # 3 scales
    with pytest.raises(ValueError):
        kernels.e3m0_encode(np.ones(300, f32), 128, f32(1.4), np.empty(3, u16), np.empty(149, u8))
    with pytest.raises(ValueError):
        kernels.e3m0_encode(np.ones(300, f32), 0, f32(1.4), np.empty(3, u16), np.empty(150, u8))
    with pytest.raises(ValueError):
        kernels.nibble_decode(np.zeros(149, u8), np.ones(3, u16), 128, C._E3M0_VALUES, np.empty(300, f32))
    with pytest.raises(ValueError):
        kernels.nibble_decode(np.zeros(150, u8), np.ones(2, u16), 128, C._E3M0_VALUES, np.empty(300, f32))
    with pytest.raises(ValueError):
        kernels.scaled_add(np.zeros(10, f32), np.zeros(9, f32), f32(1.0))
    with pytest.raises(ValueError):
        kernels.scaled_copy(np.zeros(10, f32), np.zeros(11, f32), f32(1.0))
    with pytest.raises(ValueError):
        kernels.quantize(np.zeros(10, f32), 1.0, np.zeros(9, np.float64))
    with pytest.raises(ValueError):
        kernels.gram_rows(np.zeros((3, 10), f32), np.ones(2), np.zeros((3, 3), np.int64))
    with pytest.raises(ValueError):
        kernels.gram_rows(np.zeros((3, 10), f32), np.ones(3), np.zeros((3, 2), np.int64))


def _torch_nesterov(buf, params, grad, lr, momentum):
    """OuterNesterov.step in plain torch (slices through a product buffer, each operation rounded on its own)."""
    from swarmd.protocols import outer

    buf.mul_(momentum).add_(grad)
    step = torch.empty_like(grad)
    product = torch.empty(min(outer.STEP_SLICE, buf.numel()))
    for start in range(0, buf.numel(), outer.STEP_SLICE):
        end = min(start + outer.STEP_SLICE, buf.numel())
        into = product[:end - start]
        torch.mul(buf[start:end], momentum, out=into)
        out = torch.add(grad[start:end], into, out=step[start:end])
        torch.mul(out, -lr, out=into)
        torch.add(into, params[start:end], out=out)
    return step


@pytest.mark.parametrize("n", [1, 1000, (1 << 16) + 5])
@pytest.mark.parametrize("lr, momentum", [(0.7, 0.9), (1.0, 0.0), (0.1, 0.95)])
def test_nesterov_kernel_gives_the_torch_steps_bits(n, lr, momentum):
    from swarmd.protocols import outer

    g = torch.Generator().manual_seed(n)
    params = torch.randn(n, generator=g)
    opt = outer.OuterNesterov([n], lr=lr, momentum=momentum)
    ref_buf = torch.zeros(n)
    for r in range(3):  # the momentum carried over rounds
        grad = torch.randn(n, generator=g) * 10.0 ** (r - 2)
        grad[: min(n, 6)] = _hard_values(min(n, 6), r).clamp(-1e30, 1e30)
        want = _torch_nesterov(ref_buf, params, grad.clone(), lr, momentum)
        for consume in (False, True):
            buf_before = opt.buffers[0].clone()
            got = opt.step(0, params, grad.clone(), consume=consume)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (r, consume)
            if not consume:
                opt.buffers[0] = buf_before  # (step once per round: the other try from the same buffer)
        assert torch.equal(opt.buffers[0].view(torch.int32), ref_buf.view(torch.int32))
        params = want


def test_nesterov_kernel_refuses_wrong_sizes():
    f32 = np.float32
    with pytest.raises(ValueError):
        kernels.nesterov(np.zeros(4, f32), np.zeros(4, f32), np.zeros(3, f32), f32(0.9), f32(-0.7), np.zeros(4, f32))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", COUNTS)
def test_error_feedback_kernel_gives_the_encode_decode_subtract_bits(block, n):
    # the loop's error feedback (DilocoLoop._prepare_update) encoded a part, decoded it back, took the decoded
    # values' norm and subtracted them from the part: one pass now, the same bytes, values and residual
    codec = C.E3M0Codec(block=block)
    x = _hard_values(n, 3 * n + block).clamp(-1e30, 1e30)
    want_wire = bytes(codec.encode_wire(x))
    want_decoded = C.decode(want_wire)
    want_left = x - want_decoded
    left, decoded = x.clone(), torch.full((n,), 9.0)
    wire, kept, dropped = codec.encode_wire_residual(left, decoded)
    assert bytes(wire) == want_wire
    assert torch.equal(decoded.view(torch.int32), want_decoded.view(torch.int32))
    assert torch.equal(left.view(torch.int32), want_left.view(torch.int32))
    assert kept == pytest.approx(float((want_decoded.double() ** 2).sum()), rel=1e-12, abs=1e-300)
    assert dropped == pytest.approx(float((want_left.double() ** 2).sum()), rel=1e-12, abs=1e-300)
    again = x.clone()
    assert bytes(codec.encode_wire_residual(again)[0]) == want_wire  # without a decoded copy
    assert torch.equal(again.view(torch.int32), want_left.view(torch.int32))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", COUNTS)
def test_measured_encode_gives_the_bytes_and_the_decoded_values_squares(block, n):
    # the loop's update without error feedback (DilocoLoop._prepare_update) was encoded, decoded back and measured
    # (its norm as the others see it): one pass now, the same bytes and decoded values, x left as it was
    codec = C.E3M0Codec(block=block)
    x = _hard_values(n, 5 * n + block).clamp(-1e30, 1e30)
    before = x.clone()
    want_wire = bytes(codec.encode_wire(x))
    want_decoded = C.decode(want_wire)
    decoded = torch.full((n,), 9.0)
    wire, kept = codec.encode_wire_measured(x, decoded)
    assert bytes(wire) == want_wire
    assert torch.equal(decoded.view(torch.int32), want_decoded.view(torch.int32))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))
    assert kept == pytest.approx(float((want_decoded.double() ** 2).sum()), rel=1e-12, abs=1e-300)
    wire, again = codec.encode_wire_measured(x)  # without a decoded copy
    assert bytes(wire) == want_wire and again == kept


@pytest.mark.parametrize("encoder", ["residual", "measured"])
def test_one_pass_encoders_refuse_non_finite_values_and_wrong_layouts(encoder):
    codec = C.E3M0Codec()
    encode = getattr(codec, f"encode_wire_{encoder}")
    kernel = getattr(kernels, f"e3m0_encode_{encoder}")
    for bad in (float("nan"), float("inf")):
        x = torch.randn(300)
        x[150] = bad
        with pytest.raises(C.CodecError, match="NaN or infinity"):
            encode(x)
    with pytest.raises(ValueError):
        encode(torch.randn(10, 2)[:, 0])  # not contiguous
    with pytest.raises(ValueError):
        encode(torch.randn(10), torch.empty(9))
    with pytest.raises(ValueError):
        kernel(np.zeros(10, np.float32), 4, np.float32(1.4), np.empty(3, np.uint16), np.empty(5, np.uint8),
               C._E3M0_VALUES, np.empty(9, np.float32))
