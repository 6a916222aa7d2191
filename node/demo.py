"""``swarmd demo``: a local swarm in one command.

Starts ``nodes`` node processes on loopback (``swarmd start`` each, with the chosen loop's config from
``configs/`` and its own data dir), the first one a fresh swarm and the others bootstrapping from it; prints the
dashboard's URL; shows each node's round, loss or reward and peers (live bars in a terminal, a line per change
otherwise); and on Ctrl+C (or SIGTERM, or with ``--until-done`` once every loop is done) stops every node it
started, by its PID, and exits 0.
"""

from __future__ import annotations

import importlib.resources
import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from swarmd.node import datadir
from swarmd.node.services import work_text

# --loop -> (config file in configs/, its [loops.<section>])
LOOPS = {
    "diloco": ("diloco.toml", "diloco"),
    "streaming-diloco": ("streaming-diloco.toml", "diloco"),
    "spsa": ("spsa.toml", "spsa"),
    "sapo": ("sapo.toml", "sapo"),
}
READY_TIMEOUT = 90.0  # seconds for a node to start (the p2p daemon, the model build)


class DemoError(Exception):
    pass


@dataclass
class DemoNode:
    name: str
    data_dir: Path
    proc: subprocess.Popen
    log_path: Path
    info: dict | None = None

    @property
    def url(self) -> str | None:
        return self.info and self.info.get("http")

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def settings_for(loop: str, nodes: int, rounds: int | None) -> list[str]:
    """The ``--set`` items every demo node starts with."""
    _, section = LOOPS[loop]
    items = [f"loops.{section}.min_peers={nodes}",
             "state.admission_bits=12",  # one machine: cheap membership tickets (a real swarm keeps 22)
             # its own swarm, named at random: never mixes with another demo's nodes, and no admission ticket for
             # it can be minted before it exists (cheap 12-bit tickets are cheap only from then on)
             f'node.swarm="demo-{secrets.token_hex(8)}"',
             'node.log_level="warning"',
             f"loops.{section}.threads=1"]  # several nodes on one machine: one compute thread each
    if rounds is not None:
        if section == "spsa":  # SPSA counts steps; a round is a window
            items.append(f"loops.spsa.steps={rounds * 96}")
            items.append("loops.spsa.window=96")
        else:
            items.append(f"loops.{section}.rounds={rounds}")
    return items


