"""Faults, measured (issue 17): one table from one run, each row next to its fault-free baseline from the same run.

Byzantine peers in training (``--part byzantine``): every row runs the same identities (the honest peers' data,
seeds and policy inits are the same in every row): all n honest, the first n-1 alone (the honest-only baseline),
then the n-1 with a last peer that is ``tests/byzantine_peer.py`` (a node that trains like the others and sends
Byzantine contributions; a test seam outside production code):

- DiLoCo, 1 of 4 peers: its update x100, NaN/Inf, Gaussian noise of the honest update's norm, stale (the update it
  computed 3 rounds before, sent as if fresh), the same update every round; the default exchange for this model size
  (``--diloco-exchange`` picks one);
- SPSA, 1 of 4 peers: the largest allowed |g| with a random sign at every step, a random allowed byte, its honest |g|
  with a random sign (honest-sized noise), or with the opposite sign (ascent);
- SAPO, 1 of 8 peers: garbage completions, or every completion a wrong answer.

Partitions and a dead bootstrap (``--part split``; root: it builds network namespaces): 16 nodes, each in its own
namespace on one bridge, started with the shipped defaults (only the listen address is set); baseline: the time
one write takes to reach all 16. Then the swarm is cut into two halves by iptables for 30 s: the time until every
node reports the split (``/status`` -> ``split.suspected``), a write on each side, the heal, and the time until the
CRDT state is equal everywhere, members are complete and the split cleared. Then 4 nodes join through the
bootstrap (baseline), the bootstrap is killed for good, and 4 more join through 4 other members: the time until
every live node lists every other.

kill -9 at every phase of a loop (``--part kill``, ``--kill-loops diloco spsa sapo``): 3 survivors and a victim that
is ``tests/dying_peer.py`` (it sends itself SIGKILL at a chosen phase once it closed a round with the swarm), restarted
``--kills`` times per phase with the same data dir, then plain; DiLoCo: inner steps, its update travelling, reducing a
part, a checkpoint save, a CRDT append; SPSA: probing a window's steps, its bytes just published, a checkpoint save,
a CRDT append; SAPO: sampling its rollouts, its items just published, a checkpoint save, a CRDT append. Baseline: the
survivors' rounds with the victim alive, in the same run.

Reported per Byzantine row: the honest peers' final validation loss (DiLoCo, SPSA) or mean reward per round (SAPO:
the cumulative reward / rounds), its ratio to the honest-only baseline (the same honest identities alone, goal:
within 5%; the all-honest run is shown too), how many honest peers refused the
offender's contributions and why (``/status`` -> ``offenders``), how many penalised it, and whether the honest peers
ended with identical weights (DiLoCo, SPSA).

    python bench/bench_chaos.py [--part byzantine split kill soak] [--only diloco spsa sapo] [--diloco-rounds 12]
                                [--split-nodes 16] [--partition-seconds 30]
                                [--kill-loops diloco spsa sapo] [--kill-phases ...] [--kills 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
seed = {seed}
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
            entry = [str(BYZANTINE), f"{loop}:{behaviour}"] if behaviour and i == peers - 1 else ["-m", "swarmd"]
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
               "honest": len(honest),
               # what an honest peer was refused for, by whom: a false positive's reasons, kept for the table's notes
               "honest_reasons": sorted({f"{p[:16]}: {','.join(sorted(e.get('refused', {})))}"
                                         for s in final for p, e in s["offenders"].items()
                                         if not behaviour or p != offender})}
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
                          ["extreme", "random", "noise", "inverted"], tmp)
    if "sapo" in args.only:
        # one set of rows per seed (the run's questions and every policy's init): a SAPO run's reward at this size
        # varies more between runs than the goal's 5%, so the rows are also compared averaged over the seeds
        for seed in args.sapo_seeds:
            label = "SAPO 1/8" if len(args.sapo_seeds) == 1 else f"SAPO s{seed}"
            rows += loop_rows(label, "sapo", lambda n, seed=seed: SAPO.format(
                run=f"byz{seed}", seed=seed, rounds=args.sapo_rounds, peers=n), 8, ["garbage", "wrong"],
                tmp / f"sapo-seed{seed}")
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
    seeds = sorted({loop for loop, *_ in rows if loop.startswith("SAPO s")})
    if len(seeds) > 1:  # each row's metric and its baseline's, averaged over the seeds
        print(f"SAPO over {len(seeds)} seeds ({', '.join(x.split()[1] for x in seeds)}): mean honest metric and the "
              "ratio of the means (a row's mean over the baseline's mean)")
        base = statistics.mean(base["metric"] for loop, _, r, base in rows if loop in seeds and r is base)
        for name in dict.fromkeys(b for loop, b, _, _ in rows if loop in seeds):
            runs = [r for loop, b, r, _ in rows if loop in seeds and b == name]
            mean = statistics.mean(r["metric"] for r in runs)
            ratios = [r["metric"] / base_r["metric"] for loop, b, r, base_r in rows if loop in seeds and b == name]
            print(f"{'SAPO mean':<10} | {name:<20} | {mean:>13.4f} | {mean / base:>11.3f} | per seed: "
                  + ", ".join(f"{x:.3f}" for x in ratios) + f" | refused by {sum(r['refused_by'] for r in runs)}"
                  f"/{sum(r['honest'] for r in runs)}, penalised by {sum(r['penalised_by'] for r in runs)}"
                  f"/{sum(r['honest'] for r in runs)}")
    sapo = [(b if len(seeds) < 2 else f"{loop.split()[1]} {b}", r) for loop, b, r, _ in rows if loop.startswith("SAPO")]
    if sapo:
        print("SAPO: the last peer as a source, at the honest receivers (its completions' mean reward by their own "
              "verifiers, and the groups of it they trained on): " + "; ".join(
                  f"{b}: reward {'-' if r['source_reward'] is None else round(r['source_reward'], 4)}, "
                  f"{r['source_used']} groups used" for b, r in sapo))
    for loop, b, r, _ in rows:
        if r.get("honest_reasons"):
            print(f"honest peers refused in {loop} / {b}: " + "; ".join(r["honest_reasons"]))
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
            return node.via(lambda: http_get(node.url + "/state"))["digest"]

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


# ------------------------------------------------------------------ kill -9 at every phase
KILL = """
[loops.diloco]
run = "kill"
rounds = 0
inner_steps = 20
min_peers = 3
inner_lr = 1e-3
deadline_low = 3.0
eval_every = 5
checkpoint_every = 2
exchange = "scatter"
"""
KILL_SPSA = """
[loops.spsa]
run = "kill"
task = "tinygpt"
steps = 0
window = 8
min_peers = 3
deadline = 3.0
hash_every = 4
eval_every = 4
checkpoint_every = 2
[loops.spsa.task_options]
domain = "target"
pretrain_steps = 50
"""
KILL_SAPO = """
[loops.sapo]
run = "kill"
task = "arith"
rounds = 0
min_peers = 3
deadline = 3.0
checkpoint_every = 2
"""
KILL_CONFIGS = {"diloco": KILL, "spsa": KILL_SPSA, "sapo": KILL_SAPO}
DYING = ROOT / "tests" / "dying_peer.py"
PHASES = {"diloco": ["inner", "travel", "reduce", "checkpoint", "crdt"],
          "spsa": ["probe", "published", "checkpoint", "crdt"],
          "sapo": ["rollout", "published", "checkpoint", "crdt"]}
KILL_SETUP = {
    "diloco": "tinygpt, scatter exchange, 20 inner steps, a checkpoint every 2 rounds",
    "spsa": "tinygpt fine-tune, windows of 8 steps, deadline 3 s, a checkpoint every 2 windows",
    "sapo": "arith, 8 questions x 8 completions a round, deadline 3 s, a checkpoint every 2 rounds",
}


def kill_part(args, tmp: Path, loop: str = "diloco") -> dict:
    """3 survivors and a victim run ``loop`` (DiLoCo: tinygpt, scatter, a checkpoint every 2 rounds; SPSA and SAPO:
    ``KILL_SPSA``, ``KILL_SAPO``) while a writer posts CRDT writes to the victim and the survivors in turn.
    Baseline: the survivors' round times with the victim alive. Then per phase the victim is restarted ``--kills``
    times, each time with the same data dir as ``tests/dying_peer.py kill:[<loop>:]<phase>`` (it sends itself
    SIGKILL at that phase once it closed a round with the swarm in that life), and finally as a plain node that must
    rejoin; after each phase the CRDT state must converge with every acknowledged write in it."""
    import random
    import threading

    from swarmd.protocols import checkpoint
    from swarmproc import http_post

    config = loop_config(tmp / f"kill-{loop}.toml", KILL_CONFIGS[loop])
    swarm = Swarm(tmp / f"kill-{loop}", config=config)
    rng = random.Random(9)
    acked: list[str] = []
    write_failures: dict[str, int] = {}
    stop = threading.Event()
    ticks: list[list[tuple[float, int]]] = [[], [], []]  # per survivor: (when first seen, round)
    victim_view: dict = {}
    here: dict = {}

    def d(x) -> dict:
        return x.status()["services"][loop]

    def deadline() -> float:
        """DiLoCo's adaptive deadline as a survivor has it; SPSA's and SAPO's fixed one (KILL_SPSA, KILL_SAPO)."""
        return d(here["survivors"][0]).get("deadline_s", 3.0)

    def poller():
        while not stop.wait(0.25):
            for i, x in enumerate(here["survivors"]):
                try:
                    r = d(x)["round"]
                except Exception:  # noqa: BLE001 - a survivor too busy to answer this time: polled again
                    continue
                if not ticks[i] or ticks[i][-1][1] != r:
                    ticks[i].append((time.monotonic(), r))
            v = here.get("victim")
            if v is not None and v.proc.poll() is None and v.info:
                try:
                    saved = d(v).get("checkpoint") or {}
                    if saved.get("round") is not None:
                        victim_view["saved"] = max(victim_view.get("saved", 0), saved["round"])
                except Exception:  # noqa: BLE001 - dying or starting: polled again
                    pass

    def writer():
        i = 0
        while not stop.wait(0.4):
            v = here.get("victim")
            target = v if i % 2 == 0 and v is not None and v.info and v.proc.poll() is None \
                else rng.choice(here["survivors"])
            key = f"{target.peer_id}/kill/{i}"
            try:
                http_post(target.url + "/crdt", json_body={"ops": [{"object": "kv", "payload": {"k": key, "v": i}}]},
                          token=target.token, timeout=10)
                acked.append(key)
            except Exception:  # noqa: BLE001 - a write to a node being killed: not acknowledged, counted
                kind = "to the victim" if target is v else "to a survivor"
                write_failures[kind] = write_failures.get(kind, 0) + 1
            i += 1

    def rounds_between(t0: float, t1: float) -> tuple[int, list[float]]:
        """Rounds the survivors closed in [t0, t1] (the median over survivors) and every round's duration."""
        closed, durations = [], []
        for seen in ticks:
            inside = [(t, r) for t, r in seen if t0 <= t <= t1]
            closed.append(len(inside))
            durations += [b[0] - a[0] for a, b in zip(seen, seen[1:]) if t0 <= a[0] and b[0] <= t1]
        return int(statistics.median(closed)), durations

    def converged() -> int:
        """Waits for one CRDT state everywhere; returns how many acknowledged writes some node lacks. The writes
        acknowledged before the wait: one acknowledged after it began may still be on its way once the digests are
        equal (the writer goes on meanwhile), and would count as lost when it is not (hence the list is taken before
        the wait). Each missing key is printed."""
        everyone = [*here["survivors"], here["victim"]]
        want = set(acked)
        wait_for(lambda: len({x.get("/state")["digest"] for x in everyone}) == 1, 120,
                 "the CRDT state to converge", interval=0.5)
        missing = set().union(*(want - set(x.get("/state")["objects"].get("kv", {})) for x in everyone))
        if missing:
            print(f"kill bench: acknowledged writes missing: {sorted(missing)}", file=sys.stderr, flush=True)
        return len(missing)

    def start_victim(entry: list[str]):
        log = tmp / f"kill-{loop}" / "victim.log"
        log_from = log.stat().st_size if log.exists() else 0
        v = swarm.start("victim", bootstrap=[here["survivors"][0].tcp_addr], entry=entry, wait=False)
        v.log_from = log_from
        v.wait_ready(120)
        here["victim"] = v
        return v

    def rejoined_plain(v) -> bool:
        """A plain restart rejoined. DiLoCo: it is at the survivors' round and some survivor closed a round with 4.
        SPSA and SAPO: some survivor closed a round (window) after the restart with the victim's contribution in it
        (its bytes, or its new items: SAPO's rounds are each peer's own)."""
        if loop == "diloco":
            mine = d(v)["round"]
            theirs = [d(x) for x in here["survivors"]]
            return mine >= max(t["round"] for t in theirs) - 1 and any(
                h["participants"] == 4 and h["round"] > here["restart_round"] for t in theirs for h in t["history"])
        for x in here["survivors"]:
            view = next(lp for lp in x.get("/dashboard")["loops"] if lp["service"] == loop)
            if any(e["closed_at"] >= here["restart_wall"] and v.peer_id in e["peers"]["participants"]
                   for e in view["timeline"]):
                return True
        return False

    out = {"phases": {}}
    threads = []
    try:
        survivors = swarm.start_chain(3, members_within=120)
        here["survivors"] = survivors
        victim = start_victim(["-m", "swarmd"])
        identity = victim.peer_id
        threads = [threading.Thread(target=poller, daemon=True), threading.Thread(target=writer, daemon=True)]
        for t in threads:
            t.start()
        wait_for(lambda: all(d(x)["round"] >= 2 for x in [*survivors, victim]), 600, "4 nodes to close 2 rounds",
                 interval=1.0)
        t0 = time.monotonic()
        start_round = d(survivors[0])["round"]
        wait_for(lambda: d(survivors[0])["round"] >= start_round + args.kill_baseline_rounds, 900,
                 "the baseline rounds", interval=0.5)
        base_closed, base_durations = rounds_between(t0, time.monotonic())
        out["baseline"] = {"round_s": statistics.median(base_durations), "max_s": max(base_durations),
                           "rounds": base_closed, "deadline_s": deadline()}
        print(f"kill bench: baseline round {out['baseline']['round_s']:.2f} s", file=sys.stderr, flush=True)
        victim.stop()
        for phase in [p for p in PHASES[loop] if p in args.kill_phases]:
            t_phase = time.monotonic()
            res = {"kills": 0, "armed": 0, "hows": {}, "same_identity": 0, "weights_lost": 0,
                   "checkpoint_unreadable": 0, "deaths_timed_out": 0, "ignored_own_checkpoint": 0}
            for k in range(args.kills):
                victim_view.clear()
                v = start_victim([str(DYING), f"kill:{phase}" if loop == "diloco" else f"kill:{loop}:{phase}"])
                res["same_identity"] += v.peer_id == identity
                try:
                    wait_for(lambda: v.proc.poll() is not None, 300, f"the victim to die at {phase}", interval=0.2)
                except AssertionError:
                    res["deaths_timed_out"] += 1
                    v.kill()
                v._log.close()
                text = v.log_path.read_text(errors="replace")[v.log_from:]
                res["kills"] += v.proc.returncode == -9 and "dying_peer: kill at" in text
                res["armed"] += "dying_peer: armed" in text
                res["ignored_own_checkpoint"] += "ignoring our checkpoint" in text
                for line in text.splitlines():
                    if line.startswith("dying_peer: kill at"):
                        how = line.rsplit(":", 1)[1].split()[0] if phase in ("checkpoint", "crdt") else "-"
                        res["hows"][how] = res["hows"].get(how, 0) + 1
                # the weights it saved: the file on disk must load and be at least as new as the last save it said
                path = checkpoint.path_for(v.data_dir, loop, "kill")
                try:
                    meta = checkpoint.load(path)[1] if path.exists() else {"round": 0}
                    if meta["round"] < victim_view.get("saved", 0):
                        res["weights_lost"] += 1
                except checkpoint.CheckpointError:
                    res["checkpoint_unreadable"] += 1
                print(f"kill bench: {phase} {k + 1}/{args.kills}: {text.strip().splitlines()[-1][:100]}",
                      file=sys.stderr, flush=True)
            here["restart_round"] = d(survivors[0])["round"]
            here["restart_wall"] = time.time()
            t_restart = time.monotonic()
            v = start_victim(["-m", "swarmd"])
            res["same_identity"] += v.peer_id == identity
            try:
                wait_for(lambda: rejoined_plain(v), 300, "the plain restart to rejoin", interval=0.5)
                res["final_rejoined"] = True
                res["final_rejoin_s"] = time.monotonic() - t_restart
            except AssertionError:
                res["final_rejoined"] = False
            t_end = time.monotonic()
            closed, durations = rounds_between(t_phase, t_end)
            res.update({"wall": t_end - t_phase, "closed": closed, "round_s": statistics.mean(durations),
                        "max_s": max(durations), "deadline_s": deadline(),
                        "ops_missing": converged(), "acked": len(acked)})
            out["phases"][phase] = res
            print(f"kill bench: {phase}: {res}", file=sys.stderr, flush=True)
            v.stop()
        out["write_failures"] = write_failures
        out["survivor_counters"] = [{k: c for k, c in d(x).items() if k in (
            "deadline_missed", "pull_failed", "chunks_missing", "resyncs", "diverged", "parts_fallback",
            "parts_from_other_holders", "late_updates", "joins_ignored", "peers_missed", "hash_mismatches",
            "rejected_audit", "equivocation", "rejected_malformed", "coordinator_missing", "coordinator_too_late",
            "announcements_asked_early", "parts_coordinator_gone", "parts_coordinator_missing")} for x in survivors]
        return out
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        swarm.close()


