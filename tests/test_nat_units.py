"""NAT pieces that need no lab: the private-address guess, AutoNAT replies, and the doctor's report."""

import pytest

from swarmd.node import datadir
from swarmd.node.doctor import diagnose
from swarmd.node.nat import guess_private, relays_in
from swarmd.transport.identity import Identity
from swarmd.transport.errors import MalformedMessage
from swarmd.transport.nat import ip_of, parse_addrs, parse_reply

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def test_guess_private():
    assert guess_private(["/ip4/10.1.0.10/tcp/4001"], [])
    assert guess_private(["/ip4/192.168.1.5/tcp/4001", "/ip4/100.64.3.2/tcp/4001"], [])
    assert not guess_private(["/ip4/198.51.100.10/tcp/4001"], [])
    assert not guess_private(["/ip4/127.0.0.1/tcp/0"], [])  # a local swarm: nothing to traverse
    assert not guess_private(["/ip4/10.1.0.10/tcp/4001"], ["/ip4/203.0.113.7/tcp/4001"])  # a forwarded port


def test_relays_found_in_member_records_are_remembered(tmp_path):
    me, relay, other = (Identity.generate().peer_id for _ in range(3))
    addrs = [
        f"/ip4/198.51.100.10/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{other}",  # a member reached through a relay
        f"/ip4/198.51.100.10/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{me}",  # the same relay, again
        f"/ip4/10.0.0.5/tcp/4001/p2p/{other}/p2p-circuit/p2p/{me}",  # a relay at a private address: useless
        f"/ip4/127.0.0.1/tcp/4001/p2p/{other}/p2p-circuit/p2p/{me}",
        f"/ip4/198.51.100.9/tcp/4001/p2p/{me}/p2p-circuit/p2p/{other}",  # ourselves
        f"/ip4/198.51.100.10/tcp/4001/p2p/{other}",  # a direct address, no relay
        "/ip4/198.51.100.10/tcp/4001/p2p/not-a-peer-id/p2p-circuit",
    ]
    assert relays_in(addrs, me) == [f"/ip4/198.51.100.10/tcp/4001/p2p/{relay}"]
    assert datadir.read_relays(tmp_path) == []
    datadir.write_relays(tmp_path, [f"/ip4/198.51.100.10/tcp/4001/p2p/{relay}"] * 12)
    assert len(datadir.read_relays(tmp_path)) == datadir.MAX_RELAYS
    (tmp_path / datadir.RELAYS_FILE).write_text('["junk", 5, "/ip4/1.2.3.4/tcp/1/p2p/%s"]' % relay)
    assert datadir.read_relays(tmp_path) == [f"/ip4/1.2.3.4/tcp/1/p2p/{relay}"]
    (tmp_path / datadir.RELAYS_FILE).write_text("{not json")
    assert datadir.read_relays(tmp_path) == []


def test_autonat_and_punch_messages_are_checked():
    assert ip_of("/ip4/1.2.3.4/tcp/4001") == ("1.2.3.4", 4001)
    assert ip_of("/ip4/1.2.3.4/tcp/4001/p2p/Qm/p2p-circuit") is None and ip_of("/dns/x/tcp/1") is None
    assert parse_reply({"observed": "/ip4/1.2.3.4/tcp/55", "ok": [4001]}) == ("/ip4/1.2.3.4/tcp/55", [4001])
    assert parse_reply({"error": "rate limited"}) == "rate limited"
    for bad in ({"observed": "/ip4/1.2.3.4/udp/5", "ok": []}, {"observed": "x", "ok": []}, {"ok": [1] * 9}, [1]):
        with pytest.raises(MalformedMessage):
            parse_reply(bad)
    assert parse_addrs({"addrs": ["/ip4/1.2.3.4/tcp/4001"]}) == [("1.2.3.4", 4001)]
    # a peer cannot aim our punch into our own network
    inside = ["/ip4/10.0.0.1/tcp/22", "/ip4/127.0.0.1/tcp/8470", "/ip4/192.168.1.1/tcp/80", "/ip4/0.0.0.0/tcp/1",
              "/ip4/224.0.0.1/tcp/1", "/ip6/::1/tcp/1", "/ip6/fe80::1/tcp/1"]
    assert parse_addrs({"addrs": inside + ["/ip4/198.51.100.2/tcp/4001"]}) == [("198.51.100.2", 4001)]
    for bad in ({"addrs": ["/ip4/1.2.3.4/tcp/1"] * 9}, {"addrs": ["/ip4/x/tcp/1"]}, {"addrs": [5]}, {},
                {"addrs": ["/ip4/1.2.3.4/tcp/0"]}):
        with pytest.raises(MalformedMessage):
            parse_addrs(bad)


