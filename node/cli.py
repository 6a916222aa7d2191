"""``swarmd`` command line: start, status, peers, id, keygen.

Exit codes: 0 success (also after a clean SIGINT/SIGTERM shutdown); 1 a runtime failure (port in use, data dir
locked, no node running); 2 bad input (flags, config, addresses). Errors are one line on stderr, no traceback.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from swarmd.node import __version__, allocator, datadir
from swarmd.node.config import ConfigError, load_config, parse_host_port
from swarmd.node.doctor import diagnose
from swarmd.node.services import work_text

EXIT_RUNTIME = 1
EXIT_USAGE = 2


class Fail(Exception):
    def __init__(self, message: str, code: int = EXIT_RUNTIME):
        super().__init__(message)
        self.code = code


def _overrides(**flags) -> dict:
    """CLI flags -> config overrides (only the flags the user gave)."""
    mapping = {
        "data_dir": ("node", "data_dir"),
        "swarm": ("node", "swarm"),
        "log_level": ("node", "log_level"),
        "listen": ("network", "listen"),
        "announce": ("network", "announce"),
        "bootstrap": ("network", "bootstrap"),
        "port_mapping": ("network", "port_mapping"),
        "reachability": ("network", "reachability"),
        "http": ("http", "listen"),
    }
    out: dict = {}
    for name, value in flags.items():
        if value is None or value == ():
            continue
        section, key = mapping[name]
        out.setdefault(section, {})[key] = list(value) if isinstance(value, tuple) else value
    return out


def _setup_logging(level: str) -> None:
    from swarmd.transport._compat import load_hivemind

    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    hm = load_hivemind()
    hm.use_hivemind_log_handler("nowhere")  # hivemind logs go through our root handler
    logging.getLogger("hivemind").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    for noisy in ("aiohttp.access", "multiaddr", "libp2p", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="swarmd")
def cli() -> None:
    """swarmd: a peer-to-peer daemon for decentralized training."""


@cli.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config (default: embedded).")
@click.option("--data-dir", help="Where the identity and state live (default: platform user data dir).")
@click.option("--listen", multiple=True, metavar="MULTIADDR", help="Listen address (repeatable). Port 0 picks one.")
@click.option("--announce", multiple=True, metavar="MULTIADDR", help="Public address to announce (repeatable).")
@click.option("--bootstrap", multiple=True, metavar="MULTIADDR", help="Peer to join through (repeatable).")
@click.option("--http", metavar="HOST:PORT", help="Status endpoint address (port 0 picks one).")
@click.option("--swarm", help="Swarm name (nodes only see members of the same swarm).")
@click.option("--reachability", type=click.Choice(["auto", "public", "private"]), help="Force reachability.")
@click.option("--port-mapping/--no-port-mapping", default=None, help="UPnP/NAT-PMP on the router (default off).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Any config setting, dotted, value in TOML (repeatable): --set loops.diloco.rounds=20")
def start(config_path, settings, **flags) -> None:
    """Run a node until SIGINT/SIGTERM. Without --bootstrap it starts a new swarm."""
    config = _load(config_path, flags, settings)
    allocator.configure(config.node.memory)  # before the task builds its model (node/allocator.py)
    prepared = _prepare_loops(config, Path(config_path).resolve().parent if config_path else None)
    _setup_logging(config.node.log_level)
    data_dir = datadir.ensure(datadir.resolve(config.node.data_dir))
    lock = datadir.DataDirLock(data_dir)
    lock.acquire()
    try:
        from swarmd.transport.identity import Identity

        identity, created = Identity.load_or_create(data_dir / datadir.IDENTITY_FILE)
        if created:
            logging.getLogger("swarmd").info("created identity %s in %s", identity.peer_id, data_dir)
        code = _run_node(config, identity, data_dir, prepared, _root_obj().get("on_loops"))
    finally:
        lock.release()
    # Everything is closed and flushed; skip interpreter finalization, which resets signal handlers to their
    # defaults (a Ctrl+C then would kill us with a traceback-less SIGINT) and only slows the exit down.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _root_obj() -> dict:
    """What ``main``'s caller handed the command (``main(on_loops=...)``)."""
    return click.get_current_context().find_root().obj or {}


