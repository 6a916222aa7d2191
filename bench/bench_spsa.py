"""SPSA benchmark, one run: 4 peers vs 1 peer at equal steps, wire bytes per step per peer, late-join replay cost.

- loss: target-domain validation loss of the shared weights during the same run (same base model, seed, eps, lr,
  batch) with 4 peer processes and with 1 (the baseline, same run of this script);
- bytes: what each peer publishes per step (its signed window messages and weight-hash messages, framed: all
  overhead included), and what its node sends on the pubsub protocol per step (forwarding included);
- replay: seconds a late joiner spends replaying 1,000 steps of a 4-peer log, next to the seconds a peer spends
  computing 1,000 live steps (its probes), measured in this process.

The task is any of the seam (default ``hf-text``: a small Llama from a transformers config, pretrained here on one
half of the standard library's source, then fine-tuned by SPSA on the other half, its last layer perturbed;
``--task tinygpt`` for the tiny GPT).

    python bench/bench_spsa.py [--steps 384] [--window 96] [--task hf-text] [--task-options '{...}']
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_diloco import toml_options  # noqa: E402
from swarmproc import Swarm, loop_config, wait_for  # noqa: E402

DEFAULT_OPTIONS = {
    "hf-text": {"pretrain_steps": 300, "finetune": "tail", "perturb_layers": 1, "batch": 8, "seq_len": 64,
                "eval_batches": 4, "config": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2}},
    "tinygpt": {"domain": "target", "pretrain_steps": 200},
}

CONFIG = """
[loops.spsa]
run = "{run}"
task = "{task}"
device = "cpu"
checkpoint_every = 0
steps = {steps}
window = {window}
min_peers = {peers}
deadline = 30.0
hash_every = 8
eval_every = 1

[loops.spsa.task_options]
{options}
"""


def run_swarm(peers: int, steps: int, window: int, root: Path, task: str, options: dict) -> dict:
    config = loop_config(root / "spsa.toml", CONFIG.format(run=f"bench{peers}", steps=steps, window=window,
                                                           peers=peers, task=task,
                                                           options=toml_options(options, "loops.spsa.task_options")))
    swarm = Swarm(root / "nodes", config=config)
    try:
        nodes = swarm.start_chain(peers, members_within=None)

        def spsa(n):
            return n.status()["services"]["spsa"]

        final = wait_for(lambda: all(spsa(n)["state"] == "done" for n in nodes) and [spsa(n) for n in nodes],
                         900, f"{peers} peers to finish", interval=1.0)
        if len({s["final_hash"] for s in final}) != 1:
            raise RuntimeError("peers ended with different weights")
        pubsub = [n.status()["traffic"]["bytes_out_by_protocol"].get("/swarmd/pubsub/1.0.0", 0) for n in nodes]
        return {
            "losses": final[0]["losses"],
            "wire_per_step": max(s["wire_bytes_per_step"] for s in final),
            "pubsub_per_step": max(pubsub) / steps,
            "checks": {k: sum(s.get(k, 0) for s in final) for k in ("audited_steps", "rejected_audit",
                                                                    "batches_other_weights", "diverged")},
        }
    finally:
        swarm.close()


def replay_cost(window: int) -> tuple[float, float]:
    import torch

    from swarmd.protocols import tinylm
    from swarmd.protocols.spsa import Weights, encode_grad, step_seed

    torch.set_num_threads(1)
    weights = Weights(tinylm.pretrain(1, steps=0))  # the replay cost per parameter: measured on the tiny GPT
    data = tinylm.encode_text(tinylm.corpus(8, 50_000, target=True))
    steps = 100
    start = time.perf_counter()
    for step in range(steps):
        g = weights.probe(tinylm.batch_at(data, step, 16, weights.model.ctx), step_seed("x", step, "A"), 1e-3)
        encode_grad(g, 100)
    live = (time.perf_counter() - start) / steps * 1000
    start = time.perf_counter()
    for step in range(steps):
        weights.apply("x", step, {p: 0x21 for p in ("A", "B", "C", "D")}, 3e-3)
    replay = (time.perf_counter() - start) / steps * 1000
    return replay, live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=384)
    parser.add_argument("--window", type=int, default=96)
    parser.add_argument("--task", default="hf-text")
    parser.add_argument("--task-options", default=None, help="JSON object (default: this script's for the task)")
    args = parser.parse_args()
    options = json.loads(args.task_options) if args.task_options else DEFAULT_OPTIONS.get(args.task, {})
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-spsa-") as tmp:
        four = run_swarm(4, args.steps, args.window, Path(tmp) / "four", args.task, options)
        one = run_swarm(1, args.steps, args.window, Path(tmp) / "one", args.task, options)
    replay, live = replay_cost(args.window)
    print(f"SPSA, task {args.task} {json.dumps(options)} ({args.steps} steps, window {args.window}): validation "
          "loss of the shared weights")
    print(f"{'step':>6} | {'4 peers':>8} | {'1 peer':>8} | {'4 - 1':>7}")
    print("-" * 38)
    for (step, l4), (_, l1) in zip(four["losses"], one["losses"]):
        print(f"{step:>6} | {l4:>8.4f} | {l1:>8.4f} | {l4 - l1:>+7.4f}")
    print()
    print(f"wire bytes per step per peer, as published (signed, framed, hashes included): "
          f"{four['wire_per_step']:.2f} B (goal <= 4)")
    print(f"pubsub bytes sent per step per node, forwarding included (4 peers): {four['pubsub_per_step']:.1f} B")
    print("checks, summed over the 4 peers (audited steps, batches refused by an audit, batches probed at "
          f"other weights, divergences): {four['checks']}")
    print(f"late-join replay (tiny GPT): {replay:.2f} s per 1,000 steps of a 4-peer log, vs {live:.2f} s to compute "
          f"1,000 live "
          f"steps (ratio {replay / live:.2f})")


if __name__ == "__main__":
    main()