def status(**nat):
    return {
        "reachability": "private", "addresses": ["/ip4/10.1.0.10/tcp/4001/p2p/A"], "listen": ["/ip4/0.0.0.0/tcp/4001"],
        "bootstrap": [{"addr": "/ip4/198.51.100.10/tcp/4001/p2p/R", "state": "connected"}],
        "peers": [
            {"peer_id": "R", "member": True, "connected": True, "path": "direct", "relay": None, "path_since": 1.0},
            {"peer_id": "B", "member": True, "connected": True, "path": "relayed", "relay": "R", "path_since": 2.0},
            {"peer_id": "C", "member": True, "connected": False, "path": "none", "relay": None, "path_since": None},
        ],
        "services": {"nat": {"detected": "private", "relays": ["/ip4/198.51.100.10/tcp/4001/p2p/R"],
                             "relay_service": False, "punch_attempts": 2, "punch_successes": 0,
                             "punches": [{"ok": False, "error": "timed out"}], **nat}},
    }


def test_doctor_explains_what_it_sees():
    report = diagnose(status(observed_addrs=["/ip4/198.51.100.1/tcp/4001"]))
    assert report["reachability_source"] == "AutoNAT" and (report["direct"], report["relayed"]) == (1, 1)
    assert "listen port is kept" in report["nat"] and "198.51.100.1" in report["nat"]
    hints = " ".join(report["hints"])
    assert "through a relay" in hints and "hole punching failed" in hints and "not connected" in hints
    assert "no connection to any relay" not in hints
    sym = diagnose(status(observed_addrs=["/ip4/198.51.100.1/tcp/31337"]))
    assert "symmetric" in sym["nat"]


def test_doctor_names_why_hole_punching_failed_and_what_to_do():
    def hints(**nat):
        return " ".join(diagnose(status(observed_addrs=["/ip4/198.51.100.1/tcp/4001"], **nat))["hints"])

    ours = hints(mapping="changed", punches=[{"ok": False, "cause": "our-mapping", "error": "no simultaneous open",
                                              "peer": "peerBBBB"}])
    assert "this node's NAT gives each destination its own port" in ours and "with peerBBBB" in ours
    assert "a burst of many at once reaches peers whose NAT keeps the port" in ours  # not hopeless any more
    assert "--announce /ip4/<public ip>/tcp/<port>" in ours and "network.port_mapping = true" in ours
    theirs = hints(mapping="kept", punches=[{"ok": False, "cause": "their-mapping", "error": "x", "peer": "B"}])
    assert "the peer's NAT changes the port" in theirs and "this node's NAT" not in theirs
    closed = hints(mapping="kept", punches=[{"ok": False, "cause": "closed", "error": "x", "peer": "B"}])
    assert "closed while it was handed to the p2p daemon" in closed
    timeout = hints(mapping="kept", punches=[{"ok": False, "cause": "timeout", "error": "x", "peer": "B"}])
    assert "filters inbound connections" in timeout
    report = diagnose(status(observed_addrs=[], mapping="kept", punches=[{"ok": False, "cause": "closed",
                                                                         "error": "reset", "peer": "B"}]))
    assert report["punch"].endswith("last: failed (closed: reset)")
    # a symmetric NAT of our own is named even before a punch failed, once a peer is only relayed
    assert "each destination its own port" in hints(mapping="varies", punches=[], punch_attempts=0)
    assert "hole punching" not in hints(mapping="kept", punches=[{"ok": True, "peer": "B"}], punch_attempts=1,
                                        punch_successes=1)
    lonely = diagnose(status(observed_addrs=[], relays=[]))
    assert "unknown" in lonely["nat"] and any("has no relay" in h for h in lonely["hints"])


async def test_a_peer_with_a_relayed_and_a_direct_connection_is_listed_once_on_its_best_path():
    """The daemon lists connections, not peers: during a hole punch's hand-over (or when a stream is opened over
    the relay meanwhile) a peer has two. It was listed twice, and whichever came last won: a punch that had worked
    was called failed ('the new connection is not the punched one') and the pair stayed on the relay."""
    from types import SimpleNamespace

    from swarmd.transport.base import PathType
    from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport

    me, other, relay = Identity.generate(), Identity.generate().peer_id, Identity.generate().peer_id
    transport = P2PDaemonTransport(me, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    spliced = "/ip4/127.0.0.1/tcp/40123"
    transport._adopted[spliced] = "/ip4/198.51.100.7/tcp/4001"
    circuit = f"/ip4/192.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit"

    def info(peer_id: str, addr: str):
        return SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer_id), addrs=[addr])

    for order in ([circuit, spliced], [spliced, circuit]):
        listed = [info(other, a) for a in order] + [info(relay, "/ip4/192.0.0.1/tcp/4001")]
        transport._p2p = SimpleNamespace(list_peers=lambda listed=listed: _done(listed))
        peers = {p.peer_id: p for p in await transport.peers()}
        assert len(peers) == 2 and len(await transport.peers()) == 2
        assert peers[other].path is PathType.PUNCHED and peers[other].addrs == ("/ip4/198.51.100.7/tcp/4001",)
        assert peers[relay].path is PathType.DIRECT
    listed = [info(other, circuit), info(other, "/ip4/10.0.0.2/tcp/4001")]
    transport._p2p = SimpleNamespace(list_peers=lambda: _done(listed))
    (only,) = await transport.peers()
    assert only.path is PathType.DIRECT  # direct beats relayed too


