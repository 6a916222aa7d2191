"""One S-byte update exchanged among N peers (separate processes; loopback, or each peer on its own capped link),
per round: swarmd's DiLoCo exchange all-to-all and by reduce-scatter + all-gather, next to hivemind's
DecentralizedAverager (butterfly all-reduce) of the same bytes, in the same run.

swarmd: N nodes run DiLoCo on ``bench/vector_task.py`` (one parameter vector of S/4 values, codec ``none``: an
update is S bytes; ``--codec e3m0``, the loop's default, sends about S/7.5 for the same values), one inner step per
round, so a round's time is its exchange; bytes = what each node's bulk service pulled and served,
per round, in units of S. The peers start each round together, as hivemind's do: after each (SGD) inner step they
wait for each other at a barrier, and time = a round's period, from the moment the last peer was ready with its
trained weights to the moment the last was ready again (our update's preparation, the exchange, the outer step and
one SGD step; the median over rounds); "exchange s": the same less the SGD step and the barrier, to the moment the
last peer began its next inner step (the part of a round hivemind's timing has a counterpart of). ``--free``: the
peers train (AdamW) and announce as they go, and time = a node's median span
from announcing its update to holding the round's combined update (the slowest node's), which leaves out our own
update's preparation and the steps on either side. "after
all in": from the round's close (every update announced, the members agreed) to the combined update.
hivemind: N processes, each a DecentralizedAverager over one S/4-value fp32 tensor,
timed from the trigger after matchmaking (every peer waits at a barrier for it) to the all-reduce's end (the
slowest peer's; the median of the rounds).

    python bench/bench_exchange.py [--peers 4,8] [--mb 25] [--rounds 4] [--only swarmd|hivemind] [--link 100]
    python bench/bench_exchange.py --e2e [--layers 15]     # DiLoCo end to end, 4 peers, a ~109M-parameter Llama

--link 100: each peer (swarmd node, or hivemind averager with its DHT) runs on its own host of a star lab of network
namespaces (tests/natlab.py StarLab: one switch, each host's link capped at 100 Mbit/s both ways by tc tbf, as a
home connection), so bytes, not this machine's CPU, set the time. Needs root.

--e2e: 4 peers run DiLoCo (default settings: e3m0, exchange auto) on the hf-text task with a Llama of hidden 768,
15 layers (random init), batch 1 x 64 tokens, H = 4, 3 rounds; reported: round time, the fraction of time a node was
not blocked on the exchange, each node's peak RSS, the exchange chosen.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from natlab import StarLab, unavailable  # noqa: E402
from swarmproc import LOOPBACK_NODE, Swarm, loop_config, wait_for  # noqa: E402
from vector_task import periods, windows  # noqa: E402  (bench/ is this script's own directory)

CONFIG = """
[node]
memory = "{memory}"
[loops.diloco]
run = "x{peers}{mode_short}"
task = "{task}"
device = "cpu"
codec = "{codec}"
rounds = {rounds}
inner_steps = 1
min_peers = {peers}
deadline_low = 2.0
deadline_high = 120.0
exchange = "{mode}"
agree = {agree}
audit = {audit}
parts = {parts}
checkpoint_every = 0
min_bandwidth = 5e6
[loops.diloco.task_options]
size = {size}
sgd = {sgd}
together = "{together}"
peers = {peers}
"""


# the nodes' own settings with ``--intervals default``: the shipped intervals (member poll 5 s, CRDT anti-entropy 5 s,
# ...), as a user runs a node; ``tests`` is the test suite's loopback node (tests/swarmproc.py LOOPBACK_NODE: poll
# 3 s, anti-entropy 1 s), whose faster intervals cost more (16 idle nodes: 66% of a core against 54-59%)
NODE_DEFAULTS = """
[network]
listen = ["/ip4/127.0.0.1/tcp/0"]
reachability = "public"
[state]
admission_bits = 12
[http]
listen = "127.0.0.1:0"
"""


AGREEMENT = ("parts_", "members_", "coordinator_", "views_", "view_", "own_update", "reduced_parts", "audits_",
             "announcement", "chunks_", "diverged", "deadline_missed", "minority_parts")


def _is_p2p_daemon(proc) -> bool:
    """Whether a process is a p2p daemon (swarmd's and hivemind's both run hivemind's bundled ``p2pd``)."""
    return proc.name() == "p2pd"


class PeakMemory:
    """Each peer's peak memory while a run goes: the PSS (proportional set size: a page shared by k processes
    counts 1/k in each, so hivemind's shared-memory tensors are not counted twice) of its process and every
    process under it (a swarmd node and its p2p daemon; a hivemind peer, its averager and DHT processes); and the
    CPU time (user + system) those processes used from ``mark()`` to ``stop()`` (a process that ended between two
    samples counts up to its last sample).

    Every 0.3 s, in a thread, it reads each process's RSS and CPU times (``/proc/<pid>/stat``, cheap) and reads a
    peer's PSS (``smaps_rollup``: a walk of the process's page tables in the kernel) only when that peer's RSS is
    at a new high (over PSS_NEW_HIGH x its highest so far), and PSS_EVERY seconds after its last reading. Reading
    the PSS of every process every 0.3 s takes 120 ms of kernel CPU a sample for the 16 processes of 8 swarmd peers,
    about 13% of a core taken from the peers it measures."""

    PSS_EVERY = 5.0  # seconds
    PSS_NEW_HIGH = 1.01  # x the peer's highest RSS when its PSS was read: a new high

    def __init__(self, pids: list[int]):
        import threading

        self.pids, self.peak = pids, [0] * len(pids)
        self._rss_high = [0] * len(pids)  # each peer's highest RSS at a PSS reading
        self._pss_at = [-math.inf] * len(pids)  # when each peer's PSS was last read (monotonic)
        self._procs: dict[int, tuple[float, list]] = {}  # peer -> (when listed, its processes)
        self._cpu: dict[int, float] = {}  # pid (every process of every tree) -> its CPU seconds at the last sample
        self._daemons: set[int] = set()  # the pids of p2p daemons among them
        self._marked: dict[int, float] | None = None
        self._main: list[list[float]] = []  # [at mark, at stop]: each peer's main thread's CPU seconds
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self, i: int, force: bool = False) -> int:
        """Peer i's PSS if it is read this time (see the class), else 0; its processes' CPU times either way."""
        import psutil

        now = time.monotonic()
        procs = self._procs.get(i)
        if procs is None or now - procs[0] >= self.PSS_EVERY:  # each peer's processes, listed again every PSS_EVERY
            try:
                root = psutil.Process(self.pids[i])
                procs = self._procs[i] = (now, [root, *root.children(recursive=True)])
            except psutil.Error:
                return 0
        procs = procs[1]
        rss = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
                times = proc.cpu_times()
                daemon = _is_p2p_daemon(proc)
                with self._lock:
                    self._cpu[proc.pid] = times.user + times.system
                    if daemon:
                        self._daemons.add(proc.pid)
            except psutil.Error:
                pass
        if not (force or rss > self.PSS_NEW_HIGH * self._rss_high[i] or now - self._pss_at[i] >= self.PSS_EVERY):
            return 0
        self._rss_high[i] = max(self._rss_high[i], rss)
        self._pss_at[i] = now
        total = 0
        for proc in procs:
            try:
                total += proc.memory_full_info().pss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            self._sample()

    def _sample(self, force: bool = False) -> None:
        for i in range(len(self.pids)):
            self.peak[i] = max(self.peak[i], self._tree(i, force))

    def _main_threads(self) -> list[float]:
        """Each peer's main thread's CPU seconds (user + system) so far: for a swarmd node, its event loop (the
        rest of the process is the worker threads the loop hands work to)."""
        import psutil

        out = []
        for pid in self.pids:
            try:
                main = next(t for t in psutil.Process(pid).threads() if t.id == pid)
                out.append(main.user_time + main.system_time)
            except (psutil.Error, StopIteration):
                out.append(math.nan)
        return out

    def mark(self) -> None:
        """Start counting CPU time here (what the processes used before, starting up, is left out)."""
        self._sample()
        self._main = [self._main_threads()]
        with self._lock:
            self._marked = dict(self._cpu)

    def stop(self) -> list[int]:
        self._main.append(self._main_threads())
        self._stop.set()
        self._thread.join()
        self._sample(force=True)
        return self.peak

    def main_thread_seconds(self) -> float:
        """The CPU seconds the peers' main threads used from ``mark()`` to ``stop()``, all peers together."""
        if len(self._main) != 2:
            return math.nan
        return sum(b - a for a, b in zip(*self._main))

    def cpu_seconds(self, daemons_only: bool = False) -> float:
        """The CPU seconds every process (or only the p2p daemons) used since ``mark()`` (since the start without
        one), all peers together."""
        marked = self._marked or {}
        with self._lock:
            return sum(v - marked.get(pid, 0.0) for pid, v in self._cpu.items()
                       if not daemons_only or pid in self._daemons)


