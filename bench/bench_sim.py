"""The simulator's table (node/sim.py, ``swarmd sim``): the real gossip, CRDT and DiLoCo code, many nodes in one
process on in-memory links (25 ms one way per host, 100 Mbit/s up and down), on virtual time.

Rows:
- gossip and CRDT for 100 and 1,000 peers (each opens 8 connections: a random graph of mean degree ~16): a flood
  message's delivery latency (p50/p99 over every receiver) and pubsub bytes each node sends per message; the swarm
  cut in halves for 30 s while 10 nodes of each side write, then healed: when each side agreed within itself, and
  how long after the heal every replica held the same state;
- gossip alone for 10,000 peers (every CRDT replica holds every op: 10,000 replicas of 10,000 members' ops do not fit
  one process; the gossip layer does);
- DiLoCo on the regression task, a full mesh (as every real swarm within discovery.max_peers is) of 16 and 64 peers,
  with no churn and with 10% of the peers down at any time (a different 10% every 5 simulated seconds, killed as
  kill -9 and restarted with their data dir): simulated seconds per round, participants per round, resyncs,
  whether every peer ends on the same weights, and the validation loss;
- DiLoCo with one far peer (5 peers, one of them 0.5 s or 0.16 s away one way), in each exchange mode, with the
  round's members agreed (the coordinator's view, the default) and, as the same-run baseline, each peer's own view;
- DiLoCo on slow links (4 peers, 200 and 100 kB/s up and down, an update of 262,144 values (0.27 MB in int8) by
  reduce-scatter, 8 rounds of 1 s of inner steps, seeds 1-8) with the default ``min_bandwidth`` (10 MB/s: the
  exchange step takes the rate it measures) and, as the same-run baseline, ``min_bandwidth`` set to the link's
  rate (what a user who knows it sets);
- DiLoCo with slow uplinks (4 peers on 2 MB/s links exchanging the same update, 8 rounds; after round 2 one
  peer's uplink falls to 50 kB/s, then two peers'; then the same from the start, before round 0: ``--uplink-after
  2 0``), seeds 1-16: runs clean (all 4 in every round, one final weights, no resync), resyncs, members a round and
  simulated seconds a round, next to the same seeds with no link falling (baseline).

Each row says how long it took in wall time on this machine. Seeds are fixed: a row is the same in every run.

    python bench/bench_sim.py [--peers 100 1000] [--gossip-only 10000] [--diloco 16 64] [--rounds 12]
                              [--far 0.5 0.16] [--slow 200e3 100e3] [--slow-seeds 8]
                              [--uplink 50e3] [--uplink-peers 1 2] [--uplink-after 2 0] [--uplink-seeds 16]
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarmd.node import sim  # noqa: E402
from swarmd.transport.memory import run_virtual  # noqa: E402


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="*", default=[100, 1000])
    parser.add_argument("--gossip-only", type=int, nargs="*", default=[10_000])
    parser.add_argument("--diloco", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--far", type=float, nargs="*", default=[0.5, 0.16], help="one-way latencies of the far peer")
    parser.add_argument("--slow", type=float, nargs="*", default=[200e3, 100e3], help="slow links' rates, bytes/s")
    parser.add_argument("--slow-seeds", type=int, default=8)
    parser.add_argument("--uplink", type=float, nargs="*", default=[50e3],
                        help="one peer's uplink after round 2, bytes/s (the others 2 MB/s)")
    parser.add_argument("--uplink-peers", type=int, nargs="*", default=[1, 2],
                        help="how many peers' uplinks fall (a row each)")
    parser.add_argument("--uplink-after", type=int, nargs="*", default=[2, 0],
                        help="the rounds every peer closed before the uplinks fall (0: slow from the start)")
    parser.add_argument("--uplink-seeds", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    print("Gossip and CRDT, simulated (25 ms one way per host, 100 Mbit/s, each node opens 8 connections)")
    print(sim.HEADER + " | peak RSS MB")
    rows = [(n, True) for n in args.peers] + [(n, False) for n in args.gossip_only]
    for n, crdt in rows:
        report = sim.simulate(sim.SimConfig(peers=n, crdt=crdt))
        print(sim.format_row(report) + f" | {rss_mb():>11.0f}" + ("" if crdt else "   (gossip only)"), flush=True)

    print()
    print("DiLoCo on the regression task (dim 256, int8 updates), a full mesh, 10 inner steps of 0.1 simulated s, "
          f"{args.rounds} rounds")
    print(f"{'peers':>5} | {'churn':>5} | {'kills':>5} | {'s/round':>7} | {'participants med/min':>20} | "
          f"{'resyncs':>7} | {'same weights':>12} | {'loss start -> end':>19} | {'wall s':>6}")
    for n in args.diloco:
        for churn in (0.0, 0.1):
            started = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="swarmd-sim-") as tmp:
                r = run_virtual(sim.diloco_churn(sim.SimConfig(peers=n), sim.ChurnConfig(rounds=args.rounds,
                                                                                         churn=churn), Path(tmp)))
            print(f"{n:>5} | {churn:>5.0%} | {r['kills']:>5} | {r['s_per_round']:>7.2f} | "
                  f"{r['participants_median']:>10.0f} / {r['participants_min']:<7} | {r['resyncs']:>7} | "
                  f"{r['same_final_weights']:>5}/{n:<6} | {r['loss_start']:>8.1f} -> {r['loss_end']:>7.2f} | "
                  f"{time.monotonic() - started:>6.0f}", flush=True)

    far(args)
    slow(args)
    uplink(args)


def far(args) -> None:
    if not args.far:
        return
    print()
    peers = 5
    print(f"DiLoCo with one far peer ({peers} peers, the others 25 ms away), {args.rounds} rounds: each peer's own "
          "view of a round's members (before) vs the coordinator's (agree, now)")
    print(f"{'far s':>5} | {'exchange':>10} | {'members':>11} | {'s/round':>7} | {'participants med/min':>20} | "
          f"{'resyncs':>7} | {'redone':>6} | {'far closed':>10} | {'same weights':>12} | {'loss end':>8} | "
          f"{'wall s':>6}")
    for latency in args.far:
        for exchange in ("all-to-all", "scatter"):
            for agree in (False, True):
                started = time.monotonic()
                with tempfile.TemporaryDirectory(prefix="swarmd-sim-") as tmp:
                    r = run_virtual(sim.diloco_far(sim.SimConfig(peers=peers), sim.ChurnConfig(rounds=args.rounds),
                                                   Path(tmp), latency, exchange=exchange, agree=agree))
                print(f"{latency:>5.2f} | {exchange:>10} | {'coordinator' if agree else 'own view':>11} | "
                      f"{r['s_per_round']:>7.2f} | {r['participants_median']:>10.0f} / {r['participants_min']:<7} | "
                      f"{r['resyncs']:>7} | {r['counters'].get('redone', 0):>6} | "
                      f"{r['far_closed']:>4} / {args.rounds:<3} | {r['same_final_weights']:>5}/{peers:<6} | "
                      f"{r['loss_end']:>8.3f} | {time.monotonic() - started:>6.0f}", flush=True)


def slow(args) -> None:
    if not args.slow:
        return
    print()
    peers, seeds = 4, range(1, args.slow_seeds + 1)
    churn = sim.ChurnConfig(rounds=8, dim=262144, exchange="scatter")
    print(f"DiLoCo on slow links ({peers} peers, an update of {churn.dim:,} values in int8 by reduce-scatter, "
          f"{churn.rounds} rounds of {churn.inner_steps * churn.step_seconds:.0f} s of inner steps), seeds "
          f"{seeds.start}-{seeds.stop - 1}: the default min_bandwidth (10 MB/s: the measured rate) vs min_bandwidth "
          "set to the link's rate (baseline)")
    print(f"{'link kB/s':>9} | {'min_bandwidth':>13} | {'one weights':>11} | {'0-1 resyncs':>11} | "
          f"{'resyncs':>7} | {'members mean':>12} | {'s/round':>7} | {'wall s':>6}")
    for rate in args.slow:
        for configured in (None, rate):
            started = time.monotonic()
            runs = []
            for seed in seeds:
                with tempfile.TemporaryDirectory(prefix="swarmd-sim-") as tmp:
                    settings = {} if configured is None else {"min_bandwidth": configured}
                    runs.append(run_virtual(sim.diloco_run(sim.SimConfig(peers=peers, seed=seed, bandwidth=rate),
                                                           churn, Path(tmp), **settings)))
            n = len(runs)
            print(f"{rate / 1e3:>9.0f} | {'10 MB/s' if configured is None else 'the link':>13} | "
                  f"{sum(r['same_final_weights'] == peers for r in runs):>5} of {n:<2} | "
                  f"{sum(r['resyncs'] <= 1 for r in runs):>5} of {n:<2} | "
                  f"{sum(r['resyncs'] for r in runs) / n:>7.1f} | "
                  f"{sum(r['participants_mean'] for r in runs) / n:>12.2f} | "
                  f"{sum(r['s_per_round'] for r in runs) / n:>7.2f} | {time.monotonic() - started:>6.0f}", flush=True)


async def _uplink_run(seed: int, rate: float | None, churn, root: Path, count: int = 1, after: int = 2) -> dict:
    """One run of the slow-uplink scenario: 4 peers at 2 MB/s; after every peer closed ``after`` rounds, the
    first ``count`` peers' uplinks fall to ``rate`` (None: nothing changes, the baseline)."""
    fall = sim.first_uplink_falls(rate, count) if rate is not None else (lambda s, cfg: None)
    run = await sim.diloco_links_change(sim.SimConfig(peers=4, seed=seed, bandwidth=2e6), churn, root, fall,
                                        after=after)
    loops = run["loops"].values()
    members = [h["participants"] for lp in loops for h in lp.history]
    resyncs = sum(lp.counters["resyncs"] for lp in loops)
    finals = len(run["finals"])
    return {"clean": finals == 1 and resyncs == 0 and min(members) == 4, "finals": finals, "resyncs": resyncs,
            "members": sum(members) / len(members),
            "s_per_round": run["seconds"] / max(len(lp.history) for lp in loops)}