def _run_node(config, identity, data_dir: Path, prepared: list, on_loops=None) -> int:
    import asyncio

    import uvloop

    from swarmd.node.core import Node, end_tasks
    from swarmd.node.http import HttpStartError
    from swarmd.protocols.bulk import BulkService
    from swarmd.protocols.gossip import Gossip
    from swarmd.transport.errors import DaemonStartError

    gossip = Gossip()
    tcp_hosts = [a.split("/")[2] for a in config.network.listen if a.startswith("/ip4/") and "/tcp/" in a]
    bulk = BulkService(gossip, host=tcp_hosts[0] if tcp_hosts else "0.0.0.0", port=config.network.bulk_port)
    loops = _loops(prepared, gossip, bulk)
    if on_loops is not None:
        on_loops(loops)
    services = [gossip, bulk] + loops
    node = Node(config, identity, data_dir, services=services)
    stop_signals = 0

    def on_ready(n: Node) -> None:
        lines = [f"swarmd {__version__} running as {identity.peer_id}", "share one of these addresses to join:"]
        lines += [f"  {a}" for a in n.addresses]
        lines += [f"status: {n.http.url}/status", f"data dir: {data_dir}"]
        print("\n".join(lines), flush=True)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_signal(signum: int) -> None:
            nonlocal stop_signals
            stop_signals += 1
            # from now on a signal exits at once, even while the loop shuts down or closes (the loop forgets
            # these signals, so closing it does not reset them to the default action)
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, _exit_now)
                loop.remove_signal_handler(s)
                signal.signal(s, _exit_now)
            print(f"received {signal.Signals(signum).name}, shutting down (again to exit at once)",
                  file=sys.stderr, flush=True)
            # the backstop: every step of a shutdown is bounded, but should the process still be here after
            # SHUTDOWN_DEADLINE_S, it writes every thread's stack to the log and exits (1) from a watchdog thread
            faulthandler.dump_traceback_later(SHUTDOWN_DEADLINE_S, exit=True)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await node.run(on_ready)
        except asyncio.CancelledError:
            if stop_signals:
                return 0
            raise
        except (DaemonStartError, HttpStartError) as e:
            raise Fail(str(e)) from None
        finally:
            # what the node's teardown left running (stream handlers, pulls) ends here, each task cancelled until it
            # ends: asyncio.run's own teardown cancels once and would wait forever for one that swallowed it
            others = asyncio.all_tasks() - {task}
            await end_tasks({t: t.get_name() for t in others})
        return 0

    # `kill -USR1 <pid>` writes every thread's stack to stderr (the node log): what a stuck node is doing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    started = time.monotonic()
    code = uvloop.run(main())
    # the loop (and its signal handlers) is gone, but the process still has to exit: a signal now exits at once
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_now)
    logging.getLogger("swarmd").info("stopped after %.1f s", time.monotonic() - started)
    return code


# The training loops a config may ask for: [loops.<name>] -> (module, config class, loop class)
LOOPS = {
    "diloco": ("swarmd.protocols.diloco", "DilocoConfig", "DilocoLoop"),
    "spsa": ("swarmd.protocols.spsa", "SpsaConfig", "SPSALoop"),
    "sapo": ("swarmd.protocols.sapo", "SapoConfig", "SapoLoop"),
}


