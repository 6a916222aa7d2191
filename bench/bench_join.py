"""Join benchmark: how fast a new node becomes visible to the whole swarm, and what a node costs in memory.

For swarms of 8 and 32 `swarmd start` processes on loopback (configs/local.toml with the default config's discovery
intervals, as a real deployment runs them: 32 nodes sharing 2 cores is the load here, not the network):
- join (spawn): from spawning `swarmd start --bootstrap <random member>` until every other node lists the newcomer
  as a member in its /status (median over --joins newcomers);
- join (ready): the same, counted from the moment the newcomer's HTTP endpoint is up (process start-up excluded);
- RSS per node: the Python process and its p2p daemon, median over all nodes.

Baseline, measured in the same run: a bare process that imports hivemind's P2P the way swarmd does, starts a p2p
daemon and dials the same bootstrap (the floor any p2pd-based node pays), and that process's RSS. The table shows
ratios to it, since timings on these shared machines are noisy.

    python bench/bench_join.py [--sizes 8 32] [--joins 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from swarmproc import Swarm, wait_for  # noqa: E402

BASELINE = """
import asyncio, sys, time, resource
t0 = float(sys.argv[2])
from swarmd.transport._compat import load_hivemind
from swarmd.transport.identity import Identity
hm = load_hivemind()
async def main():
    import tempfile, os
    d = tempfile.mkdtemp(); path = os.path.join(d, "k")
    Identity.generate().save(path)
    p2p = await hm.P2P.create(identity_path=path, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
                              use_ipfs=False, check_if_identity_free=False)
    addr = sys.argv[1]
    head, peer = addr.rsplit("/p2p/", 1)
    await p2p._client.connect(hm.PeerID.from_base58(peer), [hm.Multiaddr(head)])
    elapsed = time.time() - t0
    import psutil
    me = psutil.Process()
    rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
    print(elapsed, rss)
    await p2p.shutdown()
import uvloop; uvloop.run(main())
"""


def rss_of(pid: int) -> tuple[int, int]:
    proc = psutil.Process(pid)
    children = proc.children(recursive=True)
    return proc.memory_info().rss, sum(c.memory_info().rss for c in children)


def visible_everywhere(others, peer_id: str, deadline: float) -> float:
    """Wall time at which the last of ``others`` listed ``peer_id``: read from their logs afterwards
    ("member <id> joined"), so measuring does not load the nodes (polling 31 endpoints at 20 Hz did)."""
    pattern = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) .*member " + re.escape(peer_id) + " joined", re.M)
    while True:
        times = []
        for node in others:
            m = pattern.search(node.log_path.read_text(errors="replace"))
            if m is None:
                break
            times.append(m)
        if len(times) == len(others):
            break
        if time.time() > deadline:
            raise RuntimeError(f"{peer_id} seen by {len(times)}/{len(others)} nodes only")
        time.sleep(0.2)
    today = datetime.datetime.now().replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    return max(today + int(h) * 3600 + int(mi) * 60 + int(se) + int(ms) / 1000 for h, mi, se, ms in
               (m.groups() for m in times))


def baseline(bootstrap: str) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", BASELINE, bootstrap, repr(time.time())],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    elapsed, rss = out.stdout.split()
    return float(elapsed), int(rss)


BENCH_CONFIG = """
[network]
listen = ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic-v1"]
reachability = "public"
[discovery]
backoff_initial = 0.5
[http]
listen = "127.0.0.1:0"
"""


def run_size(size: int, joins: int, root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    config = root / "bench.toml"
    config.write_text(BENCH_CONFIG)
    swarm = Swarm(root / f"swarm{size}", config=config)
    rng = random.Random(size)
    try:
        nodes = [swarm.start("n0")]
        for i in range(1, size - joins):
            nodes.append(swarm.start(f"n{i}", bootstrap=[rng.choice(nodes).tcp_addr]))
        ids = {n.peer_id for n in nodes}
        wait_for(lambda: all(n.member_ids() >= ids - {n.peer_id} for n in nodes), 120, f"{len(nodes)} nodes to mesh",
                 interval=0.5)
        spawn_times, ready_times, base_times, base_rss = [], [], [], []
        for j in range(joins):
            boot = rng.choice(nodes)
            bt, br = baseline(boot.tcp_addr)
            base_times.append(bt)
            base_rss.append(br)
            t_spawn = time.time()
            newcomer = swarm.start(f"join{j}", bootstrap=[boot.tcp_addr], wait=False)
            newcomer.wait_ready(60)
            t_ready = (newcomer.data_dir / "node.json").stat().st_mtime
            t_visible = visible_everywhere(nodes, newcomer.peer_id, time.time() + 60)
            # and /status agrees
            wait_for(lambda: all(newcomer.peer_id in {p["peer_id"] for p in n.status()["peers"]} for n in nodes),
                     30, "the newcomer in every /status", interval=0.5)
            spawn_times.append(t_visible - t_spawn)
            ready_times.append(t_visible - t_ready)
            nodes.append(newcomer)
        rss = [rss_of(n.pid) for n in nodes]
        return {
            "size": size,
            "join_spawn_s": statistics.median(spawn_times),
            "join_ready_s": statistics.median(ready_times),
            "join_spawn_max_s": max(spawn_times),
            "baseline_s": statistics.median(base_times),
            "rss_py_mb": statistics.median(r[0] for r in rss) / 2**20,
            "rss_p2pd_mb": statistics.median(r[1] for r in rss) / 2**20,
            "rss_total_mb": statistics.median(r[0] + r[1] for r in rss) / 2**20,
            "rss_max_mb": max(r[0] + r[1] for r in rss) / 2**20,
            "baseline_rss_mb": statistics.median(base_rss) / 2**20,
        }
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--joins", type=int, default=3, help="newcomers measured per swarm size")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-") as tmp:
        for size in args.sizes:
            results.append(run_size(size, args.joins, Path(tmp)))
    header = (f"{'nodes':>5} | {'join from spawn':>15} | {'join from ready':>15} | {'bare p2pd dial':>14} | "
              f"{'ratio':>5} | {'RSS py+p2pd':>11} | {'(py / p2pd)':>13} | {'bare RSS':>8} | {'ratio':>5}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['size']:>5} | {r['join_spawn_s']:>13.2f} s | {r['join_ready_s']:>13.2f} s | "
              f"{r['baseline_s']:>12.2f} s | {r['join_spawn_s'] / r['baseline_s']:>5.2f} | "
              f"{r['rss_total_mb']:>8.0f} MB | {r['rss_py_mb']:>5.0f} / {r['rss_p2pd_mb']:>3.0f} MB | "
              f"{r['baseline_rss_mb']:>5.0f} MB | {r['rss_total_mb'] / r['baseline_rss_mb']:>5.2f}")
    print("targets: join <= 1 s on loopback; <= 150 MB per node (Python process + its p2p daemon)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
