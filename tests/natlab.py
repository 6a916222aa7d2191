"""A NAT lab made of Linux network namespaces, created and removed by the tests themselves.

    <p>-inet : a bridge, the lab's "internet" (L2 only)                 198.51.100.0/24 (TEST-NET-2)
    <p>-pub  : the public host (bootstrap / relay)                        .10
    <p>-rA   : NAT router, WAN .1, LAN 10.1.0.1/24  -- <p>-a 10.1.0.10  (default route via its router)
    <p>-rB   : NAT router, WAN .2, LAN 10.2.0.1/24  -- <p>-b 10.2.0.10

Each router masquerades its LAN behind its WAN address, forwards LAN -> WAN, lets back only established flows, and
accepts nothing new itself (a home router). Modes: ``eim`` (plain MASQUERADE: Linux keeps the source port, so the
mapping is endpoint-independent and hole punching is possible) and ``sym`` (MASQUERADE --random-fully: a new random
port per destination, a symmetric-like NAT). ``pubnet="ietf"`` puts the internet on 192.0.0.128/25, outside the
ranges go-libp2p calls unroutable. Nothing is attached to the root namespace and no lab namespace has a route out of
the lab, so no packet leaves it. ``down()`` kills what still runs inside (by PID, via ``ip netns pids``) and deletes
every namespace.

Code runs *inside* a namespace either as a process (``lab.cmd(ns, ...)`` gives the ``ip netns exec`` prefix) or in a
thread of this process (``lab.call(ns, fn)``: network namespaces are per thread on Linux, so sockets the thread
opens live in the lab), which is how tests read a node's local HTTP endpoint.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import uuid
from dataclasses import dataclass, field

import debian

CLONE_NEWNET = 0x40000000
PUBNETS = {"testnet": ("198.51.100", 0), "ietf": ("192.0.0", 128)}


def unavailable() -> str | None:
    """Why the lab cannot run here (None if it can). Installs iproute2/iptables with apt-get where missing."""
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces, iptables); run the tests as root, as CI does"
    missing = debian.ensure({"ip": "iproute2", "iptables": "iptables"})
    if missing:
        return f"the NAT lab needs {' and '.join(missing)} (apt-get install {' '.join(missing)})"
    probe = f"swprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create network namespaces here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")


def _setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns failed")
    finally:
        os.close(fd)


def _call_in(path: str, fn, args: tuple, timeout: float):
    """``fn(*args)`` in a thread that lives in the network namespace at ``path`` (network namespaces are per thread
    on Linux): its result, or its error raised here."""
    result: dict = {}

    def target():
        try:
            _setns(path)
            result["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} in {path} did not finish in {timeout} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


class _Lab:
    """What the labs share: ``up()`` builds (and removes what it made if building fails), ``down()`` kills what
    still runs inside each namespace it made (by PID, via ``ip netns pids``) and deletes them; a context manager."""

    _made: list[str]

    def _build(self) -> None:
        raise NotImplementedError

    def up(self):
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for name in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:  # only processes inside our own lab namespaces
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


@dataclass
class NatLab(_Lab):
    mode_a: str = "eim"
    mode_b: str = "eim"
    pubnet: str = "testnet"
    # routers that do not check TCP sequence numbers (nf_conntrack_tcp_be_liberal=1), like many NAT boxes that
    # are not Linux; by default the lab's routers are strict Linux conntrack
    liberal: bool = False
    # inbound filtering per router (RFC 4787): "port" (address- and port-dependent: only replies of a flow we
    # opened, the default), "address" (also new connections to the host's port 4001 from an address it has sent
    # to), "endpoint" (new connections to port 4001 from anyone: a full cone, where the mapping keeps the port)
    filter_a: str = "port"
    filter_b: str = "port"
    prefix: str = field(default_factory=lambda: "sw" + uuid.uuid4().hex[:5])

    def __post_init__(self):
        net, base = PUBNETS[self.pubnet]
        self.pub_ip = f"{net}.{base + 10}"
        self.wan = {"a": f"{net}.{base + 1}", "b": f"{net}.{base + 2}"}
        self.lan_ip = {"a": "10.1.0.10", "b": "10.2.0.10"}
        self.ns = {k: f"{self.prefix}-{k}" for k in ("inet", "pub", "rA", "rB", "a", "b")}
        self._made: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def _ns(self, key: str) -> str:
        name = self.ns[key]
        _run("ip", "netns", "add", name)
        self._made.append(name)
        self._x(key, "ip", "link", "set", "lo", "up")
        self._x(key, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
        return name

    def _x(self, key: str, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns[key], *args)

    def _attach(self, key: str, ifname: str) -> None:
        peer = f"{self.prefix}{key}"  # <= 15 characters
        _run("ip", "link", "add", ifname, "netns", self.ns[key], "type", "veth", "peer", "name", peer, "netns",
             self.ns["inet"])
        self._x("inet", "ip", "link", "set", peer, "master", "br0", "up")
        self._x(key, "ip", "link", "set", ifname, "up")

    def _build(self) -> None:
        self._ns("inet")
        self._x("inet", "ip", "link", "add", "br0", "type", "bridge")
        self._x("inet", "ip", "link", "set", "br0", "up")
        self._ns("pub")
        self._attach("pub", "eth0")
        self._x("pub", "ip", "addr", "add", f"{self.pub_ip}/24", "dev", "eth0")
        for side, router, lan, mode in (("a", "rA", "10.1.0", self.mode_a), ("b", "rB", "10.2.0", self.mode_b)):
            self._ns(router)
            self._ns(side)
            self._attach(router, "wan")
            self._x(router, "ip", "addr", "add", f"{self.wan[side]}/24", "dev", "wan")
            _run("ip", "link", "add", "lan", "netns", self.ns[router], "type", "veth", "peer", "name", "eth0",
                 "netns", self.ns[side])
            self._x(router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan")
            self._x(router, "ip", "link", "set", "lan", "up")
            self._x(side, "ip", "addr", "add", f"{lan}.10/24", "dev", "eth0")
            self._x(side, "ip", "link", "set", "eth0", "up")
            self._x(side, "ip", "route", "add", "default", "via", f"{lan}.1")
            self._x(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            if self.liberal:
                self._x(router, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_be_liberal=1")
            masq = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", "wan", "-j", "MASQUERADE"]
            self._x(router, *(masq + (["--random-fully"] if mode == "sym" else [])))
            self._x(router, "iptables", "-P", "FORWARD", "DROP")
            self._x(router, "iptables", "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT")
            self._x(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
                    "ESTABLISHED,RELATED", "-j", "ACCEPT")
            self._x(router, "iptables", "-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate",
                    "ESTABLISHED,RELATED", "-j", "ACCEPT")
            self._x(router, "iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP")
            self._filtering(router, f"{lan}.10", self.filter_a if side == "a" else self.filter_b)

    def _filtering(self, router: str, host: str, kind: str) -> None:
        if kind == "port":
            return
        if kind not in ("address", "endpoint"):
            raise ValueError(f"unknown filtering {kind!r}")
        dnat = ["iptables", "-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "tcp", "--dport", "4001"]
        if kind == "address":  # remember where the host sent to; let in new connections from those addresses
            self._x(router, "iptables", "-I", "FORWARD", "1", "-i", "lan", "-o", "wan", "-s", host, "-m", "recent",
                    "--name", "swsent", "--rdest", "--set")
            dnat += ["-m", "recent", "--name", "swsent", "--rsource", "--rcheck"]
        self._x(router, *dnat, "-j", "DNAT", "--to-destination", f"{host}:4001")
        self._x(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
                "DNAT", "-j", "ACCEPT")

    def reset_first_big_packet(self, side: str, port: int = 4001, size: int = 200) -> None:
        """``side``'s router resets, once, the TCP connection from ``side``'s ``port`` to the other NAT's ``port``
        at its first packet of ``size`` bytes or more (a handshake's first large message): the sender gets a RST,
        the packet is dropped. A connection that closes right after it opened, on the wire."""
        router, other = ("rA", "b") if side == "a" else ("rB", "a")
        self._x(router, "iptables", "-I", "FORWARD", "1", "-i", "lan", "-o", "wan", "-p", "tcp", "-s",
                self.lan_ip[side], "--sport", str(port), "-d", self.wan[other], "--dport", str(port), "-m", "length",
                "--length", f"{size}:65535", "-m", "recent", "--name", "swreset", "!", "--rcheck", "-m", "recent",
                "--name", "swreset", "--set", "-j", "REJECT", "--reject-with", "tcp-reset")

    # ------------------------------------------------------------------ running things inside
    def cmd(self, key: str) -> list[str]:
        """The command prefix that runs a process inside namespace ``key`` (a, b, pub, rA, rB)."""
        return ["ip", "netns", "exec", self.ns[key]]

    def call(self, key: str, fn, *args, timeout: float = 30.0):
        """Run ``fn(*args)`` in a thread that lives in namespace ``key``; return its result or raise its error."""
        return _call_in(f"/run/netns/{self.ns[key]}", fn, args, timeout)

    def conntrack_flows(self, router: str) -> str:
        r = subprocess.run(self.cmd(router) + ["cat", "/proc/net/nf_conntrack"], capture_output=True, text=True)
        return r.stdout


@dataclass
class StarLab(_Lab):
    """N hosts, each in its own namespace, on one switch (a bridge in a namespace of its own), each host's link
    capped at ``rate_mbit`` both ways by ``tc ... tbf``: its upload on its own end of the link, its download on the
    switch's end. No NAT and no route out of the lab: host i is 10.77.0.(i + 1)/24. What the exchange benchmark uses
    for peers that each sit behind a home connection."""

    hosts: int
    rate_mbit: float = 100.0
    prefix: str = field(default_factory=lambda: "sw" + uuid.uuid4().hex[:5])

    def __post_init__(self):
        self.ns = [f"{self.prefix}-h{i}" for i in range(self.hosts)]
        self.switch = f"{self.prefix}-sw"
        self.ips = [f"10.77.0.{i + 1}" for i in range(self.hosts)]
        self._made: list[str] = []

    def _add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        _run("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1")

    def _tbf(self, ns: str, dev: str) -> None:
        # burst: at least one rate-tick of bytes (rate / HZ) and a few full frames; latency bounds the queue
        burst = max(32_000, int(self.rate_mbit * 1e6 / 8 / 250))
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
             f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "200ms")

    def _build(self) -> None:
        if not 1 <= self.hosts <= 250:
            raise ValueError("a star lab holds 1 to 250 hosts")
        self._add(self.switch)
        _run("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(zip(self.ns, self.ips)):
            self._add(ns)
            port = f"{self.prefix}p{i}"  # <= 15 characters
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns",
                 self.switch)
            _run("ip", "netns", "exec", self.switch, "ip", "link", "set", port, "master", "br0", "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            if self.rate_mbit:
                self._tbf(ns, "eth0")  # the host's upload
                self._tbf(self.switch, port)  # its download

    def cmd(self, i: int) -> list[str]:
        """The command prefix that runs a process on host i."""
        return ["ip", "netns", "exec", self.ns[i]]

    def enter(self, i: int) -> None:
        """Move the calling thread (the whole process, if it has one thread) into host i's namespace."""
        _setns(f"/run/netns/{self.ns[i]}")

    def call(self, i: int, fn, *args, timeout: float = 30.0):
        """Run ``fn(*args)`` in a thread that lives on host i; return its result or raise its error."""
        return _call_in(f"/run/netns/{self.ns[i]}", fn, args, timeout)

    def qdiscs(self, i: int) -> str:
        """tc's view of host i's link, both ends (for checks)."""
        mine = subprocess.run(self.cmd(i) + ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
        switch = subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "show", "dev",
                                 f"{self.prefix}p{i}"], capture_output=True, text=True)
        return mine.stdout + switch.stdout