def _prepare_loops(config, base_dir: Path | None = None) -> list:
    """The training loops the config asks for ([loops.<name>] tables), validated with their tasks loaded (imported,
    made with their task_options, checked against the loop's contract) before anything starts: bad settings exit 2.
    Returns [(loop class, loop config, task)]."""
    if not config.loops:
        return []  # a node without loops never imports the task machinery (and so torch: ~200 MB of RSS)
    import importlib

    from pydantic import ValidationError

    from swarmd.protocols.task import TaskError, load

    prepared = []
    for name, table in config.loops.items():
        if name not in LOOPS:
            raise Fail(f"invalid loops.{name}: unknown loop (known: {', '.join(sorted(LOOPS))})", EXIT_USAGE)
        module_name, config_cls, loop_cls = LOOPS[name]
        module = importlib.import_module(module_name)
        try:
            cfg = getattr(module, config_cls)(**table)
        except ValidationError as e:
            err = e.errors()[0]
            field = "".join(f".{x}" for x in err["loc"])
            raise Fail(f"invalid loops.{name}{field}: {err['msg']}", EXIT_USAGE) from None
        try:
            task = load(cfg.task, cfg.options(), name, base_dir)
        except TaskError as e:
            raise Fail(f"loops.{name}.task: {e}", EXIT_USAGE) from None
        prepared.append((getattr(module, loop_cls), cfg, task))
    return prepared


def _loops(prepared: list, gossip, bulk) -> list:
    return [cls(gossip, bulk, cfg, task) if cls.name == "diloco" else cls(gossip, cfg, task)
            for cls, cfg, task in prepared]


SHUTDOWN_DEADLINE_S = 60.0  # well above the bounded steps' sum (6 x 5 s); reaching it is a bug, and says where


def _exit_now(*_) -> None:
    os._exit(130)


def _load(config_path, flags, settings=()):
    try:
        return load_config(config_path, _overrides(**flags), settings)
    except ConfigError as e:
        raise Fail(str(e), EXIT_USAGE) from None


def _status_url(data_dir: str | None, http: str | None) -> str:
    if http:
        if http.startswith("http://") or http.startswith("https://"):
            return http.rstrip("/")
        try:
            host, port = parse_host_port(http)
        except ValueError as e:
            raise Fail(f"--http: {e}", EXIT_USAGE) from None
        return f"http://{host}:{port}"
    path = datadir.resolve(data_dir)
    info = datadir.read_runtime(path)
    if info is None:
        raise Fail(f"no running node found for data dir {path} (start one with `swarmd start`, or pass --http)")
    return info["http"]


def _get_json(url: str):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp)
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
        raise Fail(f"cannot read {url}: {getattr(e, 'reason', e)}") from None


def _ago(t: float | None) -> str:
    return "-" if t is None else f"{max(0.0, time.time() - t):.1f}s ago"


_local_opts = [
    click.option("--data-dir", help="Data dir of the node to ask (default: platform user data dir)."),
    click.option("--http", help="Status endpoint of the node (HOST:PORT or URL) instead of --data-dir."),
    click.option("--json", "as_json", is_flag=True, help="Print the raw JSON."),
]


def _with_local_opts(f):
    for opt in reversed(_local_opts):
        f = opt(f)
    return f


@cli.command()
@_with_local_opts
def status(data_dir, http, as_json) -> None:
    """Summary of a running node, read from its HTTP endpoint."""
    s = _get_json(_status_url(data_dir, http) + "/status")
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    connected = sum(1 for p in s["peers"] if p["connected"])
    relayed = sum(1 for p in s["peers"] if p["path"] == "relayed")
    punched = sum(1 for p in s["peers"] if p["path"] == "hole-punched")
    lines = [
        f"peer id       {s['peer_id']}",
        f"version       {s['version']}   swarm {s['swarm']}   up {s['uptime_s']:.0f}s",
        f"reachability  {s['reachability']}",
        f"peers         {s['members']} members, {connected} connected ({relayed} relayed, {punched} hole-punched)",
        f"dht           {s['dht']['routing_table_size']} in routing table",
        f"traffic       {s['traffic']['bytes_in']} B in, {s['traffic']['bytes_out']} B out",
        "addresses     " + ("\n              ".join(s["addresses"]) or "-"),
    ]
    for b in s["bootstrap"]:
        line = f"bootstrap     {b['addr']}: {b['state']}"
        if b["state"] != "connected":
            line += f" (attempt {b['attempts']}; {b['last_error'] or 'waiting'})"
        lines.append(line)
    if s["errors"]:
        lines.append("errors        " + ", ".join(f"{k}={v}" for k, v in sorted(s["errors"].items())))
    for name in sorted(LOOPS):
        if name in s.get("services", {}):
            lines.append(f"{name:<13} " + loop_summary(s["services"][name]))
    click.echo("\n".join(lines))


