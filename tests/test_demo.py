"""``swarmd demo`` as a user runs it: one command starts a local training swarm, prints the dashboard's URL and
every node's progress; Ctrl+C (SIGINT) stops every node it started and it exits 0, leaving no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swarmd.node import datadir
from swarmproc import http_get

pytestmark = pytest.mark.swarm


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _states(root: Path) -> str:
    """What each node says of itself (its loop, its members, its gossip links and mesh), for a failure's message:
    a start that never comes (a full suite run on a loaded machine can show one) is read from it, not guessed."""
    out = []
    for i in range(3):
        try:
            info = datadir.read_runtime(root / f"node{i}")
            st = http_get(info["http"] + "/status")
            loop = st["services"].get("diloco", {})
            gossip = st["services"].get("gossip", {})
            out.append(json.dumps({"node": i, "members": st.get("members"), "connected": st.get("connected"),
                                   "loop": {k: v for k, v in loop.items() if not isinstance(v, (list, dict))},
                                   "gossip": {"links": gossip.get("links"), "topics": gossip.get("topics")}}))
        except Exception as e:  # a diagnostic: whatever it cannot read, it says so
            out.append(f"node{i}: status unreadable: {e!r}")
    return "\n" + "\n".join(out)


@pytest.mark.timeout(180)
def test_demo_starts_a_training_swarm_shows_its_progress_and_stops_it_all_on_ctrl_c(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-m", "swarmd", "demo", "--nodes", "3", "--rounds", "1000",
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        trained: dict[str, float] = {}
        while time.monotonic() < deadline and len(trained) < 3:  # every node's progress, as the demo prints it
            for text in list(lines):
                m = re.match(r"(node\d)\s+\S+\s+running\s+round (\d+)/1000\s+step (\d+)\s+loss ([\d.]+)\s+peers 2",
                             text)
                if m and int(m[2]) >= 1:
                    trained[m[1]] = float(m[4])
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert sorted(trained) == ["node0", "node1", "node2"], "".join(lines) + _states(tmp_path)
        url = next(re.match(r"dashboard: (\S+)", x)[1] for x in lines if x.startswith("dashboard: "))
        assert "<title>swarmd</title>" in http_get(url)
        for i in range(3):
            info = datadir.read_runtime(tmp_path / f"node{i}")
            pids.append(info["pid"])
        assert all(alive(pid) for pid in pids)
        proc.send_signal(signal.SIGINT)  # what Ctrl+C sends
        assert proc.wait(60) == 0, "".join(lines)
        reader.join(10)
        assert not [pid for pid in pids if alive(pid)], "the demo left node processes behind"
        assert any("stopped 3 node(s): exit codes [0, 0, 0]" in x for x in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
