"""Outer-step primitives for DiLoCo: fragments, outer Nesterov, robust combination, adaptive deadlines."""

import asyncio
import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmd.protocols import outer, tinylm
from swarmd.transport.memory import run_virtual

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def test_fragments_are_strided_by_block_and_cover_everything():
    names = [n for n, _ in tinylm.TinyGPT(layers=4).named_parameters()]
    frags = outer.fragments(names, 2)
    assert sorted(i for f in frags for i in f) == list(range(len(names)))
    for p, frag in enumerate(frags):
        for i in frag:
            if ".blocks." in f".{names[i]}" or names[i].startswith("blocks."):
                assert int(names[i].split(".")[1]) % 2 == p
    assert outer.fragments(names, 1) == [list(range(len(names)))]


def test_outer_nesterov_matches_torch_sgd():
    torch.manual_seed(0)
    theta = torch.randn(50)
    ours = theta.clone()
    ref = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    o = outer.OuterNesterov([50])
    for _ in range(5):
        g = torch.randn(50)
        ours = o.step(0, ours, g)
        ref.grad = g.clone()
        opt.step()
    assert torch.allclose(ours, ref.detach(), atol=1e-6)


def test_a_consuming_step_gives_the_same_bits_in_the_update_it_was_given():
    torch.manual_seed(1)
    a, b = outer.OuterNesterov([64]), outer.OuterNesterov([64])
    theta = torch.randn(64)
    for _ in range(3):
        g = torch.randn(64)
        given, before = g.clone(), g.clone()
        new_a = a.step(0, theta, g)
        new_b = b.step(0, theta, given, consume=True)
        assert torch.equal(g, before)  # the plain step leaves its update as it was
        assert new_b.data_ptr() == given.data_ptr() and torch.equal(new_a, new_b)
        assert torch.equal(a.buffers[0], b.buffers[0])
        theta = new_a


_STEPS = """
import sys
sys.path.insert(0, "tests")
from test_outer import _stepped
print(_stepped())
"""


def _stepped() -> str:
    """Three outer steps of a fragment over two step slices and a bit, from values numpy draws (the same bits on
    every CPU), one of them consuming its update: the hash of the weights and momentum they end on."""
    rng = np.random.default_rng(11)
    n = 2 * outer.STEP_SLICE + 12_345
    theta = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    opt = outer.OuterNesterov([n])
    for r in range(3):
        theta = opt.step(0, theta, torch.from_numpy(rng.standard_normal(n, dtype=np.float32)), consume=r == 1)
    return hashlib.sha256(theta.numpy().tobytes() + opt.buffers[0].numpy().tobytes()).hexdigest()


@pytest.mark.timeout(120)
def test_the_outer_step_is_the_same_bits_with_torchs_scalar_kernels():
    """A CPU without AVX2 runs torch's scalar kernels: its outer step must land on the bits an AVX2 or AVX-512
    CPU's does (add(alpha=) fuses the product and the sum in the vector kernels only, so with it such peers would
    end on other weights from the same combined update)."""
    out = subprocess.run([sys.executable, "-c", _STEPS], cwd=Path(__file__).resolve().parent.parent,
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _stepped()


def test_the_outer_step_is_each_operation_rounded_on_its_own():
    rng = np.random.default_rng(5)
    n = outer.STEP_SLICE + 7
    theta, g = (torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) for _ in range(2))
    opt = outer.OuterNesterov([n], lr=0.7, momentum=0.9)
    opt.buffers[0] = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    buf = opt.buffers[0] * torch.tensor(0.9) + g  # the reference, an operation at a time
    want = ((g + buf * torch.tensor(0.9)) * torch.tensor(-0.7)) + theta
    assert torch.equal(opt.step(0, theta, g), want) and torch.equal(opt.buffers[0], buf)


def test_relative_difference_is_per_parameter_and_refuses_what_no_rounding_gives():
    ours = torch.cat([torch.full((4,), 2.0), torch.zeros(3), torch.full((5,), 0.01)])
    sizes = [4, 3, 5]
    assert outer.relative_difference(ours, ours.clone(), sizes) == 0.0
    theirs = ours.clone()
    theirs[2] += 2e-5  # 1e-5 of that parameter's scale
    theirs[9] += 1e-8  # 1e-6 of the small one's: judged on its own scale, not the fragment's
    assert outer.relative_difference(ours, theirs, sizes) == pytest.approx(1e-5, rel=1e-2)
    theirs[9] += 1e-4
    assert outer.relative_difference(ours, theirs, sizes) == pytest.approx(1e-2, rel=1e-2)
    for where, value in ((5, 1e-9), (0, float("nan")), (8, float("inf"))):  # off zeros; non-finite
        bad = ours.clone()
        bad[where] = value
        assert outer.relative_difference(ours, bad, sizes) == math.inf
    with pytest.raises(ValueError):
        outer.relative_difference(ours, ours[:-1], sizes)