def _mb(n) -> str:
    return f"{(n or 0) / 1e6:.2f} MB"


def loop_summary(st: dict) -> str:
    """One line for a training loop's /status entry: state, round/step, last loss or reward, bytes."""
    state = st.get("state", "?")
    if state == "failed":
        return f"failed: {st.get('error')}"
    if state == "refused":
        return f"refused: {st.get('refused')}"
    rounds = st.get("total_rounds") or 0
    parts = [state, f"round {st.get('round', 0)}/{rounds if rounds else 'open-ended'}", f"step {st.get('step', 0)}"]
    losses = st.get("losses") or []
    if losses:
        parts.append(f"loss {losses[-1][1]:.4f}")
    elif st.get("train_loss") is not None:
        parts.append(f"train loss {st['train_loss']:.4f}")
    if st.get("reward_last50") is not None:
        parts.append(f"reward {st['reward_last50']:.3f} (last 50 rounds)")
    if "bytes_sent" in st or "bytes_received" in st:
        parts.append(f"sent {_mb(st.get('bytes_sent'))}, received {_mb(st.get('bytes_received'))}")
    elif "step_wire_bytes" in st:
        parts.append(f"sent {st['step_wire_bytes']} B ({st.get('wire_bytes_per_step', 0)} B/step)")
    elif "wire_bytes_published" in st:
        parts.append(f"sent {_mb(st['wire_bytes_published'])}")
    if st.get("checkpoint"):
        parts.append(f"saved round {st['checkpoint'].get('round')}")
    parts += [work_text(w) for w in st.get("work") or []]
    return "  ".join(parts)



@cli.command()
@_with_local_opts
def peers(data_dir, http, as_json) -> None:
    """Table of peers: id, addresses, path, latency, last seen."""
    rows = _get_json(_status_url(data_dir, http) + "/peers")
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no peers yet")
        return
    header = ("PEER ID", "PATH", "LATENCY", "LAST SEEN", "ADDRESSES")
    table = [header]
    for p in rows:
        path = p["path"] + (f" via {p['relay'][-8:]}" if p.get("relay") else "")
        latency = "-" if p["latency_ms"] is None else f"{p['latency_ms']:.2f} ms"
        table.append((p["peer_id"], path, latency, _ago(p["last_seen"]), ", ".join(p["addrs"][:3])))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for r in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])


@cli.command()
@_with_local_opts
def state(data_dir, http, as_json) -> None:
    """The swarm's replicated state (merged CRDT objects) as this node sees it."""
    s = _get_json(_status_url(data_dir, http) + "/state")
    click.echo(json.dumps(s, indent=2 if as_json else 1, sort_keys=True))