def uplink(args) -> None:
    if not args.uplink:
        return
    print()
    seeds = range(1, args.uplink_seeds + 1)
    churn = sim.ChurnConfig(rounds=8, dim=262144, exchange="scatter")
    print(f"DiLoCo with slow uplinks (4 peers at 2 MB/s, an update of {churn.dim:,} values in int8 by "
          f"reduce-scatter, {churn.rounds} rounds; once every peer closed 'from' rounds, the uplinks of the first "
          f"peers (by id) fall; 0: slow from the start), seeds {seeds.start}-{seeds.stop - 1}; baseline: the same "
          f"seeds, no link falls")
    print(f"{'slow':>4} | {'from':>4} | {'uplink kB/s':>11} | {'clean':>8} | {'one weights':>11} | {'resyncs':>7} | "
          f"{'members mean':>12} | {'s/round':>7} | {'wall s':>6}")
    rows = [(0, None, 0), *((c, r, a) for a in args.uplink_after for c in args.uplink_peers for r in args.uplink)]
    for count, rate, after in rows:
        started = time.monotonic()
        runs = []
        for seed in seeds:
            with tempfile.TemporaryDirectory(prefix="swarmd-sim-") as tmp:
                runs.append(run_virtual(_uplink_run(seed, rate, churn, Path(tmp), count, after)))
        n = len(runs)
        base = "2000 (base)" if rate is None else f"{rate / 1e3:.0f}"
        print(f"{count:>4} | {'-' if rate is None else after:>4} | {base:>11} | "
              f"{sum(r['clean'] for r in runs):>2} of {n:<2} | {sum(r['finals'] == 1 for r in runs):>5} of {n:<2} | "
              f"{sum(r['resyncs'] for r in runs):>7} | {sum(r['members'] for r in runs) / n:>12.2f} | "
              f"{sum(r['s_per_round'] for r in runs) / n:>7.2f} | {time.monotonic() - started:>6.0f}", flush=True)


if __name__ == "__main__":
    main()
