"""The sparse 2-bit codec (protocols/sparse.py): what it keeps, its levels, error feedback through it, its exact
size, and the payloads its decoder refuses."""

import math

import msgpack
import numpy as np
import pytest
import torch

from swarmd.protocols import codecs as C
from swarmd.protocols import sparse

pytestmark = [pytest.mark.beside, pytest.mark.timeout(120)]


def chunked(x: torch.Tensor, chunk: int):
    for a in range(0, x.numel(), chunk):
        yield a, x[a:a + chunk]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4096, 4097, 3 * 4096 + 5])
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_round_trip_keeps_each_chunks_top_k_with_its_sign_and_nearest_level(n, bits):
    codec = sparse.SparseCodec(density=1 / 64, chunk=4096 if n > 1000 else 16, bits=bits)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 3, n)
    y = C.decode(C.encode(x, codec))
    assert y.shape == x.shape
    levels = 1 << (bits - 1)
    for a, part in chunked(x, codec.chunk):
        got = y[a:a + part.numel()]
        k = codec.k if part.numel() == codec.chunk else math.ceil(codec.k * part.numel() / codec.chunk)
        kept = got != 0
        assert int(kept.sum()) == k  # (random values: none is zero, every kept level positive)
        top = torch.topk(part.abs(), k).indices
        assert bool(kept[top].all())  # exactly the chunk's k largest magnitudes
        assert torch.equal(got[kept] < 0, part[kept] < 0)
        mags = sorted(set(got[kept].abs().tolist()))
        assert len(mags) <= levels
        table = torch.tensor(mags)
        # each kept value became the level nearest to its magnitude
        nearest = table[torch.argmin((part[kept].abs()[:, None] - table[None, :]).abs(), dim=1)]
        assert torch.equal(got[kept].abs(), nearest)
        if levels == 1:  # one level: the chunk's mean kept magnitude (to bfloat16)
            assert mags[0] == pytest.approx(float(part[kept].abs().mean()), rel=2**-8)
    assert C.decode(C.encode(x, codec)).equal(y)  # deterministic


def test_error_feedback_delivers_over_rounds_what_was_sent_and_decays_as_set():
    codec = C.get("topk2", density=1 / 8, chunk=64)
    torch.manual_seed(0)
    inputs = [torch.randn(1000) * (1 + torch.arange(1000) / 300) for _ in range(40)]
    total = torch.stack(inputs).sum(0)
    ef = C.ErrorFeedback(codec)
    sent = torch.zeros(1000)
    for x in inputs:
        sent += C.decode(ef.encode(x).to_wire())
    assert torch.allclose(sent + ef.residual, total, atol=1e-3)
    plain = sum(C.decode(C.encode(x, codec)) for x in inputs)
    assert (plain - total).norm() > 3 * (sent - total).norm()  # without it the dropped mass is lost
    # decay: r_t = decay * r_(t-1) + x_t - sent_t, the residual of SparseLoCo's error feedback
    ef, r = C.ErrorFeedback(codec, decay=0.9), torch.zeros(1000)
    for x in inputs[:5]:
        out = C.decode(ef.encode(x).to_wire())
        r = 0.9 * r + x - out
        assert torch.allclose(ef.residual, r, atol=1e-5)


@pytest.mark.parametrize("chunk, density, bits", [(4096, 1 / 64, 2), (4096, 1 / 32, 2), (1024, 1 / 64, 1),
                                                  (64, 0.25, 4)])
def test_wire_size_is_the_formula_and_bits_per_parameter_come_from_the_bytes(chunk, density, bits):
    codec = sparse.SparseCodec(density, chunk, bits)
    n = 100 * chunk + chunk // 2
    x = torch.randn(n)
    wire = codec.encode(x).to_wire()
    k, width, levels = codec.k, chunk.bit_length() - 1, 1 << (bits - 1)
    kept = 100 * k + math.ceil(k / 2)  # the last half chunk keeps half as many
    body = math.ceil(kept * width / 8) + math.ceil(kept * bits / 8) + 2 * levels * 101
    assert body < len(wire) <= body + 64  # the map's fields and bin headers
    assert codec.wire_size(x) == len(wire) == codec.wire_size(torch.zeros(n))  # fixed by n, not by the values
    per_value = 8 * len(wire) / n
    assert sparse.bits_per_param_step(len(wire), n, 30) == pytest.approx(per_value / 30, rel=1e-12)
    assert codec.kept_fraction(n) == kept / n
    whole = codec.wire_size(torch.randn(1000 * chunk)) * 8 / (1000 * chunk)  # whole chunks: the per-chunk formula
    assert whole == pytest.approx((k * (width + bits) + 16 * levels) / chunk, rel=0.01)
    if (chunk, density, bits) == (4096, 1 / 64, 2):  # SparseLoCo's setting: 0.2266 bits a value, 0.0076 at H = 30
        assert whole == pytest.approx(928 / 4096, rel=1e-3)