@cli.command()
@click.argument("obj", metavar="OBJECT")
@click.argument("payload", metavar="PAYLOAD_JSON")
@click.option("--data-dir", help="Data dir of the node to write through.")
@click.option("--http", help="Status endpoint of the node (HOST:PORT or URL); the token still comes from --data-dir.")
def write(obj, payload, data_dir, http) -> None:
    """Write one op to a replicated object, e.g. `swarmd write kv '{"k": "<peer id>/note", "v": "hi"}'`."""
    import urllib.error
    import urllib.request

    try:
        parsed = json.loads(payload)
    except json.JSONDecodeError as e:
        raise Fail(f"PAYLOAD_JSON is not JSON: {e}", EXIT_USAGE) from None
    url = _status_url(data_dir, http) + "/crdt"
    folder = datadir.resolve(data_dir)
    token = datadir.read_http_token(folder)
    if token is None:
        raise Fail(f"no {datadir.TOKEN_FILE} in {folder}: writes need the node's token (pass the node's --data-dir)")
    data = json.dumps({"ops": [{"object": obj, "payload": parsed}]}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            click.echo(json.load(resp)["ops"][0]["id"])
    except urllib.error.HTTPError as e:
        raise Fail(json.loads(e.read() or b"{}").get("error", str(e))) from None
    except (urllib.error.URLError, OSError) as e:
        raise Fail(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


@cli.command()
@click.option("--data-dir", help="Data dir of the node (default: platform user data dir).")
@click.option("--loop", type=click.Choice(sorted(LOOPS)), help="Which loop's weights (default: the newest saved).")
@click.option("--out", "out", type=click.Path(dir_okay=False), help="safetensors file to write "
              "(default: <loop>-<run>-round<N>.safetensors here).")
@click.option("--pretrained", type=click.Path(file_okay=False), help="Also write a save_pretrained directory "
              "(transformers models), with the model rebuilt from --config's task or --task.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The TOML config the node ran with: "
              "--pretrained rebuilds the model from its [loops.<loop>] task and task_options.")
@click.option("--task", "task_spec", help="Task to rebuild the model from for --pretrained (file.py:factory, "
              "module:factory or a built-in name); its task_options come from --config's loop table if given.")
def export(data_dir, loop, out, pretrained, config_path, task_spec) -> None:
    """Write the latest saved weights of a training run to a file (works while the node runs or after it ended)."""
    from swarmd.protocols import checkpoint

    if pretrained and not (config_path or task_spec):
        raise Fail("--pretrained rebuilds the model from a task you name: pass --config (the config the node ran "
                   "with) or --task; the task written inside a weights file is never imported", EXIT_USAGE)
    folder = datadir.resolve(data_dir)
    path = checkpoint.latest(folder, loop)
    if path is None:
        raise Fail(f"no saved weights in {folder / checkpoint.DIR}" + (f" for the {loop} loop" if loop else "")
                   + " (a loop saves them every checkpoint_every rounds and at the end)")
    started = time.monotonic()
    try:
        with click.progressbar(length=path.stat().st_size, label=f"reading {path.name}", file=sys.stderr,
                               show_pos=False, show_percent=True) as bar:
            tensors, meta = checkpoint.load(path, progress=bar.update)
    except checkpoint.CheckpointError as e:
        raise Fail(str(e)) from None
    state = checkpoint.model_state(tensors)
    # names from the file only label things: each is reduced to a safe file-name part before it makes a path
    loop_name = loop or (meta.get("loop") if meta.get("loop") in LOOPS else None)
    if loop_name is None:
        raise Fail(f"{path}: names no known loop (pass --loop)")
    run, rnd = safe_name(meta.get("run")), _safe_int(meta.get("round"))
    target = Path(out) if out else Path(f"{loop_name}-{run}-round{rnd}.safetensors")
    info = {k: meta[k] for k in ("loop", "run", "round", "step", "hash", "task", "task_options") if k in meta}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    click.echo(f"writing {nbytes / 1e6:.1f} MB to {target} ...", err=True)
    checkpoint.save(target.resolve(), state, info)
    click.echo(f"wrote {len(state)} tensors of {loop_name} run {run} (round {rnd}) to {target} "
               f"in {time.monotonic() - started:.1f} s")
    if pretrained:
        spec, options = _export_task(config_path, task_spec, loop_name)
        click.echo(f"rebuilding the model of task {spec} to save it with save_pretrained ...", err=True)
        click.echo(f"wrote a save_pretrained directory to "
                   f"{_export_pretrained(spec, options, loop_name, state, Path(pretrained), config_path)}")


def safe_name(value, fallback: str = "run", limit: int = 64) -> str:
    """A name from a file or a peer as one harmless file-name part: letters, digits, '.', '_' and '-' only (no
    separators, so no '../' and no absolute path), no leading dot, at most ``limit`` characters."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "_", value if isinstance(value, str) else "").lstrip(".")[:limit]
    return text or fallback


def _safe_int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**12 else 0


def _export_task(config_path, task_spec, loop_name: str) -> tuple[str, dict]:
    """The task spec and options to rebuild the model from: --task, else the config's [loops.<loop>] table (the
    same table `swarmd start` validates); options from that table when the config has one."""
    table = {}
    if config_path:
        config = _load(config_path, {})
        table = (config.loops or {}).get(loop_name)
        if table is None and not task_spec:
            raise Fail(f"{config_path} has no [loops.{loop_name}] table to rebuild the {loop_name} model from "
                       "(pass --task)", EXIT_USAGE)
        table = table or {}
    import importlib

    from pydantic import ValidationError

    module_name, config_cls, _ = LOOPS[loop_name]
    try:
        cfg = getattr(importlib.import_module(module_name), config_cls)(**{**table, **({"task": task_spec}
                                                                                      if task_spec else {})})
    except ValidationError as e:
        err = e.errors()[0]
        raise Fail(f"invalid loops.{loop_name}{''.join(f'.{x}' for x in err['loc'])}: {err['msg']}",
                   EXIT_USAGE) from None
    return cfg.task, cfg.options()


def _export_pretrained(spec: str, options: dict, loop_name: str, state: dict, directory: Path,
                       config_path: str | None) -> Path:
    """Rebuild the task's model from the spec and options the user named, load the weights, save_pretrained."""
    from swarmd.protocols.task import TaskError, build_model, load, seeded

    try:
        task = load(spec, options, loop_name, Path(config_path).resolve().parent if config_path else None)
        if loop_name == "sapo":
            with seeded(0):
                model = task.call("policy", 0).model
        else:
            model = build_model(task, 0)
    except TaskError as e:
        raise Fail(f"cannot rebuild the model to export: {e}") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k in dict(model.named_parameters())]:
        raise Fail(f"the saved weights do not fit the task's model (missing {missing[:3]}, unexpected "
                   f"{unexpected[:3]})")
    if not (task.has("export_pretrained") or hasattr(model, "save_pretrained")):
        raise Fail(f"{spec} is not a transformers model: --pretrained needs a model with save_pretrained()")
    directory.mkdir(parents=True, exist_ok=True)
    if task.has("export_pretrained"):
        task.call("export_pretrained", model, str(directory))
    else:
        model.save_pretrained(str(directory))
    return directory


