"""The dashboard, /metrics per loop, and what a node says about its loops, on a small DiLoCo swarm of real node
processes: the page is loaded in headless Chromium (installed with apt-get where it can be; skipped, saying why,
where it cannot), must log no error, must plot exactly the swarm's progress, and says so clearly when its node
stops. A screenshot of it is kept under ``tests/artifacts/``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import browser
from swarmproc import Swarm, loop_config, wait_for

pytestmark = pytest.mark.swarm

ARTIFACTS = Path(__file__).parent / "artifacts"

CONFIG = """
[loops.diloco]
run = "dash"
rounds = 4
inner_steps = 20
min_peers = 3
inner_lr = 1e-3
deadline_low = 2.0
[loops.diloco.task_options]
batch = 8  # half the tiny GPT's default: the same curves at half the CPU
"""


def d(node) -> dict:
    return node.status()["services"]["diloco"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("dash")
    s = Swarm(root / "nodes", config=loop_config(root / "diloco.toml", CONFIG))
    try:
        nodes = s.start_chain(3, members_within=None)
        wait_for(lambda: all(d(n)["state"] == "done" for n in nodes), 150, "3 nodes to finish 4 DiLoCo rounds")
        # the last progress write lands, then every node's recorder samples it (every second)
        ids = {n.peer_id for n in nodes}

        def settled():
            views = [n.get("/dashboard") for n in nodes]
            return all(set(v["progress"]) >= ids and all(
                v["progress"][p]["points"] and v["progress"][p]["points"][-1][1] == v["progress"][p]["last"]["step"]
                for p in ids) for v in views)
        wait_for(settled, 30, "every node's dashboard to hold every peer's last progress", interval=0.5)
        yield s, nodes
    finally:
        s.close()


@pytest.mark.timeout(240)
def test_a_node_names_its_loops_and_exports_them_per_loop(swarm):
    _, nodes = swarm
    st = nodes[0].status()
    assert st["loops"] == {"diloco/dash": {"service": "diloco", "state": "done", "round": 4, "step": 80}}
    # the DHT record carries the loop, so every peer's table shows it
    wait_for(lambda: all(p["loops"] == ["diloco/dash"] for p in nodes[1].status()["peers"]), 30,
             "peers' records to name their loop", interval=0.5)
    text = nodes[0].get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = {"loop": "diloco", "run": "dash"}

    def value(name: str) -> float:
        samples = [s for s in families[name].samples if s.labels == labels]
        assert len(samples) == 1, (name, families[name].samples)
        return samples[0].value
    assert value("swarmd_loop_round") == 4 and value("swarmd_loop_step") == 80
    assert value("swarmd_loop_bytes_sent") == d(nodes[0])["bytes_sent"] > 0
    assert value("swarmd_loop_loss") == d(nodes[0])["losses"][-1][1]
    assert value("swarmd_loop_deadline_seconds") > 0 and value("swarmd_loop_running") == 0
    assert value("swarmd_loop_deadlines_missed") == 0 and value("swarmd_loop_peers_missed") == 0
    assert value("swarmd_loop_round_participants") == 3
    # the Grafana dashboard shipped in docker/ asks only for series this node exports
    grafana = json.loads((Path(__file__).parents[1] / "docker" / "grafana" / "swarmd.json").read_text())
    exprs = [t["expr"] for p in grafana["panels"] for t in p.get("targets", [])]
    assert exprs
    # (a counter without samples yet, such as errors on a healthy node, is not in the text: its name is in the code)
    declared = re.findall(r'"(swarmd_[a-z_]+)"', (Path(__file__).parents[1] / "node" / "metrics.py").read_text())
    exported = {s.name for f in families.values() for s in f.samples} | set(declared) | {n + "_total" for n in declared}
    for expr in exprs:
        for name in re.findall(r"\b(swarmd_[a-z_]+)\b", expr):
            assert name in exported, f"the Grafana panel query {expr!r} names {name}, which /metrics does not export"


# DiLoCo's plainest end-to-end check, on this module's swarm (the same 3 nodes and 4 rounds of 20 steps it would
# otherwise start again): one test of the loop and one of the dashboard cost one swarm
@pytest.mark.timeout(240)
def test_three_diloco_nodes_hold_identical_global_weights_after_every_round(swarm):
    _, nodes = swarm
    final = [d(n) for n in nodes]
    rounds = [[(h["round"], h["fragment"], h["global_hash"]) for h in s["history"]] for s in final]
    assert rounds[0] == rounds[1] == rounds[2]
    assert len(rounds[0]) == 4 and len({h for _, _, h in rounds[0]}) == 4
    assert all(h["participants"] == 3 for h in final[0]["history"])
    losses = [loss for _, loss in final[0]["losses"]]
    assert losses[-1] < losses[0]
    assert final[0]["bytes_sent"] > 0 and final[0]["bytes_received"] >= 2 * final[0]["bytes_sent"] * 0.9
    # each founder timed the other two's links before round 0 (the probe's blobs over the nodes' p2p streams)
    assert all(s["links_probed"] == 2 for s in final), [s.get("links_probed") for s in final]


@pytest.mark.timeout(240)
def test_the_round_timeline_says_who_took_part(swarm):
    _, nodes = swarm
    view = nodes[0].get("/dashboard")
    (loop,) = view["loops"]
    assert loop["key"] == "diloco/dash" and loop["metric"] == "loss"
    assert [e["round"] for e in loop["timeline"]] == [0, 1, 2, 3]
    ids = sorted(n.peer_id for n in nodes)
    for e in loop["timeline"]:
        assert e["participants"] == 3 and e["peers"]["participants"] == ids and e["missing"] == 0
        assert e["bytes_sent"] > 0 and 0 <= e["waited_s"] <= e["deadline_s"] + 5
    assert sum(e["bytes_sent"] for e in loop["timeline"]) == d(nodes[0])["bytes_sent"]
    assert view["doctor"]["reachability"] and isinstance(view["doctor"]["hints"], list)


@pytest.mark.timeout(240)
async def test_the_dashboard_in_a_real_browser_plots_the_swarm_and_says_when_its_node_stops(swarm):
    why = browser.unavailable()
    if why:
        pytest.skip(why)
    _, nodes = swarm
    node = nodes[0]
    ARTIFACTS.mkdir(exist_ok=True)
    b = browser.Browser()
    try:
        await b.start()
        await b.goto(node.url + "/")
        await b.wait("document.getElementById('state').dataset.state === 'live'", 30, "the page's first poll")
        await b.wait("Object.keys(swarmd.plotted('loss')).length === 3", 30, "three peers' loss curves")
        # what the page draws is the swarm's progress: each peer's last plotted point is its progress register
        plotted = await b.eval("swarmd.plotted('loss')")
        progress = node.get("/state")["objects"]["progress"]
        assert set(plotted) == set(progress) == {n.peer_id for n in nodes}
        for peer, points in plotted.items():
            assert points[-1] == [progress[peer]["step"], progress[peer]["loss"]], peer
            assert [x for x, _ in points] == sorted(x for x, _ in points)
        recorded = node.get("/dashboard")["progress"]
        for peer, points in plotted.items():
            assert points == [[p[1], p[3]] for p in recorded[peer]["points"]]
        # the round-bytes chart is the timeline's bytes; the peers table lists every peer with its path
        round_bytes = await b.eval("swarmd.plotted('round-bytes')")
        assert round_bytes == {"diloco/dash": [[e["round"], e["bytes_sent"]] for e in
                                               node.get("/dashboard")["loops"][0]["timeline"]]}
        rows = await b.eval("[...document.querySelectorAll('#peers tbody tr')].map(r => r.cells[1].textContent)")
        assert len(rows) == 2 and all(r == "direct" for r in rows)
        timeline_rows = await b.eval("document.querySelectorAll('#timeline tbody tr').length")
        assert timeline_rows == 4
        assert b.errors == [], b.errors
        await b.screenshot(ARTIFACTS / "dashboard.png")
        assert browser.png_size(ARTIFACTS / "dashboard.png")[0] >= 1000
        await b.screenshot(ARTIFACTS / "dashboard-phone.png", width=390, height=844)
        await b.wait("document.documentElement.scrollWidth <= 390 + 1", 10, "the page to fit a phone's width")
        # the node stops: the page keeps its last data and says the node is not answering
        node.stop()
        await b.wait("document.getElementById('state').dataset.state === 'down'", 30, "the page to notice")
        banner = await b.eval("document.getElementById('banner').textContent")
        assert "not answering" in banner and "last answer" in banner
        assert await b.eval("Object.keys(swarmd.plotted('loss')).length") == 3
        await b.screenshot(ARTIFACTS / "dashboard-stopped.png", width=1280, height=900)
    finally:
        await b.close()
