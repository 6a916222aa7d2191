"""The ``swarmd`` commands that look at things: a running node through its HTTP endpoint (``status``, ``peers``,
``state``, ``doctor``, and ``write``, which writes one op through it), and the table of every wire message
(``wire``)."""

from __future__ import annotations

import json
import time

import click

from swarmd.node import datadir
from swarmd.node.cli_common import EXIT_USAGE, LOOPS, Fail
from swarmd.node.config import parse_host_port
from swarmd.node.doctor import diagnose
from swarmd.node.services import work_text


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


@click.command()
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


@click.command()
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


@click.command()
@_with_local_opts
def state(data_dir, http, as_json) -> None:
    """The swarm's replicated state (merged CRDT objects) as this node sees it."""
    s = _get_json(_status_url(data_dir, http) + "/state")
    click.echo(json.dumps(s, indent=2 if as_json else 1, sort_keys=True))


@click.command()
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


@click.command()
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


# the modules that declare wire messages (transport.wire): importing them fills the registry
WIRE_MODULES = tuple(f"swarmd.{m}" for m in (
    "transport.ping", "transport.nat", "dht.discovery", "dht.hello", "dht.records", "node.replication", "node.reach",
    "protocols.gossip_message", "protocols.gossip", "protocols.bulk", "protocols.diloco", "protocols.spsa",
    "protocols.sapo"))


@click.command()
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