@cli.command()
@click.option("--loop", type=click.Choice(["diloco", "streaming-diloco", "spsa", "sapo"]), default="diloco",
              show_default=True, help="Which training loop the swarm runs (on its built-in task).")
@click.option("--nodes", type=click.IntRange(2, 16), default=4, show_default=True, help="How many nodes to start.")
@click.option("--rounds", type=click.IntRange(1), help="Rounds to train (default: the loop's config in configs/).")
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Keep the nodes' data dirs and logs "
              "here (default: a temporary dir, removed at the end).")
@click.option("--until-done", is_flag=True, help="Stop the swarm and exit once every node's loop is done.")
def demo(loop, nodes, rounds, directory, until_done) -> None:
    """Start a local training swarm (loopback), show its progress, stop it all on Ctrl+C."""
    from swarmd.node import demo as demo_module

    sys.exit(demo_module.run(loop, nodes, rounds, directory, until_done))


@cli.command()
@click.option("--peers", "peers", multiple=True, type=click.IntRange(2, 100_000), default=(100,), show_default=True,
              help="Swarm sizes to simulate (repeatable).")
@click.option("--scenario", "scenarios", multiple=True, type=click.Choice(["gossip", "partition"]),
              default=("gossip", "partition"), show_default=True, help="What to measure (repeatable).")
