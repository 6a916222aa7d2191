"""SPSA's window logic, the loop's own code, in one process on virtual time (node/sim.py SpsaSim): a peer killed
and restarted, a peer whose weights drift, a partition and its heal. Seconds each; test_spsa.py's multi-process
tests stay as the end-to-end layer."""

import asyncio

import msgpack
import pytest
import torch

from swarmd.node.sim import ChurnConfig, SimConfig, SpsaSim
from swarmd.protocols import gossip as pubsub
from swarmd.protocols import spsa
from swarmd.transport import framing
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.memory import run_virtual
from swarmd.transport.wire import WIRE

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def _sim(tmp_path, peers: int, windows: int = 12, **settings) -> SpsaSim:
    return SpsaSim(SimConfig(peers=peers, seed=11), ChurnConfig(rounds=windows, inner_steps=16, dim=64), tmp_path,
                   **settings)


def _finals(sim: SpsaSim) -> set:
    return {n.loop.final_hash for n in sim.nodes.values()}


@pytest.mark.timeout(120)
def test_four_peers_end_bit_identical_and_learn(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4)
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            loops = [sim.loop(p) for p in sim.peers]
            return _finals(sim), [lp.losses for lp in loops], sim.report(0.0), \
                [(len(lp.book.applied), len(lp.book.my_hashes), len(lp.book.log)) for lp in loops]

    finals, losses, report, kept = run_virtual(main())
    assert len(finals) == 1 and report["diverged"] == 0
    assert all(lo[-1][1] < 0.5 * lo[0][1] for lo in losses)
    # the decoded batches of the last few windows only (every window's, before: memory that grew with the run);
    # the log keeps every window's bytes for joiners
    assert all(applied <= spsa.KEEP_APPLIED + 1 and hashes <= 3 and log == 12 for applied, hashes, log in kept), kept


@pytest.mark.timeout(120)
@pytest.mark.parametrize("part_bytes", [None, 600])
def test_a_peer_killed_and_restarted_resumes_and_ends_with_the_others(tmp_path, monkeypatch, part_bytes):
    """(600: the log it replays comes in parts of a window or two each, as a long run's log does.)"""
    if part_bytes:
        monkeypatch.setattr(spsa.log, "LOG_PART_BYTES", part_bytes)  # (log_parts reads it there)

    async def main():
        sim = _sim(tmp_path, 4, windows=16)
        victim = sim.peers[3]
        async with sim:
            await sim.start_all()
            await sim.until(lambda: sim.loop(victim).window >= 4, 120, "window 4")
            await sim.kill(victim)  # kill -9: its data dir (checkpoint) stays
            await asyncio.sleep(3.0)  # the others close a window or two without it
            await sim.start(victim, restart=True)
            await sim.until(sim.finished, 300, "everyone to finish")
            return _finals(sim), sim.loop(victim).resumed, [sim.loop(p).counters for p in sim.peers[:3]], \
                sim.loop(victim).counters

    finals, resumed, survivors, victim = run_virtual(main())
    assert len(finals) == 1
    assert resumed and resumed["round"] >= 4  # from its own checkpoint, then the others' log
    # the others' log begins with ours: only the windows after our checkpoint's were applied (a restart costs the
    # windows it missed, not the whole run), and still bit-identical
    assert victim["replay_windows_kept"] == resumed["round"] - 1 and victim["replayed_windows"] > resumed["round"]
    assert all(c.get("deadline_missed", 0) >= 1 and c.get("diverged", 0) == 0 for c in survivors)


@pytest.mark.timeout(120)
def test_a_peer_whose_weights_drift_resyncs_from_the_majority(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).window >= 3 for p in sim.peers), 120, "window 3")
            d = sim.loop(sim.peers[0])
            for c in d.weights.canonical:
                c.add_(0.01 * torch.randn(c.shape))
            d.weights._load(None, 0.0)
            await sim.until(sim.finished, 300, "everyone to finish")
            return d.counters, _finals(sim), [sim.loop(p).counters.get("diverged", 0) for p in sim.peers[1:]], \
                [set(sim.loop(p).book.applied[max(sim.loop(p).book.applied)]) for p in sim.peers]

    counters, finals, others, last = run_virtual(main())
    assert counters["diverged"] >= 1 and len(finals) == 1 and others == [0, 0, 0]
    # its batches from the other weights were applied (not audited: no one probed its weights), so it is still
    # expected, and after its resync it contributes again
    assert all(len(members) == 4 for members in last), last


