"""DiLoCo and Streaming DiLoCo between real node processes: a node killed mid-run does not stop the others, a peer
that drifts or closes a round differently ends on the majority's weights, fresh keys cannot steer a run. (Identical
global weights after every round among 3 nodes: tests/test_dashboard.py, on the swarm its dashboard tests watch.)"""

from pathlib import Path

import pytest

from swarmproc import Swarm, loop_config, wait_for

pytestmark = pytest.mark.swarm

CONFIG = """
[loops.diloco]
run = "{run}"
rounds = {rounds}
inner_steps = {h}
fragments = {fragments}
overlap = {overlap}
alpha = {alpha}
min_peers = {min_peers}
inner_lr = 1e-3
deadline_low = {deadline_low}
codec = "{codec}"
[loops.diloco.task_options]
batch = 8  # the tiny GPT's default 16 doubles the inner steps' CPU (~55% of a node's here) and tests nothing more
"""


def diloco_swarm(tmp_path: Path, **params) -> Swarm:
    defaults = dict(run="t", rounds=4, h=20, fragments=1, overlap=0, alpha=0.0, min_peers=3, deadline_low=2.0,
                    codec="e3m0")
    config = loop_config(tmp_path / "diloco.toml", CONFIG.format(**{**defaults, **params}))
    return Swarm(tmp_path / "nodes", config=config)


def d(node) -> dict:
    return node.status()["services"]["diloco"]


def rounds(node) -> list[tuple]:
    return [(h["round"], h["fragment"], h["global_hash"]) for h in d(node)["history"]]


@pytest.mark.timeout(180)
def test_streaming_survives_a_node_killed_mid_run(tmp_path):
    # with the 1-bit sign codec and its error feedback (on by default for it): each fragment's residual kept apart
    swarm = diloco_swarm(tmp_path, run="stream", rounds=6, h=25, fragments=2, overlap=5, alpha=0.5, codec="sign")
    try:
        nodes = swarm.start_chain(3, members_within=None)
        wait_for(lambda: d(nodes[0]).get("rounds", 0) >= 3, 120, "3 rounds")
        nodes[2].kill()
        alive = nodes[:2]
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in alive) and [d(n) for n in alive], 150,
                         "the survivors to finish")
        # the killed node's last update may reach one survivor and not the other: they split for a round, the next
        # round's hash check sends one side (the same one on both, ties included) to a checkpoint, and they end equal
        assert final[0]["final_hash"] == final[1]["final_hash"]
        history = final[0]["history"]
        assert history[-1]["round"] == 5
        assert any(h["participants"] == 2 for h in history)  # the two survivors closed rounds together
        if history[-1]["participants"] != 2:
            # on a starved machine one survivor's last update can miss the deadline: the last round closes without
            # it (at the coordinator, whose member view the other takes), and the final hash check gives both the
            # same weights (a run much slower than usual, as on a fresh clone, can end so). Only a missed
            # deadline, an update left out of the view or a resync may explain it
            late = ("deadline_missed", "own_update_left_out", "resyncs")
            assert sum(s.get(k, 0) for s in final for k in late) >= 1, [{k: s.get(k) for k in late} for s in final]
        if rounds(alive[0]) != rounds(alive[1]):
            assert sum(s.get("resyncs", 0) for s in final) >= 1
        assert all(s["codec"] == "sign" and s["residual_norm"] is not None for s in final)
        # a peer that took a checkpoint starts its residuals afresh; one that did not holds one per fragment
        assert all(sorted(s["residual_norm"]) == ["0", "1"] for s in final if not s.get("resyncs", 0))
    finally:
        swarm.close()