@click.option("--degree", type=click.IntRange(1, 1000), default=8, show_default=True,
              help="Connections each node opens (discovery's max_peers bounds them in a real swarm).")
@click.option("--latency-ms", type=click.FloatRange(0), default=25.0, show_default=True,
              help="One-way latency of each host's link.")
@click.option("--mbit", type=click.FloatRange(0), default=100.0, show_default=True,
              help="Each host's up and down rate (0: unlimited).")
@click.option("--loss", type=click.FloatRange(0, 0.9), default=0.0, show_default=True,
              help="Share of writes whose segment is lost once (late by a retransmission timeout).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--no-crdt", is_flag=True, help="Gossip only: no CRDT replicas (every replica holds every op, so "
              "10,000 of them do not fit one process).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw results.")
def sim(peers, scenarios, degree, latency_ms, mbit, loss, seed, no_crdt, as_json) -> None:
    """Simulate a swarm in this process, on virtual time: the real gossip and CRDT code on in-memory links."""
    from swarmd.node import sim as sim_module

    _setup_logging("warning")
    reports = []
    if not as_json:
        click.echo(sim_module.HEADER)
    for n in peers:
        cfg = sim_module.SimConfig(peers=n, degree=degree, latency=latency_ms / 1e3,
                                   bandwidth=mbit * 1e6 / 8 if mbit else None, loss=loss, seed=seed,
                                   crdt=not no_crdt)
        report = sim_module.simulate(cfg, tuple(scenarios))
        reports.append(report)
        if not as_json:
            click.echo(sim_module.format_row(report))
    if as_json:
        click.echo(json.dumps([{"peers": r.peers, "wall_s": r.wall_s, **r.rows} for r in reports], indent=2))


# the modules that declare wire messages (transport.wire): importing them fills the registry
WIRE_MODULES = tuple(f"swarmd.{m}" for m in (
    "transport.ping", "transport.nat", "dht.discovery", "dht.records", "node.replication", "node.reach",
    "protocols.gossip_message", "protocols.gossip", "protocols.bulk", "protocols.diloco", "protocols.spsa",
    "protocols.sapo"))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def wire(as_json) -> None:
    """Every message swarmd sends: carrier, kind, version, size limit, signing domain and schema."""
    import importlib

    from swarmd.transport.wire import WIRE

    for module in WIRE_MODULES:
        importlib.import_module(module)
    rows = WIRE.table()
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for r in rows:
        click.echo(f"{r['carrier']:<26} {r['kind']:>3} v{r['version']}  {r['name']:<28} <= {r['max_bytes']:>10} B"
                   f"{'  signed ' + r['signed'] if r['signed'] else ''}\n      {r['schema']}"
                   f"{chr(10) + '      ' + r['doc'] if r['doc'] else ''}")


@cli.command("id")
@click.option("--data-dir", help="Data dir holding identity.key (default: platform user data dir).")
def show_id(data_dir) -> None:
    """Print this node's peer id."""
    from swarmd.transport.errors import IdentityError
    from swarmd.transport.identity import Identity

    path = datadir.resolve(data_dir) / datadir.IDENTITY_FILE
    try:
        click.echo(Identity.load(path).peer_id)
    except IdentityError as e:
        raise Fail(str(e)) from None