async def _done(value):
    return value


def test_doctor_says_what_a_training_run_receives_through_members_and_what_this_node_contributes():
    s = status(observed_addrs=["/ip4/198.51.100.1/tcp/31337"])
    s["services"]["diloco"] = {"state": "running", "reach": {
        "through_members": {"12D3KooW" + "A" * 44: 9},
        "rounds_with_our_update": 9, "rounds_closed": 12}}
    report = diagnose(s)
    assert report["training"] == ["diloco: this node's update was in 9 of 12 rounds; 1 peer(s) without a direct "
                                  "path, their updates pulled through members (AAAAAAAA)"]
    assert not any("left out" in h for h in report["hints"])
    s["services"]["diloco"]["reach"]["rounds_with_our_update"] = 6
    assert any("left out of 6 of 12 rounds" in h for h in diagnose(s)["hints"])
    s["services"]["diloco"]["reach"]["rounds_closed"] = 0  # nothing closed yet: nothing to say
    assert diagnose(s)["training"] == []


def test_doctor_says_whose_batches_a_gossiping_loop_took_without_a_direct_path():
    s = status(observed_addrs=["/ip4/198.51.100.1/tcp/31337"])
    s["services"]["spsa"] = {"state": "running", "reach": {
        "via": "gossiped", "through_members": {"12D3KooW" + "C" * 44: 6}, "rounds_with_our_update": 6,
        "rounds_closed": 6}}
    assert diagnose(s)["training"] == ["spsa: this node's update was in 6 of 6 rounds; 1 peer(s) without a direct "
                                       "path, their updates gossiped through members (CCCCCCCC)"]


def test_doctor_says_whose_chunks_members_reduced_in_scatter_and_that_this_node_reduced_none():
    s = status(observed_addrs=["/ip4/198.51.100.1/tcp/31337"])
    s["services"]["diloco"] = {"state": "running", "reach": {
        "through_members": {}, "reduced_by_members": {"12D3KooW" + "B" * 44: 12}, "rounds_not_reducing": 12,
        "rounds_with_our_update": 12, "rounds_closed": 12}}
    assert diagnose(s)["training"] == ["diloco: this node's update was in 12 of 12 rounds; 1 peer(s) without a "
                                       "direct path, their chunks reduced by members that reach both (BBBBBBBB); "
                                       "this node reduced no part in 12 round(s), lacking a direct path to a member"]


def test_a_burst_is_made_only_where_the_mappings_give_roles_and_the_budgets_allow():
    from swarmd.node.bursts import Bursts

    b = Bursts()
    assert b.note_mapping("p", {"mapping": "varies", "burst": True}, [("1.2.3.4", 4001)]) == "varies"
    assert b.note_mapping("q", {}, [("1.2.3.5", 4001), ("1.2.3.5", 4001)]) == "kept"  # one port for all: kept
    assert b.note_mapping("r", {}, [("1.2.3.6", 4001), ("1.2.3.6", 5555)]) == "changed"
    assert b.role("kept", "p") == "keep" and b.role("varies", "q") == "scatter"
    assert b.role("kept", "q") is None and b.role("varies", "p") is None and b.role("kept", "unheard") is None
    assert not b.may("varies", "r", 0.0)  # both change the port: nothing to aim a burst at
    assert b.may("kept", "p", 0.0)
    b.take("p", 0.0)
    with b.flowing():
        assert not b.free("q", 100.0)  # one burst in flight at once, for all peers
    assert not b.free("q", b.GAP - 1) and b.free("q", b.GAP)  # one every GAP seconds in all
    assert not b.free("p", b.EVERY - 1) and b.free("p", b.EVERY)  # one per peer every EVERY seconds
    for i in range(1000):  # a peer id per punch message: what is remembered stays bounded
        b.note_mapping(f"x{i}", {"mapping": "kept"}, [])
        b.take(f"x{i}", 10_000.0 + i * b.GAP)
        b.free("y", 10_000.0 + i * b.GAP)
    assert len(b.mappings) <= 256 and len(b.started) <= 257