def print_kill(r: dict, args, loop: str = "diloco") -> None:
    b = r["baseline"]
    name = {"diloco": "DiLoCo", "spsa": "SPSA", "sapo": "SAPO"}[loop]
    print(f"kill -9 at each {name} phase: 3 survivors + 1 victim ({KILL_SETUP[loop]}) and CRDT writes every 0.4 s "
          f"alternately to the victim and a survivor; per "
          f"phase the victim is killed {args.kills} times (SIGKILL it sends itself at the phase, once it rejoined), "
          f"each time restarted at once with the same data dir, then restarted plain. Same-run baseline: the "
          f"survivors' median round {b['round_s']:.2f} s (max {b['max_s']:.2f} s) with the victim alive, over "
          f"{b['rounds']} rounds.")
    print(f"{'phase':<11} | {'kills':>5} | {'how':<26} | {'rejoined':>9} | {'same id':>7} | {'rounds closed':>13} | "
          f"{'round s (vs base)':>17} | {'lost/kill':>9} | {'longest':>8} | {'ops lost':>8} | {'weights lost':>12} | "
          f"{'wall':>6}")
    print("-" * 150)
    for phase, x in r["phases"].items():
        hows = ",".join(f"{h} {c}" for h, c in sorted(x["hows"].items())) if set(x["hows"]) != {"-"} else "-"
        rejoined = x["armed"] + bool(x.get("final_rejoined"))
        print(f"{phase:<11} | {x['kills']:>2}/{args.kills:<2} | {hows:<26} | "
              f"{rejoined:>4}/{args.kills + 1:<4} | {x['same_identity']:>3}/{args.kills + 1:<3} | {x['closed']:>13} | "
              f"{x['round_s']:>6.2f} ({x['round_s'] / b['round_s']:>5.2f}x) | "
              f"{x['closed'] * (x['round_s'] - b['round_s']) / max(1, x['kills']):>8.1f}s | {x['max_s']:>7.1f}s | "
              f"{x['ops_missing']:>8} | {x['weights_lost'] + x['checkpoint_unreadable']:>12} | {x['wall']:>5.0f}s")
    print("rejoined: restarts that closed a round with the swarm (each killed life did before it died; the last, "
          "plain restart too); rounds closed: by the survivors while the phase ran; lost/kill: the survivors' time "
          "lost per kill, (their mean round - the baseline's) x rounds closed / kills; longest: the survivors' longest "
          f"round ({'their adaptive' if loop == 'diloco' else 'the'} deadline: {b['deadline_s']:.1f} s); ops lost: "
          "acknowledged CRDT writes missing "
          "anywhere once the state converged (goal 0); weights "
          "lost: the victim's checkpoint on disk unreadable or older than its last reported save (goal 0)")
    print(f"write failures (not acknowledged, so not counted as lost): {r['write_failures'] or 'none'}; "
          f"survivors' fault counters: {r['survivor_counters']}")


