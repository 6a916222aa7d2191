"""SAPO benchmark, one run: cumulative reward with rollout sharing (4 local / 4 external) vs without (8 / 0).

8 peers, each a separate node process with its own policy (different random inits), on loopback. Per seed, the
same 8 identities (hence the same policy inits and the same questions) run the baseline, I/J = 8/0 (every peer
trains on its own 8 groups; it still publishes, nobody uses them), then I/J = 4/4 (4 own groups, the informative
ones first, and 4 drawn from what others shared, re-scored by the receiver's verifier). Same generation compute
per round in both: 8 questions x 8 completions. Metric (the SAPO paper's): cumulative reward, the per-round mean
reward of a peer's own rollouts summed over rounds, averaged over the 8 peers. Sharing must win on every seed.

The task is any SAPO task of the seam: ``reasoning-gym`` by default, questions regenerated and scored by
reasoning-gym on every receiver, on sparse datasets (``--datasets sparse``, the default: chain_sum over 1-2 digits
and lcm of 2-12, where a random policy answers about 2% right; SAPO's gain comes from peers whose own groups mostly
score all 0, protocols.md 2.5) or the task's own single-digit chain_sum and products (``--datasets default``);
``--task arith`` for the built-in arithmetic. ``--task hf-lm``: each peer's policy a transformers causal LM
(``protocols.tasks.hf_policy``; ``--model tiny``, a 2-layer llama built from a config, or ``0.5b``, a Qwen2-0.5B-class
config, random init: no weights can be downloaded) on the same reasoning-gym datasets, first fitted to the datasets'
reference answers of its own questions for ``--sft-steps`` steps (a supervised warm-up on the task, in each peer, so
rewards are not all zero from the start), then trained by GRPO on its rollouts and, in 4/4, its peers'.

    python bench/bench_sapo.py [--rounds 300] [--seeds 1 2] [--peers 8] [--task reasoning-gym] [--datasets sparse]
    python bench/bench_sapo.py --task hf-lm [--peers 4] [--rounds 60] [--seeds 1 2 3 4 5 6] [--sft-steps 400]
                               [--model tiny] [--device cpu]
    python bench/bench_sapo.py --task hf-lm --seeds 1 2 3 --sft-steps 150   # the earlier, sparser regime
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_diloco import toml_options  # noqa: E402
from swarmproc import Swarm, http_get, loop_config, wait_for  # noqa: E402

CONFIG = """
[loops.sapo]
run = "{run}"
seed = {seed}
rounds = {rounds}
local = {local}
external = {external}
min_peers = {peers}
deadline = 10.0
task = "{task}"
device = "{device}"
checkpoint_every = 0
{datasets}"""

# --datasets sparse: answers of 2-3 characters that a random policy gets right about 2% of the time, so most of a
# peer's own groups score all 0 early on (about 1 in 5 is informative at a random init, against 2 in 5 with the
# task's default single-digit datasets): the regime the SAPO paper's gain comes from (protocols.md 2.5)
DATASETS = {
    "default": None,  # the task's own (reasoning-gym: chain_sum and products over single digits)
    "sparse": {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
               "lcm": {"min_value": 2, "max_value": 12}},
}


# --task hf-lm: the regime (chosen on seeds 1-3 only, docs/benchmarks/sapo.md): enough supervised warm-up that a
# peer's own groups are informative about half the time (mean reward ~0.1-0.15 in the swarm; 150 steps gave ~0.05-0.07)
HF_LM = {"peers": 4, "rounds": 60, "seeds": [1, 2, 3, 4, 5, 6], "sft_steps": 400}
# the policy's settings (the model's config is --model's); answers of 2-3 characters fit 4 tokens
LM = {"max_new_tokens": 4, "sft_lr": 3e-3, "lr": 1e-3, "temperature": 1.0}
MODELS = {
    "tiny": {"model_type": "llama"},  # hf_policy.TINY_LLAMA: 2 layers of 64, ~0.1 M parameters with its 512 tokens
    "0.5b": {"model_type": "qwen2", "lr": 1e-5, "sft_lr": 3e-4, "micro_batch": 16, "config": {  # Qwen2.5-0.5B's
        # shape (float32 weights) with our own tokenizer: for a GPU (--device cuda); not run on the CPU box
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": True}},
}


def sapo_table(seed: int, local: int, external: int, rounds: int, peers: int, task: str,
               datasets: dict | None = None, lm: dict | None = None, device: str = "cpu") -> str:
    """The ``[loops.sapo]`` table of one setting. Both settings of a seed share the run name: a peer's questions
    are a function of (run, seed, its id, round), so with the same identities they are the same questions."""
    options = {**(lm or {}), **({"datasets": datasets} if datasets else {})}
    options = "[loops.sapo.task_options]\n" + toml_options(options, "loops.sapo.task_options") if options else ""
    return CONFIG.format(run=f"bench-s{seed}", seed=seed, rounds=rounds, local=local, external=external,
                         peers=peers, task=task, device=device, datasets=options)


def run_swarm(root: Path, keys: Path, seed: int, local: int, external: int, rounds: int, peers: int,
              task: str, datasets: dict | None = None, lm: dict | None = None, device: str = "cpu") -> dict:
    run = f"bench-s{seed}-{local}-{external}"  # this setting's directory (the run's name is the seed's)
    config = loop_config(root / f"{run}.toml", sapo_table(seed, local, external, rounds, peers, task, datasets, lm,
                                                          device))
    swarm = Swarm(root / run, config=config)
    for i in range(peers):  # the same identities in every configuration: same policy inits, same questions
        key = keys / f"n{i}.key"
        if key.exists():
            (root / run / f"n{i}").mkdir(parents=True)
            shutil.copy(key, root / run / f"n{i}" / "identity.key")
    try:
        nodes = swarm.start_chain(peers, members_within=None) if task != "hf-lm" else start_slowly(swarm, peers)
        for i, n in enumerate(nodes):
            if not (keys / f"n{i}.key").exists():
                shutil.copy(root / run / f"n{i}" / "identity.key", keys / f"n{i}.key")
        started = time.monotonic()

        def sapo(n):
            return n.status()["services"]["sapo"]

        final = wait_for(lambda: all(sapo(n)["state"] == "done" for n in nodes) and [sapo(n) for n in nodes],
                         1800, f"{peers} peers to finish {rounds} rounds", interval=1.0)
        seconds = time.monotonic() - started
        curves = [[h[1] for h in http_get(n.url + "/sapo/history")["rounds"]] for n in nodes]
    finally:
        swarm.close()
    per_round = [sum(c[r] for c in curves) / peers for r in range(rounds)]
    k, w = max(1, rounds // 6), window(rounds)
    return {
        "cumulative": sum(s["cumulative_reward"] for s in final) / peers,
        "first": sum(per_round[:w]) / w,
        "last": sum(per_round[-w:]) / w,
        "bins": [sum(per_round[i * k:(i + 1) * k]) / k for i in range(6)],
        "bytes_per_round": sum(s["wire_bytes_published"] for s in final) / peers / rounds,
        "external_used": sum(s["items_used_external"] for s in final) / peers / rounds,
        "deadline_missed": sum(s.get("deadline_missed", 0) for s in final),
        "seconds": seconds,
    }


def window(rounds: int) -> int:
    """The rounds the first and last columns average: 50, or a third of a shorter run (so they do not overlap)."""
    return max(1, min(50, rounds // 3))


def start_slowly(swarm: Swarm, peers: int) -> list:
    """start_chain's start, waiting longer for each node: a transformers policy's task loads transformers and
    reasoning-gym and trains its tokenizer before the node listens (tens of seconds on a busy 2-core box)."""
    listen, bootstrap = swarm._prepared_first("n0")
    nodes = [swarm.start("n0", *listen, wait=False)]
    nodes += [swarm.start(f"n{i}", bootstrap=[bootstrap], wait=False) for i in range(1, peers)]
    for node in nodes:
        node.wait_ready(300)
    return nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, help="default 300 (hf-lm: 60)")
    parser.add_argument("--seeds", type=int, nargs="+", help="default 1 2 (hf-lm: 1 to 6)")
    parser.add_argument("--peers", type=int, help="default 8 (hf-lm: 4)")
    parser.add_argument("--task", default="reasoning-gym")
    parser.add_argument("--datasets", default="sparse", choices=sorted(DATASETS),
                        help="reasoning-gym only: sparse ones (2-3 character answers, the default: the regime SAPO's "
                        "gain is measured in), or the task's own (single digits)")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS), help="hf-lm only: the policy's shape")
    parser.add_argument("--sft-steps", type=int, default=HF_LM["sft_steps"],
                        help="hf-lm only: supervised warm-up steps")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    defaults = HF_LM if args.task == "hf-lm" else {"rounds": 300, "seeds": [1, 2], "peers": 8}
    for name in ("rounds", "seeds", "peers"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    datasets = DATASETS[args.datasets] if args.task in ("reasoning-gym", "hf-lm") else None
    lm = {**LM, **MODELS[args.model], "sft_steps": args.sft_steps} if args.task == "hf-lm" else None
    rows, began = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-sapo-") as tmp:
        for seed in args.seeds:
            keys = Path(tmp) / f"keys-{seed}"
            keys.mkdir()
            base = run_swarm(Path(tmp), keys, seed, 8, 0, args.rounds, args.peers, args.task, datasets, lm,
                             args.device)
            shared = run_swarm(Path(tmp), keys, seed, 4, 4, args.rounds, args.peers, args.task, datasets, lm,
                               args.device)
            rows.append((seed, base, shared))
            print(f"seed {seed}: 8/0 {base['cumulative']:.2f}, 4/4 {shared['cumulative']:.2f} cumulative reward "
                  f"({time.monotonic() - began:.0f}s so far)", file=sys.stderr, flush=True)
    what = {"reasoning-gym": "reasoning-gym " + (" + ".join(f"{k} {v}" for k, v in datasets.items()) if datasets
                                                 else "chain_sum + products over single digits") + " (its own scorer)",
            "arith": "2-digit arithmetic (binary reward)"}.get(args.task, args.task)
    if args.task == "hf-lm":
        what = (f"a transformers causal LM per peer ({args.model}: {MODELS[args.model]['model_type']}, "
                f"{args.sft_steps} supervised warm-up steps) on reasoning-gym "
                + " + ".join(f"{k} {v}" for k, v in datasets.items()) + f", device {args.device}")
    print(f"SAPO, {args.peers} peer processes, {args.rounds} rounds, 8 questions x 8 completions per round, {what}")
    w = window(args.rounds)
    print(f"{'seed':>4} | {'I/J':>4} | {'cumulative':>10} | {f'first {w}':>8} | {f'last {w}':>8} | "
          f"{'per-round reward, 6 bins':<41} | {'ext/rnd':>7} | {'B/round':>7} | {'missed':>6} | {'wall':>6}")
    print("-" * 126)
    for seed, base, shared in rows:
        for name, r in (("8/0", base), ("4/4", shared)):
            bins = " ".join(f"{b:.3f}" for b in r["bins"])
            print(f"{seed:>4} | {name:>4} | {r['cumulative']:>10.2f} | {r['first']:>8.3f} | {r['last']:>8.3f} | "
                  f"{bins:<41} | {r['external_used']:>7.2f} | {r['bytes_per_round']:>7.0f} | "
                  f"{r['deadline_missed']:>6} | {r['seconds']:>5.0f}s")
    print()
    wins = 0
    for seed, base, shared in rows:
        ratio = shared["cumulative"] / base["cumulative"]
        wins += ratio > 1
        print(f"seed {seed}: 4/4 vs 8/0 cumulative reward ratio {ratio:.3f} ({(ratio - 1) * 100:+.0f}%)")
    for name, k in (("8/0", 1), ("4/4", 2)):
        means = [row[k]["cumulative"] / args.rounds for row in rows]
        print(f"{name}: mean reward per round {sum(means) / len(means):.4f} (per seed: "
              f"{', '.join(f'{m:.4f}' for m in means)})")
    mean = sum(s["cumulative"] for _, _, s in rows) / sum(b["cumulative"] for _, b, _ in rows)
    print(f"all seeds: ratio {mean:.3f}; sharing won on {wins} of {len(rows)} seeds "
          f"(goal: every seed; protocols.md acceptance: >= 1.10 on average); {time.monotonic() - began:.0f}s in all")


if __name__ == "__main__":
    main()
