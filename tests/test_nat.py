"""NAT traversal in the lab: one public bootstrap/relay node, two nodes each behind its own NAT (real processes,
real sockets, network namespaces this test creates and removes)."""

import contextlib
import functools
import os
import subprocess
import sys
import time

import pytest

from natlab import NatLab, unavailable
from swarmproc import Swarm, wait_for

pytestmark = [pytest.mark.nat, pytest.mark.swarm]

LAB_NODE = """
[network]
listen = ["/ip4/0.0.0.0/tcp/4001"]
probe_interval = 30.0
punch_delay = 5.0  # the relayed calls are checked first, then the upgrade
[discovery]
poll_interval = 1.0
backoff_initial = 0.5
refresh_interval = 5.0
ping_interval = 1.0
[state]
sync_interval = 1.0
admission_bits = 12
[http]
listen = "127.0.0.1:8470"
"""


@pytest.fixture(scope="module", autouse=True)
def _needs_lab():
    reason = unavailable()
    if reason:
        pytest.skip(reason)


def start_in(lab: NatLab, swarm: Swarm, where: str, bootstrap=()):
    return swarm.start(where, bootstrap=list(bootstrap), prefix=lab.cmd(where),
                       via=functools.partial(lab.call, where))


def peer(node, peer_id: str) -> dict | None:
    return next((p for p in node.status()["peers"] if p["peer_id"] == peer_id), None)


def relayed_call_works(src, dst, relay_id: str) -> bool:
    """src is connected to dst through the relay, and a ping (a request/response stream) got through."""
    p = peer(src, dst.peer_id)
    return bool(p and p["connected"] and p["path"] == "relayed" and p["relay"] == relay_id
                and p["latency_ms"] is not None)


def run_lab(tmp_path, mode: str) -> dict:
    config = tmp_path / "lab.toml"
    config.write_text(LAB_NODE)
    with NatLab(mode_a=mode, mode_b=mode) as lab:
        swarm = Swarm(tmp_path / "nodes", config=config)
        try:
            pub = start_in(lab, swarm, "pub")
            bootstrap = f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"
            a = start_in(lab, swarm, "a", [bootstrap])
            b = start_in(lab, swarm, "b", [bootstrap])
            ready = time.monotonic()
            wait_for(lambda: relayed_call_works(a, b, pub.peer_id) and relayed_call_works(b, a, pub.peer_id), 10,
                     "a and b to call each other through the relay")
            first_call = time.monotonic() - ready
            wait_for(lambda: all(n.status()["reachability"] == r for n, r in ((pub, "public"), (a, "private"),
                                                                              (b, "private"))), 20,
                     "AutoNAT: the public node public, the NATed ones private")
            nat_a = a.status()["services"]["nat"]
            assert nat_a["observed_addrs"] and all(f"/ip4/{lab.wan['a']}/" in o for o in nat_a["observed_addrs"])
            assert nat_a["relay_client"] and not nat_a["relay_service"]
            assert pub.status()["services"]["nat"]["relay_service"]
            # b's record, as a sees it, carries b's relayed address
            assert any("/p2p-circuit" in addr for addr in peer(a, b.peer_id)["addrs"])
            # the peer with the smaller id upgrades the relayed connection by hole punching: through
            # endpoint-independent NATs (strict conntrack) the pair ends up on a direct, hole-punched connection;
            # through symmetric NATs the attempt fails and the pair stays on the relay
            first, second = sorted((a, b), key=lambda n: n.peer_id)
            wait_for(lambda: first.status()["services"]["nat"]["punches"], 20, "a hole punch attempt")
            if mode == "eim":
                wait_for(lambda: all((p := peer(x, y.peer_id)) and p["path"] == "hole-punched"
                                     for x, y in ((a, b), (b, a))), 20, "a hole-punched connection on both sides")
                conn = peer(first, second.peer_id)
                assert conn["relay"] is None and conn["conn_addrs"] == [f"/ip4/{lab.wan[n]}/tcp/4001" for n in "ab"
                                                                      if n != ("a" if first is a else "b")]
                pinged = conn["last_seen"]
                wait_for(lambda: peer(first, second.peer_id)["last_seen"] > pinged, 10, "a call over the punched path")
                assert second.status()["services"]["nat"]["punch_served_ok"] >= 1
                assert 'swarmd_hole_punch_total{result="success"} 1.0' in first.get("/metrics")
                # bulk bytes: a's TCP port is behind its NAT, so b pulls a's blob over the punched connection
                blob = os.urandom(3 << 20)
                put = a.post("/bulk?codec=raw", blob)
                wait_for(lambda: b.status()["services"]["bulk"]["announcements"] >= 1, 10, "the announcement")
                pulled = b.post(f"/bulk/{put['hash']}/pull", timeout=60)
                assert pulled["size"] == len(blob) and pulled["source"] == a.peer_id
                assert b.status()["services"]["bulk"]["pulled_over_stream"] == 1
            else:
                wait_for(lambda: first.status()["services"]["nat"]["punch_attempts"] >= 1, 10, "an attempt")
                assert first.status()["services"]["nat"]["punches"][0]["ok"] is False
                wait_for(lambda: relayed_call_works(first, second, pub.peer_id), 20, "the pair still on the relay")
            doctor = subprocess.run(lab.cmd("a") + [sys.executable, "-m", "swarmd", "doctor", "--data-dir",
                                                    str(a.data_dir)], capture_output=True, text=True, timeout=30)
            assert doctor.returncode == 0, doctor.stderr
            assert "reachability  private  (AutoNAT)" in doctor.stdout and lab.wan["a"] in doctor.stdout
            if mode == "eim":
                assert "the listen port is kept" in doctor.stdout and "hole-punched" in doctor.stdout
            return {"first_call_s": first_call, "a": a, "b": b, "pub": pub}
        finally:
            swarm.close()