@pytest.mark.timeout(240)
def test_a_peer_whose_weights_drift_resyncs_from_a_checkpoint_or_redoes_its_close(tmp_path):
    # fault injected from outside: n2 is paused (SIGSTOP) while the others close two rounds without it; resumed, it
    # either sees the others two rounds past its own and takes a checkpoint at once (fell_behind), or closes the
    # round it was in with all three updates, so its global weights are no longer the majority's: the others' next
    # updates name their base and n2 redoes that close without its own update (redone), or, where no redo gives
    # their weights, its hash leaves the majority and it takes a checkpoint (diverged). The checkpoint path alone:
    # test_rounds_sim's drift test, whose drift no redo undoes
    swarm = diloco_swarm(tmp_path, run="drift", rounds=10, h=20)
    try:
        nodes = swarm.start_chain(3)
        n2 = nodes[2]
        wait_for(lambda: d(n2).get("rounds", 0) >= 2, 150, "n2 to close two rounds")
        with n2.paused():
            at = d(nodes[0])["rounds"]
            wait_for(lambda: d(nodes[0])["rounds"] >= at + 2, 120, "the others to close two rounds without n2")
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes], 200,
                         "everyone to finish")
        # (or it closes that round with the coordinator's members, the others' view without its own update: its
        # weights stay the majority's and nothing is redone or pulled)
        mended = ("fell_behind", "diverged", "redone", "own_update_left_out")
        assert sum(final[2].get(k, 0) for k in mended) >= 1, {k: final[2].get(k) for k in mended}
        assert final[2].get("resyncs", 0) + final[2].get("redone", 0) + final[2].get("own_update_left_out", 0) >= 1
        assert final[0].get("resyncs", 0) == 0 and final[1].get("resyncs", 0) == 0
        assert len({s["final_hash"] for s in final}) == 1
    finally:
        swarm.close()


@pytest.mark.timeout(240)
async def test_fresh_keys_can_neither_outvote_nor_stall_nor_send_a_run_to_resync(tmp_path):
    # issue 14 item 6: three fresh keys outvoted the real peers on a round hash and sent them to resync from the
    # fresh keys; a join from any key added it to the set every round waits for; a "ready" from a fresh key counted
    import asyncio

    from hostile import HostilePeer

    from swarmd.protocols.diloco import JOIN, READY, ROUND_HASH
    from swarmd.transport.wire import WIRE

    swarm = diloco_swarm(tmp_path, run="sybil", rounds=0, h=20, min_peers=2)  # open-ended: runs until stopped
    keys = [HostilePeer(tmp_path / f"k{i}") for i in range(3)]
    try:
        nodes = await asyncio.to_thread(swarm.start_chain, 2, "n", None)
        await asyncio.to_thread(wait_for, lambda: d(nodes[0]).get("rounds", 0) >= 2, 120, "2 rounds")
        for k in keys:
            await k.start(nodes[0], "diloco/sybil", max_size=1024)
        fp = d(nodes[0])["fingerprint"]
        tag = [fp["layout"], fp["config"]]
        start = d(nodes[0])["rounds"]
        for burst in range(8):  # for the next rounds: a bogus hash from every key, joins, and "ready"
            r = d(nodes[0])["rounds"]
            for k in keys:
                for rr in range(r - 1, r + 3):
                    await k.send(WIRE.pack(ROUND_HASH, {"r": rr, "p": 0, "h": "f" * 32, "t": tag}))
                    await k.send(WIRE.pack(JOIN, {"r": rr, "p": 0, "join": True, "t": tag}))
                await k.send(WIRE.pack(READY, {"r": 0, "p": 0, "ready": "0" * 32, "t": tag}))
            await asyncio.to_thread(wait_for, lambda: d(nodes[0])["rounds"] > r, 60, "the next round")
        final = [d(n) for n in nodes]
        assert final[0]["rounds"] >= start + 8
        for s in final:
            assert s.get("resyncs", 0) == 0 and s.get("diverged", 0) == 0  # never outvoted
            assert s["state"] == "running"
            # a brand-new key is waited for only in every 4th round (a newcomer slot), so at most those stall
            assert s.get("deadline_missed", 0) <= (s["rounds"] - start) // 4 + 1
            assert all(h["participants"] == 2 for h in s["history"] if h["round"] >= start)
        ours, theirs = ({r: h for r, _, h in rounds(n)} for n in nodes)
        common = ours.keys() & theirs.keys()
        assert len(common) >= 6 and all(ours[r] == theirs[r] for r in common)  # one run, never forked
    finally:
        for k in keys:
            await k.close()
        await asyncio.to_thread(swarm.close)


