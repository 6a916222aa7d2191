"""DiLoCo benchmark, one run, peers as separate processes, equal per-peer compute (the same inner steps each):

(a) one peer alone; (b) 4 peers DiLoCo, H=50, 4-bit e3m0; (c) 4 peers Streaming DiLoCo (2 fragments, overlap 5,
alpha 0.5, e3m0); (d) the data-parallel reference: the same 4 peers syncing every step (H=1, fp32, outer SGD with
lr 1 and no momentum, i.e. averaging every step).

Reported: validation loss at the end, bytes each peer sent, and the fraction of wall time a node was not blocked
waiting for a round to close (compute while a fragment is in flight).

    python bench/bench_diloco.py [--steps 500]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from swarmproc import Swarm, loop_config, wait_for  # noqa: E402

CONFIG = """
[loops.diloco]
run = "{run}"
rounds = {rounds}
inner_steps = {h}
fragments = {fragments}
overlap = {overlap}
alpha = {alpha}
codec = "{codec}"
inner_lr = 1e-3
outer_lr = {outer_lr}
outer_momentum = {momentum}
min_peers = {peers}
eval_every = {eval_every}
deadline_low = 5.0
"""


def run(name: str, peers: int, steps: int, root: Path, *, h: int, fragments: int = 1, overlap: int = 0,
        alpha: float = 0.0, codec: str = "e3m0", outer_lr: float = 0.7, momentum: float = 0.9) -> dict:
    table = CONFIG.format(run=name, rounds=steps // h, h=h, fragments=fragments, overlap=overlap, alpha=alpha,
                          codec=codec, outer_lr=outer_lr, momentum=momentum, peers=peers,
                          eval_every=max(1, (steps // h) // 5))
    config = loop_config(root / "diloco.toml", table)
    swarm = Swarm(root / "nodes", config=config)
    try:
        nodes = swarm.start_chain(peers, members_within=None)

        def d(n):
            return n.status()["services"]["diloco"]

        final = wait_for(lambda: all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes], 1200,
                         f"{name} to finish", interval=1.0)
        return {
            "identical": len({s["final_hash"] for s in final}) == 1,
            "resyncs": sum(s.get("resyncs", 0) for s in final),
            "loss": final[0]["losses"][-1][1],
            "bytes": max(s.get("bytes_sent", 0) for s in final),
            "compute": min(s["compute_fraction"] for s in final),
        }
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    s = args.steps
    results = {}
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-diloco-") as tmp:
        root = Path(tmp)
        results["(a) 1 peer alone"] = run("alone", 1, s, root / "a", h=50)
        results["(b) 4 peers DiLoCo H=50 e3m0"] = run("diloco", 4, s, root / "b", h=50)
        results["(c) 4 peers Streaming DiLoCo P=2 tau=5 e3m0"] = run("streaming", 4, s, root / "c", h=50,
                                                                       fragments=2, overlap=5, alpha=0.5)
        results["(d) 4 peers syncing every step (DP ref.)"] = run("dp", 4, s, root / "d", h=1, codec="none",
                                                                  outer_lr=1.0, momentum=0.0)
    dp_bytes = results["(d) 4 peers syncing every step (DP ref.)"]["bytes"]
    print(f"DiLoCo, tiny GPT from scratch, {s} inner steps per peer, validation loss at the end")
    print(f"{'run':<46} | {'val loss':>8} | {'MB sent/peer':>12} | {'DP bytes / bytes':>16} | {'not blocked':>11} | "
          f"{'same weights':>12}")
    print("-" * 123)
    for name, r in results.items():
        ratio = dp_bytes / r["bytes"] if r["bytes"] else float("inf")
        print(f"{name:<46} | {r['loss']:>8.4f} | {r['bytes'] / 1e6:>12.3f} | {ratio:>15.0f}x | "
              f"{r['compute'] * 100:>10.1f}% | {('yes' if r['identical'] else 'NO'):>5} ({r['resyncs']} resyncs)")


if __name__ == "__main__":
    main()