def good(n=40, chunk=16, density=0.25):
    return msgpack.loads(sparse.SparseCodec(density, chunk).encode(torch.randn(n)).to_wire())


def packed(**fields):
    return msgpack.packb(fields, use_bin_type=True)


def with_offsets(obj, chunk, offsets):
    """``obj`` with its offsets section replaced (the codes kept)."""
    width = chunk.bit_length() - 1
    at = math.ceil(len(offsets) * width / 8)
    return {**obj, "data": sparse.pack(np.array(offsets), width).tobytes() + obj["data"][at:]}


def refusals():
    base = good()  # 40 values, chunks of 16: 16 + 16 + 8, k = 4, 4 and 2
    cases = {
        "truncated data": {**base, "data": base["data"][:-1]},
        "extra data": {**base, "data": base["data"] + b"\x00"},
        "truncated scales": {**base, "scales": base["scales"][:-2]},
        "3 levels a chunk": {**base, "scales": base["scales"] + b"\x00\x00" * 3},
        "chunk not a power of two": {**base, "block": 24},
        "chunk too large": {**base, "block": sparse.MAX_CHUNK * 2},
        "chunk too small": {**base, "block": 8},
        "k = 0": {**base, "k": 0},
        "k over the chunk": {**base, "k": 17},
        "oversized shape": {**base, "shape": [1 << 24]},
        "offset past the last chunk": with_offsets(base, 16, [0, 1, 2, 3] * 2 + [0, 8]),
        "offsets not increasing": with_offsets(base, 16, [3, 1, 2, 4] + [0, 1, 2, 3] + [0, 1]),
        "offset repeated": with_offsets(base, 16, [0, 1, 2, 3, 5, 5, 6, 7, 0, 1]),
        "last offsets repeated": with_offsets(base, 16, [0, 1, 2, 3] * 2 + [1, 1]),
        "last offsets decreasing": with_offsets(base, 16, [0, 1, 2, 3] * 2 + [3, 1]),
        "infinite level": {**base, "scales": b"\x80\x7f" + base["scales"][2:]},
        "NaN level": {**base, "scales": b"\xc0\x7f" + base["scales"][2:]},
        "negative level": {**base, "scales": b"\x80\xbf" + base["scales"][2:]},
    }
    odd = good(n=5, chunk=16, density=3 / 16)  # 1 offset, 1 code of 2 bits: each byte's high bits are padding
    raw = bytearray(odd["data"])
    raw[1] |= 0xF0
    cases["nonzero padding bits"] = {**odd, "data": bytes(raw)}
    return cases


@pytest.mark.parametrize("what", sorted(refusals()))
def test_decoder_refuses_malformed_payloads_with_codec_error(what):
    payload = packed(**refusals()[what])
    with pytest.raises(C.CodecError):
        C.decode(payload, max_elements=1 << 20)


def test_a_short_last_chunk_keeps_as_dense_a_share_as_the_others():
    assert [sparse.last_kept(64, m, 4096) for m in (0, 1, 63, 64, 65, 2048, 4095)] == [0, 1, 1, 1, 2, 32, 64]
    codec = sparse.SparseCodec()  # an update cut into 16 parts costs about what it costs whole
    whole = 8 * codec.wire_size(torch.randn(1_377_408)) / 1_377_408
    parts = 8 * sum(codec.wire_size(torch.randn(86_088)) for _ in range(16)) / 1_377_408
    assert parts < 1.04 * whole


def test_the_unchanged_payloads_decode():
    for obj in (good(), good(n=5, chunk=16, density=3 / 16), good(n=0)):
        assert C.decode(packed(**obj)).numel() == obj["shape"][0]


def test_a_payload_allocates_in_proportion_to_its_size():
    """A few bytes claim a billion values: refused on their sizes before anything is allocated."""
    tiny = packed(v=1, codec=7, dtype=0, shape=[1 << 30], block=sparse.MAX_CHUNK, k=1, scales=b"\x80\x3f",
                  data=b"\x01")
    with pytest.raises(C.CodecError, match="scales"):
        C.decode(tiny)
    # the largest output per byte of input: MAX_CHUNK values per chunk, each chunk at least 2 bytes of scales
    chunks = 4
    fine = packed(v=1, codec=7, dtype=0, shape=[chunks * sparse.MAX_CHUNK], block=sparse.MAX_CHUNK, k=1,
                  scales=b"\x80\x3f" * chunks, data=sparse.pack(np.zeros(chunks), 14).tobytes() + b"\x00")
    assert C.decode(fine).numel() == chunks * sparse.MAX_CHUNK <= (sparse.MAX_CHUNK // 2) * len(fine)


def test_settings_are_checked():
    for bad in ({"chunk": 4095}, {"chunk": 8}, {"bits": 5}, {"density": 0}, {"density": 1.5}):
        with pytest.raises(ValueError):
            C.get("topk2", **bad)
    assert C.get("topk2", density=1e-9).k == 1  # at least one value a chunk
