"""The Python API's price, measured in one run against its baselines.

1. Cost per inner step: the same training loop (an MLP, its own batches) with no swarm and inside
   ``swarmd.DiLoCo`` (one peer, the sync every ``--sync-every`` steps), alternated ``--pairs`` times; the step time
   between syncs (steps that closed a round are reported apart). Goal: the API adds under 2%.
2. The API-driven run next to the CLI-driven run of the same task (``--task``, default the tiny GPT): 2 peers each,
   the same settings, the same inner optimizer (AdamW), the same initial weights and the same batches per peer
   (shard and seed as the loop draws them); final validation loss and bytes each peer sent per round.

    python bench/bench_api.py [--pairs 3] [--steps 400] [--sync-every 100] [--rounds 4] [--h 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from swarmproc import LOCAL_CONFIG, Swarm, loop_config, wait_for  # noqa: E402

STEP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    import swarmd

    mode, steps, sync_every, data_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(64, 512, generator=g) for _ in range(8)]

    def train(run=None):
        times = []
        for i in range(steps):
            x = data[i % len(data)]
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        return times

    if mode == "plain":
        # the node sets the process's allocator (node/allocator.py) as it starts; the loop without a swarm gets the
        # same, so the two differ by the API alone (without it, the plain loop's steps fault their pages in again)
        from swarmd.node import allocator
        allocator.configure("reuse")
        times = train()
    else:
        node = swarmd.Node(config=sys.argv[5], data_dir=data_dir)
        with node, swarmd.DiLoCo(node, run="bench-api", model=model, inner_optimizer=opt,
                                 sync_every=sync_every) as run:
            times = train(run)
    print(json.dumps(times))
""")

TASK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import swarmd
    from swarmd.protocols import task as tasks

    data_dir, config, task_name, options, rounds, h, lr, boot = (sys.argv[1], sys.argv[2], sys.argv[3],
        json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]), sys.argv[8:])
    node = swarmd.Node(config=config, data_dir=data_dir, bootstrap=boot)
    node.start()
    print(json.dumps({"addresses": node.addresses}), flush=True)
    task = tasks.load(task_name, options, "diloco")
    model = tasks.build_model(task, 1)  # the loop's seed: the CLI run's initial weights
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = tasks.data_iter(task, tasks.shard_of(node.peer_id), 1)  # the batches the loop would draw
    with swarmd.DiLoCo(node, run="bench-api-task", model=model, inner_optimizer=opt, sync_every=h, rounds=rounds,
                       evaluate=lambda m: tasks.evaluate(task, m), settings={"min_peers": 2}) as run:
        while not run.done:
            loss = tasks.loss_value(task, model, next(batches))
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.report_loss(loss)
        st = run.status()
    print(json.dumps({"loss": tasks.evaluate(task, model), "bytes_sent": st["bytes_sent"], "final": run.final_hash}),
          flush=True)
    sys.stdin.read()
    node.close()
""")

CLI_TABLE = """
[loops.diloco]
run = "bench-cli-task"
task = "{task}"
rounds = {rounds}
inner_steps = {h}
min_peers = 2
inner_optimizer = "adamw"
inner_lr = {lr}
seed = 1
[loops.diloco.task_options]
{options}
"""


def step_costs(args, work: Path) -> list[dict]:
    script = work / "steps.py"
    script.write_text(STEP_SCRIPT)
    rows = []
    for i in range(args.pairs):
        for mode in ("plain", "api"):
            out = subprocess.run([sys.executable, str(script), mode, str(args.steps), str(args.sync_every),
                                  str(work / f"step-{i}"), str(LOCAL_CONFIG)], capture_output=True, text=True,
                                 timeout=600, cwd=work)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            times = json.loads(out.stdout.strip().splitlines()[-1])[20:]  # past the warm-up
            syncing = {k for k in range(len(times)) if (k + 21) % args.sync_every == 0}
            between = [t for k, t in enumerate(times) if k not in syncing]
            rows.append({"pair": i, "mode": mode, "median_ms": 1000 * statistics.median(between),
                         "mean_ms": 1000 * statistics.fmean(between),
                         "sync_step_ms": 1000 * statistics.fmean([times[k] for k in syncing]) if syncing else None})
    return rows


def task_runs(args, work: Path) -> dict:
    options = json.loads(args.task_options)
    results = {}
    # the CLI: swarmd start with [loops.diloco]
    toml_opts = "\n".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    config = loop_config(work / "cli.toml", CLI_TABLE.format(task=args.task, rounds=args.rounds, h=args.h,
                                                             lr=args.lr, options=toml_opts))
    swarm = Swarm(work / "cli", config=config)
    try:
        nodes = swarm.start_chain(2)
        wait_for(lambda: all(n.status()["services"]["diloco"]["state"] == "done" for n in nodes), 600, "the CLI run")
        views = [n.status()["services"]["diloco"] for n in nodes]
        results["cli"] = [{"loss": v["losses"][-1][1] if v["losses"] else None, "bytes_sent": v["bytes_sent"],
                           "final": v["final_hash"]} for v in views]
    finally:
        swarm.close()
    # the API: the same task's model, batches and loss in a script's own loop
    script = work / "task.py"
    script.write_text(TASK_SCRIPT)
    procs = []
    try:
        common = [str(LOCAL_CONFIG), args.task, json.dumps(options), str(args.rounds), str(args.h), str(args.lr)]
        first = subprocess.Popen([sys.executable, str(script), str(work / "api0"), *common], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, cwd=work)
        procs.append(first)
        boot = [a for a in json.loads(first.stdout.readline())["addresses"] if "/tcp/" in a][:1]
        second = subprocess.Popen([sys.executable, str(script), str(work / "api1"), *common, *boot],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=work)
        procs.append(second)
        second.stdout.readline()
        results["api"] = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sync-every", type=int, default=100)
    ap.add_argument("--task", default="tinygpt")
    ap.add_argument("--task-options", default='{"batch": 8}')
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--h", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--skip-task", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = step_costs(args, work)
        print("| pair | loop | step between syncs, median (ms) | mean (ms) | a step that syncs (ms) |")
        print("|---|---|---|---|---|")
        for r in rows:
            sync = "" if r["sync_step_ms"] is None else f"{r['sync_step_ms']:.1f}"
            print(f"| {r['pair']} | {r['mode']} | {r['median_ms']:.3f} | {r['mean_ms']:.3f} | {sync} |")
        plain = statistics.median(r["median_ms"] for r in rows if r["mode"] == "plain")
        api = statistics.median(r["median_ms"] for r in rows if r["mode"] == "api")
        print(f"\nAPI cost per inner step between syncs: {100 * (api / plain - 1):+.2f}% "
              f"(median of pairs: {api:.3f} ms against {plain:.3f} ms)\n")
        if not args.skip_task:
            res = task_runs(args, work)
            print(f"| front door | peer | final validation loss | bytes sent ({args.rounds} rounds) | final hash |")
            print("|---|---|---|---|---|")
            for door, peers in res.items():
                for i, p in enumerate(peers):
                    print(f"| {door} | {i} | {p['loss']:.4f} | {p['bytes_sent']:,} | {p['final']} |")
    print(f"\n({time.time() - started:.0f} s, {time.strftime('%Y-%m-%d %H:%M')})")


if __name__ == "__main__":
    main()
