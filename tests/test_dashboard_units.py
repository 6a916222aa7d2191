"""The dashboard recorder's bounds, on made-up progress: a long run keeps its whole shape in a fixed number of
points, a large swarm's answer stays small, this node's curve is always in it."""

from types import SimpleNamespace

import pytest

from swarmd.node import dashboard
from swarmd.node.dashboard import Recorder, Series, _thin

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def test_a_long_curve_keeps_its_whole_shape_in_a_bounded_number_of_points():
    s = Series(max_points=64)
    for step in range(1, 10_001):
        s.add(float(step), {"step": step, "round": step // 10, "loss": 1.0 / step})
    assert 32 <= len(s.points) <= 64
    assert s.points[0][1] == 1 and s.points[-1][1] == 10_000  # the start and the latest are both there
    for step in range(10_001, 30_001):  # and the latest stays the last point through every thinning
        s.add(float(step), {"step": step, "round": step // 10, "loss": 1.0 / step})
        assert s.points[-1][1] == step and len(s.points) <= 65
    steps = [p[1] for p in s.points]
    assert steps == sorted(steps) and max(b - a for a, b in zip(steps, steps[1:])) <= 10_000 / 8  # no hole
    s.add(10_001.0, {"step": 10_000, "round": 1000, "loss": 0.5})  # same step and round: not a new point
    assert s.points[-1][1] == 10_000 and len({tuple(p[1:3]) for p in s.points}) == len(s.points)


def test_thin_keeps_the_ends():
    pts = [[i] for i in range(1000)]
    out = _thin(pts, 10)
    assert len(out) == 10 and out[0] == [0] and out[-1] == [999]
    assert _thin(pts[:5], 10) == pts[:5]


class FakeNode:
    """What the recorder reads from a node: identity, traffic counters, the progress register, status()."""

    def __init__(self, me: str, progress: dict):
        self.identity = SimpleNamespace(peer_id=me)
        self.transport = SimpleNamespace(stats=SimpleNamespace(bytes_in_by_protocol={"/swarmd/crdt/2.0.0": 10},
                                                               bytes_out_by_protocol={}))
        self.progress = progress
        self.replicator = SimpleNamespace(store=SimpleNamespace(value=lambda name: self.progress))

    def training_loops(self):
        return []

    def status(self):
        return {"peer_id": self.identity.peer_id, "version": "x", "swarm": "s", "uptime_s": 1.0, "addresses": [],
                "members": 0, "connected": 0, "services": {}, "traffic": {}, "peers": [], "penalties": {},
                "reachability": "public", "bootstrap": []}


def test_a_large_swarm_answers_with_this_node_and_the_most_recent_peers():
    me = "me"
    progress = {f"p{i:04d}": {"step": 1, "round": 0, "loss": 1.0} for i in range(500)}
    progress[me] = {"step": 1, "round": 0, "loss": 2.0}
    node = FakeNode(me, progress)
    now = [0.0]
    rec = Recorder(node, clock=lambda: now[0])
    rec.sample()
    assert len(rec.series) == dashboard.MAX_PEERS  # bounded, and we kept our own curve
    assert me in rec.series and "p0300" not in rec.series
    rec.sample()  # with more peers than places the curves shown stay (a new one waits for a still one)
    assert "p0300" not in rec.series and "p0001" in rec.series  # (p0000 made room for us)
    now[0] = 1.0
    progress["p0200"] = {"step": 2, "round": 0, "loss": 0.9}  # the latest to move
    progress["p0300"] = {"step": 2, "round": 0, "loss": 0.9}  # moves, but every curve shown moved a second ago
    node.transport.stats.bytes_in_by_protocol["/swarmd/crdt/2.0.0"] = 1010
    rec.sample()
    assert "p0300" not in rec.series
    view = rec.view()
    shown = list(view["progress"])
    assert len(shown) == dashboard.VIEW_PEERS and shown[0] == me and shown[1] == "p0200"
    assert view["progress_peers"] == dashboard.MAX_PEERS
    now[0] = 100.0  # a minute on: a peer that moves takes the place of the curve still for longest
    progress["p0300"] = {"step": 5, "round": 0, "loss": 0.8}
    rec.sample()
    assert "p0300" in rec.series and "p0001" not in rec.series and "p0200" in rec.series
    assert len(rec.series) == dashboard.MAX_PEERS
    assert view["traffic"] == {"t": [0.0, 1.0], "in": {"/swarmd/crdt/2.0.0": [0.0, 1000.0]},
                               "out": {"/swarmd/crdt/2.0.0": [0.0, 0.0]}}