def _summed(final: list[dict]) -> dict:
    """The nodes' exchange and agreement counters (``/status`` -> services.diloco), summed."""
    out: dict[str, int] = {}
    for s in final:
        for k, v in s.items():
            if k.startswith(AGREEMENT) and isinstance(v, int) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _gossip_drops(gossip: list[dict]) -> dict:
    """What the nodes' gossip dropped (``/status`` -> services.gossip), summed: a full send queue or subscriber,
    or a topic's delivery queue full. A round's views and announcements that never reached a peer show here if they
    were dropped, not merely late."""
    out = {f"gossip_{k}": sum(g.get(k, 0) for g in gossip)
           for k in ("send_queue_dropped", "subscriber_dropped", "stale", "iwant_sent", "iwant_served", "duplicates",
                     "forwarded")}
    out["gossip_dropped_full"] = sum(t.get("dropped_full", 0) for g in gossip for t in g.get("topics", {}).values())
    return out


def _frames_in(nodes: list) -> dict[str, float]:
    """The frames the nodes received on each of their p2p protocols so far (``/metrics``:
    swarmd_messages_total, direction "in"), all nodes together, by the protocol's name (``/swarmd/<name>/...``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for n in nodes:
        for family in text_string_to_metric_families(n.get("/metrics")):
            for sample in family.samples:
                if sample.name == "swarmd_messages_total" and sample.labels.get("direction") == "in":
                    name = sample.labels["protocol"].split("/")[2]
                    out[name] = out.get(name, 0.0) + sample.value
    return out


STARTUP = 300.0  # s a node may take to come up


def _start(swarm: Swarm, peers: int, lab: StarLab | None) -> list:
    """N nodes on loopback (each bootstrapped from the first), or each on its own host of the star lab."""
    if lab is None:
        # the first, then the others, each given STARTUP s to come up: on 2 cores that others share, N processes
        # importing torch at once took over start_chain's 32 s
        nodes = [swarm.start("n0", wait=False)]
        nodes[0].wait_ready(STARTUP)
        nodes += [swarm.start(f"n{i}", bootstrap=[nodes[0].tcp_addr], wait=False) for i in range(1, peers)]
        for node in nodes[1:]:
            node.wait_ready(STARTUP)
        return nodes

    def start(i, bootstrap=(), wait=False):
        return swarm.start(f"n{i}", "--listen", f"/ip4/{lab.ips[i]}/tcp/0", bootstrap=list(bootstrap), wait=wait,
                           prefix=lab.cmd(i), via=functools.partial(lab.call, i))

    nodes = [start(0)]
    nodes[0].wait_ready(STARTUP)
    nodes += [start(i, [nodes[0].tcp_addr]) for i in range(1, peers)]
    for node in nodes[1:]:
        node.wait_ready(STARTUP)
    return nodes


def _daemon_env(spec: str):
    """The nodes started inside run their p2p daemons with the Go settings of ``spec`` (``NAME=value`` joined by
    ``+``; a user's GOGC wins over swarmd's, and a node's environment is this process's); "default" leaves
    swarmd's own. This process's environment is as it was afterwards."""
    settings = dict(x.split("=", 1) for x in spec.split("+")) if spec != "default" else {}
    return mock.patch.dict(os.environ, settings)


def swarmd(mode: str, peers: int, size_bytes: int, rounds: int, root: Path, audit: float = 0.0,
           parts: str = "auto", lab: StarLab | None = None, codec: str = "none", sgd: bool = False,
           memory: str = "reuse", intervals: str = "default", together: bool = False) -> dict:
    # "scatter-own": scatter with each peer's own view of a round's members (agree = false), the baseline of the
    # agreed members
    agree = "false" if mode.endswith("-own") else "true"
    mode = mode.removesuffix("-own")
    table = CONFIG.format(
        peers=peers, mode=mode, mode_short=mode[0], agree=agree, codec=codec,
        task=f"{ROOT / 'bench' / 'vector_task.py'}:make_task",
        rounds=rounds, audit=audit, size=size_bytes // 4, parts=parts if parts != "auto" else '"auto"',
        sgd=str(sgd).lower(), memory=memory, together=root / "together" if together else "")
    if together:
        (root / "together").mkdir(parents=True)
    config = loop_config(root / "diloco.toml", table, LOOPBACK_NODE if intervals == "tests" else NODE_DEFAULTS)
    swarm = Swarm(root / "nodes", config=config)
    try:
        nodes = _start(swarm, peers, lab)

        def d(n):
            return n.status()["services"]["diloco"]

        memory = PeakMemory([n.pid for n in nodes])
        wait_for(lambda: all(d(n)["state"] in ("running", "done") for n in nodes), 600, "every node running",
                 interval=0.1)
        memory.mark()
        frames = _frames_in(nodes)
        t0 = time.monotonic()
        # (every 0.5 s: a node's status is read on the cores the peers share; the rounds' times are the nodes' own)
        final = wait_for(lambda: all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes], 1800,
                         f"{mode} x{peers} to finish", interval=0.5)
        wall = time.monotonic() - t0
        frames = {k: (v - frames.get(k, 0.0)) / rounds / peers for k, v in _frames_in(nodes).items()}
        peak = memory.stop()
        statuses = [n.status()["services"] for n in nodes]
        bulk = [s["bulk"] for s in statuses]
        for i, s in enumerate(final):
            if s["exchange"].get("round_seconds_median") is None:  # no round with our update in it: say whose
                print(f"node {i} closed no round with its own update in it: {json.dumps(s)[:4000]}", file=sys.stderr)
        span = max(s["exchange"]["round_seconds_median"] or math.inf for s in final)
        period = periods(str(root / "together"), peers) if together else []
        window = windows(str(root / "together"), peers) if together else []
        return {
            # the peers started together (the default): a round's period, from the last peer ready with its update to
            # the last ready with the next (the median over rounds), as hivemind's rounds are timed (the slowest
            # peer's, from the trigger that every peer waited for); --free: a node's span from announcing its update
            # to the combined one
            # (no period when a node skipped a barrier, a resync: NaN, not the span under the "together" label)
            "round_s": (statistics.median(period) if period else math.nan) if together else span,
            "span_s": span,
            # (together) the exchange alone: a period less the inner step and the barrier, from the last peer ready
            # to the last one done with the round (hivemind's time has a counterpart of this part only)
            "exchange_s": statistics.median(window) if window else math.nan,
            "periods": len(period),
            "period_each": [round(x, 3) for x in period],  # (stderr) each round's, in order
            "close_s": max(s["exchange"]["close_seconds_median"] for s in final),
            "wall_s": wall / rounds,
            "in": max(b.get("bytes_pulled", 0) for b in bulk) / rounds / size_bytes,
            # (stderr) each peer's bytes in, and those of the exchange alone (the link probe before round 0 aside)
            "in_each": sorted(round(b.get("bytes_pulled", 0) / rounds / size_bytes, 3) for b in bulk),
            "exchange_in_each": sorted(round(s.get("bytes_received", 0) / rounds / size_bytes, 3) for s in final),
            # (stderr) what each peer's bytes in went to, over the run: (x S a round, parts reduced, parts audited)
            "load_each": sorted((round(s.get("bytes_received", 0) / rounds / size_bytes, 3), s.get("parts_reduced", 0),
                                 s.get("parts_audited", 0)) for s in final),
            "out": max(b.get("bytes_served", 0) for b in bulk) / rounds / size_bytes,
            "same": len({s["final_hash"] for s in final}) == 1,
            "mode": final[0]["exchange"].get("mode"),
            "parts": final[0]["exchange"].get("parts"),  # the last round's part count
            "fallback": sum(s.get("parts_fallback", 0) for s in final),
            "conformed": sum(s.get("parts_conformed", 0) for s in final),
            "resyncs": sum(s.get("resyncs", 0) for s in final),
            "peak_gb": max(peak) / 1e9,
            "cpu_s": memory.cpu_seconds() / rounds / peers,
            "p2pd_cpu_s": memory.cpu_seconds(daemons_only=True) / rounds / peers,
            # (where a node's CPU goes, per node and round) its event loop's thread, the p2p daemon's, and frames in
            "main_cpu_s": memory.main_thread_seconds() / rounds / peers,
            "frames_in": dict(sorted(frames.items(), key=lambda kv: -kv[1])),
            "evicted": sum(b.get("blobs_evicted", 0) for b in bulk),
            "agreement": {**_summed(final), **_gossip_drops([s["gossip"] for s in statuses])},  # stderr only
            # each phase's median at the node where it took longest (protocols/diloco.py: _phase_times)
            "phases": {k: max(s["exchange"].get("phase_seconds_median", {}).get(k, 0.0) for s in final)
                       for k in ("wait", "agree", "reduce", "conform", "combine")
                       if any(k in s["exchange"].get("phase_seconds_median", {}) for s in final)},
        }
    finally:
        swarm.close()


E2E = """
[node]
memory = "{memory}"
[loops.diloco]
run = "e2e"
task = "hf-text"
device = "cpu"
rounds = {rounds}
inner_steps = {h}
min_peers = {peers}
deadline_low = 5.0
deadline_high = 600.0
checkpoint_every = 0
eval_every = 100
[loops.diloco.task_options]
seq_len = 64
batch = 1
eval_batches = 1
[loops.diloco.task_options.config]
hidden_size = 768
intermediate_size = 2048
num_hidden_layers = {layers}
num_attention_heads = 12
num_key_value_heads = 12
"""


def e2e(peers: int, layers: int, rounds: int, h: int, root: Path, memory: str = "reuse") -> None:
    import psutil

    config = loop_config(root / "diloco.toml", E2E.format(peers=peers, layers=layers, rounds=rounds, h=h,
                                                           memory=memory))
    swarm = Swarm(root / "nodes", config=config)
    try:
        nodes = swarm.start_chain(peers, members_within=None)
        procs = [psutil.Process(n.pid) for n in nodes]
        peak = [0] * peers

        def d(n):
            return n.status()["services"]["diloco"]

        def done():
            for i, p in enumerate(procs):
                peak[i] = max(peak[i], p.memory_info().rss)
            return all(d(n)["state"] == "done" for n in nodes) and [d(n) for n in nodes]

        started = time.monotonic()
        final = wait_for(done, 3600, "the end-to-end run to finish", interval=0.5)
        wall = time.monotonic() - started
        s0 = final[0]
        print(f"DiLoCo end to end: {peers} peers, Llama hidden 768 x {layers} layers, {s0['parameters']:,} parameters, "
              f"H = {h}, {rounds} rounds, codec e3m0 ({s0['bytes_sent'] / rounds / 1e6:.1f} MB per update), "
              f"node.memory = {memory}")
        print(f"exchange: {s0['exchange']}")
        refused = {k: sum(s.get(k, 0) for s in final) for k in sorted({k for s in final for k in s})
                   if k.startswith("rejected_")}
        print(f"same final weights: {len({s['final_hash'] for s in final}) == 1}; participants per round: "
              f"{[x['participants'] for x in s0['history']]} (updates refused, summed over the nodes: "
              f"{refused or 'none'}); wall {wall:.0f} s from start to done")
        print(f"{'node':>4} | {'not blocked':>11} | {'round s (median)':>16} | {'after all in s':>14} | "
              f"{'peak RSS GB':>11} | {'MB in':>7} | {'MB out':>7} | {'loop stalls':>11}")
        for i, (n, s) in enumerate(zip(nodes, final)):
            status = n.status()
            b = status["services"]["bulk"]
            print(f"{i:>4} | {s['compute_fraction'] * 100:>10.1f}% | {s['exchange']['round_seconds_median']:>16.2f} | "
                  f"{s['exchange']['close_seconds_median']:>14.2f} | {peak[i] / 1e9:>11.2f} | "
                  f"{b.get('bytes_pulled', 0) / 1e6:>7.1f} | {b.get('bytes_served', 0) / 1e6:>7.1f} | "
                  f"{status['event_loop']['stalls']:>11}")
        print("loop stalls: the times the node's event loop ran a timer over 100 ms late, since it started "
              "(/status -> event_loop)")
    finally:
        swarm.close()


def _no_compression():
    from hivemind.compression import NoCompression

    return NoCompression()


def _float16():
    from hivemind.compression import Float16Compression

    return Float16Compression()


# hivemind's compressions the bench runs (``--hivemind-codec``), and the bytes each sends of fp32's
HIVEMIND_CODECS = {"none": _no_compression, "float16": _float16}
HIVEMIND_BYTES = {"none": 1.0, "float16": 0.5}


def _tree_cpu() -> tuple[float, float]:
    """The CPU seconds (user + system) this process and every process under it have used, and those of the p2p
    daemons among them."""
    import psutil

    me = psutil.Process()
    total = daemons = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
            if _is_p2p_daemon(proc):
                daemons += times.user + times.system
        except psutil.Error:
            pass
    return total, daemons


def _averager_peer(index: int, peers: int, size: int, rounds: int, addrs, barrier, out, host=None,
                   codec: str = "none") -> None:
    """One averager; ``host`` = (namespace file, IP): this process moves into that host of the star lab first (its
    DHT and averager processes, forked from it, live there too); ``codec``: its all-reduce's compression
    (``HIVEMIND_CODECS``)."""
    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager are processes forked from this one
    ip = "127.0.0.1"
    if host is not None:
        from natlab import _setns

        _setns(host[0])
        ip = host[1]
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    if index == 0:
        dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{ip}/tcp/0"])
        addrs.extend([str(a) for a in dht.get_visible_maddrs()])
    else:
        while not addrs:
            time.sleep(0.05)
        dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=list(addrs))
    averager = hivemind.averaging.DecentralizedAverager(
        [torch.randn(size)], dht, prefix="bench", target_group_size=peers, min_group_size=peers,
        min_matchmaking_time=2.0, request_timeout=10.0, start=True, compression=HIVEMIND_CODECS[codec]())
    times = []
    cpu_from, window = None, 0.0
    for _ in range(rounds):
        barrier.wait()
        if cpu_from is None:  # the rounds' CPU time: from here (the DHT and averager started) to the last one's end
            cpu_from = _tree_cpu()
        control = averager.step(wait=False, require_trigger=True, timeout=300)
        while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
            time.sleep(0.01)
        barrier.wait()
        c0 = _tree_cpu()[0]
        t0 = time.monotonic()
        control.allow_allreduce()
        control.result()
        times.append(time.monotonic() - t0)
        window += _tree_cpu()[0] - c0  # the all-reduce's own CPU, from the trigger to its end
    cpu_to = _tree_cpu()
    out.put((times, cpu_to[0] - cpu_from[0], cpu_to[1] - cpu_from[1], window))
    barrier.wait()
    averager.shutdown()
    dht.shutdown()


def hivemind_averager(peers: int, size_bytes: int, rounds: int, lab: StarLab | None = None,
                      codec: str = "none") -> dict:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    addrs, barrier, out = manager.list(), ctx.Barrier(peers), ctx.Queue()
    hosts = [None] * peers if lab is None else [(f"/run/netns/{lab.ns[i]}", lab.ips[i]) for i in range(peers)]
    procs = [ctx.Process(target=_averager_peer, args=(i, peers, size_bytes // 4, rounds, addrs, barrier, out,
                                                      hosts[i], codec))
             for i in range(peers)]
    for p in procs:
        p.start()
    memory = PeakMemory([p.pid for p in procs])
    try:
        times = []
        while len(times) < peers:
            try:
                times.append(out.get(timeout=1.0))
            except Exception:  # queue.Empty: check that no averager died
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("an averager process failed (see its traceback above)")
    finally:
        peak = memory.stop()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        manager.shutdown()
    cpu = sum(c for _, c, _, _ in times) / rounds / peers
    daemons = sum(d for _, _, d, _ in times) / rounds / peers
    window = sum(w for _, _, _, w in times) / rounds / peers
    times = [t for t, _, _, _ in times]
    per_round = [max(t[r] for t in times) for r in range(rounds)]
    return {"round_s": statistics.median(per_round), "close_s": statistics.median(per_round),
            "period_each": [round(x, 3) for x in per_round],
            "exchange_s": statistics.median(per_round), "cpu_s": cpu,
            "window_cpu_s": window,
            "p2pd_cpu_s": daemons,
            "in": 2 * (peers - 1) / peers * HIVEMIND_BYTES[codec],
            "out": 2 * (peers - 1) / peers * HIVEMIND_BYTES[codec],
            "same": True, "mode": "butterfly", "fallback": 0,
            "conformed": 0, "resyncs": 0, "peak_gb": max(peak) / 1e9, "evicted": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="4,8")
    parser.add_argument("--mb", type=float, default=25.0, help="S, one update, in MB")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--only", default="", help="swarmd or hivemind (default: both)")
    parser.add_argument("--e2e", action="store_true", help="DiLoCo end to end on a ~100M-parameter model")
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--modes", default="all-to-all,scatter", help="swarmd's exchanges to run (scatter-own: "
                        "scatter with each peer's own view of a round's members, not the coordinator's)")
    parser.add_argument("--parts", default="auto", help="parts an update is cut into (the config's parts: auto, "
                        "the default, or a number); several, comma-separated, each run in turn (a same-run baseline)")
    parser.add_argument("--memory", default="reuse", help="the nodes' allocator (node.memory: reuse, the default, "
                        "or release); both, comma-separated, each run in turn (a same-run baseline)")
    parser.add_argument("--daemon-env", default="default", help="the Go runtime's settings for swarmd's p2p "
                        "daemons: default (swarmd's own: transport.p2pd.DAEMON_GOGC) or assignments joined by +, "
                        "e.g. GOMEMLIMIT=48MiB+GOGC=100 (a memory-capped alternative); several, comma-separated, "
                        "each run in turn (a same-run baseline)")
    parser.add_argument("--intervals", default="default", help="the nodes' background intervals: default (the "
                        "shipped ones, as a user runs a node) or tests (the test suite's faster member poll and CRDT "
                        "anti-entropy); both, comma-separated, each run in turn")
    parser.add_argument("--audit", type=float, default=0.25, help="the fraction of parts audited (the default)")
    parser.add_argument("--codec", default="none", help="swarmd's codec (default none: an update is S bytes, as "
                        "hivemind's; e3m0, the loop's default, sends about S/7.5, hivemind's averager fp32 either way)")
    parser.add_argument("--hivemind-codec", default="none", choices=sorted(HIVEMIND_CODECS),
                        help="hivemind's all-reduce compression: none (fp32, the same bytes as swarmd's codec none) "
                             "or float16 (its best that works: its 8-bit codecs send fp32 on numpy 2)")
    parser.add_argument("--inner-sgd", action="store_true", help="the vector trained by plain SGD (no optimizer "
                        "state: a node's memory is then the exchange's; default AdamW, the loop's)")
    parser.add_argument("--free", action="store_true", help="swarmd's peers train and announce as they go (the "
                        "vector trained by AdamW), and s/round is a node's span from announcing its update to the "
                        "combined one, waiting for the others included, which "
                        "leaves our own update's preparation and the peers' steps out of the time. Default: the peers "
                        "start each round together, as hivemind's averagers do (a barrier among them after each inner "
                        "step, the vector trained by plain SGD), and s/round is a round's period from the last peer "
                        "ready with its update to the last ready with the next (the exchange, the outer step and one "
                        "SGD step), the median over rounds, as hivemind's is timed from the trigger every peer "
                        "waited for")
    parser.add_argument("--link", type=float, default=0.0, metavar="MBIT",
                        help="each peer in its own network namespace, its link capped at MBIT both ways by tc tbf "
                             "(needs root; default: every peer on loopback)")
    args = parser.parse_args()
    if args.link and unavailable():
        parser.error(f"--link: {unavailable()}")
    if not set(args.intervals.split(",")) <= {"default", "tests"}:
        parser.error("--intervals: default, tests, or both")
    if args.e2e:
        for memory in args.memory.split(","):
            with tempfile.TemporaryDirectory(prefix="swarmd-bench-e2e-") as tmp:
                e2e(4, args.layers, args.rounds if args.rounds != 4 else 3, 4, Path(tmp), memory)
        return
    size = int(args.mb * 1e6) // 4 * 4
    rows = []
    for n in [int(x) for x in args.peers.split(",")]:
        with tempfile.TemporaryDirectory(prefix="swarmd-bench-exchange-") as tmp:
            result = {}
            # a fresh lab for each run: nothing one run left queued or open meets the next
            lab = (lambda: StarLab(n, rate_mbit=args.link)) if args.link else contextlib.nullcontext
            if args.only != "hivemind":
                choices, memories, daemons = args.parts.split(","), args.memory.split(","), args.daemon_env.split(",")
                every = args.intervals.split(",")
                for mode in args.modes.split(","):
                    for parts, memory, daemon, intervals in itertools.product(choices, memories, daemons, every):
                        name = mode + "".join(f" ({x})" for x, many in ((parts, choices), (memory, memories),
                                                                        (daemon, daemons), (intervals, every))
                                              if len(many) > 1)
                        with lab() as star, _daemon_env(daemon):
                            result[name] = swarmd(mode, n, size, args.rounds, Path(tmp) / name.replace(" ", ""),
                                                  args.audit, parts, star, args.codec, args.inner_sgd, memory,
                                                  intervals, not args.free)
                        print(f"N={n} {name}: {result[name]}", file=sys.stderr, flush=True)
            if args.only != "swarmd":
                with lab() as star:
                    result["hivemind"] = hivemind_averager(n, size, args.rounds, star, args.hivemind_codec)
                print(f"N={n} hivemind: {result['hivemind']}", file=sys.stderr, flush=True)
            rows.append((n, result))
    where = (f"each peer in its own network namespace, its link capped at {args.link:g} Mbit/s both ways (tc tbf)"
             if args.link else "loopback")
    print(f"One update of S = {size / 1e6:.0f} MB among N peers, {where}, {args.rounds} rounds; bytes per peer per "
          "round in units of S (the most any peer moved; hivemind's from its design: 2(N-1)/N, half that in float16)")
    print(f"{'N':>3} | {'exchange':<30} | {'parts':>5} | {'s/round':>8} | {'after all in':>12} | {'in (xS)':>7} | "
          f"{'out (xS)':>8} | "
          f"{'vs hivemind':>11} | {'exchange s':>10} | {'vs hivemind':>11} | "
          f"{'same weights':>12} | {'resyncs':>7} | {'fallback parts':>14} | {'parts redone':>12} | "
          f"{'peak GB/peer':>12} | {'CPU s/round/peer':>16} | {'of which p2pd':>13}")
    print("-" * 240)
    for n, result in rows:
        base = result.get("hivemind", {}).get("round_s")
        for name, r in result.items():
            ratio = f"{r['round_s'] / base:.2f}" if base else "-"
            alone = r.get("exchange_s", math.nan)
            alone_ratio = f"{alone / base:.2f}" if base and math.isfinite(alone) else "-"
            codec = "" if args.codec == "none" else f", {args.codec}"
            together = "" if args.free else ", together"
            label = (name + ("" if args.hivemind_codec == "none" else f" ({args.hivemind_codec})")
                     if name == "hivemind" else f"{name} (swarmd{codec}{together})")
            print(f"{n:>3} | {label:<30} | {r.get('parts') or '-':>5} | {r['round_s']:>8.2f} | "
                  f"{r['close_s']:>12.2f} | "
                  f"{r['in']:>7.2f} | {r['out']:>8.2f} | {ratio:>11} | {alone:>10.2f} | {alone_ratio:>11} | "
                  f"{('yes' if r['same'] else 'NO'):>12} | "
                  f"{r['resyncs']:>7} | {r['fallback']:>14} | {r['conformed']:>12} | {r['peak_gb']:>12.2f} | "
                  f"{format(r['cpu_s'], '.2f') if 'cpu_s' in r else '-':>16} | "
                  f"{format(r['p2pd_cpu_s'], '.2f') if 'p2pd_cpu_s' in r else '-':>13}")
    print("where a swarmd round goes (s; each phase's median at the node where it is longest): wait = our update "
          "announced -> every update announced; agree = the member agreement; reduce = chunks in, our parts reduced, "
          "the others' taken and audited; conform = the coordinator's parts list awaited and followed; combine = "
          "all-to-all's combination of the pulled updates")
    for n, result in rows:
        for name, r in result.items():
            if "phases" in r:
                print(f"{n:>3} | {name:<30} | " + " | ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
    print("where a swarmd node's CPU goes, per node and round (ms): its event loop's thread, its other threads (the "
          "work handed off the loop: inner step, encoding, hashes, checks, reductions), its p2p daemon; and the "
          "frames it received on each p2p protocol (the bulk bytes go over direct TCP, outside them)")
    for n, result in rows:
        for name, r in result.items():
            if "main_cpu_s" in r:
                other = r["cpu_s"] - r["p2pd_cpu_s"] - r["main_cpu_s"]
                frames = ", ".join(f"{k} {v:.1f}" for k, v in r["frames_in"].items() if v >= 0.05)
                print(f"{n:>3} | {name:<30} | loop {1e3 * r['main_cpu_s']:.0f} | other threads {1e3 * other:.0f} | "
                      f"p2pd {1e3 * r['p2pd_cpu_s']:.0f} | frames in: {frames}")
    print("peak GB/peer: the most memory one peer's processes held at once (PSS, read at each new high of "
          "the peer's RSS, sampled every 0.3 s, and every 5 s; a swarmd "
          "node with its p2p daemon, a hivemind peer with its averager and DHT processes); the bulk store dropped "
          f"{sum(r.get('evicted', 0) for _, res in rows for r in res.values())} blobs early (goal 0); "
          "CPU s/round/peer: the CPU time (user + system) of a swarmd node and its p2p daemon from every node "
          "running to the last round's end, a round's inner step included (of a hivemind peer and its processes "
          "from the first round's start to the last's end, matchmaking included), over rounds and peers; the "
          "kernel's work for a process's sockets counts as its system time. Where the peers' CPU time over this "
          "machine's cores is about the round's time, the round is CPU-bound here (every peer on this machine); of "
          "which p2pd: the p2p daemons' part of it (swarmd's carries its gossip, DHT and state sync, the bulk bytes "
          "going over direct TCP; hivemind's carries its all-reduce's bytes too)")
    for n, result in rows:
        h = result.get("hivemind", {}).get("window_cpu_s")
        for name, r in result.items():
            if r.get("periods"):
                print(f"{n:>3} | {name:<30} | together: the median of {r['periods']} rounds' periods (last ready -> "
                      f"last ready) {r['round_s']:.2f} s, of which the exchange (last ready -> last done with the "
                      f"round: our update's preparation, the exchange, the outer step) {r['exchange_s']:.2f} s; "
                      f"a node's span from announcing its update to the combined "
                      f"one {r['span_s']:.2f} s; CPU a round a peer {r['cpu_s']:.2f} s (every bit of a round)"
                      + (f", hivemind's from its trigger to its all-reduce's end {h:.2f} s" if h else ""))
    print("goals: scatter's bytes per peer <= 2.2 x S at every N; time <= 0.5 x hivemind's at N = 8")


if __name__ == "__main__":
    main()