class Demo:
    def __init__(self, loop: str, nodes: int, rounds: int | None, directory: Path | None, out=None):
        if loop not in LOOPS:
            raise DemoError(f"unknown loop {loop!r} (one of {', '.join(LOOPS)})")
        self.loop = loop
        self.n = nodes
        self.keep = directory is not None
        self.root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="swarmd-demo-"))
        self.config = Path(str(importlib.resources.files("swarmd.configs").joinpath(LOOPS[loop][0])))
        self.settings = settings_for(loop, nodes, rounds)
        self.section = LOOPS[loop][1]
        self.nodes: list[DemoNode] = []
        self.out = out or sys.stdout
        self.stopping = False

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, bootstrap: str | None) -> DemoNode:
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.root / f"{name}.log"
        args = [sys.executable, "-m", "swarmd", "start", "--config", str(self.config), "--data-dir", str(data_dir)]
        for item in self.settings:
            args += ["--set", item]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        with open(log_path, "ab") as log:
            # a session of its own: the terminal's Ctrl+C reaches the demo only, which stops each node cleanly
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        node = DemoNode(name, data_dir, proc, log_path)
        self.nodes.append(node)
        return node

    def _wait_ready(self, nodes: list[DemoNode]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        waiting = list(nodes)
        while waiting:
            if self.stopping:
                raise KeyboardInterrupt
            for node in list(waiting):
                info = datadir.read_runtime(node.data_dir)
                if info and info.get("pid") == node.proc.pid and info.get("http"):
                    node.info = info
                    waiting.remove(node)
                elif node.proc.poll() is not None:
                    raise DemoError(f"{node.name} exited with code {node.proc.returncode} while starting; its log "
                                    f"({node.log_path}):\n{node.log_tail()}")
            if time.monotonic() > deadline:
                raise DemoError(f"{', '.join(n.name for n in waiting)} did not start within {READY_TIMEOUT:.0f} s; "
                                f"see {self.root}/*.log")
            time.sleep(0.1)

    def start(self) -> None:
        first = self._spawn("node0", None)
        self._wait_ready([first])
        addr = next(a for a in first.info["addresses"] if "/tcp/" in a)
        others = [self._spawn(f"node{i}", addr) for i in range(1, self.n)]
        self._wait_ready(others)

    def stop(self, timeout: float = 20.0) -> list[int]:
        """SIGTERM to every node we started (by PID), then SIGKILL to any still there after ``timeout``."""
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        return [node.proc.returncode for node in self.nodes]

    # ------------------------------------------------------------------ progress
    def poll(self) -> list[dict]:
        rows = []
        for node in self.nodes:
            row = {"node": node.name, "peer": "", "state": "starting", "round": 0, "total": 0, "step": 0,
                   "value": None, "metric": "loss", "peers": 0}
            if node.proc.poll() is not None:
                row["state"] = f"exited ({node.proc.returncode})"
            elif node.url:
                try:
                    with urllib.request.urlopen(node.url + "/status", timeout=2) as r:
                        st = json.loads(r.read())
                except (OSError, ValueError):
                    row["state"] = "not answering"
                else:
                    loop = st["services"].get(self.section, {})
                    losses = loop.get("losses") or []
                    reward = loop.get("reward_last50")
                    row.update(peer=st["peer_id"][-8:], state=loop.get("state", "?"), round=loop.get("round", 0),
                               total=loop.get("total_rounds") or 0, step=loop.get("step", loop.get("round", 0)),
                               peers=st["connected"], metric="reward" if "reward_last50" in loop else "loss",
                               value=reward if "reward_last50" in loop else
                               (losses[-1][1] if losses else loop.get("train_loss", loop.get("last_loss"))),
                               error=loop.get("error") or loop.get("refused"),
                               work=", ".join(work_text(w) for w in loop.get("work") or []))
            rows.append(row)
        return rows

    def done(self, rows: list[dict]) -> bool:
        return bool(rows) and all(r["state"] == "done" for r in rows)


def line(row: dict) -> str:
    value = "-" if row["value"] is None else f"{row['value']:.4f}"
    total = f"/{row['total']}" if row["total"] else ""
    text = (f"{row['node']:<6} {row['peer']:<8} {row['state']:<17} round {row['round']}{total}  step {row['step']}  "
            f"{row['metric']} {value}  peers {row['peers']}")
    if row.get("work"):
        text += f"  [{row['work']}]"
    return text + (f"  ({row['error']})" if row.get("error") else "")


def _table(rows: list[dict]):
    from rich.markup import escape
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("node", "peer", "state", "progress", "round", "step", rows[0]["metric"] if rows else "loss", "peers"):
        table.add_column(col)
    for r in rows:
        total = r["total"] or max(r["round"], 1)
        style = "red" if r["state"].startswith(("exited", "failed", "refused", "not")) else \
            "green" if r["state"] in ("running", "done") else "yellow"
        state = r["state"] + (f" ({r['work']})" if r.get("work") else "")
        table.add_row(r["node"], r["peer"], f"[{style}]{escape(state)}[/]",
                      ProgressBar(total=total, completed=r["round"], width=24), f"{r['round']}/{r['total'] or '-'}",
                      str(r["step"]), "-" if r["value"] is None else f"{r['value']:.4f}", str(r["peers"]))
    return table


def run(loop: str, nodes: int, rounds: int | None, directory: str | None, until_done: bool) -> int:
    demo = Demo(loop, nodes, rounds, Path(directory) if directory else None)

    def on_signal(signum, frame):
        demo.stopping = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    out = demo.out
    code = 0
    try:
        print(f"starting {nodes} nodes running {loop} on loopback (data and logs in {demo.root})", file=out,
              flush=True)
        demo.start()
        first = demo.nodes[0]
        print(f"dashboard: {first.url}/", file=out)
        for node in demo.nodes[1:]:
            print(f"  {node.name}: {node.url}/", file=out)
        print("Ctrl+C stops every node" + (" (or they stop once training is done)" if until_done else ""),
              file=out, flush=True)
        _watch(demo, until_done)
    except DemoError as e:
        print(f"swarmd demo: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping the demo's nodes ...", file=out, flush=True)
        codes = demo.stop()
        print(f"stopped {len(codes)} node(s): exit codes {codes}", file=out, flush=True)
        for s, h in previous.items():
            signal.signal(s, h)
    return code


def _watch(demo: Demo, until_done: bool) -> None:
    out = demo.out
    if out.isatty():
        from rich.console import Console
        from rich.live import Live

        with Live(_table(demo.poll()), console=Console(file=out), refresh_per_second=4, transient=False) as live:
            while not demo.stopping:
                rows = demo.poll()
                live.update(_table(rows))
                if until_done and demo.done(rows):
                    break
                _sleep(demo, 1.0)
        return
    shown: dict[str, tuple] = {}
    full = time.monotonic()
    while not demo.stopping:
        rows = demo.poll()
        every = time.monotonic() - full >= 30
        for r in rows:  # a line per node when its state or round moved, and every node's every 30 s
            key = (r["state"], r["round"], r["peers"])
            if every or shown.get(r["node"]) != key:
                print(line(r), file=out, flush=True)
                shown[r["node"]] = key
        if every:
            full = time.monotonic()
        if until_done and demo.done(rows):
            break
        _sleep(demo, 1.0)


def _sleep(demo: Demo, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not demo.stopping and time.monotonic() < end:
        time.sleep(0.05)

