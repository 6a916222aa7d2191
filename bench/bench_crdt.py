"""CRDT benchmark: apply rate on one core, convergence of a 16-node swarm, bytes on the wire per op.

1. ops applied per second (decode + verify + merge) into a fresh store, one core, over ops written concurrently by
   4 authors; baseline in the same run: the Ed25519 verifications alone (the floor), and decode + merge without
   signature checks (what the rest costs).
2. convergence: N `swarmd start` processes (default 16) on loopback; each writes M ops (default 1000, in batches of
   100 through its local HTTP API, all nodes at once); time from the last acknowledged write until every node has
   the same DAG heads. Baseline in the same run: the same swarm converging after a single op.
3. bytes on the wire per op and receiving replica: all CRDT protocol bytes the nodes sent, divided by
   (ops x (N - 1)); next to the op's own encoded size.
4. compaction: one author writes ``--compact-ops`` ops (kv keys, counter increments, progress, inside the quota);
   what a replica then holds (ops, bytes of op log, memory of a replica built from a sync) and what rebuilding it
   from its log costs. Baseline in the same run: the same writes under a schema that takes no bases (every op kept,
   as before compaction).

    python bench/bench_crdt.py [--nodes 16] [--ops 1000] [--compact-ops 20500] [--only compaction]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from swarmproc import Swarm, http_get, http_post, wait_for  # noqa: E402

from swarmd.crdt import OpStore  # noqa: E402
from swarmd.crdt.ops import SIGN_DOMAIN  # noqa: E402
from swarmd.crdt import LWWMap  # noqa: E402
from swarmd.node.crdt_wire import CRDT_SPEC  # noqa: E402
from swarmd.node.replication import BASE_SCHEMA  # noqa: E402
from swarmd.transport.identity import Identity, verify  # noqa: E402

BASE_SCHEMA_NO_BASES = {**BASE_SCHEMA, "shared": LWWMap(namespaced=False)}  # a shared type: no author restates it

BENCH_CONFIG = """
[network]
listen = ["/ip4/127.0.0.1/tcp/0"]
reachability = "public"
[discovery]
backoff_initial = 0.5
[state]
sync_interval = 2.0
admission_bits = 12
[http]
listen = "127.0.0.1:0"
"""


def _random_write(rng: random.Random, who: Identity, i: int) -> tuple[str, dict]:
    """A node's kind of write: half kv keys (of 100), a third counter increments, the rest progress."""
    kind = rng.random()
    if kind < 0.5:
        return "kv", {"k": f"{who.peer_id}/k{rng.randrange(100)}", "v": rng.random()}
    if kind < 0.8:
        return "events", {"n": rng.randrange(10)}
    return "progress", {"step": i, "samples": 64 * i, "loss": rng.random(), "bytes": 100, "round": 0}


def make_history(n_ops: int, authors: int = 4, seed: int = 0):
    rng = random.Random(seed)
    ids = [Identity.generate() for _ in range(authors)]
    stores = [OpStore(BASE_SCHEMA, verify) for _ in range(authors)]
    now = int(time.time() * 1000) - 100 * n_ops
    ops = []
    for i in range(n_ops):
        now += 100  # inside each author's quota (4 authors: an op of one every 400 ms on average)
        a = rng.randrange(authors)
        if rng.random() < 0.05:
            other = stores[rng.randrange(authors)]
            for op in other.missing_for(stores[a].version_vector(), 10**6)[0]:
                stores[a].receive_op(op, now)
        who = ids[a]
        obj, payload = _random_write(rng, who, i)
        ops.append(stores[a].create(who.sign, who.peer_id, obj, payload, now).op)
    return ops


def apply_rate(n_ops: int) -> dict:
    ops = make_history(n_ops)
    wires = [op.wire() for op in ops]
    now = int(time.time() * 1000)

    def timed(fn, repeats=3):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    def full():
        s = OpStore(BASE_SCHEMA, verify)
        for w in wires:
            s.receive(w, now)
        assert len(s.ops) == len(ops)

    def no_verify():
        s = OpStore(BASE_SCHEMA, lambda *_: True)
        for w in wires:
            s.receive(w, now)

    def verify_only():
        for op in ops:
            assert verify(op.author, SIGN_DOMAIN + op.body, op.sig)

    t_full, t_nov, t_ver = timed(full), timed(no_verify), timed(verify_only)
    now = int(time.time() * 1000)
    return {
        "ops": n_ops,
        "full_ops_s": n_ops / t_full,
        "no_verify_ops_s": n_ops / t_nov,
        "verify_only_ops_s": n_ops / t_ver,
        "op_bytes": statistics.mean(len(op.body) + len(op.sig) for op in ops),
    }


def post(node, ops):
    return http_post(node.url + "/crdt", json_body={"ops": [{"object": o, "payload": p} for o, p in ops]},
                     timeout=60)


def digests(nodes) -> set[str]:
    return {http_get(n.url + "/state")["digest"] for n in nodes}


def crdt_bytes(nodes) -> int:
    return sum(n.status()["traffic"]["bytes_out_by_protocol"].get(CRDT_SPEC.id, 0) for n in nodes)


