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
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from natlab import NatLab, unavailable  # noqa: E402
from swarmproc import Swarm, wait_for  # noqa: E402
from test_nat import LAB_NODE, peer, relayed_call_works  # noqa: E402


# what a new user runs: `swarmd start --listen /ip4/0.0.0.0/tcp/4001 --bootstrap <public node>`, the embedded
# defaults for everything else
DEFAULTS_NODE = """
[network]
listen = ["/ip4/0.0.0.0/tcp/4001"]
"""


def one_run(root: Path, mode: str, punch_wait: float, blob_mb: int, defaults: bool = False) -> dict:
    config = root / "lab.toml"
    config.write_text(DEFAULTS_NODE if defaults else LAB_NODE)
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
                if defaults:  # the upgrade may come before a relayed ping: time from connected, by any path
                    wait_for(lambda: all((p := peer(x, y.peer_id)) and p["connected"] for x, y in ((a, b), (b, a))),
                             60, "a and b connected", interval=0.1)
                else:
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
            if defaults:
                return {"relayed": relayed, "direct": direct, "punch_s": None, "tcp": None, "punched": None,
                        "after_seen": None if direct is None else direct - relayed}
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
    parser.add_argument("--defaults", action="store_true", help="run the nodes on the embedded default config "
                        "(only --listen /ip4/0.0.0.0/tcp/4001 given), as a new user does; no bulk rows")
    args = parser.parse_args()
    if args.defaults:
        return main_defaults(args)
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


def main_defaults(args) -> None:
    """Hole punching with the shipped defaults: per mode, how many pairs went direct within 10 s of seeing each
    other (goal >= 95% with endpoint-independent NATs)."""
    results = {}
    for mode in args.modes:
        results[mode] = []
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="swarmd-bench-nat-") as tmp:
                r = one_run(Path(tmp), mode, args.punch_wait, args.blob_mb, defaults=True)
                results[mode].append(r)
                if r["relayed"] is None or (r["after_seen"] is None and mode != "sym") or \
                        (r["after_seen"] or 0) > 10:
                    kept = Path(tempfile.gettempdir()) / f"swarmd-bench-nat-defaults-{mode}-{i + 1}"
                    shutil.copytree(tmp, kept, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
                    print(f"{mode} run {i + 1}: logs kept in {kept}", file=sys.stderr)
            print(f"{mode} run {i + 1}: {r}", file=sys.stderr, flush=True)
    print(f"NAT lab with the embedded default config, {args.runs} fresh labs per mode: 1 public node, 2 nodes "
          "behind their own NAT, each started with --listen /ip4/0.0.0.0/tcp/4001 --bootstrap <public node>")
    print(f"{'mode':<12} | {'connected':>9} | {'seen p50 / max':>15} | {'direct <= 10 s':>14} | {'direct at all':>13} "
          f"| {'direct after seen p50 / max':>27}")
    print("-" * 106)
    for mode, runs in results.items():
        seen = [r["relayed"] for r in runs if r["relayed"] is not None]
        after = [r["after_seen"] for r in runs if r["after_seen"] is not None]
        fast = sum(1 for x in after if x <= 10)
        print(f"{mode:<12} | {len(seen):>4} / {len(runs):<2} | "
              f"{(f'{statistics.median(seen):.1f} / {max(seen):.1f} s' if seen else '-'):>15} | "
              f"{fast / len(runs):>14.0%} | {len(after) / len(runs):>13.0%} | "
              f"{(f'{statistics.median(after):.1f} / {max(after):.1f} s' if after else '-'):>27}")
    print("goal: >= 95% of pairs hole-punched within 10 s of seeing each other with endpoint-independent NATs, "
          "on the defaults; seen = both list the other as connected (relayed or direct) after the second starts")


if __name__ == "__main__":
    main()