@pytest.mark.timeout(240)
def test_a_peer_that_closed_the_last_round_differently_takes_the_majoritys_final_weights(tmp_path):
    # found by bench_hostile: a peer whose last round closed with other updates than the rest (its deadline passed
    # first, or it was away) ended on its own weights: no later round compared the hashes. Paused (SIGSTOP) through
    # the last round, the others close it without its update; resumed, it closes it with all four: the minority.
    # deadline_low 4 s: with 2 s, a CI run (2 workers on 2 cores) once had a node's round-1 update reach one peer
    # after its deadline and that peer resync a round before the pause; what this test checks is the last round
    swarm = diloco_swarm(tmp_path, run="last", rounds=3, h=20, min_peers=4, deadline_low=4.0)
    try:
        nodes = swarm.start_chain(4)
        late = nodes[3]
        wait_for(lambda: d(late).get("rounds", 0) >= 2, 150, "two rounds closed")
        with late.paused():
            # what the others did before the pause is not what this test checks: under load a round-1 update can
            # reach a peer after its deadline, and that peer then resyncs
            resynced_before = [d(n).get("resyncs", 0) for n in nodes[:3]]
            wait_for(lambda: all(d(n)["state"] == "done" for n in nodes[:3]), 120, "the others to finish")
        final = wait_for(lambda: d(late)["state"] == "done" and [d(n) for n in nodes], 120, "the late one to finish")
        assert len({s["final_hash"] for s in final}) == 1, [s["final_hash"] for s in final]
        # it takes the round's coordinator's members (the others', without its own update), or the others' final
        # weights from one of them, or redoes its last close without its own update
        assert final[3].get("own_update_left_out", 0) + final[3].get("resyncs", 0) + final[3].get("redone", 0) >= 1
        # and the late one's last close never moves the others off the weights they finished on
        assert [s.get("resyncs", 0) for s in final[:3]] == resynced_before
    finally:
        swarm.close()


@pytest.mark.timeout(240)
def test_a_peer_whose_cpu_draws_other_initial_weights_starts_with_the_others(tmp_path):
    """torch draws a seed's initial weights with other low bits under its scalar kernels (a CPU without AVX2) than
    under AVX2: such a node held other weights than the others from the start, so with min_peers = 3 no node ever
    started. It takes the initial weights most of its peers hold, once they are within rounding of its own."""
    swarm = diloco_swarm(tmp_path, run="cpus", rounds=2, h=10)
    try:
        nodes = swarm.start_chain(2, members_within=None,
                                  more=[{"name": "scalar", "env": {"ATEN_CPU_CAPABILITY": "default"}}])
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes], 200,
                         "3 nodes of two kinds of kernels to finish")
        assert len({s["final_hash"] for s in final}) == 1
        assert final[0]["history"][0]["participants"] == 3  # started together
        # which side takes which depends on whose readiness a node hears first (ties go to the smaller hash): the
        # scalar node takes the others' weights, or they take its own (both happen)
        takers = [(n, s) for n, s in zip(nodes, final) if s["initial_weights"] is not None]
        assert takers and all(s.get("initial_weights_taken") == 1 and s.get("initial_other_weights_peers", 0) >= 1
                              and 0 < s["initial_weights"]["apart"] < 1e-5
                              and s["initial_weights"]["source"] in {m.peer_id for m in nodes} - {n.peer_id}
                              for n, s in takers)
        scalar_took = final[2]["initial_weights"] is not None
        assert {n.peer_id for n, _ in takers} == ({nodes[2].peer_id} if scalar_took else
                                                   {nodes[0].peer_id, nodes[1].peer_id})
    finally:
        swarm.close()


@pytest.mark.timeout(180)
def test_initial_weights_beyond_rounding_are_not_taken(tmp_path):
    """A model() that trains (here 10 pretraining steps) carries another CPU's rounding far beyond rounding (0.004 of
    a parameter's scale): no node takes such weights at the start, so no peer can hand the founders weights of its
    choosing. With min_peers = 3 the run then does not start (its nodes say why); with fewer, the node of the
    other kernels joins the others' run by a checkpoint, as any late joiner."""
    config = CONFIG.format(run="far", rounds=3, h=10, fragments=1, overlap=0, alpha=0.0, min_peers=3,
                           deadline_low=2.0, codec="e3m0") + "pretrain_steps = 10\n"
    swarm = Swarm(tmp_path / "nodes", config=loop_config(tmp_path / "diloco.toml", config))
    try:
        nodes = swarm.start_chain(2, members_within=None,
                                  more=[{"name": "scalar", "env": {"ATEN_CPU_CAPABILITY": "default"}}])
        # the scalar node asks both holders of the majority's weights, and takes neither's
        scalar = wait_for(lambda: (s := d(nodes[2])).get("initial_weights_refused", 0) >= 2 and s, 120,
                          "the scalar node to refuse both others' initial weights")
        assert scalar["initial_other_weights_peers"] == 2 and scalar["initial_weights"] is None
        assert all(d(n)["state"] == "waiting for peers" and d(n)["initial_weights"] is None for n in nodes)
    finally:
        swarm.close()
