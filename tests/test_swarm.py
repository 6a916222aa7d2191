"""Multi-node tests: real `swarmd start` processes on loopback, observed through their HTTP endpoints."""

import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmproc import http_get, run_cli, wait_for

pytestmark = pytest.mark.swarm


def _all_see_all(nodes):
    ids = {n.peer_id for n in nodes}
    return all(n.member_ids() >= ids - {n.peer_id} for n in nodes)


@pytest.mark.timeout(150)
def test_chain_of_five_discover_each_other_and_survive_the_bootstrap_dying(swarm):
    nodes = [swarm.start("n0")]
    for i in range(1, 5):  # B from A, C from B, ...
        nodes.append(swarm.start(f"n{i}", bootstrap=[nodes[-1].tcp_addr]))
    wait_for(lambda: _all_see_all(nodes), 20, "5 chained nodes to see each other in /status")

    # everyone is connected directly and has a latency measurement for the others
    def measured():
        for n in nodes:
            peers = [p for p in n.status()["peers"] if p["member"]]
            if not all(p["connected"] and p["path"] == "direct" and p["latency_ms"] is not None for p in peers):
                return False
        return True

    wait_for(measured, 20, "direct connections with latency to every member")

    # kill the first node; a sixth joins through the third and everyone alive sees it
    nodes[0].kill()
    sixth = swarm.start("n5", bootstrap=[nodes[2].tcp_addr])
    wait_for(lambda: all(sixth.peer_id in n.member_ids() for n in nodes[1:]), 20, "the sixth node to be seen by all")
    wait_for(lambda: sixth.member_ids() >= {n.peer_id for n in nodes[1:]}, 20, "the sixth node to see all")
    # and the dead first node's record eventually expires (ttl 60 s is too long to wait for; it is not connected)
    s = sixth.status()
    assert s["joined"] and s["bootstrap"][0]["state"] == "connected"


@pytest.mark.timeout(90)
def test_restart_with_same_data_dir_keeps_peer_id(swarm):
    a = swarm.start("a")
    b = swarm.start("b", bootstrap=[a.tcp_addr])
    wait_for(lambda: a.peer_id in b.member_ids(), 20, "b to see a")
    b_id = b.peer_id
    assert b.stop() == 0
    b2 = swarm.start("b", bootstrap=[a.tcp_addr])
    assert b2.peer_id == b_id
    wait_for(lambda: a.peer_id in b2.member_ids() and a.status()["peers"], 20, "b to rejoin")
    assert (swarm.root / "b" / "identity.key").stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(90)
def test_a_node_killed_with_sigkill_has_the_sockets_it_left_in_tmp_removed_at_its_next_start(swarm):
    """SIGKILL gives the node no time to close: the unix socket its p2p client listens on stays in /tmp (the suite's
    kill -9 tests left about 250 of them). The data dir remembers the sockets of its run; the next start removes
    those that nothing listens on, and a clean stop leaves none."""
    import json
    import os

    a = swarm.start("a")
    listed = json.loads((a.data_dir / "p2p-sockets.json").read_text())
    assert len(listed) == 2 and all(os.path.exists(p) for p in listed), listed  # the daemon's and the client's
    client = next(p for p in listed if "p2pclient" in p)
    a.kill()
    assert os.path.exists(client)  # what SIGKILL leaves
    again = swarm.start("a")
    assert not os.path.exists(client) and f"removed {client}" in again.log()
    ours = json.loads((a.data_dir / "p2p-sockets.json").read_text())
    assert client not in ours and all(os.path.exists(p) for p in ours)
    assert again.stop() == 0
    assert not (a.data_dir / "p2p-sockets.json").exists() and not any(os.path.exists(p) for p in ours)


@pytest.mark.timeout(60)
def test_unreachable_bootstrap_keeps_retrying_and_shows_it(swarm):
    # a valid address where nobody listens
    ghost = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRLprPmBWgQTLfjEci2hccdjFNWhxDAPs9dA2fVxbmfJw"
    n = swarm.start("lonely", bootstrap=[ghost])
    assert http_get(n.url + "/healthz")["ok"] is True

    def retried_twice():
        b = n.status()["bootstrap"][0]
        return b if b["attempts"] >= 3 and b["state"] in ("retrying", "dialing") and b["last_error"] else None

    b = wait_for(retried_twice, 30, "bootstrap to be retried with backoff")
    assert n.status()["joined"] is False
    out = run_cli("status", "--data-dir", str(n.data_dir))
    assert out.returncode == 0 and "bootstrap" in out.stdout and "attempt" in out.stdout, out.stdout + out.stderr
    assert b["next_attempt"] is None or b["next_attempt"] > time.time() - 1


