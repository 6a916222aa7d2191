"""NAT traversal benchmark in the namespace lab (needs root): per NAT mode, over N runs, time to the first relayed
call, hole-punch success rate and time to a direct connection.

Each run builds a fresh lab (one public bootstrap/relay node, two nodes behind their own NAT), starts the three
swarmd processes, and measures from the moment the second NATed node is ready:
- first relayed call: until each NATed node has pinged the other through the relay (a request/response stream);
- direct: until both show their connection as hole-punched in /status (what a user sees; /status is refreshed
  every 2 s), at most --punch-wait seconds;
- bulk: b pulls a --blob-mb blob from the public node over plain TCP (through b's NAT: the baseline) and one from a
  over the hole-punched connection (a ``/swarmd/bulk`` stream through both nodes' splices and p2p daemons); the
  ratio is punched / TCP throughput within the run.
Modes: eim (endpoint-independent mapping, strict Linux conntrack), eim-liberal (the same, with routers that do not
track TCP sequence numbers), sym (a new random port per destination).

    python bench/bench_nat.py [--runs 20] [--modes eim eim-liberal sym] [--punch-wait 15]

With --per-kind, per NAT kind (endpoint-, address-, port-dependent filtering; symmetric on one side, on both) and
config (the embedded defaults as users get them, and/or the lab config): N fresh labs each, direct within 10 s and
60 s of the two NATed nodes seeing each other, still relayed, median time to direct, failed attempts by cause (one
lab of each config and kind in turn; cut short by SIGTERM, it prints the table of the labs that ran):

    python bench/bench_nat.py --per-kind --runs 50 [--kinds ...] [--configs defaults lab] [--punch-wait 60]

With --diloco, a 4-peer DiLoCo run (two public peers, two behind symmetric NATs: the two NATed ones have no direct
path to each other, since neither keeps a port a burst could aim at) next to the same run with all four public, in
the same invocation: rounds whose combination holds every peer's update, the symmetric peer's update, pulls made
through the public members, bulk requests refused for coming over a relay, and the median round time:

    python bench/bench_nat.py --diloco --runs 3 [--rounds 12] [--exchange scatter]

With --birthday, not swarmd but the bare mechanism of its burst (transport/birthday.py) where one side is symmetric:
a behind a symmetric
NAT opens N flows to b's port at once (N random public ports), b behind a port-keeping NAT that lets in only replies
opens N flows to N random ports of a's address; where a guess meets one of a's ports the SYNs cross and a TCP
simultaneous open completes (the birthday estimate: 1 - exp(-N^2 / 64512)):

    python bench/bench_nat.py --birthday --runs 10 [--flows 128 256 512]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from natlab import NatLab, unavailable  # noqa: E402
from swarmproc import Swarm, wait_for  # noqa: E402
from test_nat import LAB_DILOCO, LAB_NODE, peer, relayed_call_works  # noqa: E402


# what a new user runs: `swarmd start --listen /ip4/0.0.0.0/tcp/4001 --bootstrap <public node>`, the embedded
# defaults for everything else
DEFAULTS_NODE = """
[network]
listen = ["/ip4/0.0.0.0/tcp/4001"]
"""


def one_run(root: Path, mode: str, punch_wait: float, blob_mb: int) -> dict:
    config = root / "lab.toml"
    config.write_text(LAB_NODE)
    nat = "sym" if mode == "sym" else "eim"
    with NatLab(mode_a=nat, mode_b=nat, liberal=mode.endswith("liberal")) as lab:
        swarm = Swarm(root / "nodes", config=config)

        def start(where, bootstrap=()):
            return swarm.start(where, bootstrap=list(bootstrap), prefix=lab.cmd(where),
                               via=functools.partial(lab.call, where))

        try:
            pub = start("pub")
            bootstrap = f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"
            a = start("a", [bootstrap])
            b = start("b", [bootstrap])
            t0 = time.monotonic()
            try:
                wait_for(lambda: relayed_call_works(a, b, pub.peer_id) and relayed_call_works(b, a, pub.peer_id),
                         30, "relayed calls", interval=0.1)
                relayed = time.monotonic() - t0
            except AssertionError:
                return {"relayed": None, "direct": None, "punch_s": None, "tcp": None, "punched": None}
            try:
                wait_for(lambda: all((p := peer(x, y.peer_id)) and p["path"] == "hole-punched"
                                     for x, y in ((a, b), (b, a))), punch_wait, "direct", interval=0.1)
                direct = time.monotonic() - t0
            except AssertionError:
                direct = None
            blobs = 0

            def rate(puller, holder):
                nonlocal blobs
                blobs += 1
                put = holder.post("/bulk?codec=raw", os.urandom(blob_mb << 20), timeout=60)
                wait_for(lambda: puller.status()["services"]["bulk"]["announcements"] >= blobs, 10, "announcement")
                pulled = puller.post(f"/bulk/{put['hash']}/pull", timeout=120)
                assert pulled["source"] == holder.peer_id, pulled
                return blob_mb * 1.048576 / pulled["seconds"]

            first = min((a, b), key=lambda n: n.peer_id)  # the one that starts the punch
            punches = first.status()["services"]["nat"]["punches"]
            punch_s = punches[0]["seconds"] if direct is not None and punches and punches[0]["ok"] else None
            tcp = rate(b, pub)
            punched = rate(b, a) if direct is not None else None
            return {"relayed": relayed, "direct": direct, "punch_s": punch_s, "tcp": tcp, "punched": punched}
        finally:
            swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=["eim", "eim-liberal", "sym"])
    parser.add_argument("--punch-wait", type=float, default=15.0)
    parser.add_argument("--blob-mb", type=int, default=32)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS),
                        help="with --per-kind: the NAT kinds")
    parser.add_argument("--configs", nargs="+", default=["defaults"], choices=["defaults", "lab"],
                        help="with --per-kind: the embedded defaults (only --listen given, as a new user does) "
                        "and/or the lab config of tests/test_nat.py")
    parser.add_argument("--per-kind", action="store_true", help="per NAT kind: direct within 10 s / 60 s, still "
                        "relayed, median time to direct, failures by cause (no bulk rows)")
    parser.add_argument("--diloco", action="store_true", help="a 4-peer DiLoCo run with one peer behind a symmetric "
                        "NAT next to the same run all public (--runs each, --rounds rounds)")
    parser.add_argument("--rounds", type=int, default=12, help="with --diloco: the run's rounds")
    parser.add_argument("--exchange", default="auto", choices=["auto", "all-to-all", "scatter"],
                        help="with --diloco: the exchange (auto: all-to-all for the lab's small model)")
    parser.add_argument("--birthday", action="store_true", help="a measurement, not swarmd: TCP punching across a "
                        "symmetric NAT by --flows simultaneous flows on each side (--runs trials per count)")
    parser.add_argument("--flows", type=int, nargs="+", default=[128, 256, 512], help="with --birthday")
    args = parser.parse_args()
    if args.birthday:
        return main_birthday(args)
    if args.per_kind:
        return main_defaults(args)
    if args.diloco:
        return main_diloco(args)
    reason = unavailable()
    if reason:
        sys.exit(f"bench_nat: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the lab's namespaces and processes go too
    results = {}
    for mode in args.modes:
        results[mode] = []
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="swarmd-bench-nat-") as tmp:
                results[mode].append(one_run(Path(tmp), mode, args.punch_wait, args.blob_mb))
                r = results[mode][-1]
                if r["relayed"] is None or (r["direct"] is None and mode != "sym"):  # keep the logs to look at
                    kept = Path(tempfile.gettempdir()) / f"swarmd-bench-nat-failed-{mode}-{i + 1}"
                    shutil.copytree(tmp, kept, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
                    print(f"{mode} run {i + 1}: logs kept in {kept}", file=sys.stderr)
            print(f"{mode} run {i + 1}: {results[mode][-1]}", file=sys.stderr, flush=True)
    print(f"NAT lab, {args.runs} runs per mode: 1 public bootstrap/relay, 2 nodes behind their own NAT (swarmd "
          f"processes in network namespaces)")
    print(f"{'mode':<12} | {'relayed ok':>10} | {'first relayed call p50 / max':>28} | {'direct':>8} | "
          f"{'time to direct p50 / max':>24} | {'punch p50':>9} | {'bulk TCP MB/s':>13} | {'punched MB/s':>12} | "
          f"{'ratio':>5}")
    print("-" * 152)
    for mode, runs in results.items():
        relayed = [r["relayed"] for r in runs if r["relayed"] is not None]
        direct = [r["direct"] for r in runs if r["direct"] is not None]
        rel = f"{statistics.median(relayed):.2f} / {max(relayed):.2f} s" if relayed else "-"
        dire = f"{statistics.median(direct):.2f} / {max(direct):.2f} s" if direct else "-"
        tcp = [r["tcp"] for r in runs if r["tcp"] is not None]
        punched = [r["punched"] for r in runs if r["punched"] is not None]
        tcp_p50 = statistics.median(tcp) if tcp else None
        punched_p50 = statistics.median(punched) if punched else None
        ratio = f"{punched_p50 / tcp_p50:.2f}" if tcp_p50 and punched_p50 else "-"
        punch_s = [r["punch_s"] for r in runs if r["punch_s"] is not None]
        punch = f"{statistics.median(punch_s):.3f} s" if punch_s else "-"
        print(f"{mode:<12} | {len(relayed):>5} / {len(runs):<2} | {rel:>28} | {len(direct) / len(runs):>7.0%} | "
              f"{dire:>24} | {punch:>9} | {tcp_p50 or 0:>13.0f} | {punched_p50 or 0:>12.0f} | {ratio:>5}")
    print("goal: >= 90% direct with endpoint-independent NATs (libp2p production: ~70%); the relay works always")
    print("time to direct includes the lab config's punch_delay = 5 s (the relayed calls are measured first; the "
          "default is 1 s); punch = the attempt itself, from the first punch message to the adopted connection")
    print(f"bulk: p50 of one {args.blob_mb} MiB pull per run; TCP = from the public node's bulk port, punched = from "
          "the other NATed node over the hole-punched connection; ratio = punched / TCP")


# NAT kinds (RFC 4787): every router maps endpoint-independently (Linux keeps the source port) unless symmetric;
# they differ in what they let in (tests/natlab.py, filter_*)
KINDS = {
    "endpoint": {"filter_a": "endpoint", "filter_b": "endpoint"},  # full cone: port 4001 open to anyone
    "address": {"filter_a": "address", "filter_b": "address"},  # from addresses the host has sent to
    "port": {},  # only replies of flows the host opened (the lab's default)
    "sym-one": {"mode_a": "sym"},  # a behind a symmetric NAT (a new port per destination), b as "port"
    "sym-both": {"mode_a": "sym", "mode_b": "sym"},
}
MAPPING_CAUSES = ("our-mapping", "their-mapping")
START_WAIT = 120.0  # s a node may take to start (a shared machine's load: 30 s was not always enough)


def kind_run(root: Path, kind: str, config_text: str, wait: float) -> dict:
    """One fresh lab of ``kind``: from the moment both NATed nodes list each other as connected, until both list
    the other as direct or hole-punched (at most ``wait`` s; a symmetric NAT's failed punch, whose cause no retry
    changes, ends the run early). Every failed punch attempt is reported with its cause."""
    config = root / "lab.toml"
    config.write_text(config_text)
    with NatLab(**KINDS[kind]) as lab:
        swarm = Swarm(root / "nodes", config=config)

        def start(x: str, bootstrap: list[str]):
            node = swarm.start(x, bootstrap=bootstrap, prefix=lab.cmd(x), via=functools.partial(lab.call, x),
                               wait=False)
            node.wait_ready(START_WAIT)
            return node
        try:
            try:
                pub = start("pub", [])
                bootstrap = f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"
                a, b = start("a", [bootstrap]), start("b", [bootstrap])
            except AssertionError:  # the machine's load, not the NATs: counted apart, never as relayed
                return {"seen": False, "started": False, "direct": None, "path": None, "failures": [],
                        "outcome": f"a node did not start in {START_WAIT:.0f} s"}
            try:
                wait_for(lambda: all((p := peer(x, y.peer_id)) and p["connected"] for x, y in ((a, b), (b, a))),
                         60, "a and b connected", interval=0.1)
            except AssertionError:
                return {"seen": False, "direct": None, "path": None, "failures": [], "outcome": "never connected"}
            t0 = time.monotonic()
            first = min((a, b), key=lambda n: n.peer_id)  # the one that starts the punch
            direct = path = None
            failures: list[str] = []
            deadline = t0 + wait
            while time.monotonic() < deadline:
                paths = [(p := peer(x, y.peer_id)) and p["path"] for x, y in ((a, b), (b, a))]
                if all(p in ("direct", "hole-punched") for p in paths):
                    direct, path = time.monotonic() - t0, paths[0]
                    break
                punches = first.status()["services"]["nat"]["punches"]
                if punches and not punches[0]["ok"] and punches[0].get("cause") in MAPPING_CAUSES:
                    break
                time.sleep(0.1)
            nat = first.status()["services"]["nat"]
            for p in nat["punches"]:
                if not p["ok"]:
                    failures.append(p.get("cause", "error"))
                elif p.get("burst"):  # the ordinary attempt failed on the mapping, the burst after it went through
                    failures += ["mapping (then a burst)"] + ["closed (retried at once)"] * (p["tries"] - 2)
                elif p.get("tries", 1) > 1:
                    failures += ["closed (retried at once)"] * (p["tries"] - 1)
            if direct is not None:
                outcome = path
            elif not nat["punches"]:
                outcome = "relayed: no punch attempt"
            else:
                outcome = "relayed: " + (nat["punches"][0].get("cause") or "error")
            return {"seen": True, "direct": direct, "path": path, "failures": failures, "outcome": outcome}
        finally:
            swarm.close()


def main_defaults(args) -> None:
    """Hole punching per NAT kind, as users get it: per kind, N fresh labs, direct within 10 s and 60 s of the two
    NATed nodes seeing each other, still relayed, median time to direct, failures by cause (goal: >= 95% within
    10 s wherever one side is endpoint-independent, on the defaults)."""
    reason = unavailable()
    if reason:
        sys.exit(f"bench_nat: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    configs = {"defaults": DEFAULTS_NODE, "lab": LAB_NODE}
    results: dict[tuple[str, str], list[dict]] = {}
    load_before = os.getloadavg()
    # one lab of each config and kind in turn, so a run cut short (SIGTERM, a timeout) still has about as many labs
    # of each, and prints what it has
    try:
        for i in range(args.runs):
            for config in args.configs:
                for kind in args.kinds:
                    with tempfile.TemporaryDirectory(prefix="swarmd-bench-nat-") as tmp:
                        r = kind_run(Path(tmp), kind, configs[config], args.punch_wait)
                        results.setdefault((config, kind), []).append(r)
                        if r["direct"] is None or r["direct"] > 10 or r["failures"]:
                            kept = Path(tempfile.gettempdir()) / f"swarmd-bench-nat-{config}-{kind}-{i + 1}"
                            shutil.copytree(tmp, kept, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
                            r["logs"] = str(kept)
                    print(f"{config} {kind} run {i + 1}: {r}", file=sys.stderr, flush=True)
    finally:
        _per_kind_table(args, results, load_before)


def _per_kind_table(args, results: dict[tuple[str, str], list[dict]], load_before: tuple[float, ...]) -> None:
    done = sorted({len(runs) for runs in results.values()})
    print(f"NAT lab, {'/'.join(map(str, done)) or 0} of {args.runs} fresh labs per kind and config: 1 public node, "
          "2 nodes behind their own NAT, each "
          "started with --listen /ip4/0.0.0.0/tcp/4001 --bootstrap <public node>; times from both listing the other")
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before[0]:.1f} at the start and "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"{'config':<8} | {'kind':<8} | {'<= 10 s':>7} | {'<= 60 s':>7} | {'relayed':>7} | {'median':>7} | "
          f"{'how':<22} | failed attempts by cause")
    print("-" * 120)
    for (config, kind), runs in sorted(results.items(), key=lambda x: (args.configs.index(x[0][0]),
                                                                      args.kinds.index(x[0][1]))):
        runs = [r for r in runs if r.get("started", True)]  # a node that never started says nothing of the NATs
        n = len(runs)
        direct = [r["direct"] for r in runs if r["direct"] is not None]
        how = collections.Counter(r["outcome"] for r in runs)
        causes = collections.Counter(c for r in runs for c in r["failures"])
        print(f"{config:<8} | {kind:<8} | {sum(d <= 10 for d in direct):>3}/{n:<3} | {len(direct):>3}/{n:<3} | "
              f"{n - len(direct):>3}/{n:<3} | "
              f"{(f'{statistics.median(direct):.1f} s' if direct else '-'):>7} | "
              f"{', '.join(f'{k} {v}' for k, v in how.most_common()):<22} | "
              f"{', '.join(f'{k} {v}' for k, v in causes.most_common()) or '-'}")
    print(f"relayed = not direct within {args.punch_wait:.0f} s, or a symmetric NAT's punch failed for a mapping "
          "cause (no retry changes that; the run stops there). how: the path both ended on, else why not")
    unseen = collections.Counter(r["outcome"] for runs in results.values() for r in runs
                                 if not r.get("started", True))
    if unseen:
        print("labs left out (not a NAT outcome): " + ", ".join(f"{k} {v}" for k, v in unseen.most_common()))



def diloco_run(root: Path, public: bool, rounds: int, mode: str = "auto") -> dict:
    """One 4-peer DiLoCo run in a fresh lab: pub and pub2 public; a and b each behind a symmetric NAT (no punch or
    burst joins them), or (``public``) two more public nodes in their place; ``mode``: the exchange."""
    config = root / "lab.toml"
    config.write_text(LAB_NODE + LAB_DILOCO.replace("rounds = 8", f"rounds = {rounds}").replace(
        'codec = "e3m0"\n', f'codec = "e3m0"\nexchange = "{mode}"\n'))
    with NatLab(mode_a="sym", mode_b="sym") as lab:
        swarm = Swarm(root / "nodes", config=config)
        try:
            def start(where, name, port, bootstrap=()):
                extra = ("--listen", f"/ip4/0.0.0.0/tcp/{port}", "--http", f"127.0.0.1:{8470 + port - 4001}")
                node = swarm.start(name, *extra, bootstrap=list(bootstrap), prefix=lab.cmd(where),
                                   via=functools.partial(lab.call, where), wait=False)
                node.wait_ready(START_WAIT)
                return node
            pub = start("pub", "pub", 4001)
            bootstrap = [f"/ip4/{lab.pub_ip}/tcp/4001/p2p/{pub.peer_id}"]
            nodes = [pub, start("pub", "pub2", 4002, bootstrap)]
            nodes += ([start("pub", "c", 4003, bootstrap), start("pub", "d", 4004, bootstrap)] if public else
                      [start("a", "a", 4001, bootstrap), start("b", "b", 4001, bootstrap)])

            def diloco(n) -> dict:
                return n.status()["services"]["diloco"]
            wait_for(lambda: all(diloco(n)["state"] == "running" for n in nodes), 120, "the run to start")
            began = time.monotonic()
            final = wait_for(lambda: all(diloco(n)["state"] in ("done", "failed") for n in nodes)
                             and [diloco(n) for n in nodes], 60 + 20 * rounds, "the run to end")
            took = time.monotonic() - began
            last = final[-1]  # b: the symmetric-NAT peer (or the fourth public one)
            return {
                "full": min(sum(h["participants"] == 4 for h in s["history"]) for s in final),
                "rounds": rounds,
                "last_in": last["reach"]["rounds_with_our_update"],
                "through": sum(s.get("pulls_through_members", 0) for s in final),
                "mode": last["exchange"].get("mode"),
                "missing": sum(s.get("chunks_missing", 0) for s in final),
                # (a node before this count: None)
                "without": (sum(s.get("members_missing_from_parts", 0) for s in final)
                            if all("rounds_not_reducing" in s["reach"] for s in final) else None),
                "refused_relayed": sum(n.status()["services"]["bulk"].get("refused_relayed", 0) for n in nodes),
                "round_s": took / rounds,
                "same": len({s["final_hash"] for s in final}) == 1,
            }
        finally:
            swarm.close()


def main_diloco(args) -> None:
    reason = unavailable()
    if reason:
        sys.exit(f"bench_nat: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows = []
    for i in range(args.runs):  # alternated, so both settings see the machine's load alike
        for public in (True, False):
            with tempfile.TemporaryDirectory(prefix="swarmd-bench-nat-diloco-") as tmp:
                r = {"setting": "all public" if public else "two symmetric NATs",
                     **diloco_run(Path(tmp), public, args.rounds, args.exchange)}
            print(f"run {i + 1}: {r}", file=sys.stderr, flush=True)
            rows.append(r)
    print(f"DiLoCo in the NAT lab: 4 peers, {args.rounds} rounds of 20 inner steps (tests/test_nat.py's LAB_DILOCO), "
          f"exchange = \"{args.exchange}\", {args.runs} run(s) per setting, alternated")
    print("| setting | run | exchange | rounds with all 4 updates | the 4th peer's update in | pulls through members | "
          "chunks missing | members missing from parts | bulk requests over a relay | round time (s) | "
          "one final hash |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {r['setting']} | {i // 2 + 1} | {r['mode']} | {r['full']} of {r['rounds']} | "
              f"{r['last_in']} of {r['rounds']} | {r['through']} | {r['missing']} | "
              f"{'-' if r['without'] is None else r['without']} | {r['refused_relayed']} | {r['round_s']:.2f} | "
              f"{'yes' if r['same'] else 'NO'} |")
    for setting in ("all public", "two symmetric NATs"):
        times = [r["round_s"] for r in rows if r["setting"] == setting]
        print(f"{setting}: median round time {statistics.median(times):.2f} s")


# --birthday: TCP punching across a symmetric NAT by many flows at once (the mechanism of transport/birthday.py
# without swarmd around it). a sits behind MASQUERADE --random-fully (a random public port per flow, from 1024-65535),
# b behind a NAT that keeps the port and lets in only replies (the lab's "port" kind)
BIRTHDAY_PORTS = (1024, 65536)


def _flows(targets: list[tuple[str, int]], local_port: int, wait: float) -> tuple[float, tuple] | None:
    """(In a lab namespace.) A non-blocking connect() to each of ``targets``, every socket bound to ``local_port``
    (0: a port each); the first to connect within ``wait`` s: (seconds, its peer), held 1 s so that the other side
    sees its end connected before the resets of closing."""
    import select
    import socket as so
    socks, t0, done = [], time.monotonic(), None
    try:
        for host, port in targets:
            s = so.socket(so.AF_INET, so.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(so.SOL_SOCKET, so.SO_REUSEADDR, 1)
            s.setsockopt(so.SOL_SOCKET, so.SO_REUSEPORT, 1)
            s.bind(("0.0.0.0", local_port))
            s.setblocking(False)
            try:
                s.connect((host, port))
            except BlockingIOError:
                pass
        poll, by_fd = select.poll(), {s.fileno(): s for s in socks}
        for fd in by_fd:
            poll.register(fd, select.POLLOUT)
        while time.monotonic() - t0 < wait and by_fd and done is None:
            for fd, _ in poll.poll(50):
                s = by_fd.pop(fd)
                poll.unregister(fd)
                if s.getsockopt(so.SOL_SOCKET, so.SO_ERROR) == 0:
                    done = (time.monotonic() - t0, s.getpeername())
                    break
        if done is not None:
            time.sleep(1.0)
    finally:
        for s in socks:
            s.setsockopt(so.SOL_SOCKET, so.SO_LINGER, struct.pack("ii", 1, 0))  # a reset: no TIME_WAIT left
            s.close()
    return done


def main_birthday(args) -> None:
    """Per flow count n: --runs trials in one lab, a opening n flows to b's port 4001 from n local ports (n random
    public ports at its NAT) while b opens n flows from its port 4001 to n random ports of a's public address; a
    trial succeeds where both ends hold a connection (one guess met one of a's ports: the SYNs cross, and a TCP
    simultaneous open completes through both NATs)."""
    import math
    import random
    import resource
    import threading
    reason = unavailable()
    if reason:
        sys.exit(f"bench_nat: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(4 * max(args.flows) + 256, 1024),) * 2)
    rows = []
    with NatLab(mode_a="sym") as lab:
        for n in args.flows:
            ok, times = 0, []
            for i in range(args.runs):
                out: dict = {}
                guesses = random.sample(range(*BIRTHDAY_PORTS), n)
                sides = {"a": ([(lab.wan["b"], 4001)] * n, 0), "b": ([(lab.wan["a"], g) for g in guesses], 4001)}
                threads = [threading.Thread(target=lambda x=x: out.__setitem__(x, lab.call(
                    x, _flows, *sides[x], 4.0, timeout=60))) for x in "ab"]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if out.get("a") and out.get("b"):
                    ok += 1
                    times.append(max(out["a"][0], out["b"][0]))
                print(f"{n} flows, trial {i + 1}: a {out.get('a')}, b {out.get('b')}", file=sys.stderr, flush=True)
            rows.append((n, ok, times, 1 - math.exp(-n * n / (BIRTHDAY_PORTS[1] - BIRTHDAY_PORTS[0]))))
    print(f"birthday punching in the NAT lab: a behind a symmetric NAT (random port per flow, 1024-65535), b behind a "
          f"port-keeping NAT that lets in only replies; {args.runs} trials per flow count, one lab")
    print("| flows each side | connected | birthday estimate | time to connect (median) |")
    print("|---|---|---|---|")
    for n, ok, times, expect in rows:
        print(f"| {n} | {ok} of {args.runs} | {expect:.0%} | "
              f"{f'{statistics.median(times):.2f} s' if times else '-'} |")


if __name__ == "__main__":
    main()
