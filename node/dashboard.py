"""What the dashboard at ``GET /`` draws, gathered by the node as it runs (``GET /dashboard`` serves it as JSON).

The swarm's ``progress`` register holds each peer's latest step, loss and metrics, not their history: the
:class:`Recorder` samples it (and the traffic counters) every second and keeps a bounded history, so curves
start when the node does and cost a fixed amount of memory however long it runs: at most ``MAX_PEERS`` peers,
each with at most ``MAX_POINTS`` points (when full, every other point is dropped and the curve keeps its shape
at half the resolution), and ``TRAFFIC_SAMPLES`` traffic samples. One answer carries at most ``VIEW_PEERS`` curves
of at most ``VIEW_POINTS`` points: it stays small (under about 1 MB) however large the swarm.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import TYPE_CHECKING, Callable

from swarmd.node.doctor import diagnose

if TYPE_CHECKING:
    from swarmd.node.core import Node

MAX_PEERS = 256
MAX_POINTS = 512
TRAFFIC_SAMPLES = 600  # 10 minutes at the default interval
TIMELINE_ROUNDS = 32  # per loop, in the JSON (the loops keep 64)
STILL = 60.0  # seconds without a change after which a curve may give its place to a new peer's
VIEW_PEERS = 64  # curves in one /dashboard answer: this node and the peers heard from most recently
VIEW_POINTS = 256  # points per curve in one answer (evenly thinned, the latest always in)


class Series:
    """One peer's progress over time: [unix time, step, round, loss, reward], appended when step or round moves."""

    def __init__(self, max_points: int = MAX_POINTS):
        self.points: list[list] = []
        self.stride = 1  # every stride-th change is kept (doubles each time the series is thinned)
        self._seen = 0
        self.max_points = max_points

    def add(self, t: float, payload: dict) -> None:
        step, rnd = payload.get("step"), payload.get("round")
        if self.points and self.points[-1][1:3] == [step, rnd]:
            return
        reward = (payload.get("metrics") or {}).get("reward")
        point = [round(t, 3), step, rnd, payload.get("loss"), reward]
        self._seen += 1
        if self.points and (self._seen - 1) % self.stride:
            self.points[-1] = point  # between kept points: the newest stands in until the next kept one
            return
        self.points.append(point)
        if len(self.points) > self.max_points:
            kept = self.points[::2]
            if kept[-1] is not point:
                kept.append(point)  # the latest always stays
            self.points = kept
            self.stride *= 2


class Recorder:
    def __init__(self, node: Node, interval: float = 1.0, clock: Callable[[], float] = time.time):
        self.node = node
        self.interval = interval
        self.clock = clock
        self.series: collections.OrderedDict[str, Series] = collections.OrderedDict()
        self.traffic: collections.deque[tuple[float, dict, dict]] = collections.deque(maxlen=TRAFFIC_SAMPLES)
        self._seen: dict[str, tuple] = {}  # every peer of the register: (step, round) at the last sample

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def sample(self) -> None:
        now = self.clock()
        stats = self.node.transport.stats
        self.traffic.append((now, dict(stats.bytes_in_by_protocol), dict(stats.bytes_out_by_protocol)))
        progress = self.node.replicator.store.value("progress")
        me = self.node.identity.peer_id
        seen = {}
        for peer, payload in progress.items():
            seen[peer] = key = (payload.get("step"), payload.get("round"))
            series = self.series.get(peer)
            if series is None:
                if len(self.series) >= MAX_PEERS:
                    # more peers than places: a peer that moved since the last sample takes the place of the curve
                    # still for longest, if that one has been still for a minute (ours always gets a place), so the
                    # curves shown are the moving ones and do not cycle
                    moved = peer in self._seen and self._seen[peer] != key
                    victim = next((p for p in self.series if p != me), None)
                    if victim is None or (peer != me and not (
                            moved and now - self.series[victim].points[-1][0] >= STILL)):
                        continue
                    del self.series[victim]
                series = self.series[peer] = Series()
            before = len(series.points), series.points[-1] if series.points else None
            series.add(now, payload)
            if (len(series.points), series.points[-1]) != before:
                self.series.move_to_end(peer)
        self._seen = seen

    def _shown(self, me: str) -> list[str]:
        """The peers whose curves one answer carries: us, then the most recently updated (a chart of hundreds of
        lines says nothing, and the answer stays small however large the swarm)."""
        recent = [p for p in reversed(self.series) if p != me][:VIEW_PEERS - 1]
        return ([me] if me in self.series else []) + recent

    def traffic_view(self) -> dict:
        """Bytes per second by protocol and direction between consecutive samples."""
        samples = list(self.traffic)
        out = {"t": [], "in": collections.defaultdict(list), "out": collections.defaultdict(list)}
        protocols = sorted({p for _, i, o in samples for p in (*i, *o)})
        for (t0, in0, out0), (t1, in1, out1) in zip(samples, samples[1:]):
            dt = max(t1 - t0, 1e-3)
            out["t"].append(round(t1, 3))
            for proto in protocols:
                out["in"][proto].append(round(max(0, in1.get(proto, 0) - in0.get(proto, 0)) / dt, 1))
                out["out"][proto].append(round(max(0, out1.get(proto, 0) - out0.get(proto, 0)) / dt, 1))
        return {"t": out["t"], "in": dict(out["in"]), "out": dict(out["out"])}

    def view(self) -> dict:
        node = self.node
        status = node.status()
        progress = node.replicator.store.value("progress")
        loops = []
        for svc in node.training_loops():
            st = status["services"][svc.name]
            loops.append({
                "key": svc.loop_key, "service": svc.name, "state": st.get("state"), "round": st.get("round"),
                "step": st.get("step", st.get("round")), "total_rounds": st.get("total_rounds"),
                "task": st.get("task"),
                "error": st.get("error") or st.get("refused"), "work": st.get("work") or [],
                "metric": "reward" if "reward_last50" in st else "loss",
                "timeline": list(getattr(svc, "timeline", ()))[-TIMELINE_ROUNDS:],
            })
        return {
            "now": self.clock(),
            "interval": self.interval,
            "peer_id": status["peer_id"],
            "version": status["version"],
            "swarm": status["swarm"],
            "uptime_s": status["uptime_s"],
            "addresses": status["addresses"],
            "members": status["members"],
            "connected": status["connected"],
            "loops": loops,
            "progress": {peer: {"points": _thin(self.series[peer].points, VIEW_POINTS),
                                "last": _finite(progress.get(peer))} for peer in self._shown(status["peer_id"])},
            "progress_peers": len(self.series),
            "traffic": self.traffic_view(),
            "totals": status["traffic"],
            "peers": status["peers"],
            "penalties": status["penalties"],
            "doctor": diagnose(status),
        }


def _thin(points: list, n: int) -> list:
    """At most n of the points, evenly spaced, the first and the last always kept."""
    if len(points) <= n:
        return points
    step = (len(points) - 1) / (n - 1)
    return [points[round(i * step)] for i in range(n)]


def _finite(payload: dict | None) -> dict | None:
    """The register's payloads are finite by its check; kept that way for JSON (NaN is not JSON)."""
    if payload is None:
        return None
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in payload.items()}
