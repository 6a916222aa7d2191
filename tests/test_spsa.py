"""Seed-based SPSA: the pure pieces (bit-exact restore and replay), and the loop across real node processes."""

import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmd.protocols import tinylm
from swarmd.protocols.spsa import (BATCH, JOIN, NORMAL_TABLE, PERTURBATION, Z_BITS, SpsaConfig, Weights, capped,
                                   decode_grad, encode_grad, perturbation, screen_window, step_seed)
from hostile import HostilePeer
from swarmproc import Swarm, http_get, loop_config, wait_for

RUN = "t"


@pytest.mark.beside
def test_byte_code():
    assert encode_grad(0.0, 10) & 0x7F == 0 and decode_grad(encode_grad(-3.0, 10)) < 0
    for g in (1e-3, 0.37, -2.5, 99.0):
        assert abs(decode_grad(encode_grad(g, 100)) / g - 1) < 2 ** (1 / 8)  # within half a quarter-octave
    assert decode_grad(encode_grad(1e9, 50.0)) == pytest.approx(50.0, rel=0.1)  # clipped
    codes = [encode_grad(x / 10, 100) for x in range(1, 200)]
    assert codes == sorted(codes)  # monotonic
    with pytest.raises(ValueError):
        encode_grad(float("nan"), 1)


@pytest.mark.beside
def test_a_window_screen_refuses_bytes_out_of_scale_and_caps_the_rest():
    honest = {f"p{i}": bytes(encode_grad(g * (1 + i / 10), 100) for g in (0.01, -0.02, 0.015, -0.01, 0.03, 0.02))
              for i in range(3)}
    assert screen_window(honest)[0] == set()
    loud = bytes(encode_grad(g, 100) for g in (100, -100, 100, -100, 100, -100))
    out, cap = screen_window({**honest, "loud": loud})
    assert out == {"loud"} and decode_grad(cap) == pytest.approx(4 * decode_grad(encode_grad(0.015, 100)), rel=0.2)
    # a single large byte among honest ones is capped, not refused; its sign is kept
    spiky = bytes([encode_grad(-50.0, 100)]) + honest["p0"][1:]
    out, cap = screen_window({**honest, "spiky": spiky})
    assert out == set() and capped(spiky[0], cap) == 0x80 | cap and capped(honest["p0"][0], cap) == honest["p0"][0]
    assert screen_window({"a": loud, "b": honest["p0"]}) == (set(), 0x7F)  # 2 peers: nothing to compare with


def _signed(who, topic: str, data: bytes, seq: int = 1) -> dict:
    """A pubsub message as gossip signs it (protocols/gossip.py), as a log serves it."""
    import msgpack

    from swarmd.protocols.gossip import SIGN_DOMAIN

    body = msgpack.packb([1, topic, who.peer_id, seq, 1_800_000_000_000, data], use_bin_type=True)
    return {"b": body, "s": who.sign(SIGN_DOMAIN + body)}