# ------------------------------------------------------------------ the soak
SOAK = """
[loops.diloco]
run = "soak"
rounds = 0
inner_steps = {inner}
min_peers = {peers}
inner_lr = 1e-3
deadline_low = 3.0
eval_every = 10
checkpoint_every = 10
exchange = "{exchange}"
"""


def usage(pid: int) -> dict:
    """RSS (MB) and open file descriptors of a node's process and of its children (the p2p daemon)."""
    import psutil

    proc = psutil.Process(pid)
    kids = proc.children(recursive=True)
    return {"rss": proc.memory_info().rss / 1e6, "fds": proc.num_fds(), "sockets": sockets(pid),
            "kid_rss": sum(k.memory_info().rss for k in kids) / 1e6, "kid_fds": sum(k.num_fds() for k in kids)}


def sockets(pid: int) -> int:
    """How many of a process's open fds are sockets (the rest: files, pipes, event fds)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def log_kinds(text: str) -> dict[str, int]:
    """WARNING/ERROR lines and tracebacks in a node's log, by kind: the logger and the message's first words with
    numbers, ids and addresses blanked (one kind per distinct complaint, not per peer)."""
    import re

    kinds: dict[str, int] = {}
    for line in text.splitlines():
        m = re.search(r"\b(WARN|WARNING|ERROR|CRITICAL)\b\s+(.*)", line)
        if line.startswith("Traceback"):
            key = "Traceback"
        elif m:
            words = re.sub(r"(/ip[46]/\S+|12D3Koo\w+|\b[0-9a-f]{8,}\b|\d+(\.\d+)?)", "#", m.group(2)).split()
            key = f"{m.group(1)} {' '.join(words[:7])}"
        else:
            continue
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def soak_part(args, tmp: Path) -> dict:
    """n nodes on loopback run DiLoCo (tinygpt, until stopped) while a writer posts CRDT writes to random nodes; the
    writes start once every node closed ``--soak-warmup`` rounds (imports, the model, the first exchanges and the
    first checkpoint done: the steady state's start); the clock starts 2 rounds later and runs ``--soak-minutes``."""
    import random
    import threading

    from swarmproc import http_post

    n, seconds = args.soak_nodes, args.soak_minutes * 60
    config = loop_config(tmp / "soak.toml", SOAK.format(inner=args.soak_inner_steps, peers=n,
                                                         exchange=args.soak_exchange))
    swarm = Swarm(tmp / "soak", config=config)
    rng = random.Random(17)
    acked, failed, stop = [], {}, threading.Event()
    rounds: list[dict[int, int]] = [dict() for _ in range(n)]  # per node: round -> participants

    def writer(nodes):
        i = 0
        while not stop.wait(1.0 / args.soak_writes):
            node = rng.choice(nodes)
            key = f"{node.peer_id}/soak/{i}"  # kv is namespaced: a node writes under its own id
            try:
                http_post(node.url + "/crdt", json_body={"ops": [{"object": "kv", "payload": {"k": key, "v": i}}]},
                          token=node.token)
                acked.append(key)
            except Exception as e:  # noqa: BLE001 - counted by kind, shown in the table
                failed[type(e).__name__] = failed.get(type(e).__name__, 0) + 1
            i += 1

    def poll(nodes) -> list[dict]:
        views = [x.status()["services"]["diloco"] for x in nodes]
        for seen, v in zip(rounds, views):
            for h in v["history"]:
                seen[h["round"]] = h["participants"]
        return views

    try:
        nodes = swarm.start_chain(n, members_within=120)
        wait_for(lambda: all(v["round"] >= 1 for v in poll(nodes)), 900, f"{n} nodes to close a first round",
                 interval=2.0)
        first_round = [usage(x.pid) for x in nodes]
        wait_for(lambda: all(v["round"] >= args.soak_warmup for v in poll(nodes)), 1800,
                 f"{n} nodes to close {args.soak_warmup} rounds", interval=2.0)
        # the writes start 2 rounds before the start sample: the soak's load from its first sample on (taken before
        # the writes, the start sample read 53 open fds a node, against 65 a minute into them)
        writes = threading.Thread(target=writer, args=(nodes,), daemon=True)
        writes.start()
        wait_for(lambda: all(v["round"] >= args.soak_warmup + 2 for v in poll(nodes)), 600,
                 f"{n} nodes to close 2 rounds under the writes", interval=2.0)
        start = [usage(x.pid) for x in nodes]
        first = [v["round"] for v in poll(nodes)]
        t0, samples = time.monotonic(), []
        while time.monotonic() - t0 < seconds:
            time.sleep(min(30.0, max(0.0, seconds - (time.monotonic() - t0))))  # the soak's length, not a wait
            views = poll(nodes)
            now = [usage(x.pid) for x in nodes]
            samples.append((time.monotonic() - t0, now))
            print(f"soak {time.monotonic() - t0:6.0f} s: rounds {min(v['round'] for v in views)}-"
                  f"{max(v['round'] for v in views)}, rss {statistics.median(u['rss'] for u in now):.0f} MB "
                  f"(max {max(u['rss'] for u in now):.0f}), fds {max(u['fds'] for u in now)}, "
                  f"writes {len(acked)}", file=sys.stderr, flush=True)
        stop.set()
        writes.join()
        end = [usage(x.pid) for x in nodes]
        views = poll(nodes)

        def kv_keys(x) -> int:
            kv = x.get("/state")["objects"].get("kv", {})
            return sum(1 for k in kv if "/soak/" in str(k))
        wait_for(lambda: len({x.get("/state")["digest"] for x in nodes}) == 1, 120,
                 "the CRDT state to be equal everywhere", interval=0.5)
        kept = [kv_keys(x) for x in nodes]
        statuses = [x.status() for x in nodes]
        last = [v["round"] for v in views]
        closed = max(last)
        short = sorted({r for seen in rounds for r, p in seen.items() if p < n})
        kinds: dict[str, int] = {}
        for x in nodes:
            for k, c in log_kinds(x.log_path.read_text(errors="replace")).items():
                kinds[k] = kinds.get(k, 0) + c
        errors: dict[str, int] = {}
        for st in statuses:
            for k, c in {**st.get("errors", {}), **{f"penalty:{p}": c for p, c in st.get("penalties", {}).items()},
                         **{f"diloco:{c}": v for c, v in st["services"]["diloco"].items() if isinstance(v, int) and
                            c in ("deadline_missed", "pull_failed", "chunks_missing", "resyncs", "diverged",
                                  "late_updates", "parts_disputed", "parts_fallback", "reduced_parts_rejected",
                                  "rejected_base", "updates_withheld")}}.items():
                if c:
                    errors[k] = errors.get(k, 0) + c
        return {"n": n, "minutes": args.soak_minutes, "first_round": first_round, "start": start, "end": end,
                "samples": samples,
                "rounds_first": first, "rounds_last": last, "closed": closed, "short_rounds": short,
                "acked": len(acked), "failed": failed, "kept": kept, "log_kinds": kinds, "errors": errors,
                "alive": sum(x.proc.poll() is None for x in nodes),
                "rounds_seen": [len(seen) for seen in rounds]}
    finally:
        stop.set()
        swarm.close()


def print_soak(r: dict, args) -> None:
    def growth(key: str) -> list[float]:
        return [(e[key] - s[key]) / s[key] * 100 if s[key] else 0.0 for s, e in zip(r["start"], r["end"])]

    print(f"Soak: {r['n']} nodes on loopback, DiLoCo (tinygpt, {args.soak_inner_steps} inner steps, exchange "
          f"{args.soak_exchange}, min_peers {r['n']}, checkpoint every 10 rounds) and {args.soak_writes} CRDT "
          f"writes/s to random nodes, for {r['minutes']:.0f} min from the moment every node closed round "
          f"{args.soak_warmup} and then 2 more under the writes (start: warm, past the first checkpoint with the "
          f"defaults, under the soak's load) to the end; per node, "
          f"median [max] over the {r['n']} nodes:")
    print(f"{'measure':<34} | {'start':>16} | {'end':>16} | {'growth':>22} | goal")
    print("-" * 110)
    for key, label, unit in (("rss", "RSS, node process", "MB"), ("kid_rss", "RSS, its p2p daemon", "MB"),
                             ("fds", "open fds, node process", ""), ("sockets", "  of which sockets", ""),
                             ("kid_fds", "open fds, its p2p daemon", "")):
        s = [u[key] for u in r["start"]]
        e = [u[key] for u in r["end"]]
        g = growth(key)
        print(f"{label:<34} | {statistics.median(s):>8.0f} [{max(s):>5.0f}] | {statistics.median(e):>8.0f} "
              f"[{max(e):>5.0f}] | {statistics.median(g):>+10.1f}% [{max(g):>+6.1f}%] | < 10% {unit}")
    # a count of connections and streams is a level that moves from moment to moment: its growth is also shown
    # between the mean of each node's first and last K samples (K = 10: 5 minutes of 30-s samples)
    k = min(10, len(r["samples"]) // 2)
    if k:
        for key, label in (("fds", "open fds, node"), ("kid_fds", "open fds, p2p daemon")):
            first = [statistics.mean(us[i][key] for _, us in r["samples"][:k]) for i in range(r["n"])]
            last = [statistics.mean(us[i][key] for _, us in r["samples"][-k:]) for i in range(r["n"])]
            g = [(b - a) / a * 100 if a else 0.0 for a, b in zip(first, last)]
            name = f"{label}, mean of {k} samples"
            print(f"{name:<34} | {statistics.median(first):>8.1f} [{max(first):>5.0f}] | "
                  f"{statistics.median(last):>8.1f} [{max(last):>5.0f}] | {statistics.median(g):>+10.1f}% "
                  f"[{max(g):>+6.1f}%] | < 10%")
    done = [b - a for a, b in zip(r["rounds_first"], r["rounds_last"])]
    short = f" {r['short_rounds'][:20]}" if r["short_rounds"] else ""
    print(f"rounds: the swarm closed {r['closed']} (each node {min(r['rounds_last'])}-{max(r['rounds_last'])}); "
          f"during the soak each node closed {min(done)}-{max(done)}; rounds some node closed with fewer than "
          f"{r['n']} participants: {len(r['short_rounds'])}{short}; "
          f"nodes alive at the end: {r['alive']}/{r['n']}")
    print(f"CRDT writes: {r['acked']} acknowledged, failed {r['failed'] or 0}; after the soak every node holds "
          f"{min(r['kept'])}-{max(r['kept'])} of them (ops lost: {r['acked'] - min(r['kept'])}; goal 0)")
    print("errors by kind (summed over nodes; /status errors and penalties, DiLoCo fault counters): " +
          (", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items(), key=lambda kv: -kv[1])) or "none"))
    print("log lines by kind (WARNING/ERROR, summed over nodes): " +
          ("; ".join(f"{v}x {k}" for k, v in sorted(r["log_kinds"].items(), key=lambda kv: -kv[1])[:15]) or "none"))
    marks = [(-1.0, r["first_round"]), (0.0, r["start"])] + r["samples"][::max(1, len(r["samples"]) // 6)]
    def over_time(key: str) -> str:
        return ", ".join(f"{'round 1' if t < 0 else f'{t / 60:.0f} min'} {statistics.median(u[key] for u in us):.0f}/"
                         f"{max(u[key] for u in us):.0f}" for t, us in marks)
    print("RSS of the node processes over time (median/max MB; 'round 1': when every node closed its first round): "
          + over_time("rss"))
    print("open fds of the node processes over time (median/max): " + over_time("fds"))


def print_rows(title: str, rows: list[tuple]) -> None:
    print(title)
    print(f"{'row':<15} | {'fault':<45} | {'measured':<110} | {'same-run baseline':<42} | goal")
    print("-" * 240)
    for name, fault, measured, base, goal in rows:
        print(f"{name:<15} | {fault:<45} | {measured:<110} | {base:<42} | {goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", choices=["byzantine", "split", "soak", "kill"],
                        default=["byzantine", "split"])
    parser.add_argument("--split-nodes", type=int, default=16)
    parser.add_argument("--partition-seconds", type=float, default=30.0)
    parser.add_argument("--only", nargs="+", default=["diloco", "spsa", "sapo"])
    parser.add_argument("--diloco-rounds", type=int, default=12)
    parser.add_argument("--diloco-exchange", default="auto", choices=["auto", "all-to-all", "scatter"])
    parser.add_argument("--spsa-steps", type=int, default=256)
    parser.add_argument("--sapo-rounds", type=int, default=150)
    parser.add_argument("--sapo-seeds", type=int, nargs="+", default=[1],
                        help="SAPO's rows once per seed, then averaged over them (default: seed 1 only)")
    parser.add_argument("--kills", type=int, default=20, help="kills per phase")
    parser.add_argument("--kill-loops", nargs="+", default=["diloco"], choices=list(PHASES))
    every_phase = sorted({p for phases in PHASES.values() for p in phases})
    parser.add_argument("--kill-phases", nargs="+", default=every_phase, choices=every_phase,
                        help="phases to kill at (each loop runs those it has)")
    parser.add_argument("--kill-baseline-rounds", type=int, default=10)
    parser.add_argument("--soak-nodes", type=int, default=16)
    parser.add_argument("--soak-minutes", type=float, default=30.0)
    parser.add_argument("--soak-inner-steps", type=int, default=20)
    parser.add_argument("--soak-warmup", type=int, default=11,
                        help="rounds closed everywhere before the writes start (the start sample: 2 rounds later)")
    parser.add_argument("--soak-exchange", default="scatter", choices=["auto", "all-to-all", "scatter"])
    parser.add_argument("--soak-writes", type=float, default=2.0, help="CRDT writes per second, to random nodes")
    parser.add_argument("--keep", type=Path, default=None,
                        help="run in this directory and keep it (the nodes' data dirs and logs), not a temporary one")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(args.keep)) if args.keep is not None
          else tempfile.TemporaryDirectory(prefix="swarmd-bench-chaos-")) as tmp:
        if "split" in args.part:
            print_rows("Partitions and a dead bootstrap (network namespaces + iptables, the shipped defaults):",
                       split_part(args, Path(tmp)))
            print()
        if "byzantine" in args.part:
            print_byzantine(byzantine(args, Path(tmp)), args)
            print()
        if "kill" in args.part:
            for loop in args.kill_loops:
                print_kill(kill_part(args, Path(tmp), loop), args, loop)
                print()
        if "soak" in args.part:
            print_soak(soak_part(args, Path(tmp)), args)


if __name__ == "__main__":
    main()