@pytest.mark.timeout(120)
def test_two_nodes_behind_nats_reach_each_other_through_the_public_relay(tmp_path):
    run_lab(tmp_path, "eim")


@pytest.mark.timeout(120)
def test_symmetric_nats_keep_the_swarm_working_over_the_relay(tmp_path):
    run_lab(tmp_path, "sym")


@pytest.mark.timeout(150)
def test_a_relay_found_through_the_dht_is_reserved_on_after_a_restart(tmp_path):
    """a bootstraps (and relays) through pub; b through a second public node, pub2. a learns pub2 is a relay from
    b's DHT record, remembers it, and after a restart also holds a slot there (reachable if pub goes away)."""
    config = tmp_path / "lab.toml"
    config.write_text(LAB_NODE)
    with NatLab(mode_a="eim", mode_b="eim") as lab:
        swarm = Swarm(tmp_path / "nodes", config=config)
        try:
            pub = start_in(lab, swarm, "pub")
            relay1 = f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"
            pub2 = swarm.start("pub2", "--listen", "/ip4/0.0.0.0/tcp/4002", "--http", "127.0.0.1:8471",
                               bootstrap=[relay1], prefix=lab.cmd("pub"), via=functools.partial(lab.call, "pub"))
            relay2 = f"/ip4/{lab.pub_ip}/tcp/4002/p2p/{pub2.peer_id}"
            start_in(lab, swarm, "b", [relay2])  # its relay is pub2: its record says so
            a = start_in(lab, swarm, "a", [relay1])
            wait_for(lambda: relay2 in a.status()["services"]["nat"]["relays_found"], 30,
                     "a to find pub2 as a relay in b's record")
            assert a.status()["services"]["nat"]["relays"] == [relay1]
            assert a.stop() == 0
            a = start_in(lab, swarm, "a", [relay1])
            wait_for(lambda: any(x.startswith(relay2 + "/p2p-circuit") for x in a.status()["addresses"]), 30,
                     "a to hold a slot on pub2 after the restart")
            assert a.status()["services"]["nat"]["relays"] == [relay1, relay2]
        finally:
            swarm.close()


@pytest.mark.timeout(150)
def test_a_punched_connection_that_closes_in_the_hand_over_is_punched_again_at_once(tmp_path):
    """The punched connection closes mid-handshake (the dialer's router resets it once, at the daemons' first
    large handshake message): the attempt is made again at once, from the same ports, and the pair is direct
    seconds later, not after a backoff."""
    config = tmp_path / "lab.toml"
    config.write_text(LAB_NODE)
    with NatLab(mode_a="eim", mode_b="eim") as lab:
        swarm = Swarm(tmp_path / "nodes", config=config)
        try:
            pub = start_in(lab, swarm, "pub")
            bootstrap = f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"
            a = start_in(lab, swarm, "a", [bootstrap])
            b = start_in(lab, swarm, "b", [bootstrap])
            first, second = sorted((a, b), key=lambda n: n.peer_id)  # the dialer of the hand-over
            lab.reset_first_big_packet("a" if first is a else "b")  # before the first attempt (punch_delay 5 s)
            punches = wait_for(lambda: first.status()["services"]["nat"]["punches"], 40, "a hole punch")
            assert punches[0]["ok"] and punches[0]["tries"] == 2, punches
            assert punches[0]["seconds"] < 8
            wait_for(lambda: all((p := peer(x, y.peer_id)) and p["path"] == "hole-punched"
                                 for x, y in ((a, b), (b, a))), 10, "a hole-punched connection on both sides")
            assert "attempt 1 failed (closed" in first.log()
        finally:
            swarm.close()