@pytest.mark.beside
def test_a_served_log_is_verified_whole_and_its_contributors_are_the_screened_batches():
    """SPSA's replay, without a loop: a joiner reads a peer's log (protocols/spsa/log.py read_log) and counts each
    window's contributors as the live peers did (log_contributors): the batches less those refused as out of
    scale. Any fault anywhere in the log refuses the whole log before anything is taken from it."""
    import msgpack

    from swarmd.protocols.spsa import log_contributors, read_log
    from swarmd.transport.identity import Identity
    from swarmd.transport.wire import WIRE

    topic, window = "spsa/run", 4
    peers = [Identity.generate() for _ in range(4)]
    tag = ["layout", "config"]

    def batch(who, w, codes, t=tag, n=None):
        body = {"w": w, "b": bytes(codes[:n] if n else codes), "h": bytes(8), "t": list(t)}
        return _signed(who, topic, WIRE.pack(BATCH, body), seq=w + 1)

    honest = [1, 0x82, 3, 0x84]
    log = [[0, [batch(p, 0, honest) for p in peers]],
           [1, [batch(p, 1, honest) for p in peers[:3]] + [batch(peers[3], 1, [0x7F] * window)]]]

    def accepts(author, body):
        return body.pop("t") == tag

    windows = read_log(log, topic=topic, window=window, accepts=accepts)
    assert [sorted(b) for _, b in windows] == [sorted(p.peer_id for p in peers)] * 2
    assert log_contributors(windows) == [{p.peer_id for p in peers}, {p.peer_id for p in peers[:3]}]

    def refused(bad) -> str:
        with pytest.raises(ValueError) as e:
            read_log(bad, topic=topic, window=window, accepts=accepts)
        return str(e.value)

    assert "contiguous" in refused([log[1], log[0]])
    assert "contiguous" in refused([[0, log[0][1]], [2, log[1][1]]])
    forged = dict(log[0][1][0], s=bytes(64))
    assert "does not verify" in refused([[0, [forged] + log[0][1][1:]], log[1]])
    elsewhere = _signed(peers[0], "spsa/other", WIRE.pack(BATCH, {"w": 0, "b": bytes(honest), "h": bytes(8),
                                                                   "t": tag}))
    assert "does not verify" in refused([[0, [elsewhere]]])
    assert "not a batch of its window" in refused([[0, [batch(peers[0], 1, honest)]]])  # window 1's, in window 0
    assert "not a batch of its window" in refused([[0, [batch(peers[0], 0, honest, n=3)]]])  # 3 steps, not 4
    assert "not a batch of its window" in refused([[0, [batch(peers[0], 0, honest, t=["x", "y"])]]])
    not_batch = _signed(peers[0], topic, msgpack.packb({"k": 99, "v": 1}))
    assert "not a batch" in refused([[0, [not_batch]]])


@pytest.mark.beside
def test_seeds_are_per_step_and_peer():
    assert step_seed(RUN, 1, "A") == step_seed(RUN, 1, "A")
    assert len({step_seed(RUN, s, p) for s in range(50) for p in "ABCD"}) == 200
    assert 0 <= step_seed(RUN, 1, "A") < 2**63


def small_model():
    torch.manual_seed(0)
    return tinylm.TinyGPT(d=16, layers=1, heads=2, ctx=16)


@pytest.fixture
def torch_precision():
    """Give the process its float32 precision flags back after a test that changes them."""
    saved = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True  # PyTorch's default


@pytest.mark.beside
@pytest.mark.parametrize("api", ["legacy", "per-backend"])
def test_probes_run_in_full_float32_whatever_the_task_set(api, torch_precision):
    """A task that turns TF32 on (for speed, in its model() or loss()) must not make its honest peer fail audits:
    on an H200 TF32 matmuls moved a loss by up to 4.6e-5 against the CPU, beyond the audit's 1e-5 (bench_audit)."""
    data = tinylm.encode_text(tinylm.corpus(3, 5000, target=True))
    weights = Weights(small_model())
    if api == "legacy":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    else:  # the newer API, set inconsistently: reading the legacy flags then raises
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
    weights.probe(tinylm.batch_at(data, 1, 4, 16), 123, 1e-3)
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.beside
def test_probe_restores_weights_bit_exactly_and_replay_matches_live():
    torch.set_num_threads(1)
    data = tinylm.encode_text(tinylm.corpus(3, 5000, target=True))
    live, replayed = Weights(small_model()), Weights(small_model())
    before = live.hash()
    batch = tinylm.batch_at(data, 1, 4, 16)
    g = live.probe(batch, 123, 1e-3)
    assert live.hash() == before and all(torch.equal(p, c) for p, c in zip(live.params, live.canonical))
    log = []
    for step in range(30):
        updates = {}
        for peer in ("A", "B", "C"):
            batch = tinylm.batch_at(data, step * 10 + ord(peer), 4, 16)
            updates[peer] = encode_grad(live.probe(batch, step_seed(RUN, step, peer), 1e-3), 100)
        live.apply(RUN, step, updates, 3e-3)
        log.append((step, updates))
    for step, updates in log:
        replayed.apply(RUN, step, dict(reversed(list(updates.items()))), 3e-3)  # arrival order does not matter
    assert live.hash() == replayed.hash() != before
    assert g != 0.0


