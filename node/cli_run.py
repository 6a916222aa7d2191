"""The ``swarmd`` commands that run nodes: ``start`` (one node until a signal), ``demo`` (a local swarm), ``sim`` (a
simulated swarm in this process), and the identity a node runs as (``id``, ``keygen``).

This module is a composition root (like ``node/cli.py``): ``start`` plugs the training loops of ``protocols/`` into
the node."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import click

from swarmd.node import __version__, allocator, datadir
from swarmd.node.cli_common import EXIT_USAGE, LOOPS, Fail, _load, _setup_logging


@click.command()
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


@click.command()
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


@click.command()
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


@click.command("id")
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


@click.command()
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
