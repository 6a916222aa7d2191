"""A partition lab: ``n`` hosts, each a network namespace on one bridge (a LAN of the lab's own), that the test can
split into groups with ``iptables`` and heal again. Created and removed by the tests themselves; nothing is attached
to the root namespace and no lab namespace has a route out of the lab.

    <p>-br          : the bridge (L2 only)
    <p>-h0 .. h<n-1>: host i at 10.77.0.(10 + i)/24

``partition(groups)`` makes every host drop every packet to and from the hosts of the other groups (INPUT and
OUTPUT, so established connections stall exactly as through a cut link); ``heal()`` flushes those rules. Code runs in
a host as a process (``cmd(i)``) or in a thread of this process (``call(i, fn)``), as in ``natlab``.
"""

from __future__ import annotations

import subprocess
import uuid
from dataclasses import dataclass, field

from natlab import NatLab, _run, unavailable  # noqa: F401  (unavailable: the same requirements)


@dataclass
class SplitLab:
    n: int
    prefix: str = field(default_factory=lambda: "sp" + uuid.uuid4().hex[:5])

    def __post_init__(self):
        self.ns = {"br": f"{self.prefix}-br", **{f"h{i}": f"{self.prefix}-h{i}" for i in range(self.n)}}
        self.ip = [f"10.77.0.{10 + i}" for i in range(self.n)]
        self._made: list[str] = []
        self.partitioned = False

    def up(self) -> "SplitLab":
        return NatLab.up(self)  # builds, and removes what it made if building fails

    def _x(self, key: str, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns[key], *args)

    def _build(self) -> None:
        for key, name in self.ns.items():
            _run("ip", "netns", "add", name)
            self._made.append(name)
            self._x(key, "ip", "link", "set", "lo", "up")
            self._x(key, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
        self._x("br", "ip", "link", "add", "br0", "type", "bridge")
        self._x("br", "ip", "link", "set", "br0", "up")
        for i in range(self.n):
            peer = f"{self.prefix}v{i}"[:15]
            _run("ip", "link", "add", "eth0", "netns", self.ns[f"h{i}"], "type", "veth", "peer", "name", peer,
                 "netns", self.ns["br"])
            self._x("br", "ip", "link", "set", peer, "master", "br0", "up")
            self._x(f"h{i}", "ip", "addr", "add", f"{self.ip[i]}/24", "dev", "eth0")
            self._x(f"h{i}", "ip", "link", "set", "eth0", "up")

    def partition(self, groups: list[list[int]]) -> None:
        """Cut every link between hosts of different groups: one iptables-restore per host (the whole cut takes
        about 30 ms a host, not a process per rule)."""
        where = {h: g for g, hosts in enumerate(groups) for h in hosts}
        for i in range(self.n):
            others = [self.ip[j] for j in range(self.n) if i != j and i in where and j in where
                      and where[i] != where[j]]
            if not others:
                continue
            rules = ["*filter"] + [f"-A INPUT -s {ip} -j DROP" for ip in others] \
                + [f"-A OUTPUT -d {ip} -j DROP" for ip in others] + ["COMMIT", ""]
            r = subprocess.run(["ip", "netns", "exec", self.ns[f"h{i}"], "iptables-restore", "--noflush"],
                               input="\n".join(rules), capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"iptables-restore in h{i}: {r.stderr.strip()}")
        self.partitioned = True

    def heal(self) -> None:
        for i in range(self.n):
            self._x(f"h{i}", "iptables", "-F")
        self.partitioned = False

    def down(self) -> None:
        NatLab.down(self)  # kills what still runs in our namespaces (by PID), deletes them

    def __enter__(self) -> "SplitLab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def cmd(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[f"h{i}"]]

    def call(self, i: int, fn, *args, timeout: float = 30.0):
        return NatLab.call(self, f"h{i}", fn, *args, timeout=timeout)