def test_combine_rejects_bad_updates_and_resists_outliers():
    good = {f"p{i}": torch.full((10,), 1.0 + 0.01 * i) for i in range(4)}
    bad = {"nan": torch.full((10,), float("nan")), "short": torch.ones(9), "huge": torch.full((10,), 1e6)}
    combined, rejected = outer.combine({**good, **bad}, 10, method="clipped_mean")
    assert rejected == {"nan": "non_finite", "short": "wrong_shape", "huge": "norm_outlier"}
    assert float(combined.max()) < 1.1
    big, rejected = outer.combine({**good, "big": torch.full((10,), 5.0)}, 10, method="clipped_mean")
    assert rejected == {}  # 5x the median: not refused, but clipped to 2x the median norm before averaging
    assert float(big.max()) < (4 * 1.03 + 2 * 1.03) / 5 + 1e-3
    trimmed, _ = outer.combine({**good, "huge": torch.full((10,), 1e6)}, 10, method="trimmed_mean", trim=0.2)
    assert float(trimmed.max()) < 1.1  # dropped per coordinate
    assert outer.combine({"x": torch.ones(3)}, 10)[0] is None


def test_combine_is_bit_identical_whatever_the_arrival_order():
    torch.manual_seed(1)
    signal = torch.randn(1000)
    updates = {f"peer{i}": signal + torch.randn(1000) for i in range(5)}
    a, rejected = outer.combine(updates, 1000)
    b, _ = outer.combine(dict(reversed(list(updates.items()))), 1000)
    assert rejected == {} and torch.equal(a, b)


def test_sparse_updates_are_averaged_over_the_peers_that_sent_each_value():
    """``senders``: a value only one peer's top-k sent is applied whole (the mean over all peers would apply a
    quarter of it, while that peer's error feedback forgets all of it); where several sent one, their mean; zero
    where none did. Clipping still scales each update first. The reduced parts of a scatter round give the same
    bits as the whole updates combined."""
    from swarmd.protocols import exchange

    n = 4096
    updates = {}
    for i in range(4):  # each peer: the same signal on its own 1/16 of the values, and 8 values all 4 send
        u = torch.zeros(n)
        u[i * 256:(i + 1) * 256] = 1.0 + 0.1 * i
        u[-8:] = 2.0 + i
        updates[f"p{i}"] = u
    everyone, rejected = outer.combine(updates, n, screen=False)
    senders, _ = outer.combine(updates, n, screen=False, senders=True)
    assert rejected == {}
    for i in range(4):
        assert torch.allclose(senders[i * 256:(i + 1) * 256], torch.tensor(1.0 + 0.1 * i))
        assert torch.allclose(everyone[i * 256:(i + 1) * 256], torch.tensor((1.0 + 0.1 * i) / 4))
    assert torch.allclose(senders[-8:], torch.tensor(3.5)) and torch.equal(senders[-8:], everyone[-8:])
    assert not senders[1024:-8].any()
    # a peer clipped to 2x the median norm: its values scaled, still divided by the senders alone
    big = {**updates, "p3": updates["p3"] * 100}
    clipped, _ = outer.combine(big, n, screen=False, senders=True)
    factor = exchange.clip_factors({a: float(u.norm()) for a, u in big.items()})["p3"]
    assert factor < 0.1
    assert torch.allclose(clipped[768:1024], 130.0 * factor * torch.ones(256), rtol=1e-6)
    # part by part (a scatter round's reducers) the same bits as the whole
    factors = {a: 1.0 for a in updates}
    whole = exchange.reduce_part(updates, factors, n, senders=True)
    parts = torch.cat([exchange.reduce_part({a: u[a0:a0 + 1000] for a, u in updates.items()}, factors,
                                            min(1000, n - a0), senders=True) for a0 in range(0, n, 1000)])
    assert torch.equal(whole, parts) and torch.equal(whole, senders)


def test_the_sparse_codec_averages_over_senders_and_says_so_in_the_runs_fingerprint():
    from swarmd.protocols.diloco import DilocoConfig

    sparse = DilocoConfig(run="x", codec="topk2")
    assert sparse.senders() and sparse.shared()["outer_average"] == "senders"
    assert not DilocoConfig(run="x", codec="topk2", outer_average="all").senders()
    assert "outer_average" not in DilocoConfig(run="x", codec="topk2", outer_average="all").shared()
    assert not DilocoConfig(run="x").senders() and "outer_average" not in DilocoConfig(run="x").shared()
    assert DilocoConfig(run="x", codec="sign", outer_average="senders").shared()["outer_average"] == "senders"
    with pytest.raises(ValueError):
        DilocoConfig(run="x", outer_average="median")


def test_flatten_unflatten_and_hash():
    params = [torch.randn(3, 4), torch.randn(5)]
    flat = outer.flatten(params)
    copies = [torch.zeros(3, 4), torch.zeros(5)]
    outer.unflatten_into(flat, copies)
    assert all(torch.equal(a, b) for a, b in zip(params, copies))
    assert outer.params_hash(params) == outer.params_hash(copies)
    delta = outer.pseudo_gradient(params, [p - 1 for p in params])
    assert torch.allclose(delta, torch.ones(17))


