"""Faults, measured (issue 17): one table from one run, each row next to its fault-free baseline from the same run.

Byzantine peers in training (``--part byzantine``): every row runs the same identities (the honest peers' data,
seeds and policy inits are the same in every row): all n honest, the first n-1 alone (the honest-only baseline),
then the n-1 with a last peer that is ``tests/byzantine_peer.py`` (a node that trains like the others and sends
Byzantine contributions; a test seam outside production code):

- DiLoCo, 1 of 4 peers: its update x100, NaN/Inf, Gaussian noise of the honest update's norm, stale (the update it
  computed 3 rounds before, sent as if fresh), the same update every round; the default exchange for this model size
  (``--diloco-exchange`` picks one);
- SPSA, 1 of 4 peers: the largest allowed |g| with a random sign at every step, or a random allowed byte;
- SAPO, 1 of 8 peers: garbage completions, or every completion a wrong answer.

Partitions and a dead bootstrap (``--part split``; root: it builds network namespaces): 16 nodes, each in its own
namespace on one bridge, started with the shipped defaults (only the listen address is set); baseline: the time
one write takes to reach all 16. Then the swarm is cut into two halves by iptables for 30 s: the time until every
node reports the split (``/status`` -> ``split.suspected``), a write on each side, the heal, and the time until the
CRDT state is equal everywhere, members are complete and the split cleared. Then 4 nodes join through the
bootstrap (baseline), the bootstrap is killed for good, and 4 more join through 4 other members: the time until
every live node lists every other.

Reported per Byzantine row: the honest peers' final validation loss (DiLoCo, SPSA) or mean reward per round (SAPO:
the cumulative reward / rounds), its ratio to the honest-only baseline (the same honest identities alone, goal:
within 5%; the all-honest run is shown too), how many honest peers refused the
offender's contributions and why (``/status`` -> ``offenders``), how many penalised it, and whether the honest peers
ended with identical weights (DiLoCo, SPSA).

    python bench/bench_chaos.py [--part byzantine split] [--only diloco spsa sapo] [--diloco-rounds 12]
                                [--split-nodes 16] [--partition-seconds 30]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from swarmproc import Swarm, http_get, loop_config, wait_for  # noqa: E402

DILOCO = """
[loops.diloco]
run = "{run}"
rounds = {rounds}
inner_steps = 20
min_peers = {peers}
inner_lr = 1e-3
deadline_low = 3.0
eval_every = 1
checkpoint_every = 0
exchange = "{exchange}"
"""

SPSA = """
[loops.spsa]
run = "{run}"
task = "tinygpt"
steps = {steps}
window = 8
min_peers = {peers}
deadline = 20.0
hash_every = 8
eval_every = 4
checkpoint_every = 0
[loops.spsa.task_options]
domain = "target"
pretrain_steps = 200
"""

SAPO = """
[loops.sapo]
run = "{run}"
seed = 1
rounds = {rounds}
local = 4
external = 4
min_peers = {peers}
deadline = 10.0
task = "arith"
checkpoint_every = 0
"""

BYZANTINE = ROOT / "tests" / "byzantine_peer.py"


def run_swarm(loop: str, table: str, peers: int, root: Path, keys: Path, behaviour: str | None,
              timeout: float = 1500, name: str | None = None) -> dict:
    """``peers`` nodes with the identities in ``keys`` (made by the first call), the last one Byzantine if
    ``behaviour``; waits for the honest ones to finish and reads what they saw."""
    name = name or behaviour or "honest"
    config = loop_config(root / f"{loop}-{name}.toml", table)
    swarm = Swarm(root / f"{loop}-{name}", config=config)
    keys.mkdir(exist_ok=True)
    for i in range(peers):
        if (keys / f"n{i}.key").exists():
            (root / f"{loop}-{name}" / f"n{i}").mkdir(parents=True)
            shutil.copy(keys / f"n{i}.key", root / f"{loop}-{name}" / f"n{i}" / "identity.key")
    started = time.monotonic()
    try:
        nodes = [swarm.start("n0")]
        for i in range(1, peers):
            entry = [str(BYZANTINE), f"{loop}:{behaviour}"] if behaviour and i == peers - 1 else ["-m", "node"]
            nodes.append(swarm.start(f"n{i}", bootstrap=[nodes[-1].tcp_addr], entry=entry))
        for i, n in enumerate(nodes):
            if not (keys / f"n{i}.key").exists():
                shutil.copy(root / f"{loop}-{name}" / f"n{i}" / "identity.key", keys / f"n{i}.key")
        honest = nodes[:-1] if behaviour else nodes
        offender = nodes[-1].peer_id

        def st(n):
            return n.status()["services"][loop]

        final = wait_for(lambda: all(st(n)["state"] == "done" for n in honest) and [st(n) for n in honest],
                         timeout, f"{loop} {name}: the honest peers to finish", interval=1.0)
        scores = [{p["peer_id"]: p["penalty_score"] for p in n.status()["peers"]} for n in honest]
        out = {"wall": time.monotonic() - started, "final": final,
               "refused_by": sum(offender in s["offenders"] for s in final),
               "reasons": sorted({r for s in final for r in s["offenders"].get(offender, {}).get("refused", {})}),
               "penalised_by": sum(sc.get(offender, 0) > 0 for sc in scores),
               "honest_refused": sum(len(set(s["offenders"]) - {offender}) for s in final) if behaviour else
               sum(len(s["offenders"]) for s in final),
               "honest": len(honest)}
        if loop == "sapo":
            curves = [[h[1] for h in http_get(n.url + "/sapo/history")["rounds"]] for n in honest]
            out["metric"] = statistics.mean(statistics.mean(c) for c in curves)  # cumulative reward / rounds
            out["identical"] = None
            # what the honest receivers' verifiers made of each source: the offender's completions vs the others'
            seen = [s["sources"].get(offender, {}) for s in final]
            out["source_reward"] = statistics.mean(x["reward"] for x in seen if x.get("reward") is not None) \
                if any(x.get("reward") is not None for x in seen) else None
            out["source_used"] = sum(x.get("used", 0) for x in seen)
        else:
            out["metric"] = final[0]["losses"][-1][1]
            out["identical"] = len({s["final_hash"] for s in final}) == 1
        return out
    finally:
        swarm.close()


def loop_rows(label: str, loop: str, table, n: int, behaviours: list[str], tmp: Path) -> list[tuple]:
    """n peers all honest; the same first n-1 alone (the honest-only baseline every row is compared with); then n-1
    honest + 1 Byzantine per behaviour."""
    keys = tmp / f"keys-{loop}"
    every = run_swarm(loop, table(n), n, tmp, keys, None, name="all-honest")
    alone = run_swarm(loop, table(n - 1), n - 1, tmp, keys, None, name="honest-only")
    rows = [(label, f"none ({n} honest)", every, alone), (label, f"none ({n - 1} honest only)", alone, alone)]
    for b in behaviours:
        rows.append((label, b, run_swarm(loop, table(n), n, tmp, keys, b), alone))
    return rows


def byzantine(args, tmp: Path) -> list[tuple]:
    rows = []
    if "diloco" in args.only:
        rows += loop_rows("DiLoCo 1/4", "diloco", lambda n: DILOCO.format(
            run="byz", rounds=args.diloco_rounds, peers=n, exchange=args.diloco_exchange), 4,
            ["scale100", "nan", "noise", "stale", "same"], tmp)
    if "spsa" in args.only:
        rows += loop_rows("SPSA 1/4", "spsa", lambda n: SPSA.format(run="byz", steps=args.spsa_steps, peers=n), 4,
                          ["extreme", "random"], tmp)
    if "sapo" in args.only:
        rows += loop_rows("SAPO 1/8", "sapo", lambda n: SAPO.format(run="byz", rounds=args.sapo_rounds, peers=n), 8,
                          ["garbage", "wrong"], tmp)
    return rows


def print_byzantine(rows: list[tuple], args) -> None:
    print(f"Byzantine peers in training: DiLoCo {args.diloco_rounds} rounds x 20 inner steps (tinygpt, exchange "
          f"{args.diloco_exchange}); SPSA {args.spsa_steps} steps (tinygpt fine-tune); SAPO {args.sapo_rounds} rounds "
          "(arith). Honest metric: final validation loss (lower is better) or mean reward per round (the cumulative "
          "reward / rounds; higher is better); vs baseline = the same honest identities alone (honest only).")
    print(f"{'loop':<10} | {'offender':<20} | {'honest metric':>13} | {'vs baseline':>11} | {'refused by':>10} | "
          f"{'reasons':<24} | {'penalised by':>12} | {'honest refused':>14} | {'same weights':>12} | {'wall':>6}")
    print("-" * 150)
    for loop, b, r, base in rows:
        ratio = r["metric"] / base["metric"] if base["metric"] else float("nan")
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        print(f"{loop:<10} | {b:<20} | {r['metric']:>13.4f} | {ratio:>11.3f} | "
              f"{r['refused_by']:>4}/{r['honest']:<5} | {','.join(r['reasons']) or '-':<24} | "
              f"{r['penalised_by']:>6}/{r['honest']:<5} | {r['honest_refused']:>14} | {same:>12} | "
              f"{r['wall']:>5.0f}s")
    sapo = [(b, r) for loop, b, r, _ in rows if loop.startswith("SAPO")]
    if sapo:
        print("SAPO: the last peer as a source, at the honest receivers (its completions' mean reward by their own "
              "verifiers, and the groups of it they trained on): " + "; ".join(
                  f"{b}: reward {'-' if r['source_reward'] is None else round(r['source_reward'], 4)}, "
                  f"{r['source_used']} groups used" for b, r in sapo))
    print("goal: every row within 5% of its baseline (loss ratio <= 1.05, reward ratio >= 0.95), the offender "
          "penalised and shown by the honest peers; 'honest refused' counts honest peers refused (goal 0)")


# ------------------------------------------------------------------ partitions and a dead bootstrap
SPLIT_NODE = """
[network]
listen = ["/ip4/0.0.0.0/tcp/4001"]
reachability = "public"
[state]
admission_bits = 12
[http]
listen = "127.0.0.1:8470"
"""


def split_part(args, tmp: Path) -> list[tuple]:
    """16 nodes (the shipped defaults but for the listen address), each in its own namespace on one bridge."""
    import functools

    from splitlab import SplitLab, unavailable
    from swarmproc import http_post

    reason = unavailable()
    if reason:
        raise SystemExit(f"the partition rows need network namespaces: {reason}")
    n, joiners = args.split_nodes, 4
    config = tmp / "split.toml"
    config.write_text(SPLIT_NODE)
    rows = []
    with SplitLab(n + 2 * joiners) as lab:
        swarm = Swarm(tmp / "split", config=config)

        def start(i: int, via: int | None, wait: bool = True):
            boot = [] if via is None else [f"/ip4/{lab.ip[via]}/tcp/4001/p2p/{nodes[via].peer_id}"]
            node = swarm.start(f"h{i}", bootstrap=boot, prefix=lab.cmd(i), via=functools.partial(lab.call, i),
                               wait=wait)
            nodes[i] = node
            return node

        def join(first: int, vias: list[int]) -> float:
            """Start len(vias) nodes at once, each through its own bootstrap; the seconds from the last one ready
            (serving) to every live node listing every other."""
            new = [start(first + k, via, wait=False) for k, via in enumerate(vias)]
            for x in new:
                x.wait_ready(120)
            live.extend(new)
            t = time.monotonic()
            wait_for(lambda: all_visible(live), 180, f"{len(new)} joiners visible everywhere", interval=0.5)
            return time.monotonic() - t

        def digest(node) -> str:
            return node.via(lambda: http_get(node.url + "/state"))["heads_digest"]

        def write(node, key: str) -> None:
            node.via(lambda: http_post(node.url + "/crdt", json_body={"ops": [
                {"object": "kv", "payload": {"k": f"{node.peer_id}/{key}", "v": 1}}]}, token=node.token))

        pool = ThreadPoolExecutor(max_workers=32)

        def sweep(fn, live: list) -> list:
            """fn on every node at once (each read runs in a thread inside that node's namespace)."""
            return list(pool.map(fn, live))

        def all_visible(live: list) -> bool:
            ids = {x.peer_id for x in live}
            return all(m >= ids - {x.peer_id} for x, m in zip(live, sweep(lambda x: x.member_ids(), live)))

        def one_state(live: list) -> bool:
            return len(set(sweep(digest, live))) == 1

        nodes: dict[int, object] = {}
        try:
            start(0, None)
            for i in range(1, n):
                start(i, 0)
            live = [nodes[i] for i in range(n)]
            wait_for(lambda: all_visible(live), 120, f"{n} nodes to list each other", interval=1.0)
            wait_for(lambda: all(x.status()["split"]["known"] >= n - 1 for x in live), 60,
                     "every node to have reached the others")
            # baseline: one write reaches every node, no fault
            t = time.monotonic()
            write(live[0], "baseline")
            wait_for(lambda: one_state(live), 60, "a write to reach everyone", interval=0.1)
            base_converge = time.monotonic() - t
            # the partition
            half = [list(range(n // 2)), list(range(n // 2, n))]
            t, wall = time.monotonic(), time.time()
            lab.partition(half)
            # when each node says it saw the split (its own clock: the same machine's)

            def all_see_it():
                views = sweep(lambda x: x.status()["split"], live)
                return all(v["suspected"] for v in views) and [v["since"] for v in views]
            since = wait_for(all_see_it, 60, "every node to see the split", interval=0.5)
            detected = {i: at - wall for i, at in enumerate(since)}
            write(live[0], "left")
            write(live[-1], "right")
            time.sleep(max(0.0, args.partition_seconds - (time.monotonic() - t)))  # the fault's length, not a wait
            t = time.monotonic()
            lab.heal()
            wait_for(lambda: one_state(live), 120, "the state to converge after the heal", interval=0.1)
            converged = time.monotonic() - t
            wait_for(lambda: all_visible(live), 60, "members complete after the heal", interval=0.5)
            members = time.monotonic() - t
            wait_for(lambda: not any(sweep(lambda x: x.status()["split"]["suspected"], live)), 60,
                     "the split to clear", interval=0.2)
            cleared = time.monotonic() - t
            rows.append(("partition", f"{n} nodes cut in halves for {args.partition_seconds:.0f} s",
                         f"detected by all in {max(detected.values()):.1f} s (median "
                         f"{statistics.median(detected.values()):.1f}); after the heal: state converged in "
                         f"{converged:.1f} s, members complete in {members:.1f} s, split cleared in {cleared:.1f} s",
                         f"one write reaches all {n} in {base_converge:.1f} s",
                         "detected <= 10 s, converged <= 5 s"))
            # joiners through the bootstrap (baseline), then through other members once it is dead
            base_join = join(n, [0] * joiners)
            nodes[0].kill()
            live.remove(nodes[0])
            dead_join = join(n + joiners, list(range(1, 1 + joiners)))
            rows.append(("dead bootstrap", "bootstrap killed for good; 4 join through 4 other members",
                         f"all {len(live)} visible everywhere {dead_join:.1f} s after the 4 were serving",
                         f"4 joining through the live bootstrap: {base_join:.1f} s", "all visible"))
        finally:
            swarm.close()
            pool.shutdown()
    return rows


def print_rows(title: str, rows: list[tuple]) -> None:
    print(title)
    print(f"{'row':<15} | {'fault':<45} | {'measured':<110} | {'same-run baseline':<42} | goal")
    print("-" * 240)
    for name, fault, measured, base, goal in rows:
        print(f"{name:<15} | {fault:<45} | {measured:<110} | {base:<42} | {goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", choices=["byzantine", "split"], default=["byzantine", "split"])
    parser.add_argument("--split-nodes", type=int, default=16)
    parser.add_argument("--partition-seconds", type=float, default=30.0)
    parser.add_argument("--only", nargs="+", default=["diloco", "spsa", "sapo"])
    parser.add_argument("--diloco-rounds", type=int, default=12)
    parser.add_argument("--diloco-exchange", default="auto", choices=["auto", "all-to-all", "scatter"])
    parser.add_argument("--spsa-steps", type=int, default=256)
    parser.add_argument("--sapo-rounds", type=int, default=150)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-chaos-") as tmp:
        if "split" in args.part:
            print_rows("Partitions and a dead bootstrap (network namespaces + iptables, the shipped defaults):",
                       split_part(args, Path(tmp)))
            print()
        if "byzantine" in args.part:
            print_byzantine(byzantine(args, Path(tmp)), args)


if __name__ == "__main__":
    main()
