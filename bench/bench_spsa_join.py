"""What a late SPSA joiner pays for the run's base model: a joiner on the founders' CPU kernels (its base is theirs:
one round trip of hashes) next to one under torch's scalar kernels (``ATEN_CPU_CAPABILITY=default``, a CPU without
AVX2), whose base has other low bits and which pulls the base of the peer it replays from (``spsa-base``), in the
same run of this script.

Two founders (separate processes, loopback) run SPSA on the ``hf-text`` task (a Llama from a transformers config,
random init, no pretraining: the base is the seed's, whole model in the base, its last layer perturbed); once they
pass ``--join-after`` windows a third node joins. Reported per joiner: whether it took a base and how many MB, its
join (``replay_seconds``: the base asked for and pulled where it must be, the log pulled, verified and replayed),
the windows it replayed, the time from its start to following the run, and whether the three end on one weights.

    python bench/bench_spsa_join.py [--hidden 512] [--layers 4] [--window 16] [--windows 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_diloco import toml_options  # noqa: E402
from swarmproc import Swarm, loop_config, wait_for  # noqa: E402

CONFIG = """
[loops.spsa]
run = "{run}"
task = "hf-text"
device = "cpu"
checkpoint_every = 0
steps = {steps}
window = {window}
min_peers = 2
deadline = 30.0
hash_every = 2
eval_every = 100

[loops.spsa.task_options]
{options}
"""


def one(root: Path, kernels: str, args) -> dict:
    options = {"pretrain_steps": 0, "finetune": "tail", "perturb_layers": 1, "batch": 4, "seq_len": 32,
               "eval_batches": 1, "config": {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
                                             "num_hidden_layers": args.layers}}
    config = loop_config(root / "spsa.toml", CONFIG.format(run=f"join-{kernels}", steps=args.window * args.windows,
                                                           window=args.window,
                                                           options=toml_options(options, "loops.spsa.task_options")))
    swarm = Swarm(root / "nodes", config=config)

    def spsa(n):
        return n.status()["services"]["spsa"]

    try:
        nodes = swarm.start_chain(2, members_within=None)
        wait_for(lambda: spsa(nodes[0])["window"] >= args.join_after, 600, f"window {args.join_after}", interval=0.5)
        started = time.monotonic()
        env = {"ATEN_CPU_CAPABILITY": "default"} if kernels == "scalar" else {}
        late = swarm.start("late", bootstrap=[nodes[-1].tcp_addr], env=env)
        joined = wait_for(lambda: spsa(late)["state"] in ("running", "done") and spsa(late), 600, "the joiner",
                          interval=0.2)
        following = time.monotonic() - started
        final = wait_for(lambda: all(spsa(n)["state"] == "done" for n in nodes + [late])
                         and [spsa(n) for n in nodes + [late]], 900, "everyone to finish", interval=1.0)
        taken = joined.get("base_taken")
        return {"kernels": kernels, "taken": taken is not None, "mb": joined.get("base_bytes", 0) / 1e6 if taken else 0,
                "apart": taken["apart"] if taken else 0.0, "join_s": joined["replay_seconds"],
                "windows": joined["replayed_windows"], "following_s": following,
                "same": len({s["final_hash"] for s in final}) == 1,
                "contributed": final[2]["participants"] == 3}
    finally:
        swarm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--windows", type=int, default=14)
    ap.add_argument("--join-after", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for kernels in ("same", "scalar"):
        with tempfile.TemporaryDirectory(prefix="swarmd-bench-spsa-join-") as d:
            rows.append(one(Path(d), kernels, args))
            print(rows[-1], flush=True)
    print(f"SPSA late join, hf-text Llama hidden {args.hidden} x {args.layers} layers (random init), window "
          f"{args.window}, joining after window {args.join_after} of {args.windows}")
    print("joiner's kernels        | base taken | base MB | apart   | join s (base + log + replay) | windows "
          "replayed | start -> following s | same final weights | contributed")
    print("-" * 150)
    for r in rows:
        label = "founders' (baseline)" if r["kernels"] == "same" else "scalar (other bits)"
        print(f"{label:23} | {'yes' if r['taken'] else 'no':10} | {r['mb']:7.1f} | {r['apart']:.1e} | "
              f"{r['join_s']:28.2f} | {r['windows']:16} | {r['following_s']:20.1f} | "
              f"{'yes' if r['same'] else 'NO':18} | {'yes' if r['contributed'] else 'no'}")


if __name__ == "__main__":
    main()
