"""DiLoCo benchmark, one run, peers as separate processes, equal per-peer compute (the same inner steps each), on a
task of the seam (default: ``hf-text``, a small Llama from a transformers config on the standard library's source):

(a) one peer alone; (b) 4 peers DiLoCo, H=50, 4-bit e3m0; (c) 4 peers Streaming DiLoCo (2 fragments, overlap 5,
alpha 0.5, e3m0); (e) 4 peers DiLoCo, H=25, with the outer step as plain averaging (outer lr 1, no momentum: the
best of a sweep at this short horizon); (f) 4 peers DiLoCo, H=13 (~100x fewer bytes than data parallelism with
e3m0), averaging, with the ``swarm-adamw`` inner optimizer (protocols/inner.py: AdamW's step sized for the round's
peers' batches; the loop's default); (g) 4 peers DiLoCo, H=4, the 1-bit ``sign`` codec with error feedback
(~114x fewer bytes), averaging, swarm-adamw; (h) the same in the scatter exchange (reduce-scatter + all-gather,
each reducer's part of the mean in e3m0: the loop's ``reduced_codec`` for sign); (i) as (g) with the inner
optimizer's betas (0.9, 0.99) and inner lr 1.5e-3 (the loop's ``inner_betas``, ``inner_lr``: a longer second-moment
average steadies swarm-adamw's variance estimate; the reference keeps (0.9, 0.95) and 1e-3); (d) the fair data-parallel
reference, in this process: one model trained synchronously on the 4 peers' batches at once (4 x batch per step,
the same steps, AdamW with the same settings), which is what DDP computes. Rows (a)-(e) use plain AdamW inside,
as the DiLoCo paper does.

The peers' batches are the reference's to the sample: a peer's data shard comes from its peer id
(``protocols.task.shard_of``), so the bench gives the peers of every row the same four identities (keys from fixed
seeds) and the reference those four shards; ``--seed`` then sets the model's initialisation and every shard's order
on both sides. (With the reference on shards 0-3 and the peers on random ones the data would be the same
distribution but other samples, and the comparison noisier.)

``--pretrain N`` starts every peer and the reference from the same model pretrained N steps (the DiLoCo paper's
setting: it trains on from a pretrained checkpoint); without it, from random init.

Reported: validation loss at the end (the task's evaluate()), bytes each peer sent (for (d): one fp32 gradient per
step, what a data-parallel peer contributes), and the fraction of wall time a node was not blocked waiting for a
round to close.

    python bench/bench_diloco.py [--steps 500] [--task hf-text] [--task-options '{"batch": 8}'] [--device cuda]
                                 [--pretrain 300] [--only abcefghid] [--lr-schedule cosine --warmup 25]

``--lr-schedule cosine`` (with ``--warmup N``) gives every peer and the reference the same inner learning-rate
schedule: a linear warm-up, then a cosine down to 0.1x at the run's last step (the loop's ``lr_schedule``).
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

from swarmproc import Swarm, loop_config, wait_for  # noqa: E402


def peer_keys(n: int) -> list:
    """The bench's peers' identities, the same in every row and run: their data shards are the reference's."""
    import hashlib

    from swarmd.transport.identity import Identity

    return [Identity.generate(hashlib.blake2b(f"bench_diloco peer {i}".encode(), digest_size=32).digest())
            for i in range(n)]


def peer_shards(n: int) -> list[int]:
    from swarmd.protocols import task as tasks

    return [tasks.shard_of(key.peer_id) for key in peer_keys(n)]


CONFIG = """
[loops.diloco]
run = "{run}"
seed = {seed}
task = "{task}"
device = "{device}"
rounds = {rounds}
inner_steps = {h}
fragments = {fragments}
overlap = {overlap}
alpha = {alpha}
codec = "{codec}"
inner_optimizer = "{inner}"
inner_lr = {inner_lr}
inner_betas = {betas}
lr_schedule = "{schedule}"
warmup_steps = {warmup}
outer_lr = {outer_lr}
outer_momentum = {momentum}
min_peers = {peers}
eval_every = {eval_every}
deadline_low = 5.0
checkpoint_every = 0
exchange = "{exchange}"

[loops.diloco.task_options]
{options}
"""


def toml_options(options: dict, table: str = "loops.diloco.task_options") -> str:
    """A loop's task options as TOML lines under ``[table]`` (written right after its header): values first, then
    each nested dict as a sub-table, at any depth."""
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in options.items() if not isinstance(v, dict)) + "".join(
        f"\n[{table}.{k}]\n" + toml_options(v, f"{table}.{k}") for k, v in options.items() if isinstance(v, dict))