@pytest.mark.timeout(120)
def test_a_partition_splits_the_windows_and_after_the_heal_the_minority_takes_the_majoritys_log(tmp_path):
    async def main():
        sim = _sim(tmp_path, 5, windows=20)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).window >= 3 for p in sim.peers), 120, "window 3")
            minority, majority = sim.peers[:2], sim.peers[2:]
            sim.net.partition(set(minority), set(majority))
            await asyncio.sleep(8.0)  # windows apart: each side applies only its own batches
            split = {sim.loop(p).weights.hash() for p in sim.peers}
            sim.net.heal()
            await sim.until(sim.finished, 600, "everyone to finish")
            return split, _finals(sim), {p: sim.loop(p).counters.get("diverged", 0) for p in sim.peers}, \
                [set(sim.loop(p).book.applied[max(sim.loop(p).book.applied)]) for p in sim.peers]

    split, finals, diverged, last = run_virtual(main())
    assert len(split) >= 2  # the sides did part
    assert len(finals) == 1
    # the minority contributes again: after its resync it judges itself as the majority does (a newcomer), asks to
    # be expected again, and takes its own batches only where the majority does (before, the majority never took
    # its batches again in the run)
    assert all(len(members) == 5 for members in last), last
    assert all(diverged[p] >= 1 for p in list(diverged)[:2])  # the minority saw it was off and replayed


def _byzantine(sim, peer, flip):
    """``peer``'s bytes are its honest ones with the sign flipped where ``flip(step)`` says."""
    sim.faults.alter("code", lambda e, code: code ^ (0x80 if flip(e.info["step"]) else 0), peer=peer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("behaviour", ["inverted", "noise"])
def test_a_peer_whose_bytes_are_not_its_probes_is_convicted_by_every_honest_auditor(tmp_path, behaviour):
    """Bytes of an honest size with the wrong sign (every step, or at random) look like an honest noisy estimate;
    only re-probing the peer's step (its batch by batch_at, its seed, the same weights) tells them apart."""
    import random

    rng = random.Random(3)
    flip = (lambda step: True) if behaviour == "inverted" else (lambda step: rng.random() < 0.5)

    async def main():
        sim = _sim(tmp_path, 5, windows=10, audit_steps=4)
        bad = sim.peers[4]
        _byzantine(sim, bad, flip)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).final_hash for p in sim.peers[:4]), 300, "the honest to finish")
            honest = [sim.loop(p) for p in sim.peers[:4]]
            return ({lp.final_hash for lp in honest}, [dict(lp.audits.convicted) for lp in honest],
                    [lp.offenders.get(bad, {}).get("refused", {}) for lp in honest],
                    [sim.nodes[p].transport.penalties.score(bad) for p in sim.peers[:4]],
                    [lp.counters.get("audited_steps", 0) for lp in honest], [lp.status()["audits"] for lp in honest],
                    bad)

    finals, convicted, refused, scores, audited, states, bad = run_virtual(main())
    assert states == ["on"] * 4
    assert all(set(c) == {bad} for c in convicted), convicted  # every honest auditor, and no honest peer
    assert all(r.get("audit", 0) >= 1 for r in refused) and all(s > 0 for s in scores)
    assert all(a > 0 for a in audited)
    assert len(finals) == 1  # the honest peers end on the same weights


@pytest.mark.timeout(120)
def test_a_peer_that_claims_other_weights_to_dodge_the_audits_is_convicted(tmp_path):
    """A batch probed at other weights (its hash says so) cannot be audited: a liar could claim other weights in
    every batch. An honest peer that diverged resyncs at the next hash check; one that stays off is convicted."""
    async def main():
        sim = _sim(tmp_path, 5, windows=10)
        bad = sim.peers[4]

        _byzantine(sim, bad, lambda step: True)
        sim.faults.alter("publish", lambda e, body: {**body, "h": bytes(8)},  # not the weights it holds
                         peer=bad, kind=spsa.BATCH)
        async with sim:
            await sim.start_all()
            await sim.until(lambda: all(sim.loop(p).final_hash for p in sim.peers[:4]), 300, "the honest to finish")
            honest = [sim.loop(p) for p in sim.peers[:4]]
            return {lp.final_hash for lp in honest}, [dict(lp.audits.convicted) for lp in honest], bad

    finals, convicted, bad = run_virtual(main())
    assert all(set(c) == {bad} for c in convicted), convicted
    # convicted once it stayed off past two hash checks (hash_every = 1 here): in its third window (0, 1, 2)
    assert all(c[bad] == 2 for c in convicted), convicted
    assert len(finals) == 1


@pytest.mark.timeout(120)
def test_honest_peers_pass_every_audit(tmp_path):
    async def main():
        sim = _sim(tmp_path, 4, windows=8, audit_steps=8)
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            loops = [sim.loop(p) for p in sim.peers]
            return [lp.counters.get("audited_steps", 0) for lp in loops], [dict(lp.audits.convicted) for lp in loops], \
                [lp.counters.get("rejected_audit", 0) for lp in loops], _finals(sim)

    audited, convicted, rejected, finals = run_virtual(main())
    assert all(a >= 8 * 3 * 6 for a in audited), audited  # 3 peers x 8 steps, in most windows
    assert convicted == [{}] * 4 and rejected == [0] * 4 and len(finals) == 1