# the embedded defaults, as a new user runs them (`swarmd start --listen /ip4/0.0.0.0/tcp/4001 --bootstrap ...`)
DEFAULTS_NODE = """
[network]
listen = ["/ip4/0.0.0.0/tcp/4001"]
"""


@pytest.mark.timeout(240)
def test_a_symmetric_nat_on_one_side_is_punched_by_a_burst_of_flows_with_the_defaults(tmp_path):
    """a behind a symmetric NAT (a random port per destination), b behind a port-keeping NAT that lets in only
    replies: the ordinary punch fails on the mapping, then one burst of many flows (transport.birthday) meets one of
    a's ports and the pair is hole-punched within seconds, on the embedded defaults. (By the birthday estimate
    about 1 lab in 50 stays relayed: the burst is made once per peer per BURST_EVERY.)"""
    config = tmp_path / "defaults.toml"
    config.write_text(DEFAULTS_NODE)
    with NatLab(mode_a="sym") as lab:
        swarm = Swarm(tmp_path / "nodes", config=config)
        try:
            pub = start_in(lab, swarm, "pub")
            bootstrap = f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"
            a = start_in(lab, swarm, "a", [bootstrap])
            b = start_in(lab, swarm, "b", [bootstrap])
            wait_for(lambda: all((p := peer(x, y.peer_id)) and p["connected"] for x, y in ((a, b), (b, a))), 60,
                     "a and b connected (through the relay)")
            seen = time.monotonic()
            wait_for(lambda: all((p := peer(x, y.peer_id)) and p["path"] == "hole-punched"
                                 for x, y in ((a, b), (b, a))), 30, "a hole-punched connection on both sides")
            assert time.monotonic() - seen < 20
            first, second = sorted((a, b), key=lambda n: n.peer_id)
            punch = first.status()["services"]["nat"]["punches"][0]
            assert punch["ok"] and punch["tries"] == 2 and punch["burst"], punch  # the ordinary attempt, then a burst
            for node in (a, b):
                nat = node.status()["services"]["nat"]
                assert nat["punch_bursts"] == 1 and nat["punch_burst_successes"] == 1, nat
            assert a.status()["services"]["nat"]["mapping"] in ("changed", "varies")
            assert b.status()["services"]["nat"]["mapping"] == "kept"
            conn = peer(b, a.peer_id)
            assert conn["relay"] is None and conn["conn_addrs"][0].startswith(f"/ip4/{lab.wan['a']}/tcp/")
        finally:
            swarm.close()


LAB_DILOCO = """
[loops.diloco]
run = "lab"
rounds = 8
inner_steps = 20
min_peers = 4
inner_lr = 1e-3
deadline_low = 5.0  # a loaded CI machine: the rounds close as soon as every update is in, so this costs nothing
codec = "e3m0"
[loops.diloco.task_options]
batch = 8
"""


def _diloco(n) -> dict:
    return n.status()["services"]["diloco"]