def run(name: str, peers: int, steps: int, root: Path, task: str, options: dict, *, h: int, fragments: int = 1,
        overlap: int = 0, alpha: float = 0.0, codec: str = "e3m0", outer_lr: float = 0.7,
        momentum: float = 0.9, device: str = "cpu", inner: str = "adamw", schedule: str = "constant",
        warmup: int = 0, exchange: str = "auto", seed: int = 1, inner_lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95)) -> dict:
    table = CONFIG.format(run=name, seed=seed, device=device, rounds=steps // h, h=h, fragments=fragments,
                          overlap=overlap, alpha=alpha, inner=inner, inner_lr=inner_lr, betas=list(betas),
                          schedule=schedule, warmup=warmup,
                          exchange=exchange, codec=codec, outer_lr=outer_lr, momentum=momentum, peers=peers,
                          eval_every=max(1, (steps // h) // 5), task=task, options=toml_options(options))
    config = loop_config(root / "diloco.toml", table)
    swarm = Swarm(root / "nodes", config=config)
    keys = peer_keys(peers)
    for i, key in enumerate(keys):  # start_chain's data dirs n0, n1, ...: each keeps the identity it finds
        (root / "nodes" / f"n{i}").mkdir(parents=True, exist_ok=True)
        key.save(root / "nodes" / f"n{i}" / "identity.key")
    started = time.monotonic()
    try:
        nodes = swarm.start_chain(peers, members_within=None)
        assert [n.peer_id for n in nodes] == [k.peer_id for k in keys], "the peers did not take the bench's keys"

        def d(n):
            return n.status()["services"]["diloco"]

        final = wait_for(lambda: all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes], 1200,
                         f"{name} to finish", interval=1.0)
        return {
            "wall": time.monotonic() - started,
            "identical": len({s["final_hash"] for s in final}) == 1,
            "resyncs": sum(s.get("resyncs", 0) for s in final),
            "loss": final[0]["losses"][-1][1],
            "bytes": max(s.get("bytes_sent", 0) for s in final),
            "compute": min(s["compute_fraction"] for s in final),
            # what a peer's bulk port served (its update to each peer that pulled it; in scatter also the chunks
            # and its combined parts): the wire's bytes, where "bytes" counts one update a sync, as DP counts one
            # gradient a step
            "served": max(n.status()["services"]["bulk"].get("bytes_served", 0) for n in nodes),
            "modes": sorted({s["exchange"].get("mode", "?") for s in final}),
        }
    finally:
        swarm.close()


def data_parallel(steps: int, peers: int, task_spec: str, options: dict, inner_lr: float = 1e-3,
                  device: str = "cpu", threads: int = 2, warmup: int = 0, cosine: bool = False,
                  seed: int = 1, shards: list[int] | None = None, betas: tuple[float, float] = (0.9, 0.95)) -> dict:
    """The fair reference: one model, the peers' batches at once each step (what DDP computes), same AdamW (and
    the same learning-rate schedule as the peers: ``warmup`` steps, then ``cosine`` decay to 0.1x or constant).
    ``seed``: the model's initialisation and the peers' data order (the loop's run seed; 1 in the configs);
    ``shards``: the peers' data shards (default 0 .. peers - 1)."""
    import torch

    from swarmd.protocols import task as tasks
    from swarmd.protocols.inner import lr_scale, scale_lr

    started = time.monotonic()
    torch.set_num_threads(threads)
    task = tasks.load(task_spec, options, "diloco")
    device = torch.device(device)
    model = tasks.build_model(task, seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=inner_lr, betas=tuple(betas), weight_decay=0.1)
    streams = [tasks.data_iter(task, shard, seed) for shard in (range(peers) if shards is None else shards)]
    model.train()
    for step in range(steps):
        scale_lr(opt, lr_scale(step, steps if cosine else 0, warmup))
        opt.zero_grad(set_to_none=True)
        for stream in streams:  # the mean of the peers' losses: the gradient of the 4 x batch
            (tasks.loss_value(task, model, tasks.to_device(next(stream), device)) / peers).backward()
        opt.step()
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"loss": tasks.evaluate(task, model), "bytes": steps * n_params * 4, "compute": 1.0, "identical": True,
            "resyncs": 0, "wall": time.monotonic() - started, "params": n_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--task", default="hf-text")
    parser.add_argument("--task-options", default="{}", help="JSON object passed as the task's task_options")
    parser.add_argument("--device", default="cpu", help="every peer's and the reference's device: cpu, cuda, ...")
    parser.add_argument("--only", default="abcefghid", help="which runs, by letter (default: all)")
    parser.add_argument("--pretrain", type=int, default=0, help="hf-text: every peer (and the reference) starts "
                        "from the same model pretrained this many steps, as the DiLoCo paper starts from a "
                        "pretrained checkpoint")
    parser.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
                        help="the inner lr schedule of every peer and of the reference (the loop's lr_schedule)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up steps of that schedule")
    parser.add_argument("--seed", type=int, default=1, help="the run's seed (the model's initialisation and the "
                        "data order), the reference's too")
    args = parser.parse_args()
    s, task, options, dev = args.steps, args.task, json.loads(args.task_options), args.device
    sched = {"schedule": args.lr_schedule, "warmup": args.warmup, "seed": args.seed}
    if args.pretrain:
        options = {**options, "pretrain_steps": args.pretrain}
    results = {}
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-diloco-") as tmp:
        root = Path(tmp)
        runs = {
            "a": ("(a) 1 peer alone", lambda: run("alone", 1, s, root / "a", task, options, h=50, device=dev,
                                                **sched)),
            "b": ("(b) 4 peers DiLoCo H=50 e3m0", lambda: run("diloco", 4, s, root / "b", task, options, h=50,
                                                             device=dev, **sched)),
            "c": ("(c) 4 peers Streaming DiLoCo P=2 tau=5 e3m0",
                  lambda: run("streaming", 4, s, root / "c", task, options, h=50, fragments=2, overlap=5, alpha=0.5,
                              device=dev, **sched)),
            "e": ("(e) 4 peers DiLoCo H=25 e3m0, averaging",
                  lambda: run("averaging", 4, s, root / "e", task, options, h=25, outer_lr=1.0, momentum=0.0,
                              device=dev, **sched)),
            "f": ("(f) 4 peers H=13 e3m0, averaging, swarm-adamw",
                  lambda: run("swarm", 4, s, root / "f", task, options, h=13, outer_lr=1.0, momentum=0.0,
                              device=dev, inner="swarm-adamw", **sched)),
            "g": ("(g) 4 peers H=4 1-bit sign+ef, swarm-adamw",
                  lambda: run("sign", 4, s, root / "g", task, options, h=4, codec="sign", outer_lr=1.0,
                              momentum=0.0, device=dev, inner="swarm-adamw", **sched)),
            "h": ("(h) as (g), the scatter exchange",
                  lambda: run("sign-scatter", 4, s, root / "h", task, options, h=4, codec="sign", outer_lr=1.0,
                              momentum=0.0, device=dev, inner="swarm-adamw", exchange="scatter", **sched)),
            "i": ("(i) as (g), inner betas (0.9, 0.99), lr 1.5e-3",
                  lambda: run("sign-b2", 4, s, root / "i", task, options, h=4, codec="sign", outer_lr=1.0,
                              momentum=0.0, device=dev, inner="swarm-adamw", inner_lr=1.5e-3, betas=(0.9, 0.99),
                              **sched)),
            "d": ("(d) data-parallel reference (4 x batch)", lambda: data_parallel(
                s, 4, task, options, device=dev, warmup=args.warmup, cosine=args.lr_schedule == "cosine",
                seed=args.seed, shards=peer_shards(4))),
        }
        for letter in "abcefghid":
            if letter in args.only or letter == "d":
                name, go = runs[letter]
                results[name] = go()
                print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    dp = results["(d) data-parallel reference (4 x batch)"]
    print(f"DiLoCo, task {task} {json.dumps(options)} ({dp['params']:,} parameters), {s} inner steps per peer, "
          f"device {dev}, validation loss at the end; inner optimizer AdamW unless the row says swarm-adamw; "
          f"inner lr 1e-3 and betas (0.9, 0.95) unless the row says otherwise, {args.lr_schedule}"
          + (f" after {args.warmup} warm-up steps" if args.warmup else "") + f", seed {args.seed}")
    print(f"{'run':<46} | {'val loss':>8} | {'vs DP':>7} | {'MB sent/peer':>12} | {'DP bytes / bytes':>16} | "
          f"{'not blocked':>11} | {'same weights':>18} | {'wall':>6}")
    print("-" * 148)
    for name, r in results.items():
        ratio = dp["bytes"] / r["bytes"] if r["bytes"] else float("inf")
        print(f"{name:<46} | {r['loss']:>8.4f} | {(r['loss'] / dp['loss'] - 1) * 100:>+6.1f}% | "
              f"{r['bytes'] / 1e6:>12.3f} | {ratio:>15.0f}x | {r['compute'] * 100:>10.1f}% | "
              f"{('yes' if r['identical'] else 'NO'):>5} ({r['resyncs']} resyncs) | {r['wall']:>5.0f}s")
    print("DP bytes: one fp32 gradient per step (a ring all-reduce sends 2(N-1)/N = 1.5x that at N=4); "
          "goal: DiLoCo within 5% of (d) at >= 100x fewer bytes")


if __name__ == "__main__":
    main()