def test_audit_agrees_with_the_honest_byte_and_not_with_a_wrong_one():
    eps, clip = 1e-3, 100.0
    for plus, minus in [(2.0, 1.999), (2.0, 2.001), (1.5, 1.5 - 3e-6), (7.0, 7.0), (2.0, 1.0)]:
        g = (plus - minus) / (2 * eps)
        honest = spsa.encode_grad(g, clip)
        assert spsa.audit_agrees(honest, plus, minus, eps, clip)
        if abs(g) > spsa.AUDIT_REL * 2 * max(plus, minus) / eps:
            assert not spsa.audit_agrees(honest ^ 0x80, plus, minus, eps, clip)  # the other sign
            if abs(g) * 8 < clip:  # (beyond the clip every byte says the clip)
                assert not spsa.audit_agrees(spsa.encode_grad(g * 8, clip), plus, minus, eps, clip)
                assert not spsa.audit_agrees(spsa.encode_grad(g / 8, clip), plus, minus, eps, clip)
            else:
                assert not spsa.audit_agrees(spsa.encode_grad(clip / 8, clip), plus, minus, eps, clip)
    # within rounding's reach the sign is not judged, a size far beyond it is
    assert spsa.audit_agrees(spsa.encode_grad(-1e-3, clip), 2.0, 2.0 - 2e-9, eps, clip)
    assert not spsa.audit_agrees(spsa.encode_grad(5.0, clip), 2.0, 2.0 - 2e-9, eps, clip)
    # a probe of ours that is not finite judges nothing
    assert spsa.audit_agrees(0x7F, float("nan"), 1.0, eps, clip)


@pytest.mark.timeout(120)
def test_a_peer_behind_the_swarm_takes_the_counting_peers_windows_ahead_and_refuses_only_a_strangers(tmp_path):
    """A peer that fell behind (a restart's log replay, a slow machine) gets batches for windows far past its own:
    from a peer whose word counts they are taken (held, bounded, for when it gets there), not rejected (which
    penalised honest peers and left it without the windows it needed: found by the kill bench's plain restart
    after a 15 s replay); the same message from a peer without standing is rejected as flooding."""
    async def main():
        sim = _sim(tmp_path, 3, windows=14)
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            return sim.loop(sim.peers[0]), sim.peers[1]

    lp, other = run_virtual(main())
    # a long run's log, as a joiner gets it (these windows' real signed batches, 3,000 windows of 3 peers): within
    # what the log protocol lets a frame carry (it was refused as too dense past ~800 windows of 4 peers)
    long_log = [[w, batches] for w in range(3000) for batches in [lp.book.log[w % len(lp.book.log)][1]]]
    parts = list(spsa.log_parts(long_log, 200_000))
    assert len(parts) > 3 and [p[2] for p in parts] == [True] * (len(parts) - 1) + [False]
    for first, windows, more in parts:
        body = {"w": first, "windows": windows, "more": more}
        assert framing.decode(framing.encode(2, body), spsa.LOG_SPEC).body == body
    assert sum((p[1] for p in parts), []) == long_log
    last = max(lp.book.applied)
    message = lp.book.applied[last][other]  # a batch of a counting peer, signed by it
    lp.state, lp.window = "running", last - 12  # as if we were 12 windows behind
    lp.book.open.clear()
    del lp.book.applied[last]  # not closed yet, for a peer that far behind
    assert lp.standing.counts(other)
    assert lp._validate(message) is spsa.Verdict.ACCEPT and other in lp.book.open[last].batches
    assert lp.counters.get("rejected_future", 0) == 0
    lp.book.open.clear()
    lp.standing.counts = lambda author: False  # a stranger's batch that far ahead: flooding steps
    assert lp._validate(message) is spsa.Verdict.REJECT and lp.counters["rejected_future"] == 1


class _Parts:
    """A stream that replays frames (read_log_parts' side of a served log)."""

    def __init__(self, bodies, kind=None):
        self.frames = [framing.Message(kind or spsa.LOG_PART.code, b) for b in bodies]

    async def read_required(self):
        return self.frames.pop(0)