@pytest.mark.timeout(60)
def test_sigterm_and_sigint_shut_down_cleanly(swarm):
    import psutil

    for sig in (signal.SIGTERM, signal.SIGINT):
        n = swarm.start(f"n{sig}")
        children = psutil.Process(n.pid).children(recursive=True)
        assert any("p2pd" in c.name() for c in children)
        started = time.monotonic()
        n.signal(sig)
        assert n.proc.wait(10) == 0, n.log()
        assert time.monotonic() - started < 5
        assert not (n.data_dir / "node.json").exists()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, "p2p daemon outlived the node"
        # the lock was released: the data dir can be used again at once
        assert "in use" not in n.log()


@pytest.mark.timeout(60)
def test_second_sigint_exits_at_once(swarm):
    # a shutdown that hangs, as when the p2p daemon does not answer: injected from outside, the daemon suspended
    import psutil

    n = swarm.start("impatient")
    daemon = next(c for c in psutil.Process(n.pid).children(recursive=True) if "p2pd" in c.name())
    daemon.suspend()
    n.signal(signal.SIGINT)
    # two signals sent back to back can merge into one; send the second once the first was seen
    wait_for(lambda: "shutting down" in n.log(), 5, "the node to start shutting down", interval=0.01)
    assert n.proc.poll() is None, "shutdown finished before the second signal; cannot test it"
    n.signal(signal.SIGINT)
    assert n.proc.wait(5) == 130
    daemon.resume()  # a stopped process would not see its parent's end
    gone, alive = psutil.wait_procs([daemon], timeout=10)
    assert not alive, "p2p daemon outlived the node"


@pytest.mark.timeout(90)
def test_status_peers_metrics_and_page(swarm):
    a = swarm.start("a")
    b = swarm.start("b", bootstrap=[a.tcp_addr])
    wait_for(lambda: b.peer_id in a.member_ids(), 20, "a to see b")
    wait_for(lambda: any(p["latency_ms"] for p in a.status()["peers"]), 20, "a latency measurement")
    s = a.status()
    for key in ("peer_id", "version", "uptime_s", "listen", "addresses", "announce", "reachability", "dht", "peers",
                "loops", "traffic"):
        assert key in s
    assert s["dht"]["routing_table_size"] >= 1
    assert s["traffic"]["bytes_in"] > 0 and s["traffic"]["bytes_out"] > 0
    assert all(addr.endswith("/p2p/" + a.peer_id) for addr in s["addresses"])

    peers = http_get(a.url + "/peers")
    assert [p["peer_id"] for p in peers] == [b.peer_id]
    assert peers[0]["path"] == "direct" and peers[0]["last_seen"] is not None

    families = {f.name: f for f in text_string_to_metric_families(http_get(a.url + "/metrics"))}
    connected = [s.value for s in families["swarmd_peers"].samples if s.labels["state"] == "connected"]
    assert connected == [1.0]
    assert any(s.value > 0 for s in families["swarmd_bytes"].samples)
    assert "swarmd_errors" in families and "swarmd_dht_routing_table_size" in families

    assert "<title>swarmd</title>" in http_get(a.url + "/")

    out = run_cli("peers", "--data-dir", str(a.data_dir))
    assert out.returncode == 0 and b.peer_id in out.stdout and "direct" in out.stdout and " ms" in out.stdout
    out = run_cli("status", "--http", a.url)
    assert out.returncode == 0 and a.peer_id in out.stdout and "1 members, 1 connected" in out.stdout


@pytest.mark.timeout(60)
def test_announce_replaces_advertised_addresses(swarm):
    n = swarm.start("public", "--announce", "/ip4/203.0.113.7/tcp/4001")
    s = n.status()
    assert s["announce"] == ["/ip4/203.0.113.7/tcp/4001"]
    assert s["addresses"] == [f"/ip4/203.0.113.7/tcp/4001/p2p/{n.peer_id}"]
    assert s["listen"][0].startswith("/ip4/127.0.0.1/tcp/")
