"""The NAT lab itself: isolation, and that its two NAT modes behave as their names say."""

import socket
import subprocess
import threading

import pytest

from natlab import NatLab, StarLab, unavailable

pytestmark = [pytest.mark.nat, pytest.mark.timeout(60)]


@pytest.fixture(scope="module", autouse=True)
def _needs_lab():
    reason = unavailable()
    if reason:
        pytest.skip(reason)


def serve_observed(lab: NatLab, ports: list[int], connections: int) -> tuple[list, threading.Event]:
    """A TCP server in the public namespace that records the address each connection came from."""
    seen, ready = [], threading.Event()

    def server():
        socks = []
        for port in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((lab.pub_ip, port))
            s.listen()
            s.settimeout(10)
            socks.append(s)
        ready.set()
        for i in range(connections):
            conn, addr = socks[i % len(socks)].accept()
            seen.append(addr)
            conn.close()
        for s in socks:
            s.close()

    threading.Thread(target=lambda: lab.call("pub", server, timeout=20), daemon=True).start()
    assert ready.wait(10)
    return seen, ready


def dial(dest: tuple[str, int], source_port: int | None = None, timeout: float = 2.0) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if source_port:
        s.bind(("0.0.0.0", source_port))
    s.settimeout(timeout)
    try:
        s.connect(dest)
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["eim", "sym"])
def test_lab_isolation_and_nat_behaviour(mode):
    with NatLab(mode_a=mode, mode_b=mode) as lab:
        seen, _ = serve_observed(lab, [7001, 7002], 2)
        lab.call("a", dial, (lab.pub_ip, 7001), 40001)
        lab.call("a", dial, (lab.pub_ip, 7002), 40001)
        for _ in range(100):
            if len(seen) == 2:
                break
            threading.Event().wait(0.05)
        assert [ip for ip, _ in seen] == [lab.wan["a"]] * 2  # masqueraded behind router A's WAN address
        ports = {port for _, port in seen}
        if mode == "eim":
            assert ports == {40001}  # one mapping for every destination, source port kept
        else:
            assert len(ports) == 2 and 40001 not in ports  # a new random port per destination
        # nothing reaches a private host unsolicited: not from the public host, not from the other LAN
        with pytest.raises(OSError):
            lab.call("pub", dial, (lab.wan["a"], 40001), None, 1.0)
        with pytest.raises(OSError):
            lab.call("b", dial, (lab.lan_ip["a"], 22), None, 1.0)
        # and the lab has no way out: its routers have no route beyond the lab (checked without sending anything)
        for router in ("rA", "rB"):
            route = subprocess.run(lab.cmd(router) + ["ip", "route", "get", "1.1.1.1"], capture_output=True)
            assert route.returncode != 0
    names = lab.ns.values()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)  # removed


def test_star_lab_links_capped_both_ways():
    """The exchange benchmark's lab: hosts reach each other over the switch, each link is capped by tbf at both ends
    (its upload and its download), and there is no way out; down() removes every namespace. (The rate itself is
    measured in bench/bench_exchange.py --link, not asserted here.)"""
    with StarLab(3, rate_mbit=100) as lab:
        accepted = threading.Event()

        def serve():
            s = socket.socket()
            s.bind((lab.ips[2], 7003))
            s.listen()
            s.settimeout(5)
            conn, addr = s.accept()
            accepted.set()
            conn.close()
            s.close()
            return addr[0]

        server = threading.Thread(target=lambda: seen.append(lab.call(2, serve, timeout=10)), daemon=True)
        seen: list[str] = []
        server.start()
        for _ in range(100):  # the server binds in its own thread: dial until it listens
            try:
                lab.call(0, dial, (lab.ips[2], 7003), None, 1.0)
                break
            except ConnectionRefusedError:
                threading.Event().wait(0.05)
        server.join(10)
        assert accepted.is_set() and seen == [lab.ips[0]]
        for i in range(3):
            tbf = [line for line in lab.qdiscs(i).splitlines() if line.startswith("qdisc tbf")]
            assert len(tbf) == 2 and all("rate 100Mbit" in line for line in tbf), lab.qdiscs(i)
            route = subprocess.run(lab.cmd(i) + ["ip", "route", "get", "1.1.1.1"], capture_output=True)
            assert route.returncode != 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in [*lab.ns, lab.switch])