def test_a_log_is_read_from_its_parts_in_order_and_within_its_budget():
    log = [[w, [{"b": bytes(100 + w), "s": bytes(64)}] * 3] for w in range(50)]
    parts = [{"w": f, "windows": ws, "more": m} for f, ws, m in spsa.log_parts(log, 1000)]
    assert len(parts) >= 10 and parts[0]["w"] == 0
    assert asyncio.run(spsa.read_log_parts(_Parts(parts))) == log
    assert asyncio.run(spsa.read_log_parts(_Parts([{"w": 0, "windows": [], "more": False}]))) == []
    assert list(spsa.log_parts([])) == [(0, [], False)]
    # windows without batches still fill a part: a part never holds more windows than its schema allows
    empty = [[w, []] for w in range(5000)]
    assert max(len(ws) for _, ws, _ in spsa.log_parts(empty, 16_000)) == 1000
    with pytest.raises(spsa.MalformedMessage, match="a part from window"):  # a part missing
        asyncio.run(spsa.read_log_parts(_Parts(parts[:1] + parts[2:])))
    with pytest.raises(spsa.MalformedMessage, match="a part from window"):  # a part again
        asyncio.run(spsa.read_log_parts(_Parts(parts[:2] + parts[1:])))
    with pytest.raises(spsa.MalformedMessage, match="more than 3000 B"):  # a peer that streams beyond the budget
        asyncio.run(spsa.read_log_parts(_Parts(parts), max_bytes=3000))
    # empty windows count too: a peer streaming them forever is stopped by the budget, not by our memory
    endless = [{"w": f, "windows": [[w, []] for w in range(f, f + 1000)], "more": True} for f in range(0, 10_000, 1000)]
    with pytest.raises(spsa.MalformedMessage, match="more than 100000 B"):
        asyncio.run(spsa.read_log_parts(_Parts(endless), max_bytes=100_000))
    with pytest.raises(spsa.MalformedMessage, match="a part of the log expected"):
        asyncio.run(spsa.read_log_parts(_Parts(parts, kind=spsa.LOG_REQUEST.code)))


def _built_elsewhere(sim: SpsaSim, peer: str) -> None:
    """``peer``'s base model has other low bits than the others' (as one built under another CPU's kernels: torch's
    scalar ones, or an ARM CPU's, draw and pretrain a seed's model that way)."""
    sim.faults.alter("built", lambda e, values: [v + 2 ** -30 for v in values], peer=peer)  # the base is zeros


def _sim_with_joiner(tmp_path, windows: int) -> tuple[SpsaSim, str]:
    """Four peers at min_peers 3, the last built elsewhere (``_built_elsewhere``): it joins late."""
    sim = _sim(tmp_path, 4, windows=windows, min_peers=3)
    _built_elsewhere(sim, sim.peers[3])
    return sim, sim.peers[3]


async def _found_then_join(sim: SpsaSim, late: str) -> None:
    """The first three peers found the run; ``late`` starts once they are past window 2."""
    await sim.start_all(sim.peers[:3])
    await sim.until(lambda: all(sim.loop(p).window >= 2 for p in sim.peers[:3]), 120, "window 2")
    await sim.start(late)

@pytest.mark.timeout(120)
def test_a_late_joiner_built_on_another_cpu_replays_onto_the_runs_base_and_ends_with_the_others(tmp_path):
    """A late joiner replays the log onto its base model: where its base has other bits than the run's, it replayed
    onto other weights and never agreed with the run (each hash check sent it to replay again). It takes the base
    of the peer it replays from; the founders, whose bases are one, only compare hashes."""
    async def main():
        sim, late = _sim_with_joiner(tmp_path, windows=12)
        async with sim:
            await _found_then_join(sim, late)
            await sim.until(sim.finished, 300, "everyone to finish")
            return _finals(sim), sim.loop(late).status(), [sim.loop(p).counters for p in sim.peers], sim.peers[:3]

    finals, joiner, counters, founders = run_virtual(main())
    assert len(finals) == 1
    taken = joiner["base_taken"]
    assert taken["source"] in founders and taken["apart"] > 0 and joiner["base_hash"] == taken["hash"]
    assert counters[3]["bases_taken"] == 1 and counters[3].get("diverged", 0) == 0
    assert sum(c.get("base_served", 0) for c in counters[:3]) == 1  # the founders' bases: one, never pulled
    assert all("bases_taken" not in c for c in counters[:3])
    assert joiner["participants"] == 4  # it contributed at the end


@pytest.mark.timeout(120)
def test_a_joiner_that_took_the_runs_base_keeps_it_across_a_restart(tmp_path):
    """Its checkpoint keeps the base it took (and the model's other tensors as that base put them), so a restart
    resumes onto the run's base: it replays only the windows it missed, with no second pull."""
    async def main():
        sim, late = _sim_with_joiner(tmp_path, windows=16)
        async with sim:
            await _found_then_join(sim, late)
            await sim.until(lambda: sim.loop(late).saved and sim.loop(late).window >= sim.loop(late).join_at + 1,
                            120, "the joiner to contribute and save")
            first = sim.loop(late).status()
            await sim.kill(late)
            await asyncio.sleep(3.0)  # the others close a window or two without it
            await sim.start(late, restart=True)
            await sim.until(sim.finished, 300, "everyone to finish")
            return _finals(sim), first, sim.loop(late).status()

    finals, first, again = run_virtual(main())
    assert len(finals) == 1
    assert first["bases_taken"] == 1 and again["base_taken"] == first["base_taken"]
    assert again.get("bases_taken", 0) == 0 and again["base_hash"] == first["base_hash"]  # no second pull
    assert again["resumed"]["round"] >= 1 and again["replay_windows_kept"] >= 1  # only the windows it missed


