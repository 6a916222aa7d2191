"""Configuration: the embedded ``configs/default.toml``, then the user's ``--config`` file, then CLI flags.

Every field is validated by pydantic with unknown keys rejected (a typo is an error, not a silently ignored
setting). :func:`load_config` raises :class:`ConfigError` whose message is one line naming the field.
"""

from __future__ import annotations

import copy
import importlib.resources
import ipaddress
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from swarmd.transport.multiaddrs import parse_listen_addr, validate_multiaddr, validate_peer_addr


class ConfigError(Exception):
    """A user-facing, one-line configuration error."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSection(_Section):
    data_dir: str = ""  # empty: the platform's user data dir (platformdirs)
    swarm: str = "swarmd"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # how the C library keeps freed large blocks (node/allocator.py): reuse them next round (fewer page faults,
    # more resident memory) or give them back at once
    memory: Literal["reuse", "release"] = "reuse"

    @field_validator("swarm")
    @classmethod
    def _swarm(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", v):
            raise ValueError("must be 1-64 characters of letters, digits, '.', '_' or '-'")
        return v


class RelayLimitsSection(_Section):
    data_mb: int = Field(8, ge=1, le=1 << 20)  # per relayed connection and direction, then it is reset
    seconds: int = Field(600, ge=1)  # per relayed connection
    max_circuits: int = Field(16, ge=1)  # open relayed connections per peer
    max_reservations: int = Field(128, ge=1)  # peers that may hold a slot


class NetworkSection(_Section):
    listen: list[str] = Field(min_length=1)
    announce: list[str] = []
    bootstrap: list[str] = []
    port_mapping: bool = False  # UPnP / NAT-PMP
    reachability: Literal["auto", "public", "private"] = "auto"
    dht_mode: Literal["server", "client", "auto"] = "server"
    startup_timeout: float = Field(15.0, gt=0, le=300)
    bulk_port: int = Field(0, ge=0, le=65535)  # TCP port for bulk tensor transfer (0: the OS picks)
    relays: list[str] = []  # circuit relays to reserve slots on when private (empty: the bootstrap peers)
    relay_service: Literal["auto", "on", "off"] = "auto"  # auto: serve as a relay unless we are behind a NAT
    relay_limits: "RelayLimitsSection" = Field(default_factory=lambda: RelayLimitsSection())
    probe_interval: float = Field(300.0, ge=5.0)  # seconds between AutoNAT probes once reachability is known
    hole_punching: bool = True  # upgrade relayed connections to direct ones when the NATs allow it
    punch_delay: float = Field(1.0, ge=0.0, le=600.0)  # seconds a relayed connection runs before the first attempt

    @field_validator("relays")
    @classmethod
    def _relays(cls, v: list[str]) -> list[str]:
        return [validate_peer_addr(a) for a in v]

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: list[str]) -> list[str]:
        for addr in v:
            parse_listen_addr(addr)
        return [validate_multiaddr(a) for a in v]

    @field_validator("announce")
    @classmethod
    def _announce(cls, v: list[str]) -> list[str]:
        out = []
        for addr in v:
            _, _, _, port = parse_listen_addr(addr)
            if port == 0:
                raise ValueError(f"{addr!r}: an announced address needs an explicit port")
            out.append(validate_multiaddr(addr))
        return out

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap(cls, v: list[str]) -> list[str]:
        return [validate_peer_addr(a) for a in v]


class DiscoverySection(_Section):
    record_ttl: float = Field(60.0, ge=5, le=3600)
    refresh_interval: float = Field(20.0, ge=1, le=1800)
    poll_interval: float = Field(5.0, ge=0.2, le=600)
    ping_interval: float = Field(5.0, ge=0.5, le=600)
    reach_interval: float = Field(2.0, ge=0.2, le=600)  # ask connected members whom they reach this often
    split_window: float = Field(5.0, ge=0.5, le=3600)  # a member no one near reached this long is lost
    max_peers: int = Field(64, ge=1, le=10_000)
    backoff_initial: float = Field(1.0, ge=0.05, le=60)
    backoff_max: float = Field(60.0, ge=1, le=3600)
    dht_timeout: float = Field(15.0, ge=1, le=600)  # every DHT call gives up after this long


class StateSection(_Section):
    sync_interval: float = Field(5.0, ge=0.2, le=600)  # anti-entropy with a random peer this often
    # ops that arrive by push and are new here are pushed on to this many other peers (0: only their author pushes)
    relay_fanout: int = Field(3, ge=0, le=64)
    max_clock_skew: float = Field(30.0, ge=1, le=3600)  # ops stamped further ahead than this are rejected
    # Who may write the replicated state (crdt.admission); every node of a swarm must use the same values.
    # Open swarm: each identity pays a work ticket of this many bits once (22: about 2 s of one core).
    admission_bits: int = Field(22, ge=0, le=40)
    # Closed swarm: only these peer ids may write (no ticket needed). Empty: open.
    allow: list[str] = []
    # ops of authors without standing held aside at most (the least recently heard from give way; authors with standing
    # are never refused: crdt.store, "Standing and probation")
    max_authors: int = Field(20_000, ge=1, le=10_000_000)


class HttpSection(_Section):
    listen: str = "127.0.0.1:8470"
    # more names (or addresses) the endpoint answers to in the Host header, e.g. a LAN name for a node bound to
    # 0.0.0.0; loopback names and the machine's own addresses are always allowed there
    allowed_hosts: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("allowed_hosts")
    @classmethod
    def _allowed_hosts(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]|[0-9A-Fa-f:.]{2,45}", name):
                raise ValueError(f"{name!r} is not a host name or address (no port, no scheme)")
        return [f"[{n}]" if ":" in n and not n.startswith("[") else n.lower() for n in v]

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        parse_host_port(v)
        return v


class Config(_Section):
    # training loops, each validated by the loop itself when the node starts, e.g. [loops.spsa]
    loops: dict[str, dict] = {}
    node: NodeSection = NodeSection()
    network: NetworkSection
    discovery: DiscoverySection = DiscoverySection()
    state: StateSection = StateSection()
    http: HttpSection = HttpSection()


def parse_host_port(text: str) -> tuple[str, int]:
    """'127.0.0.1:8470' / '[::1]:0' / 'localhost:80' -> (host, port). Raises ValueError."""
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d{1,5})|([A-Za-z0-9.-]+):(\d{1,5})", text or "")
    if not m:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:8470, port 0 picks a free one)")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    if m.group(1):
        ipaddress.IPv6Address(host)
    if int(port) > 65535:
        raise ValueError(f"{text!r}: port out of range")
    return host, int(port)


# CLI flag that sets each field, so errors can name what the user typed
FLAGS = {
    ("node", "data_dir"): "--data-dir",
    ("node", "swarm"): "--swarm",
    ("node", "log_level"): "--log-level",
    ("network", "listen"): "--listen",
    ("network", "announce"): "--announce",
    ("network", "bootstrap"): "--bootstrap",
    ("network", "port_mapping"): "--port-mapping",
    ("network", "reachability"): "--reachability",
    ("http", "listen"): "--http",
}


def parse_settings(items) -> dict:
    """``["loops.diloco.rounds=20", 'node.swarm="x"']`` -> nested overrides. The value is read as a TOML value
    (numbers, booleans, quoted strings, [lists], {inline tables}); a bare word that is not one is taken as a string."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p and p.replace("_", "").replace("-", "").isalnum() for p in parts):
            raise ConfigError(f"--set {item!r}: expected dotted.key=value (e.g. loops.diloco.rounds=20)")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {key} is inside a value set by another --set")
        node[parts[-1]] = value
    return out


def _given(settings: dict, loc: tuple) -> bool:
    node = settings
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def default_config_text() -> str:
    return importlib.resources.files("swarmd.configs").joinpath("default.toml").read_text()


def _read_toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source} is not valid TOML: {e}") from None


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _format_loc(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None,
                settings: list[str] = ()) -> Config:
    """Build the effective config: the embedded defaults, the file at ``path``, the CLI flags (``overrides``),
    then ``settings``: ``--set`` items, ``dotted.key=<TOML value>``. Raises ConfigError (one line, names the field)."""
    data = _read_toml(default_config_text(), "embedded configs/default.toml")
    source = "configs/default.toml"
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        data = _merge(data, _read_toml(text, f"config file {path}"))
        source = str(path)
    overrides = overrides or {}
    data = _merge(data, overrides)
    settings = parse_settings(settings)
    data = _merge(data, settings)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting (check the spelling; see configs/default.toml)"
        flag = FLAGS.get(loc[:2])
        if _given(settings or {}, loc):
            origin = " (from --set)"
        elif flag and loc[1] in overrides.get(loc[0], {}):
            origin = f" (from {flag})"
        else:
            origin = f" (in {source})"
        raise ConfigError(f"invalid {_format_loc(loc)}{origin}: {msg}") from None