def test_the_weights_hash_is_blake3_of_their_fp32_bytes_in_order_on_one_core_or_all():
    import blake3

    params = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.randn(7, dtype=torch.float64)]
    fp32 = b"".join(t.to(torch.float32).contiguous().numpy().tobytes() for t in params)
    assert outer.params_hash(params) == blake3.blake3(fp32).hexdigest(length=16)
    assert len(outer.params_hash(params)) == 32  # the length peers' messages and checkpoints carry
    assert outer.params_hash(params) != outer.params_hash(params[::-1])
    # from HASH_THREADS_FROM bytes on, hashed on every core: the same hash
    from swarmd.protocols.bulk import HASH_THREADS_FROM

    big = [torch.randn(HASH_THREADS_FROM // 4 + 3), torch.randn(1_000)]
    whole = b"".join(t.numpy().tobytes() for t in big)
    assert outer.params_hash(big) == blake3.blake3(whole, max_threads=1).hexdigest(length=16)
    # part of the run's fingerprint: peers that hash their weights otherwise are told they run another config
    from swarmd.protocols.diloco import DilocoConfig

    assert DilocoConfig(run="x").shared()["weights_hash"] == outer.WEIGHTS_HASH == "blake3-128"


def test_the_e3m0_encoder_is_named_in_a_runs_fingerprint_where_parts_are_reduced_in_e3m0():
    # peers compare reduced parts byte for byte: nodes whose e3m0 picks other codes for a boundary value must not
    # meet in a run (they would call each other liars); runs that never reduce in e3m0 keep their fingerprint
    from swarmd.protocols import codecs
    from swarmd.protocols.diloco import DilocoConfig

    assert DilocoConfig(run="x").shared()["e3m0_encoder"] == codecs.E3M0_ENCODER  # the default codec
    assert DilocoConfig(run="x", codec="sign").shared()["e3m0_encoder"] == codecs.E3M0_ENCODER  # reduced in e3m0
    assert "e3m0_encoder" not in DilocoConfig(run="x", codec="int8").shared()
    assert "e3m0_encoder" not in DilocoConfig(run="x", codec="e3m0", reduced_codec="int8").shared()


def test_adaptive_deadline_follows_observed_arrivals():
    d = outer.AdaptiveDeadline(k=4, low=1.0, high=60.0, initial=10.0)
    assert d.value() == 10.0
    for x in (2.0, 2.2, 1.9, 2.1, 2.0):
        d.observe(x)
    assert 2.0 < d.value() < 3.5
    for x in [30.0] * 64:
        d.observe(x)
    assert 30.0 < d.value() <= 60.0
    assert outer.mix(torch.ones(2), torch.zeros(2), 0.5).tolist() == [0.5, 0.5]


def test_merge_gives_a_peer_whose_weights_blew_up_the_global_weights_back():
    global_flat = torch.arange(6, dtype=torch.float32)
    params = [torch.zeros(2, 2), torch.zeros(2)]
    outer.merge_into(params, global_flat, alpha=0.5)
    assert torch.equal(torch.cat([p.reshape(-1) for p in params]), global_flat * 0.5)
    params[1][0] = float("inf")  # overlap steps that diverged: alpha x inf would stay non-finite
    outer.merge_into(params, global_flat, alpha=0.5)
    assert torch.equal(torch.cat([p.reshape(-1) for p in params]), global_flat)
    params[0][0, 0] = float("nan")  # plain DiLoCo (alpha 0): 0 x NaN is NaN, the global weights must come back
    outer.merge_into(params, global_flat, alpha=0.0)
    assert torch.equal(torch.cat([p.reshape(-1) for p in params]), global_flat)


def test_noise_of_the_right_norm_is_refused_and_honest_updates_are_not():
    torch.manual_seed(0)
    signal = torch.randn(100_000)
    honest = {f"p{i}": signal + 2.0 * torch.randn(100_000) for i in range(3)}  # cosine ~0.2 with each other
    noise = torch.randn(100_000)
    noise *= honest["p0"].norm() / noise.norm()
    combined, rejected = outer.combine({**honest, "noise": noise}, 100_000)
    assert rejected == {"noise": "uncorrelated"}
    assert outer.combine(honest, 100_000)[1] == {}
    assert torch.equal(combined, outer.combine(honest, 100_000)[0])
    # an update pointing against the others is no better than noise
    _, rejected = outer.combine({**honest, "anti": -signal * 3}, 100_000)
    assert rejected == {"anti": "uncorrelated"}
    # two updates: neither is more suspect than the other
    assert outer.combine({"p0": honest["p0"], "noise": noise}, 100_000)[1] == {}


@pytest.mark.timeout(30)
def test_wait_until_a_hair_before_its_deadline_is_over_on_virtual_time():
    """A timer within the loop's clock resolution (1 ns) of now fires at once: virtual time never got there."""
    async def main():
        await asyncio.sleep(1000.0)
        return await outer.wait_until(lambda: False, asyncio.Event(), 1e-10)

    assert run_virtual(main()) is False