def _join_asking_first(tmp_path, faults, first=lambda founders: founders[:1]) -> tuple:
    """Three founders, some of them (``first`` of them, in order) with the faults ``faults(sim, the founder, the
    joiner's id)`` adds, and a joiner built elsewhere that replays from those before any other: (final hashes, the
    joiner's status, the first's counters, its penalty score at the joiner, the other founders)."""
    async def main():
        sim = _sim(tmp_path, 4, windows=12, min_peers=3)
        firsts, late = first(sim.peers[:3]), sim.peers[3]
        sim.faults.alter("replay-from", lambda e, peers: sorted(
            peers, key=lambda p: firsts.index(p) if p in firsts else len(firsts)), peer=late)
        for p in firsts:
            faults(sim, p, late)
        _built_elsewhere(sim, late)
        async with sim:
            await _found_then_join(sim, late)
            await sim.until(sim.finished, 300, "everyone to finish")
            return (_finals(sim), sim.loop(late).status(), sim.loop(firsts[0]).counters,
                    sim.nodes[late].transport.penalties.score(firsts[0]),
                    [p for p in sim.peers[:3] if p not in firsts])

    return run_virtual(main())


@pytest.mark.timeout(120)
def test_a_base_that_is_not_the_one_announced_is_refused_and_its_server_penalised(tmp_path):
    """The peer a joiner replays from first serves base bytes other than the hash it announced: refused (its
    penalty), and the joiner takes the next peer's base and log."""
    def liar(sim, server, late):  # the bytes change, the hash it announces does not
        sim.faults.alter("serve-base", lambda e, base: (base[0], [b + 1.0 for b in base[1]]), peer=server)

    finals, joiner, _, score, honest = _join_asking_first(tmp_path, faults=liar)
    assert len(finals) == 1
    assert joiner["base_unusable"] == 1 and score > 0
    assert joiner["bases_taken"] == 1 and joiner["base_taken"]["source"] in honest


@pytest.mark.timeout(120)
def test_a_base_never_crosses_a_relay(tmp_path):
    """A base is a whole model's bytes: a peer reached through a relay only is not sent one (it gets the head, then
    the stream ends), and the joiner takes the next peer's base."""
    def through_a_relay(sim, server, late):
        sim.net.relay(server, late)  # as the server lists its connection to the joiner (the joiner's own is direct)

    finals, joiner, server, _, direct = _join_asking_first(tmp_path, through_a_relay)
    assert len(finals) == 1
    assert server["base_serve_refused"] == 1 and server.get("base_served", 0) == 0
    assert joiner["base_pull_failed"] == 1 and joiner["base_taken"]["source"] in direct


def test_a_base_travels_in_parts_into_tensors_of_every_dtype_and_no_further():
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(3, 5))
    model.frozen = torch.nn.Parameter(torch.randn(7).to(torch.bfloat16), requires_grad=False)
    model.register_buffer("mask", torch.tensor([True, False, True]))
    model.register_buffer("nothing", torch.zeros(0))
    model.register_buffer("count", torch.tensor(5, dtype=torch.int64))
    model.tied = model.w  # a second name for a perturbed parameter: served from the base too
    base = [model.w.detach().clone() + 1]  # the base differs from the model's current (perturbed) weights
    layout = spsa.base_layout(model, [model.w])
    assert [(name, i) for name, i, _ in layout] == [("w", 0), ("frozen", None), ("tied", 0), ("mask", None),
                                                    ("nothing", None), ("count", None)]
    arrays = spsa.base_arrays(layout, base)
    size = 2 * 15 * 4 + 7 * 2 + 3 + 0 + 8
    assert sum(a.nbytes for a in arrays) == size
    parts = list(spsa.base_parts(arrays, part_bytes=7))
    assert b"".join(parts) == b"".join(a.tobytes() for a in arrays) and max(map(len, parts)) == 7
    receiver = spsa.BaseReceiver(layout)
    assert receiver.size == size
    for part in parts:
        receiver.add(part)
    assert receiver.done and receiver.digest() == spsa.base_digest(arrays) and receiver.finite()
    got = receiver.tensors
    assert torch.equal(got[0], base[0]) and torch.equal(got[2], base[0]) and torch.equal(got[1], model.frozen)
    assert torch.equal(got[3], model.mask) and got[4].numel() == 0 and int(got[5]) == 5
    with pytest.raises(MalformedMessage):  # one byte past the size its head gave
        receiver.add(b"\x00")
    nan = spsa.BaseReceiver(layout)
    nan.add(torch.full((15,), float("nan")).numpy().tobytes() + b"".join(parts)[60:])
    assert not nan.finite()