_APPLIED = """
import sys
sys.path.insert(0, "tests")
from test_spsa import _applied
print(_applied())
"""


def _numpy_weights(shapes: list[torch.Size], seed: int) -> Weights:
    """Weights of parameters that numpy drew (the same bits on every CPU), with no model to probe."""
    rng = np.random.default_rng(seed)
    params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).reshape(s))
              for s in shapes]
    return Weights(torch.nn.Module(), params, loss=lambda batch: 0.0)


def _applied() -> str:
    """The hash of a perturbation drawn for 4 shapes (one of them below 16 values, where torch.randn agreed across
    kernels, and one a scalar), and of weights numpy drew (the same bits on every CPU) after 3 peers' bytes are
    applied for 2 steps."""
    shapes = [torch.Size([3, 5]), torch.Size([100_003]), torch.Size([]), torch.Size([64, 129])]
    weights = _numpy_weights(shapes, 7)
    for step in range(2):
        weights.apply(RUN, step, {p: encode_grad(g, 100) for p, g in (("A", 0.3), ("B", -1.7), ("C", 0.02))}, 3e-3)
    z = perturbation(shapes, step_seed(RUN, 5, "A"))
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in z) + weights.hash().encode()).hexdigest()


@pytest.mark.timeout(120)
def test_perturbations_and_steps_are_the_same_bits_with_torchs_scalar_kernels():
    """A CPU without AVX2 runs torch's scalar kernels: it must draw the perturbations and step to the weights an
    AVX2 or AVX-512 CPU does. With z from torch.randn (38% of 100,000 values draw other low bits under the
    scalar kernels) or a step by add(alpha=) (fused in the vector kernels only) such a peer keeps disagreeing with
    the others' weights hash."""
    out = subprocess.run([sys.executable, "-c", _APPLIED], cwd=Path(__file__).resolve().parent.parent,
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _applied()


@pytest.mark.beside
def test_the_perturbation_is_normal_quantiles_and_a_step_rounds_each_operation_on_its_own(monkeypatch):
    table = NORMAL_TABLE
    n = 1 << Z_BITS
    assert table.dtype == torch.float32 and table.numel() == n and torch.equal(table, -table.flip(0))
    assert torch.all(table[1:] > table[:-1])  # quantiles: strictly increasing
    normal = statistics.NormalDist()
    assert table[0].item() == pytest.approx(normal.inv_cdf(0.5 / n), rel=1e-6)
    assert table.double().var(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    # the table's bits, named in every run's fingerprint: a platform that computes other quantiles says so here
    assert "blake2b-64 08b303df34892367" in PERTURBATION
    assert SpsaConfig(run="x").shared()["perturbation"] == PERTURBATION
    z = perturbation([torch.Size([2000, 50])], 1)[0]
    assert z.shape == (2000, 50) and abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert not torch.equal(z, perturbation([torch.Size([2000, 50])], 2)[0])
    assert torch.equal(z, perturbation([torch.Size([2000, 50])], 1)[0])
    # drawn a chunk of indices at a time: the same values whatever the chunk, across the parameters' boundaries
    shapes = [torch.Size([999]), torch.Size([40, 60]), torch.Size([1])]
    whole = perturbation(shapes, 9)
    monkeypatch.setattr("swarmd.protocols.spsa.weights.DRAW_CHUNK", 1000)  # (_perturbation_flat reads it there)
    assert all(torch.equal(a, b) for a, b in zip(whole, perturbation(shapes, 9)))
    assert torch.equal(torch.cat([t.view(-1) for t in whole]), perturbation([torch.Size([100_000])], 9)[0][:3400])
    # a step: -lr/M x dec(b) x z, then added, each rounded on its own (no fused multiply-add)
    weights = _numpy_weights([torch.Size([70_001])], 3)
    before = weights.canonical[0].clone()
    weights.apply(RUN, 4, {"A": encode_grad(0.9, 100)}, 3e-3)
    coeff = torch.tensor(-3e-3 * decode_grad(encode_grad(0.9, 100)), dtype=torch.float32)
    want = before + perturbation(weights.shapes, step_seed(RUN, 4, "A"))[0] * coeff
    assert torch.equal(weights.canonical[0], want) and torch.equal(weights.params[0], want)


CONFIG = """
[loops.spsa]
run = "{run}"
steps = {steps}
window = 25
min_peers = {min_peers}
deadline = 15.0
hash_every = 2
eval_every = 4

[loops.spsa.task_options]
domain = "target"
pretrain_steps = 30
batch = 8  # half the tiny GPT's default: two forward passes a step, and an auditor's re-probes, at half the CPU
"""


def spsa_swarm(tmp_path: Path, run: str, steps: int, min_peers: int) -> Swarm:
    config = loop_config(tmp_path / "spsa.toml", CONFIG.format(run=run, steps=steps, min_peers=min_peers))
    return Swarm(tmp_path / "nodes", config=config)


def spsa(node) -> dict:
    return node.status()["services"]["spsa"]


@pytest.mark.swarm
@pytest.mark.timeout(240)
async def test_four_nodes_end_bit_identical_and_garbage_changes_nothing(tmp_path):
    swarm = spsa_swarm(tmp_path, "four", 200, 4)
    attacker = HostilePeer(tmp_path)
    try:
        nodes = await asyncio.to_thread(swarm.start_chain, 4, "n", None)
        # a hostile peer on the run's topic, linked to the first node
        await attacker.start(nodes[0], "spsa/four", max_size=4096)
        await asyncio.to_thread(wait_for, lambda: spsa(nodes[0])["state"] == "running", 120, "the run to start")
        fp = spsa(nodes[0])["fingerprint"]
        tag = [fp["layout"], fp["config"]]  # the run's own tag: the junk below gets past the task check
        # the last: well-formed, from a non-participant
        for junk in (b"\xc1\xc1", {"w": 1, "b": b"\x7f" * 3}, {"w": 1, "b": b"\xff" * 25},
                     {"w": 999, "b": b"\x7f" * 25}, {"w": 1, "join": "yes"}, {"w": 1, "b": b"\x7f" * 25}):
            kind = None if isinstance(junk, bytes) else JOIN if "join" in junk else BATCH
            await attacker.send({**junk, "t": tag} if isinstance(junk, dict) else junk, kind)
        final = await asyncio.to_thread(
            wait_for, lambda: all(spsa(n)["state"] == "done" for n in nodes) and [spsa(n) for n in nodes], 200,
            "4 nodes to finish 200 steps")
        hashes = {s["final_hash"] for s in final}
        assert len(hashes) == 1, [(s["final_hash"], s.get("deadline_missed"), s.get("diverged")) for s in final]
        assert all(s["participants"] == 4 and s.get("diverged", 0) == 0 for s in final)
        first = final[0]
        assert first["losses"][-1][1] < first["losses"][0][1]  # it learned something on the target domain
        # progress is in the replicated state, for every peer, as any node sees it
        # (each node's last progress is written as its run ends, then replicated: waited for)
        await asyncio.to_thread(wait_for, lambda: (lambda progress: set(progress) >= {n.peer_id for n in nodes} and all(
            p["step"] > 0 for p in progress.values()))(http_get(nodes[1].url + "/state")["objects"]["progress"]), 30,
            "every node's progress in the replicated state")
        penalties = nodes[0].status()["penalties"]
        assert penalties.get("invalid_message", 0) >= 5  # malformed, wrong length, out of range, far future, bad join
        assert all(spsa(n).get("unexpected_batches", 0) <= 1 for n in nodes)  # the outsider's batch: not applied
    finally:
        await attacker.close()
        await asyncio.to_thread(swarm.close)


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_node_joining_at_step_100_on_another_cpu_replays_onto_the_runs_base_and_matches(tmp_path):
    """The late node runs torch's scalar kernels (a CPU without AVX2), which pretrain the base model with other low
    bits: replaying onto its own base it would never agree with the run. It takes the base of the peer it replays
    from.

    3000 steps: a newcomer contributes from the next window in which newcomers are let in (every 4th, at least two
    ahead: protocols.standing), so the late process's start must still leave it windows to contribute. Its start
    takes seconds whatever the load, and the run's steps go faster the idler the machine: two peers at batch 8 make
    ~40 steps a second under the suite's load and over 100 on an idle machine, where 1000 steps ended before the
    late node was let in (3 runs of 5). Two peers before it (it bootstraps from the one that is not the run's
    first): a third would only share the same 2 cores"""
    swarm = spsa_swarm(tmp_path, "late", 3000, 2)
    try:
        nodes = swarm.start_chain(2, members_within=None)
        wait_for(lambda: spsa(nodes[0])["step"] >= 100, 120, "the run to pass step 100")
        late = swarm.start("late", bootstrap=[nodes[-1].tcp_addr], env={"ATEN_CPU_CAPABILITY": "default"})
        wait_for(lambda: spsa(late)["state"] in ("running", "done"), 120, "the late node to replay")
        joined = spsa(late)
        assert joined["replayed_windows"] >= 4
        taken = joined["base_taken"]  # another base than its own, from a peer it replayed from
        assert taken["source"] in {n.peer_id for n in nodes} and taken["apart"] > 0 and joined["bases_taken"] == 1
        assert joined["base_hash"] == taken["hash"] == spsa(nodes[0])["base_hash"]
        final = wait_for(lambda: all(spsa(n)["state"] == "done" for n in nodes + [late])
                         and [spsa(n) for n in nodes + [late]], 200, "everyone to finish")
        assert len({s["final_hash"] for s in final}) == 1, [s["final_hash"] for s in final]
        assert all(s["participants"] == 3 for s in final)  # the late node contributed at the end
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_founder_whose_cpu_draws_another_base_starts_with_the_others(tmp_path):
    """A base model built from the seed (no pretraining: as a model() that loads pretrained weights and draws a
    fresh head) has other low bits under torch's scalar kernels: with min_peers = 3 such a node never founded the run
    with two AVX-512 nodes, and nobody started. It takes the base most ready peers hold, within rounding of its own
    (or they take its own, where a node heard it first: ties go to the smaller hash)."""
    config = loop_config(tmp_path / "spsa.toml", CONFIG.format(run="cpus", steps=100, min_peers=3).replace(
        "pretrain_steps = 30", "pretrain_steps = 0"))
    swarm = Swarm(tmp_path / "nodes", config=config)
    try:
        nodes = swarm.start_chain(2, members_within=None,
                                  more=[{"name": "scalar", "env": {"ATEN_CPU_CAPABILITY": "default"}}])
        final = wait_for(lambda: all(spsa(n)["state"] == "done" for n in nodes) and [spsa(n) for n in nodes], 200,
                         "3 nodes of two kinds of kernels to finish")
        assert len({s["final_hash"] for s in final}) == 1 and len({s["base_hash"] for s in final}) == 1
        assert all(s["participants"] == 3 for s in final)
        takers = [s for s in final if s["base_taken"] is not None]  # (the code before: the same test waits out 200 s)
        assert takers and all(s["base_taken"]["when"] == "start" and 0 < s["base_taken"]["apart"] < 1e-5
                              for s in takers)
    finally:
        swarm.close()