@contextlib.contextmanager
def _run_across_two_symmetric_nats(tmp_path, loop: str, loop_toml: str, rounds: int, timeout: float):
    """A run of ``loop`` (its config table: ``loop_toml``) on four peers: pub and pub2 public (both in the lab's
    public namespace), a and b each behind a symmetric NAT, all four bootstrapped from pub. Once the run ended on
    every node, checks what every loop must give there (each node's own contribution in all ``rounds`` rounds it
    closed; a and b never direct; no bulk byte over the relay) and yields the nodes, their final
    ``services.<loop>`` and b's ``swarmd doctor`` output."""
    config = tmp_path / "lab.toml"
    config.write_text(LAB_NODE + loop_toml)

    def service(n) -> dict:
        return n.status()["services"][loop]

    with NatLab(mode_a="sym", mode_b="sym") as lab:
        swarm = Swarm(tmp_path / "nodes", config=config)
        try:
            pub = start_in(lab, swarm, "pub")
            bootstrap = [f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"]
            pub2 = swarm.start("pub2", "--listen", "/ip4/0.0.0.0/tcp/4002", "--http", "127.0.0.1:8471",
                               bootstrap=bootstrap, prefix=lab.cmd("pub"), via=functools.partial(lab.call, "pub"))
            nodes = [pub, pub2, start_in(lab, swarm, "a", bootstrap), start_in(lab, swarm, "b", bootstrap)]
            final = wait_for(lambda: all(service(n)["state"] == "done" for n in nodes) and [service(n) for n in nodes],
                             timeout, "the run to end on every node")
            for s in final:
                assert s["reach"]["rounds_with_our_update"] == s["reach"]["rounds_closed"] == rounds, s["reach"]
            a, b = nodes[2:]
            for n, other in ((a, b), (b, a)):
                assert peer(n, other.peer_id) is None or peer(n, other.peer_id)["path"] != "direct"
            for n in nodes:
                assert n.status()["services"]["bulk"].get("refused_relayed", 0) == 0
            doctor = subprocess.run(lab.cmd("b") + [sys.executable, "-m", "swarmd", "doctor", "--data-dir",
                                                    str(b.data_dir)], capture_output=True, text=True, timeout=30)
            assert doctor.returncode == 0, doctor.stderr
            yield nodes, final, doctor.stdout
        finally:
            swarm.close()


@contextlib.contextmanager
def _diloco_across_two_symmetric_nats(tmp_path, diloco_toml: str, timeout: float):
    """The DiLoCo run above, with what both exchanges must give: one final hash; 8 rounds, each with all four
    updates; no resync."""
    with _run_across_two_symmetric_nats(tmp_path, "diloco", diloco_toml, 8, timeout) as (nodes, final, doctor):
        assert len({s["final_hash"] for s in final}) == 1
        for s in final:
            assert [h["participants"] for h in s["history"]] == [4] * 8, s["history"]
            assert not s.get("resyncs")
        yield nodes, final, doctor


@pytest.mark.timeout(240)
def test_a_peer_behind_a_symmetric_nat_counts_in_every_round_through_the_public_members(tmp_path):
    """Four DiLoCo peers: two public (pub, pub2), a and b each behind a symmetric NAT, so a and b have no direct path
    to each other (nothing to aim a punch or a burst at; the relay carries control traffic only). Each pulls
    the other's update from the public members, which pulled it themselves: every round combines all four, b's
    update included, and no bulk byte crosses the relay. Before, a and b could not start the run with the others
    (only directly connected peers counted at the start) and their rounds closed without each other's update."""
    with _diloco_across_two_symmetric_nats(tmp_path, LAB_DILOCO, 200) as (nodes, final, doctor):
        a, b = nodes[2:]
        for n, other in ((a, b), (b, a)):
            assert _diloco(n)["reach"]["through_members"].get(other.peer_id, 0) >= 8
            assert _diloco(n)["via_members"] >= 8
        for s in final[:2]:  # the public members pull every update from its author
            assert s["reach"]["through_members"] == {}
        assert ("training      diloco: this node's update was in 8 of 8 rounds; 1 peer(s) without a direct "
                f"path, their updates pulled through members ({a.peer_id[-8:]})") in doctor


@pytest.mark.timeout(300)
def test_a_peer_behind_a_symmetric_nat_counts_in_every_scatter_round_through_the_public_members(tmp_path):
    """The same four peers as above, the exchange forced to reduce-scatter (what ``exchange = "auto"`` picks from 4
    peers and 1 MiB updates): there each part's reducer takes a chunk of every member's update, and a and b have no
    direct path to each other. Every peer announces the members it reaches only through a relay, and no part is
    reduced or audited across such a path: pub and pub2 reduce every part, every part of every round combines all
    four chunks, and no bulk byte crosses the relay. Before, a reduced parts without b's chunk and b without a's
    (each chunk missing after the round's pulls waited it out)."""
    scatter = LAB_DILOCO.replace('codec = "e3m0"\n', 'codec = "e3m0"\nexchange = "scatter"\n')
    with _diloco_across_two_symmetric_nats(tmp_path, scatter, 260) as (nodes, final, doctor):
        a, b = nodes[2:]
        for s in final:
            assert s["exchange"]["mode"] == "scatter" and s["exchange"]["parts"] > 1, s["exchange"]
            assert s.get("chunks_missing", 0) == 0, s  # every part we reduced or took combines all four chunks
        for other, s in ((b, final[2]), (a, final[3])):
            assert s.get("parts_reduced", 0) == 0  # no part of theirs lacks the other's chunk
            assert s["reach"]["reduced_by_members"].get(other.peer_id, 0) >= 8
            assert s["reach"]["rounds_not_reducing"] >= 8
        # the public members reduce every part (which of them, round by round, follows the paths each round's
        # announcements name: one may reach b only through the relay for a while after it started)
        assert sum(s.get("parts_reduced", 0) for s in final[:2]) > 0, [s["reach"] for s in final[:2]]
        assert ("training      diloco: this node's update was in 8 of 8 rounds; 1 peer(s) without a direct "
                f"path, their chunks reduced by members that reach both ({a.peer_id[-8:]}); this node reduced "
                "no part in 8 round(s), lacking a direct path to a member") in doctor


def _gossiped_through_members(nodes, final, doctor: str, loop: str, rounds: int, least: int) -> None:
    """a's ``reach.through_members`` holds b in at least ``least`` rounds, and b's a. Besides them, only pub2 may be
    in a tally (a NATed peer may reach it through pub's relay for a while after it started, as its record may name
    only its relayed address then; the DiLoCo scatter test sees the same); pub, whom everyone dials, tallies none.
    b's ``swarmd doctor`` says so on its training line."""
    pub, pub2, a, b = nodes
    for s, other in ((final[2], b), (final[3], a)):
        through = s["reach"]["through_members"]
        assert through.get(other.peer_id, 0) >= least and set(through) <= {other.peer_id, pub2.peer_id}, through
    assert final[0]["reach"]["through_members"] == {}, final[0]["reach"]
    assert set(final[1]["reach"]["through_members"]) <= {a.peer_id, b.peer_id}, final[1]["reach"]
    through = sorted(final[3]["reach"]["through_members"])
    assert (f"training      {loop}: this node's update was in {rounds} of {rounds} rounds; {len(through)} peer(s) "
            f"without a direct path, their updates gossiped through members ({', '.join(p[-8:] for p in through)})"
            ) in doctor, doctor


LAB_SPSA = """
[loops.spsa]
run = "lab"
steps = 120
window = 20
min_peers = 4
deadline = 30.0  # a loaded CI machine: a window closes as soon as every batch is in, so this costs nothing
hash_every = 2
eval_every = 3
[loops.spsa.task_options]
domain = "target"
pretrain_steps = 30
batch = 8
"""


@pytest.mark.timeout(240)
def test_a_peer_behind_a_symmetric_nat_counts_in_every_spsa_window_through_the_public_members(tmp_path):
    """The same four peers running SPSA: a and b have no direct path to each other, and their batches (signed
    pubsub messages of a few bytes a step) are gossiped through the public members. All four found the run together
    and every one of its 6 windows takes all four batches, the same on every node: one final hash, no replay.
    Before, a and b could not found the run with the others (only directly connected peers counted at the start):
    they joined late by replaying the others' log, and the first windows closed without them. And the peer ready
    last (b here), whose links formed after the others' announcements and which they counted before it heard them
    all, waited out the first window and joined late as well: a founder that hears a founder's "ready" after it
    started says its own again."""
    with _run_across_two_symmetric_nats(tmp_path, "spsa", LAB_SPSA, 6, 200) as (nodes, final, doctor):
        assert len({s["final_hash"] for s in final}) == 1, [s["final_hash"] for s in final]
        for s in final:
            assert s.get("replayed_windows", 0) == 0 and s.get("peers_missed", 0) == 0, s
        _gossiped_through_members(nodes, final, doctor, "spsa", 6, 6)


LAB_SAPO = """
[loops.sapo]
run = "lab"
rounds = 6
min_peers = 4
deadline = 20.0  # a loaded CI machine: a round closes as soon as every peer's items are in, so this costs nothing
[loops.sapo.task_options]
d = 32
layers = 1
heads = 2
"""


@pytest.mark.timeout(240)
def test_a_peer_behind_a_symmetric_nat_counts_in_every_sapo_round_through_the_public_members(tmp_path):
    """The same four peers running SAPO: a and b have no direct path to each other, and their completions (signed
    pubsub messages) are gossiped through the public members. All four start together at round 0, each scores the
    items of the three others, and a's rounds take b's items (a round may close before a slower peer's items
    came). Before, a and b waited at the start for a fourth directly connected peer that never came."""
    with _run_across_two_symmetric_nats(tmp_path, "sapo", LAB_SAPO, 6, 200) as (nodes, final, doctor):
        for n, s in zip(nodes, final):
            assert s["round"] == 6 and s["joined_at"] == 0, s
            others = {o.peer_id for o in nodes} - {n.peer_id}
            assert {p for p, src in s["sources"].items() if src["items"] > 0} == others, s["sources"]
        _gossiped_through_members(nodes, final, doctor, "sapo", 6, 5)  # a round may close before its items came
