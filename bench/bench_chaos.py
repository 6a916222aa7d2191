"""Faults, measured (issue 17): one table from one run, each row next to its fault-free baseline from the same run.

Byzantine peers in training (``--part byzantine``, the default): every row runs the same identities (the honest
peers' data, seeds and policy inits are the same in every row), once with the last peer honest (the baseline), then
with the last peer replaced by ``tests/byzantine_peer.py`` (a node that trains like the others and sends Byzantine
contributions; a test seam outside production code):

- DiLoCo, 1 of 4 peers: its update x100, NaN/Inf, Gaussian noise of the honest update's norm, stale (the update it
  computed 3 rounds before, sent as if fresh), the same update every round; the default exchange for this model size
  (``--diloco-exchange`` picks one);
- SPSA, 1 of 4 peers: the largest allowed |g| with a random sign at every step, or a random allowed byte;
- SAPO, 1 of 8 peers: garbage completions, or every completion a wrong answer.

Reported per row: the honest peers' final validation loss (DiLoCo, SPSA) or mean reward over the last third of the
rounds (SAPO), its ratio to the baseline (goal: within 5%), how many honest peers refused the offender's
contributions and why (``/status`` -> ``offenders``), how many penalised it, and whether the honest peers ended with
identical weights (DiLoCo, SPSA).

    python bench/bench_chaos.py [--part byzantine] [--only diloco spsa sapo] [--diloco-rounds 12]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
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
              timeout: float = 1500) -> dict:
    """``peers`` nodes with the identities in ``keys`` (made by the first call), the last one Byzantine if
    ``behaviour``; waits for the honest ones to finish and reads what they saw."""
    name = behaviour or "honest"
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
            third = max(1, len(curves[0]) // 3)
            out["metric"] = statistics.mean(statistics.mean(c[-third:]) for c in curves)
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


def byzantine(args, tmp: Path) -> list[tuple]:
    rows = []
    if "diloco" in args.only:
        table = DILOCO.format(run="byz", rounds=args.diloco_rounds, peers=4, exchange=args.diloco_exchange)
        keys = tmp / "keys-diloco"
        base = run_swarm("diloco", table, 4, tmp, keys, None)
        rows.append(("DiLoCo 1/4", "none (baseline)", base, base))
        for b in ("scale100", "nan", "noise", "stale", "same"):
            rows.append(("DiLoCo 1/4", b, run_swarm("diloco", table, 4, tmp, keys, b), base))
    if "spsa" in args.only:
        table = SPSA.format(run="byz", steps=args.spsa_steps, peers=4)
        keys = tmp / "keys-spsa"
        base = run_swarm("spsa", table, 4, tmp, keys, None)
        rows.append(("SPSA 1/4", "none (baseline)", base, base))
        for b in ("extreme", "random"):
            rows.append(("SPSA 1/4", b, run_swarm("spsa", table, 4, tmp, keys, b), base))
    if "sapo" in args.only:
        table = SAPO.format(run="byz", rounds=args.sapo_rounds, peers=8)
        keys = tmp / "keys-sapo"
        base = run_swarm("sapo", table, 8, tmp, keys, None)
        rows.append(("SAPO 1/8", "none (baseline)", base, base))
        for b in ("garbage", "wrong"):
            rows.append(("SAPO 1/8", b, run_swarm("sapo", table, 8, tmp, keys, b), base))
    return rows


def print_byzantine(rows: list[tuple], args) -> None:
    print(f"Byzantine peers in training: DiLoCo {args.diloco_rounds} rounds x 20 inner steps (tinygpt, exchange "
          f"{args.diloco_exchange}); SPSA {args.spsa_steps} steps (tinygpt fine-tune); SAPO {args.sapo_rounds} rounds "
          "(arith). Honest metric: final validation loss (lower is better) or mean reward over the last third of "
          "the rounds (higher is better); vs baseline = the same honest identities with an honest last peer.")
    print(f"{'loop':<10} | {'offender':<16} | {'honest metric':>13} | {'vs baseline':>11} | {'refused by':>10} | "
          f"{'reasons':<24} | {'penalised by':>12} | {'honest refused':>14} | {'same weights':>12} | {'wall':>6}")
    print("-" * 150)
    for loop, b, r, base in rows:
        ratio = r["metric"] / base["metric"] if base["metric"] else float("nan")
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        print(f"{loop:<10} | {b:<16} | {r['metric']:>13.4f} | {ratio:>11.3f} | "
              f"{r['refused_by']:>4}/{r['honest']:<5} | {','.join(r['reasons']) or '-':<24} | "
              f"{r['penalised_by']:>6}/{r['honest']:<5} | {r['honest_refused']:>14} | {same:>12} | "
              f"{r['wall']:>5.0f}s")
    sapo = [(b, r) for loop, b, r, _ in rows if loop.startswith("SAPO")]
    if sapo:
        print("SAPO: the last peer as a source, at the honest receivers (its completions' mean reward by their own "
              "verifiers, and the groups of it they trained on): " + "; ".join(
                  f"{b}: reward {r['source_reward'] if r['source_reward'] is not None else '-'}, "
                  f"{r['source_used']} groups used" for b, r in sapo))
    print("goal: every row within 5% of its baseline (loss ratio <= 1.05, reward ratio >= 0.95), the offender "
          "penalised and shown by the honest peers; 'honest refused' counts honest peers refused (goal 0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["byzantine"], default="byzantine")
    parser.add_argument("--only", nargs="+", default=["diloco", "spsa", "sapo"])
    parser.add_argument("--diloco-rounds", type=int, default=12)
    parser.add_argument("--diloco-exchange", default="auto", choices=["auto", "all-to-all", "scatter"])
    parser.add_argument("--spsa-steps", type=int, default=256)
    parser.add_argument("--sapo-rounds", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-chaos-") as tmp:
        rows = byzantine(args, Path(tmp))
    print_byzantine(rows, args)


if __name__ == "__main__":
    main()
