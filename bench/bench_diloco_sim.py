"""DiLoCo's settings swept in one process per setting, against the data-parallel reference of the same run.

No network: N workers train copies of the task's model in one process for H inner steps each, their pseudo-gradients
go through the loop's codec (``protocols.codecs``), are combined by the loop's rule (``outer.combine``, the
all-to-all path: what the loop runs for an update under ``scatter_min_bytes``, as hf-text's 1.4M parameters in
e3m0 are) and applied by the loop's outer optimizer (``outer.OuterNesterov``), with the loop's inner optimizers
(``swarm-adamw`` or plain ``adamw``). What it leaves out is what ``bench_diloco.py`` measures with real processes:
deadlines, late and missing peers, the wall time. It is the fast way to compare settings (a sweep of 15 runs of
500 steps took 2 minutes on one GPU, each run in its own process); ``bench_diloco.py`` confirms a setting end to end.

    python bench/bench_diloco_sim.py                          # the default settings, CPU, one process per core
    python bench/bench_diloco_sim.py --device cuda --settings h13 h13-ef dp-lr1.5e-3
    python bench/bench_diloco_sim.py --list                   # every named setting
    python bench/bench_diloco_sim.py --settings h4-sign-ef --seeds 1 2 3   # each setting and dp once per seed
    python bench/bench_diloco_sim.py --settings h4-sign-ef --bench-shards  # the data of bench_diloco.py's peers

The reference ``dp`` is always run: one model on the N workers' batches at once (what DDP computes), the same AdamW.
A seed sets the model's initialisation and every worker's data order (the loop's run seed; 1, the default, is what
the configs use); with several, each setting's gap to ``dp`` is taken per seed (the same seed's ``dp``) and the
table gives its mean and its range over the seeds.
Bytes: what one peer sends in the run (each sync, its encoded update), against one fp32 gradient per step for DP.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> (what it is, its settings); every DiLoCo setting: 4-bit e3m0 updates, swarm-adamw, plain averaging
# (outer lr 1, no momentum) unless it says otherwise
BASE = {"h": 13, "codec": "e3m0", "ratio": 0.01, "ef": False, "inner": "swarm-adamw", "lr": 1e-3, "olr": 1.0,
        "mom": 0.0, "warmup": 0, "cosine": False, "betas": (0.9, 0.95),
        "recode": None, "options": {}, "decay": 1.0, "senders": False}
# issue 82's rows: every one with the best DiLoCo row's inner tuning (h4-sign-ef-b2.99-lr1.5e-3, as in
# configs/diloco-hf-1bit), the reference too (dp-b2.99-lr1.5e-3: pass it as --reference); the sparse rows as SparseLoCo
# runs them: error feedback with decay 0.95 in place of outer momentum (outer SGD, lr 1), each value averaged over
# the peers that sent it (the loop's outer_average "auto" for topk2)
TUNED = {"betas": (0.9, 0.99), "lr": 1.5e-3}
SPARSE = {**TUNED, "h": 30, "codec": "topk2", "ef": True, "decay": 0.95, "senders": True}
SETTINGS: dict[str, tuple[str, dict]] = {
    "dp": ("data-parallel reference (N x batch)", {"dp": True}),
    "dp-lr1.5e-3": ("data-parallel reference, lr 1.5e-3", {"dp": True, "lr": 1.5e-3}),
    "dp-b2.99": ("data-parallel reference, betas (0.9, 0.99)", {"dp": True, "betas": (0.9, 0.99)}),
    "dp-b2.99-lr1.5e-3": ("data-parallel reference, betas (0.9, 0.99), lr 1.5e-3",
                          {"dp": True, "betas": (0.9, 0.99), "lr": 1.5e-3}),
    "dp-cos": ("data-parallel reference, warm-up 25 + cosine", {"dp": True, "warmup": 25, "cosine": True}),
    "h13-cos": ("H=13 e3m0, averaging, warm-up 25 + cosine", {"warmup": 25, "cosine": True}),
    "h13": ("H=13 e3m0, averaging, swarm-adamw", {}),
    "h13-none": ("H=13 no compression (fp32)", {"codec": "none"}),
    "h13-ef": ("H=13 e3m0 + error feedback", {"ef": True}),
    "h13-adamw": ("H=13 e3m0 + error feedback, plain AdamW", {"ef": True, "inner": "adamw"}),
    "h13-lr1.5e-3": ("H=13 e3m0 + error feedback, inner lr 1.5e-3", {"ef": True, "lr": 1.5e-3}),
    "h13-m0.5": ("H=13 e3m0 + ef, outer Nesterov (1.0, 0.5)", {"ef": True, "mom": 0.5}),
    "h13-m0.3": ("H=13 e3m0 + ef, outer Nesterov (1.2, 0.3)", {"ef": True, "olr": 1.2, "mom": 0.3}),
    "h13-nesterov": ("H=13 e3m0 + ef, outer Nesterov (0.7, 0.9)", {"ef": True, "olr": 0.7, "mom": 0.9}),
    "h4-none": ("H=4 no compression (fp32)", {"h": 4, "codec": "none"}),
    "h7-none": ("H=7 no compression (fp32)", {"h": 7, "codec": "none"}),
    "h4-sign-ef": ("H=4 1-bit sign + error feedback", {"h": 4, "codec": "sign", "ef": True}),
    "h4-sign": ("H=4 1-bit sign, no error feedback", {"h": 4, "codec": "sign"}),
    "h4-sign-ef-lr1.5e-3": ("H=4 sign + ef, inner lr 1.5e-3", {"h": 4, "codec": "sign", "ef": True, "lr": 1.5e-3}),
    "h4-sign-ef-lr1.25e-3": ("H=4 sign + ef, inner lr 1.25e-3", {"h": 4, "codec": "sign", "ef": True, "lr": 1.25e-3}),
    "h4-sign-ef-lr2e-3": ("H=4 sign + ef, inner lr 2e-3", {"h": 4, "codec": "sign", "ef": True, "lr": 2e-3}),
    "h4-sign-ef-olr0.85": ("H=4 sign + ef, outer lr 0.85", {"h": 4, "codec": "sign", "ef": True, "olr": 0.85}),
    "h4-sign-ef-b2.99": ("H=4 sign + ef, inner betas (0.9, 0.99)", {"h": 4, "codec": "sign", "ef": True,
                                                                    "betas": (0.9, 0.99)}),
    "h4-sign-ef-b2.99-lr1.5e-3": ("H=4 sign + ef, inner betas (0.9, 0.99), lr 1.5e-3",
                                  {"h": 4, "codec": "sign", "ef": True, "betas": (0.9, 0.99), "lr": 1.5e-3}),
    "h4-sign-ef-b1.95": ("H=4 sign + ef, inner betas (0.95, 0.95)", {"h": 4, "codec": "sign", "ef": True,
                                                                     "betas": (0.95, 0.95)}),
    "h4-sign-ef-olr1.25": ("H=4 sign + ef, outer lr 1.25 (1 / sqrt(2 / pi))", {"h": 4, "codec": "sign", "ef": True,
                                                                              "olr": 1.25}),
    "h4-sign64-ef": ("H=4 sign (blocks of 64) + ef", {"h": 4, "codec": "sign64", "ef": True}),
    "h4-sign-ef-rc": ("H=4 sign + ef, the mean re-encoded in sign", {"h": 4, "codec": "sign", "ef": True,
                                                                      "recode": "sign"}),
    "h4-sign-ef-rce3m0": ("H=4 sign + ef, the mean re-encoded in e3m0", {"h": 4, "codec": "sign", "ef": True,
                                                                         "recode": "e3m0"}),
    "h20-ef": ("H=20 e3m0 + error feedback", {"h": 20, "ef": True}),
    "h25-nesterov": ("H=25 e3m0 + ef, outer Nesterov (0.7, 0.9)", {"h": 25, "ef": True, "olr": 0.7, "mom": 0.9}),
    "h50-nesterov": ("H=50 e3m0, outer Nesterov (0.7, 0.9) (the paper)", {"h": 50, "olr": 0.7, "mom": 0.9}),
    "topk-h2": ("H=2 top-1.1% + error feedback", {"h": 2, "codec": "topk", "ratio": 0.011, "ef": True}),
    "topk-h6": ("H=6 top-3.3% + error feedback", {"h": 6, "codec": "topk", "ratio": 0.033, "ef": True}),
    "h30-nesterov-fp32": ("plain DiLoCo: H=30 fp32, outer Nesterov (0.7, 0.9), tuned inner",
                          {**TUNED, "h": 30, "codec": "none", "olr": 0.7, "mom": 0.9}),
    "h30-topk2": ("H=30 top-1/64 of 4096, 2-bit, ef 0.95, mean over senders", SPARSE),
    "h30-topk2-all": ("H=30 topk2, ef 0.95, the mean over all peers", {**SPARSE, "senders": False}),
    "h30-topk2-d72": ("H=30 top-57 of 4096 (1/72), 2-bit, ef 0.95", {**SPARSE, "options": {"density": 1 / 72}}),
    "h30-topk2-ef1": ("H=30 topk2, ef without decay", {**SPARSE, "decay": 1.0}),
    "h30-topk2-d32": ("H=30 top-1/32 of 4096, 2-bit, ef 0.95", {**SPARSE, "options": {"density": 1 / 32}}),
    "h15-topk2": ("H=15 topk2, ef 0.95", {**SPARSE, "h": 15}),
    "h4-topk2": ("H=4 topk2, ef 0.95", {**SPARSE, "h": 4}),
    "h4-topk2-d12": ("H=4 top-1/12 of 4096, 2-bit, ef 0.95 (sign's bytes)", {**SPARSE, "h": 4,
                                                                             "options": {"density": 1 / 12}}),
    "h4-topk2-all": ("H=4 topk2, ef 0.95, the mean over all peers", {**SPARSE, "h": 4, "senders": False}),
    "h4-topk2-d12-all": ("H=4 top-1/12 of 4096, ef 0.95, the mean over all peers",
                         {**SPARSE, "h": 4, "options": {"density": 1 / 12}, "senders": False}),
    "h30-topk2-muon": ("H=30 topk2, ef 0.95, Muon inner (AdamW on the rest)", {**SPARSE, "inner": "muon"}),
    "h30-topk2-muon-all": ("H=30 topk2, ef 0.95, Muon inner, the mean over all peers", {**SPARSE, "inner": "muon",
                                                                                          "senders": False}),
    "h30-topk2-muon-lr1e-3": ("H=30 topk2, ef 0.95, Muon inner, lr 1e-3", {**SPARSE, "inner": "muon", "lr": 1e-3}),
}
DEFAULT = ["dp", "h13", "h13-none", "h13-ef", "h13-adamw", "h50-nesterov"]


def one(name: str, steps: int, peers: int, task_spec: str, options: dict, device: str, seed: int = 1,
        shards: list[int] | None = None) -> dict:
    """One setting and seed, in this process (one CPU thread); worker i reads data shard ``shards[i]`` (default i)."""
    import torch

    from swarmd.protocols import codecs, outer
    from swarmd.protocols import task as tasks
    from swarmd.protocols.inner import SwarmAdamW, lr_scale, muon_for, scale_lr

    s = {**BASE, **SETTINGS[name][1]}
    if s.get("dp"):  # the process bench's reference itself, on one thread
        from bench_diloco import data_parallel

        return {**data_parallel(steps, peers, task_spec, options, inner_lr=s["lr"], device=device, threads=1,
                                 warmup=s["warmup"], cosine=s["cosine"], seed=seed, shards=shards,
                                 betas=s["betas"]),
                "syncs": steps, "refused": 0}
    torch.set_num_threads(1)
    dev = torch.device(device)
    task = tasks.load(task_spec, options, "diloco")
    started = time.monotonic()
    streams = [tasks.data_iter(task, shard, seed) for shard in (range(peers) if shards is None else shards)]

    def adamw(model: torch.nn.Module, swarm: bool) -> torch.optim.Optimizer:
        kw = {"lr": s["lr"], "betas": tuple(s["betas"]), "weight_decay": 0.1}
        if s["inner"] == "muon":
            return muon_for(model, peers=peers, **kw)
        if swarm:
            return SwarmAdamW(model.parameters(), peers=peers, **kw)
        return torch.optim.AdamW(model.parameters(), **kw)

    codec = (codecs.get("topk", ratio=s["ratio"]) if s["codec"] == "topk" else codecs.get("sign", block=64)
             if s["codec"] == "sign64" else codecs.configured(s["codec"], s["options"]))
    models = [tasks.build_model(task, seed).to(dev) for _ in range(peers)]
    params = [[p for _, p in tasks.trainable(m)] for m in models]
    global_flat = outer.flatten(params[0])
    opts = [adamw(m, s["inner"] != "adamw") for m in models]
    feedback = [codecs.ErrorFeedback(codec, s["decay"]) for _ in models]
    outer_opt = outer.OuterNesterov([global_flat.numel()], s["olr"], s["mom"])
    step = syncs = sent = refused = 0
    while step < steps:
        h = min(s["h"], steps - step)
        for model, opt, stream in zip(models, opts, streams):
            model.train()
            for k in range(h):
                scale_lr(opt, lr_scale(step + k, steps if s["cosine"] else 0, s["warmup"]))
                opt.zero_grad(set_to_none=True)
                tasks.loss_value(task, model, tasks.to_device(next(stream), dev)).backward()
                opt.step()
        step, syncs = step + h, syncs + 1
        updates = {}
        for i, ps in enumerate(params):
            delta = global_flat - outer.flatten(ps)
            enc = feedback[i].encode(delta) if s["ef"] else codec.encode(delta)
            if i == 0:
                sent += len(enc.to_wire())
            updates[f"w{i}"] = codec.decode_flat(enc, None)
        combined, rejected = outer.combine(updates, global_flat.numel(), senders=s["senders"])
        refused += len(rejected)
        if s["recode"]:  # the scatter path: each reducer sends its part of the mean encoded (reduced_codec)
            recode = codecs.get(s["recode"])
            combined = recode.decode_flat(recode.encode(combined), None)
        global_flat = outer_opt.step(0, global_flat, combined)
        with torch.no_grad():
            for ps in params:
                outer.unflatten_into(global_flat, ps)
    return {"loss": tasks.evaluate(task, models[0]), "bytes": sent, "syncs": syncs, "refused": refused,
            "wall": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="*", default=DEFAULT, help="named settings (--list); dp always runs")
    parser.add_argument("--list", action="store_true", help="print the named settings and exit")
    parser.add_argument("--steps", type=int, default=500, help="inner steps per worker (and DP steps)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--task", default="hf-text")
    parser.add_argument("--task-options", default="{}", help="JSON object passed as the task's task_options")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (every setting on it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="run every setting (and dp) once per "
                        "seed: the model's initialisation and the data order")
    parser.add_argument("--bench-shards", action="store_true", help="the workers (and dp) read the data shards of "
                        "bench_diloco.py's peers (their fixed identities' shards) instead of shards 0 .. N-1")
    parser.add_argument("--reference", default="dp", help="the data-parallel setting the gaps are taken against "
                        "(give it the best DiLoCo row's tuning: dp-b2.99-lr1.5e-3 for the tuned rows)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: run this setting, print its JSON
    args = parser.parse_args()
    if args.list:
        for name, (what, _) in SETTINGS.items():
            print(f"{name:14s} {what}")
        return
    options = json.loads(args.task_options)
    if args.one:
        shards = None
        if args.bench_shards:
            from bench_diloco import peer_shards

            shards = peer_shards(args.peers)
        print(json.dumps(one(args.one, args.steps, args.peers, args.task, options, args.device, args.seeds[0],
                             shards)))
        return
    unknown = [n for n in args.settings if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; --list names them")
    if not SETTINGS.get(args.reference, ("", {}))[1].get("dp"):
        parser.error("--reference must name a data-parallel setting (dp...)")
    names = [args.reference, *[n for n in dict.fromkeys(args.settings) if n != args.reference]]
    seeds = list(dict.fromkeys(args.seeds))

    def launch(job: tuple[str, int]) -> dict:
        name, seed = job
        cmd = [sys.executable, __file__, "--one", name, "--steps", str(args.steps), "--peers", str(args.peers),
               "--task", args.task, "--task-options", args.task_options, "--device", args.device,
               "--seeds", str(seed), *(["--bench-shards"] if args.bench_shards else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=24 * 3600)
        if done.returncode != 0:
            raise SystemExit(f"{name} (seed {seed}) failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    jobs = [(name, seed) for seed in seeds for name in names]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = dict(zip(jobs, pool.map(launch, jobs)))
    print(f"DiLoCo settings, one process each: task {args.task} {args.task_options}, {args.peers} workers, "
          f"{args.steps} inner steps each, device {args.device}, validation loss at the end, seed"
          f"{'s' if len(seeds) > 1 else ''} {' '.join(map(str, seeds))}"
          + (", the process bench's peers' shards" if args.bench_shards else ""))
    for line in table(names, seeds, results, args.reference):
        print(line)
    print("DP bytes: one fp32 gradient per step (32 bits / param / step); bits/p/step: the bytes each peer's encoded "
          "updates took, x 8 / (parameters x inner steps)")


def table(names: list[str], seeds: list[int], results: dict[tuple[str, int], dict], reference: str = "dp") -> list[str]:
    """One row per setting. One seed: its loss and gap to ``reference`` (a dp setting). Several: the mean loss, the
    mean of the per-seed gaps (each against the same seed's reference) and their range."""
    many = len(seeds) > 1
    nw, ww = max(14, *map(len, names)), max(50, *(len(SETTINGS[n][0]) for n in names))
    head = (f"{'setting':{nw}s} | {'what':{ww}s} | " + ("mean val | mean vs DP | vs DP range      " if many else
                                                     "val loss |   vs DP") +
            " | syncs | MB sent/peer | bits/p/step | DP bytes / bytes |  wall")
    lines = [head, "-" * len(head)]
    for name in names:
        runs = [results[(name, seed)] for seed in seeds]
        gaps = [(r["loss"] / results[(reference, seed)]["loss"] - 1) * 100 for r, seed in zip(runs, seeds)]
        loss, gap = sum(r["loss"] for r in runs) / len(runs), sum(gaps) / len(gaps)
        r, ref = runs[0], results[(reference, seeds[0])]
        cells = (f"{loss:8.4f} | {gap:+9.1f}% | {min(gaps):+6.1f}% .. {max(gaps):+5.1f}%" if many else
                 f"{loss:8.4f} | {gap:+6.1f}%")
        lines.append(f"{name:{nw}s} | {SETTINGS[name][0]:{ww}s} | {cells} | {r['syncs']:5d} | "
                     f"{r['bytes'] / 1e6:12.3f} | {32 * r['bytes'] / ref['bytes']:11.4f} | "
                     f"{ref['bytes'] / max(1, r['bytes']):15.0f}x | "
                     f"{max(x['wall'] for x in runs):4.0f}s")
    if many:
        lines.append(f"per seed (val loss, vs the same seed's {reference}):")
        for name in names:
            lines.append(f"{name:{nw}s}   " + "  ".join(
                f"{seed}: {results[(name, seed)]['loss']:.4f} "
                f"{(results[(name, seed)]['loss'] / results[(reference, seed)]['loss'] - 1) * 100:+.1f}%"
                for seed in seeds))
    return lines


if __name__ == "__main__":
    main()