def convergence(n_nodes: int, n_ops: int, root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    config = root / "bench.toml"
    config.write_text(BENCH_CONFIG)
    swarm = Swarm(root / "swarm", config=config)
    try:
        nodes = swarm.start_chain(n_nodes, members_within=120)
        wait_for(lambda: len(digests(nodes)) == 1, 60, "initial convergence", interval=0.2)

        # baseline: one op
        start = time.monotonic()
        post(nodes[0], [("events", {"n": 1})])
        wait_for(lambda: len(digests(nodes)) == 1, 60, "one op to converge", interval=0.02)
        one_op = time.monotonic() - start

        bytes_before = crdt_bytes(nodes)
        last_ack = [0.0]
        lock = threading.Lock()

        def writer(node):
            for batch in range(n_ops // 100):
                post(node, [("kv", {"k": f"{node.peer_id}/k{batch}-{j}", "v": j}) for j in range(100)])
                with lock:
                    last_ack[0] = max(last_ack[0], time.monotonic())

        threads = [threading.Thread(target=writer, args=(n,)) for n in nodes]
        write_start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_for(lambda: len(digests(nodes)) == 1, 300, "all ops to converge", interval=0.1)
        done = time.monotonic()
        total_ops = n_ops * n_nodes
        state = http_get(nodes[0].url + "/state")
        assert state["ops"] >= total_ops
        sent = crdt_bytes(nodes) - bytes_before
        return {
            "nodes": n_nodes,
            "ops_total": total_ops,
            "write_s": last_ack[0] - write_start,
            "converge_after_last_write_s": done - last_ack[0],
            "converge_one_op_s": one_op,
            "bytes_per_op_per_replica": sent / (total_ops * (n_nodes - 1)),
        }
    finally:
        swarm.close()


def _one_writer(schema: dict, n_ops: int, who: Identity) -> OpStore:
    rng = random.Random(1)
    s = OpStore(schema, verify)
    now = int(time.time() * 1000) - 125 * n_ops
    for i in range(n_ops):
        now += 125  # 480 ops a minute: inside the quota
        obj, payload = _random_write(rng, who, i)
        r = s.create(who.sign, who.peer_id, obj, payload, now)
        assert r.status == "applied", r
    return s


def _replica(wires: list) -> tuple[OpStore, float, int]:
    """A replica built from ``wires`` (a sync, or its log at a restart): the store, the seconds, the peak bytes."""
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    s = OpStore(BASE_SCHEMA_NO_BASES if len(wires) and _no_bases(wires) else BASE_SCHEMA, verify)
    now = int(time.time() * 1000)
    for w in wires:
        s.receive(w, now)
    took = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return s, took, peak


def _no_bases(wires: list) -> bool:
    return not any(b"_base" in w["b"] for w in wires)


def compaction(n_ops: int) -> dict:
    import msgpack

    who = Identity.generate()
    out = {}
    for name, schema in (("bases", BASE_SCHEMA), ("none", BASE_SCHEMA_NO_BASES)):
        writer = _one_writer(schema, n_ops, who)
        wires = [op.wire() for op in writer.ops_after({who.peer_id: 0}, 10**9, 1 << 40)[0]]
        replica, took, peak = _replica(wires)
        assert replica.values() == writer.values() and replica.digest() == writer.digest()
        out[name] = {"ops": len(writer.ops), "log_bytes": sum(len(msgpack.packb(w)) + 8 for w in wires),
                     "replay_s": took, "peak_mb": peak / 2**20, "values": writer.values()}
    del out["none"]["values"]["shared"]
    assert out["bases"]["values"] == out["none"]["values"]  # compaction changed nothing a reader sees
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--ops", type=int, default=1000, help="ops written by each node (multiple of 100)")
    parser.add_argument("--apply-ops", type=int, default=5000)
    parser.add_argument("--compact-ops", type=int, default=20500)
    parser.add_argument("--only", choices=["compaction"], default=None)
    args = parser.parse_args()
    comp = compaction(args.compact_ops)
    print(f"{'measure':<52} | {'value':>12} | {'baseline (same run)':>28} | {'ratio':>6}")
    print("-" * 108)
    b, n = comp["bases"], comp["none"]
    for label, key, fmt in ((f"ops a replica holds of one author's {args.compact_ops:,}", "ops", ",.0f"),
                            ("op log bytes (a sync to a fresh replica: the same)", "log_bytes", ",.0f"),
                            ("peak memory building a replica from them, MB", "peak_mb", ".1f"),
                            ("rebuilding it from its log, s", "replay_s", ".2f")):
        print(f"{label:<52} | {format(b[key], fmt):>12} | {'no bases: ' + format(n[key], fmt):>28} | "
              f"{b[key] / n[key]:>6.3f}")
    if args.only == "compaction":
        return
    rate = apply_rate(args.apply_ops)
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-crdt-") as tmp:
        conv = convergence(args.nodes, args.ops, Path(tmp))
    print(f"{'ops applied/s, one core (decode+verify+merge)':<52} | {rate['full_ops_s']:>12,.0f} | "
          f"{'Ed25519 verify alone ' + format(rate['verify_only_ops_s'], ',.0f'):>28} | "
          f"{rate['full_ops_s'] / rate['verify_only_ops_s']:>6.2f}")
    print(f"{'ops applied/s without signature checks':<52} | {rate['no_verify_ops_s']:>12,.0f} | {'':>28} | {'':>6}")
    label = f"converge {conv['nodes']} nodes x {conv['ops_total'] // conv['nodes']} ops after last write"
    print(f"{label:<52} | {conv['converge_after_last_write_s']:>10.2f} s | "
          f"{'one op: ' + format(conv['converge_one_op_s'], '.2f') + ' s':>28} | "
          f"{conv['converge_after_last_write_s'] / conv['converge_one_op_s']:>6.1f}")
    print(f"{'writing them (all nodes at once, 100-op batches)':<52} | {conv['write_s']:>10.2f} s | {'':>28} | {'':>6}")
    print(f"{'bytes on the wire per op per receiving replica':<52} | {conv['bytes_per_op_per_replica']:>10.0f} B | "
          f"{'op encoded ' + format(rate['op_bytes'], '.0f') + ' B':>28} | "
          f"{conv['bytes_per_op_per_replica'] / rate['op_bytes']:>6.2f}")


if __name__ == "__main__":
    main()