def _base_of(sim: SpsaSim, peer: str, scale: float) -> None:
    """``peer``'s base model is the regression task's zeros moved to 0.5 (every peer's alike), times ``scale`` (1: as
    the others; 1 + 2^-20: another CPU's rounding; 1.01: a base trained otherwise)."""
    sim.faults.alter("built", lambda e, values: [torch.full_like(v, 0.5).mul_(scale) for v in values], peer=peer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scale", [1 + 2 ** -20, 1.01])
def test_founders_take_a_base_within_rounding_of_their_own_and_no_further(tmp_path, scale, caplog):
    """A base that differs by another CPU's rounding (a model() that draws a fresh head with nn.init, a model built
    from a seed) no longer keeps its peer from founding the run with the others: the peer whose base most ready
    peers do not hold takes theirs. A base further apart is refused (no peer can hand the founders weights of its
    choosing), and with min_peers counting its peer nobody starts."""
    async def main():
        sim = _sim(tmp_path, 3, windows=6)
        odd = sim.peers[2]
        for p in sim.peers:
            _base_of(sim, p, scale if p == odd else 1.0)
        async with sim:
            await sim.start_all()
            if scale > 1.001:
                await sim.until(lambda: sim.loop(odd).counters.get("base_refused", 0) >= 2, 120, "two refusals")
                await asyncio.sleep(spsa.MISMATCH_SAID_AFTER + 2)  # the wait is said in the log
            else:
                await sim.until(sim.finished, 300, "everyone to finish")
            loops = [sim.loop(p) for p in sim.peers]
            return _finals(sim), [lp.status() for lp in loops], [lp.state for lp in loops], sim.peers

    finals, status, states, peers = run_virtual(main())
    if scale > 1.001:
        assert states == ["waiting for peers"] * 3 and status[2]["base_refused"] == 2
        assert all(s["base_taken"] is None for s in status)
        said = [r.getMessage() for r in caplog.records if "hold another base model" in r.getMessage()]
        assert any("1 ready peer(s) hold another base model than ours (2 with ours, min_peers = 3)" in m for m in said)
        assert any("2 ready peer(s) hold another base model than ours (1 with ours, min_peers = 3)" in m for m in said)
        return
    assert len(finals) == 1 and all(s["log_windows"] == 6 and s["participants"] == 3 for s in status)
    takers = [s for s in status if s["base_taken"] is not None]
    # the odd peer takes the two others' base (most hold it), or, where it heard one of them first (a 1-1 view: the
    # smaller hash), they may take its own: either way one base, within rounding
    assert takers and all(s["base_taken"]["when"] == "start" and 0 < s["base_taken"]["apart"] < 1e-5
                          and s["base_taken"]["source"] in peers for s in takers)
    assert len({s["base_hash"] for s in status}) == 1


@pytest.mark.timeout(120)
def test_fresh_keys_that_announce_another_base_and_stall_cost_the_start_a_bounded_number_of_asks(tmp_path):
    """Five keys announce one base that is not the founders' (most of the ready peers then hold it) and stall when
    asked for it. Each founder asks two of them (rounds.StartWeights), then no longer counts that hash and starts
    with the two others: a start delayed by two asks, not five (nor by as many as a flood could mint)."""
    async def main():
        sim = _sim(tmp_path, 8, windows=6, min_peers=3)
        honest, sybils = sim.peers[:3], sim.peers[3:]
        stalls = []

        async def announce() -> None:  # the keys' readiness, with a base of their own
            while True:
                for p in sybils:
                    sim.say(p, spsa.READY, {"w": 0, "ready": "0" * 32})
                await asyncio.sleep(1.0)

        for p in sybils:
            sim.faults.hang("start", peer=p)  # a key's node has built the run's model and never starts it
            stalls.append(sim.faults.hang("serve-base", peer=p))  # the asker's wait gives up first
        async with sim:
            await sim.start_all(sybils)
            await sim.until(lambda: all(sim.loop(p).fp for p in sybils), 60, "the keys' models")
            announcing = asyncio.create_task(announce())
            await asyncio.sleep(2.0)  # their readiness is in before the founders start
            await sim.start_all(honest)
            started = await sim.until(lambda: all(sim.loop(p).state != "waiting for peers" for p in honest), 200,
                                      "the founders to start")
            await sim.until(lambda: all(sim.loop(p).final_hash for p in honest), 300, "the founders to finish")
            announcing.cancel()
            return started, {sim.loop(p).final_hash for p in honest}, \
                [sim.loop(p).start_state.bases.asks for p in honest], [sim.loop(p).status() for p in honest], \
                sum(f.fired for f in stalls)

    started, finals, asks, status, stalled = run_virtual(main())
    assert stalled == 6  # each founder's two asks
    assert len(finals) == 1 and all(s["participants"] == 3 for s in status)
    assert asks == [2, 2, 2] and all(s["base_ask_failed"] == 2 and s["base_taken"] is None for s in status)
    assert started < 2 * 30 + 20  # two asks' waits (30 s each) and the barrier


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("told", [True, False], ids=["the others' hashes tell", "nothing tells"])
def test_a_base_that_is_its_own_hash_but_not_the_runs_costs_a_joiner_one_replay_a_server(tmp_path, servers, told):
    """The peer a joiner asks first serves, every time it is asked, a base that is not the run's but whose bytes are
    the hash it announces (a peer that keeps another base than the one its weights came from: the joiner cannot
    tell from the bytes). The joiner replays onto it, and its weights are not the ones the other peers' batches of
    the log's last window say they held: the log is refused and the next peer asked. Where nothing tells (no
    other peer's batch in that window; here a seam), its weights are off the majority's at the next hash check,
    and it resyncs: from the other holders first, so the same base does not send it round again (before, that peer
    was first again, the smallest id of the holders, and the joiner went round for the whole run). Two such peers,
    the two smallest ids, cost it one replay each (where only the last one was put last, they took turns)."""
    made = []

    def other_base(sim, server, late):
        if not told:  # nothing tells: every loop finds a replayed log leads nowhere it can check (None)
            sim.faults.alter("replay-leads", lambda e, leads: None)
        made.append(late)
        shift = 0.25 * len(made)  # each its own base

        def serve(e, honest):
            e.loop.base.served.clear()  # its own limits are its own: it serves whenever asked
            base = [b + shift for b in honest[1]]
            return spsa.base_digest(spsa.base_arrays(e.loop.base.layout, base)), base
        sim.faults.alter("serve-base", serve, peer=server)

    finals, joiner, server, score, honest = _join_asking_first(tmp_path, faults=other_base,
                                                               first=lambda founders: sorted(founders)[:servers])
    assert len(finals) == 1 and joiner["participants"] == 4
    assert server["base_served"] == 1  # asked once: the replays after went to other holders
    assert joiner["bases_taken"] == servers + 1
    if told:
        assert joiner["log_inconsistent"] == servers and joiner.get("diverged", 0) == 0
    else:
        assert joiner["diverged"] == servers and joiner["resyncs"] == servers and "log_inconsistent" not in joiner
    assert joiner["base_taken"]["source"] in honest and score == 0  # no penalty: its bytes were its hash


@pytest.mark.timeout(120)
def test_a_log_that_carries_fresh_keys_batches_gives_them_no_say(tmp_path):
    """The peer a late joiner replays from first adds, to the last windows of the log it serves, batches six fresh
    keys signed for it (zeros: they never sent them to anyone), and once the joiner is in the keys vote weights of
    their own for every window. Before, the joiner credited them as founders, for good (vouched), and ended on
    other weights than the run. A replayed log must lead to the weights the other peers it trusts said they held
    at its last window: the keys' batches moved them, so the log is refused before anything of it is kept, and
    the joiner takes the next peer's."""
    keys = []

    def adds_batches(e, honest):
        lp, log = e.loop, [list(entry) for entry in honest]
        for entry in log[-2:]:
            w = entry[0]
            for ident in keys:
                data = WIRE.pack(spsa.BATCH, lp._tag({"w": w, "b": bytes(lp.cfg.window),
                                                      "h": bytes.fromhex(lp.book.my_hashes[w][:16])}))
                body = msgpack.packb([1, lp.topic, ident.peer_id, w + 1, lp.gossip._now_ms(), data], use_bin_type=True)
                entry[1] = [*entry[1], {"b": body, "s": ident.sign(pubsub.SIGN_DOMAIN + body)}]
        return log

    async def vote(sim, sybils: list[str], run: list[str]) -> None:
        """The keys' votes once the joiner is in: weights of their own for the windows the run is at."""
        while True:
            window = max(sim.loop(p).window for p in run)
            for p in sybils:
                for w in range(window, window + 3):
                    sim.say(p, spsa.HASH, {"w": w, "h": "f" * 32})
            await asyncio.sleep(0.5)

    async def main():
        sim = _sim(tmp_path, 10, windows=16, min_peers=3)
        founders, late, sybils = sim.peers[:3], sim.peers[3], sim.peers[4:]
        first = min(founders)
        adds = sim.faults.alter("serve-log", adds_batches, peer=first)
        sim.faults.alter("replay-from", lambda e, peers: sorted(peers, key=lambda p: p != first), peer=late)
        async with sim:
            for p in sybils:  # the keys' nodes: peers of the swarm that run no loop
                await sim.start(p, loop=False)
            keys.extend(sim.nodes[p].identity for p in sybils)
            await _found_then_join(sim, late)
            await sim.until(lambda: sim.loop(late).state == "running" and sim.loop(late).window
                            >= sim.loop(late).join_at, 120, "the join")
            voting = asyncio.create_task(vote(sim, sybils, [*founders, late]))
            await sim.until(lambda: all(sim.loop(p).final_hash for p in [*founders, late]), 300,
                            "the run's peers to finish")
            voting.cancel()
            joiner = sim.loop(late)
            return ({sim.loop(p).final_hash for p in [*founders, late]}, joiner.status(),
                    [joiner.standing.vouched(s) for s in sybils], adds.fired)

    finals, joiner, vouched, served = run_virtual(main())
    assert served >= 1 and joiner["log_inconsistent"] >= 1  # the keys' log was served, and refused
    assert not any(vouched), vouched
    assert len(finals) == 1 and joiner["participants"] == 4, joiner


@pytest.mark.timeout(120)
def test_a_joiner_that_trusts_one_peer_alone_credits_the_authors_of_its_log_and_keeps_in_step(tmp_path):
    """A joiner whose one trusted peer is the one it replays from (as a node bootstrapped from one peer, the one
    the user chose): nothing tells whether that log's windows hold the run's batches, so their authors are
    credited as usual, and it waits for the peers the others wait for (crediting that peer alone, it would close
    windows without them and be off the run at its first hash check)."""
    async def main():
        sim = _sim(tmp_path, 4, windows=12, min_peers=3)
        first, late = min(sim.peers[:3]), sim.peers[3]
        offered = []  # the peers it would have replayed from, each time it looked

        def only_first(e, peers):
            offered.append(peers)
            return [first] if first in peers else []
        sim.faults.alter("replay-from", only_first, peer=late)
        async with sim:
            await _found_then_join(sim, late)
            await sim.until(sim.finished, 300, "everyone to finish")
            return _finals(sim), sim.loop(late).status(), offered, first

    finals, joiner, offered, first = run_virtual(main())
    assert any(first in peers and len(peers) > 1 for peers in offered), offered  # others were there to trust
    assert len(finals) == 1 and joiner["participants"] == 4
    assert joiner.get("diverged", 0) == 0 and joiner.get("log_authors_unconfirmed", 0) == 0, joiner


@pytest.mark.timeout(120)
def test_a_ready_heard_before_its_author_is_listed_as_direct_still_counts_at_the_start(tmp_path):
    """As DiLoCo's (test_rounds_sim.py): node A lists B as direct only 3 s after A starts, and B, which hears
    everyone at once, starts within that time and announces no more. A's count must still take B's "ready"
    (dropped, it would leave A at the barrier, replaying the others' log to join them)."""
    sim = _sim(tmp_path, 4, windows=6)
    a, late = sim.peers[0], sim.peers[1]
    sim.list_late(a, late, 3.0)

    async def main():
        async with sim:
            await sim.start_all()
            await sim.until(sim.finished, 300, "everyone to finish")
            return sim.loop(a).counters, sim.loop(a).start_state.initial, _finals(sim)

    counters, initial, finals = run_virtual(main())
    assert len(finals) == 1 and set(initial) == set(sim.peers)
    assert counters.get("replayed_windows", 0) == 0


@pytest.mark.timeout(120)
def test_two_peers_without_a_direct_path_to_each_other_found_the_run_and_count_in_every_window(tmp_path):
    """Four peers, the last two listing each other as reached through a relay only (two peers behind symmetric
    NATs: punching cannot join them). Their batches are signed pubsub messages, which the mesh carries through the
    members, so they found the run with the others and every window takes all four batches; ``reach`` says which
    peers came without a direct path. Before, only directly connected peers counted at the start: the two joined
    late by replaying the others' log, and the first window closed without them."""
    sim = _sim(tmp_path, 4, windows=6)
    a, b = sim.peers[2:]
    sim.net.relay(a, b)
    sim.net.relay(b, a)
    loops = sim.run_to_end()
    assert len({lp.final_hash for lp in loops}) == 1
    for lp in loops:
        assert len(lp.start_state.initial) == 4
        assert lp.counters.get("replayed_windows", 0) == 0 and lp.counters.get("peers_missed", 0) == 0
        assert lp.counters.get("deadline_missed", 0) == 0
        reach = lp.status()["reach"]
        assert reach["rounds_with_our_update"] == reach["rounds_closed"] == 6, reach
    for lp, other in ((loops[2], b), (loops[3], a)):
        assert lp.status()["reach"]["through_members"] == {other: 6}
    for lp in loops[:2]:
        assert lp.status()["reach"]["through_members"] == {}


@pytest.mark.timeout(120)
def test_the_peer_ready_last_that_missed_a_founders_ready_is_answered_and_starts_with_them(tmp_path):
    """The peer ready last can miss a founder's "ready": its links form after the founder's announcements (here:
    every one the founder makes before it starts is lost on the way to it), and the founder starts a grace after
    counting it and announces no more. The founder, running, hears its repeated "ready" and says its own again:
    it founds the run with the others and every window takes all four batches. Before, it waited out the first
    window and joined late by replaying the others' log (the lab's four peers behind NATs did so, tests/test_nat.py)."""
    sim = _sim(tmp_path, 4, windows=6)
    founder, last = sim.peers[0], sim.peers[3]
    sim.faults.drop("message", peer=last, source=founder, kind=spsa.READY,
                    when=lambda e: sim.loop(founder).state != "running")
    loops = sim.run_to_end()
    assert len({lp.final_hash for lp in loops}) == 1
    assert loops[3].start_state.initial == set(sim.peers) and last in loops[0].start_state.answers.answered
    for lp in loops:
        assert lp.counters.get("replayed_windows", 0) == 0 and lp.counters.get("peers_missed", 0) == 0, lp.counters
        assert lp.status()["reach"]["rounds_with_our_update"] == lp.status()["reach"]["rounds_closed"] == 6