@cli.command()
@click.option("--data-dir", help="Data dir to create identity.key in (default: platform user data dir).")
@click.option("--force", is_flag=True, help="Replace an existing identity (the node gets a new peer id).")
def keygen(data_dir, force) -> None:
    """Create the node identity (an Ed25519 key, file mode 0600)."""
    from swarmd.transport.errors import IdentityError
    from swarmd.transport.identity import Identity

    path = datadir.ensure(datadir.resolve(data_dir)) / datadir.IDENTITY_FILE
    if path.exists() and not force:
        raise Fail(f"{path} already exists (peer id {_peer_id_or_error(path)}); use --force to replace it")
    identity = Identity.generate()
    try:
        identity.save(path, overwrite=force)
    except IdentityError as e:
        raise Fail(str(e)) from None
    click.echo(identity.peer_id)


def _peer_id_or_error(path: Path) -> str:
    from swarmd.transport.errors import IdentityError
    from swarmd.transport.identity import Identity

    try:
        return Identity.load(path).peer_id
    except IdentityError:
        return "unreadable"


def main(argv: list[str] | None = None, *, on_loops: Callable[[list], None] | None = None) -> None:
    """The ``swarmd`` command. ``on_loops``, for a script that runs the command in its own process: called with the
    training loops ``start`` made from the config, before the node starts them (a test's peer installs its fault
    plan on them: ``tests/byzantine_peer.py``)."""
    try:
        cli.main(args=argv, prog_name="swarmd", standalone_mode=False, obj={"on_loops": on_loops})
    except click.UsageError as e:
        hint = f" (see `swarmd {e.ctx.info_name} --help`)" if e.ctx and e.ctx.parent else ""
        print(f"swarmd: error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except click.exceptions.Abort:
        sys.exit(130)
    except Fail as e:
        print(f"swarmd: error: {e}", file=sys.stderr)
        sys.exit(e.code)
    except datadir.DataDirError as e:
        print(f"swarmd: error: {e}", file=sys.stderr)
        sys.exit(EXIT_RUNTIME)
    except click.ClickException as e:
        print(f"swarmd: error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()


@cli.command()
@_with_local_opts
def doctor(data_dir, http, as_json) -> None:
    """What to know when peers cannot reach each other: reachability, NAT, relays, paths, and a hint per problem."""
    s = _get_json(_status_url(data_dir, http) + "/status")
    report = diagnose(s)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    lines = [f"reachability  {report['reachability']}  ({report['reachability_source']})"]
    lines += [f"observed as   {a}" for a in report["observed_addrs"]] or ["observed as   - (no AutoNAT answer yet)"]
    lines.append(f"NAT           {report['nat']}")
    lines.append(f"relays        {', '.join(report['relays']) or '-'}"
                 + ("   (this node serves as a relay)" if report["relay_service"] else ""))
    lines.append(f"hole punching {report['punch']}")
    lines.append(f"peers         {report['direct']} direct ({report['punched']} hole-punched), "
                 f"{report['relayed']} relayed, "
                 f"{report['unconnected']} members not connected")
    for p in report["peers"]:
        lines.append(f"  {p['peer_id']}  {p['path']}{' via ' + p['relay'] if p['relay'] else ''}"
                     f"  since {_ago(p['since'])}")
    split = report["split"]
    last = split.get("last_split")
    lines.append("split         " + (f"SUSPECTED for {split['seconds']} s: {split['lost']} of {split['known']} known "
                                     "members reached by no one near" if split.get("suspected") else
                                     f"none ({split.get('known') or 0} known members reached)")
                 + (f"; the last one lasted {last['seconds']} s, healed {_ago(last['healed_at'])}" if last else ""))
    writes = report["writes"]
    lines.append("writes        " + (f"REFUSED: {writes['refused_ops']} of this node's ops refused by "
                                     f"{len(writes['refused_by'])} peer(s)" if writes["refused_ops"] else
                                     "no peer has refused this node's ops")
                 + ("; PAUSED (re-fetching own ops after log damage)" if writes["paused"] else ""))
    lines += [f"training      {t}" for t in report["training"]]
    lines.append("")
    lines += [f"hint: {h}" for h in report["hints"]] or ["no problems found"]
    click.echo("\n".join(lines))
