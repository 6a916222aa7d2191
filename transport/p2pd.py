"""Transport backend on the go-libp2p daemon (p2pd) bundled with hivemind, driven by hivemind's asyncio ``P2P``.

Runs on the caller's event loop. The daemon is a child process that exits by itself when our persistent control
connection closes (so it never outlives us, even after SIGKILL).

Decisions made here (see ``docs/design/architecture.md``, Transport):
- p2pd is started *without* bootstrap peers: dialing, retries and backoff are ours (``dht.discovery``), so an
  unreachable bootstrap shows in /status instead of failing start-up.
- Port mapping (UPnP/NAT-PMP) is off unless configured; the public IPFS bootstrap list is never used.
- TCP SO_REUSEPORT is off, so a port held by another node is a clear start-up error rather than a silently shared
  port.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import logging
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import multiaddr

from swarmd.transport._compat import load_hivemind
from swarmd.transport.base import (ConnectedPeer, HandlerRunner, InboundBudget, PathType, Reachability, Stream,
                            StreamHandler, TransportStats, path_of)
from swarmd.transport.errors import DaemonStartError, PeerUnreachable, TransportError
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import Identity
from swarmd.transport.multiaddrs import parse_listen_addr, split_peer_addr
from swarmd.transport.penalties import PeerPenalties
from swarmd.transport.handover import HandOver
from swarmd.transport.punch import Splice

logger = logging.getLogger(__name__)
_PATH_RANK = {PathType.PUNCHED: 0, PathType.DIRECT: 1, PathType.RELAYED: 2, PathType.NONE: 3}


class _ShutdownNoise(logging.Filter):
    """p2pd logs 'use of closed network connection' at ERROR whenever its control socket closes at shutdown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "use of closed network connection" not in record.getMessage()


logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_ShutdownNoise())


@dataclass
class RelayLimits:
    """What a relay grants each relayed connection and each peer (go-libp2p circuit relay v2 service)."""

    data_bytes: int = 8 << 20  # per relayed connection and direction, then the relay resets it
    seconds: int = 600  # per relayed connection
    max_circuits: int = 16  # open relayed connections per peer
    max_reservations: int = 128  # peers holding a slot


@dataclass
class P2PDaemonConfig:
    listen: list[str]
    announce: list[str] = field(default_factory=list)
    port_mapping: bool = False
    force_reachability: str | None = None  # "public" | "private" | None (AutoNAT decides): the user's setting
    relay_client: bool = False  # behind a NAT: p2pd is told it is private, so it keeps relay reservations
    dht_mode: str = "server"
    startup_timeout: float = 15.0
    relay_service: bool = True  # serve as a circuit relay v2 for others
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    static_relays: list[str] = field(default_factory=list)  # reserve slots on these (full multiaddrs with /p2p/)


# extra p2pd flags and environment hivemind's P2P.create has no parameter for; set around create() (see
# _daemon_flags, _daemon_env)
_EXTRA_FLAGS: contextvars.ContextVar[dict] = contextvars.ContextVar("swarmd_p2pd_flags", default={})
_EXTRA_ENV: contextvars.ContextVar[dict] = contextvars.ContextVar("swarmd_p2pd_env", default={})
ENV = "/usr/bin/env"
# the p2p daemon's garbage collector (Go's GOGC), unless the user sets their own: a collection once the
# heap has grown by half of what was live after the last one (Go's default: by all of it). Not a soft heap limit
# (GOMEMLIMIT=48MiB: 80 -> 67 MB RSS per daemon at 16 nodes): it sits just above the daemon's live heap, so the
# collector runs almost without a pause, more so the more connections (the heap grows with them). With 24 idle
# nodes, per daemon: 6.5% of a core and 71 MB with the limit; 3.4% and 100 MB with neither; 3.7% and 83 MB with
# GOGC 50 (4.8% and 77 MB with 30). In the exchange bench the limit costs 0.09-0.10 s of daemon CPU a round against
# 0.05-0.07 at 8 nodes, 0.80 against 0.36 at 16; and 32 nodes on 2 cores do not all start (bench_join) with it
# (``docs/benchmarks/join.md``). GOGC has no such cliff: the collector's work follows the heap, whatever the connections
DAEMON_GOGC = "50"


def _install_flag_hook(hm) -> None:
    """hivemind builds p2pd's command line in ``P2P._make_process_args``; append our flags there, only for the
    ``create()`` call that set them (a context variable, so concurrent creates do not mix). The daemon's own
    environment variables go on the command line too, through ``env`` (hivemind gives the child a copy of
    ``os.environ`` and no way to add to it; writing ``os.environ`` would change every later child of this process,
    and two nodes in one process could not differ)."""
    original = hm.P2P._make_process_args
    if getattr(original, "_swarmd", False):
        return

    def make_process_args(*args, **kwargs):
        kwargs.update(_EXTRA_FLAGS.get())
        argv = original(*args, **kwargs)
        env = _EXTRA_ENV.get()
        if env:
            argv = [ENV, *(f"{k}={v}" for k, v in sorted(env.items())), *argv]
        return argv

    make_process_args._swarmd = True
    hm.P2P._make_process_args = staticmethod(make_process_args)


class P2PDaemonTransport(HandOver):
    """Implements :class:`transport.base.Transport` on hivemind's ``P2P``."""

    def __init__(self, identity: Identity, config: P2PDaemonConfig, *, penalties: PeerPenalties | None = None):
        self.identity = identity
        self.peer_id = identity.peer_id
        self.config = config
        self.stats = TransportStats()
        self.inbound = InboundBudget()  # large inbound frames being read and decoded, all streams together
        self.penalties = penalties or PeerPenalties()
        self._runner = HandlerRunner(self.penalties, self.stats)
        self._p2p = None
        self._key_dir: tempfile.TemporaryDirectory | None = None
        self._handler_tasks: set[asyncio.Task] = set()
        self._specs: dict[str, ProtocolSpec] = {}
        self.detected_reachability = Reachability.UNKNOWN  # set by the AutoNAT client (transport.nat)
        # hole-punched connections spliced into the daemon: the loopback address the daemon sees -> the real one
        self._adopted: dict[str, str] = {}
        self._splices: dict[str, Splice] = {}
        # peers whose connection is being handed to a hole-punched socket -> [holders, set when the hand-over ends]
        self._handing_over: dict[str, list] = {}

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        hm = load_hivemind()
        _check_ports_free(self.config.listen)
        # p2pd reads the key from a file; give it a private copy in go-libp2p's 64-byte layout
        self._key_dir = tempfile.TemporaryDirectory(prefix="swarmd-key-")
        key_path = Path(self._key_dir.name) / "identity.key"
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.identity.to_p2pd_bytes())
        # the daemon's own environment (through `env` on its command line, see _install_flag_hook): no
        # SO_REUSEPORT (a taken port is an error), and its garbage collector's pace (DAEMON_GOGC; a user's own GOGC
        # wins, and a GOMEMLIMIT of theirs applies too). Behind a NAT, dials leave from the listen port
        # (SO_REUSEPORT), so the NAT maps one predictable port that hole punching can aim at (``transport.nat``)
        env = {"LIBP2P_TCP_REUSEPORT": "true" if self.config.relay_client else "false"}
        if "GOGC" not in os.environ:
            env["GOGC"] = DAEMON_GOGC
        _install_flag_hook(hm)
        token = _EXTRA_FLAGS.set(self._daemon_flags())
        env_token = _EXTRA_ENV.set(env)
        try:
            self._p2p = await hm.P2P.create(
                initial_peers=None,
                host_maddrs=self.config.listen,
                announce_maddrs=self.config.announce or None,
                identity_path=str(key_path),
                check_if_identity_free=False,  # hivemind's check only understands RSA keys
                nat_port_map=self.config.port_mapping,
                use_ipfs=False,
                use_relay=True,
                use_auto_relay=bool(self.config.static_relays),
                trusted_relays=self.config.static_relays or None,
                force_reachability="private" if self.config.relay_client else self.config.force_reachability,
                dht_mode=self.config.dht_mode,
                startup_timeout=self.config.startup_timeout,
                idle_timeout=self.config.startup_timeout + 15,
            )
        except hm.P2PDaemonError as e:
            self._cleanup_key()
            raise DaemonStartError(_explain_daemon_error(str(e), self.config.listen)) from None
        except ValueError as e:
            self._cleanup_key()
            raise DaemonStartError(str(e)) from None
        finally:
            _EXTRA_FLAGS.reset(token)
            _EXTRA_ENV.reset(env_token)
            # the daemon has read the key; do not leave a copy on disk
            self._cleanup_key()
        if self._p2p.peer_id.to_base58() != self.peer_id:
            raise DaemonStartError(
                f"p2pd reports peer id {self._p2p.peer_id.to_base58()}, expected {self.peer_id} (key format changed?)"
            )

    def _cleanup_key(self) -> None:
        if self._key_dir is not None:
            self._key_dir.cleanup()
            self._key_dir = None

    def _daemon_flags(self) -> dict:
        limits = self.config.relay_limits
        flags = {"relayService": self.config.relay_service}
        if self.config.relay_service:
            flags.update(relayDataLimit=limits.data_bytes, relayTimeLimit=f"{limits.seconds}s",
                         relayMaxCircuits=limits.max_circuits, relayMaxReservations=limits.max_reservations)
        if self.config.static_relays:
            flags["relayDiscovery"] = False  # only our relays: p2pd would otherwise reserve on random DHT peers
        return flags

    async def close(self) -> None:
        for splice in list(self._splices.values()):
            splice.close()
        for task in list(self._handler_tasks):
            task.cancel()
        if self._handler_tasks:
            await asyncio.gather(*self._handler_tasks, return_exceptions=True)
        if self._p2p is not None:
            p2p, self._p2p = self._p2p, None
            try:
                await asyncio.wait_for(p2p.shutdown(), 5.0)
            except asyncio.TimeoutError:
                logger.warning("p2p daemon did not exit within 5 s; killing it")
                if p2p._child is not None and p2p._child.returncode is None:
                    p2p._child.kill()

    @property
    def hivemind_p2p(self):
        """The underlying hivemind ``P2P`` (for hivemind's DHTNode). Backend-specific."""
        if self._p2p is None:
            raise TransportError("transport is not started")
        return self._p2p

    @property
    def alive(self) -> bool:
        """False once the daemon has exited (e.g. it got the terminal's Ctrl+C before we did)."""
        child = getattr(self._p2p, "_child", None)
        return self._p2p is not None and (child is None or child.returncode is None)

    @property
    def unix_sockets(self) -> list[str]:
        """The unix socket paths the p2p daemon and our client listen on (removed by a clean close)."""
        if self._p2p is None:
            return []
        return [str(m)[len("/unix"):] for m in (self._p2p._daemon_listen_maddr, self._p2p._client_listen_maddr)
                if str(m).startswith("/unix/")]

    @property
    def daemon_pid(self) -> int | None:
        child = getattr(self._p2p, "_child", None)
        return None if child is None else child.pid

    @property
    def reachability(self) -> Reachability:
        """Forced by configuration, else what AutoNAT probes found (``transport.nat``), else unknown."""
        if self.config.force_reachability in ("public", "private"):
            return Reachability(self.config.force_reachability)
        return self.detected_reachability

    # ---------------------------------------------------------------- connections
    async def connect(self, maddr: str, *, timeout: float = 10.0) -> str:
        peer_id, transport_addr = split_peer_addr(maddr)
        await self.connect_peer(peer_id, [transport_addr] if transport_addr else [], timeout=timeout)
        return peer_id

    async def connect_peer(self, peer_id: str, addrs: list[str], *, timeout: float = 10.0) -> None:
        if peer_id == self.peer_id:
            raise PeerUnreachable("refusing to dial ourselves")
        await self._after_hand_over(peer_id, timeout)
        await self._connect(peer_id, addrs, timeout)

    async def _connect(self, peer_id: str, addrs: list[str], timeout: float) -> None:
        hm = load_hivemind()
        try:
            # hivemind's vendored Multiaddr encodes /p2p/<id> as a CIDv1, which p2pd rejects ("length greater than
            # remaining number of bytes"); py-multiaddr encodes it as the raw multihash p2pd expects (relayed
            # addresses name the relay this way)
            maddrs = [multiaddr.Multiaddr(a) if "/p2p/" in a else hm.Multiaddr(a) for a in addrs]
            await asyncio.wait_for(self.hivemind_p2p._client.connect(hm.PeerID.from_base58(peer_id), maddrs), timeout)
        except asyncio.TimeoutError:
            raise PeerUnreachable(f"dialing {peer_id} timed out after {timeout:.0f} s") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise PeerUnreachable(f"dialing {peer_id} failed: {_short(e)}") from None

    async def disconnect(self, peer_id: str) -> None:
        hm = load_hivemind()
        try:
            await asyncio.wait_for(self.hivemind_p2p._client.disconnect(hm.PeerID.from_base58(peer_id)), 5)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise TransportError(f"disconnecting {peer_id} failed: {_short(e)}") from None

    async def peers(self) -> list[ConnectedPeer]:
        """One entry per connected peer, with its best path (hole-punched, then direct, then relayed). The daemon
        lists each connection apart: a peer holds two while a relayed connection and a direct one overlap (a
        hole punch's hand-over, or a stream opened over the relay meanwhile), and the direct one is the one new
        streams use."""
        try:
            infos = await self.hivemind_p2p.list_peers()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the daemon's control socket: a listing that failed, not a crash of our monitor
            raise TransportError(f"listing peers failed: {_short(e)}") from None
        best: dict[str, ConnectedPeer] = {}
        for info in infos:
            peer_id = info.peer_id.to_base58()
            addrs = tuple(str(a) for a in info.addrs)
            punched = tuple(self._adopted[a] for a in addrs if a in self._adopted)
            if punched:
                conn = ConnectedPeer(peer_id, punched, PathType.PUNCHED)
            else:
                path, relay = path_of(addrs)
                conn = ConnectedPeer(peer_id, addrs, path, relay)
            held = best.get(peer_id)
            if held is None or _PATH_RANK[conn.path] < _PATH_RANK[held.path]:
                best[peer_id] = conn
        return list(best.values())

    async def addresses(self, *, refresh: bool = True) -> list[str]:
        """Our addresses with /p2p/<us>; a node with relays also lists, for each relay it is connected to, the
        relayed address ``<relay addr>/p2p-circuit/p2p/<us>`` (go-libp2p does not advertise relays it deems
        non-public, so we build them ourselves)."""
        addrs = [str(a) for a in await self.hivemind_p2p.get_visible_maddrs(latest=refresh)]
        if self.config.static_relays:
            connected = {p.peer_id for p in await self.peers() if p.path.direct}
            for relay in self.config.static_relays:
                if split_peer_addr(relay)[0] in connected:
                    addrs.append(f"{relay}/p2p-circuit/p2p/{self.peer_id}")
        return addrs

    # ---------------------------------------------------------------- streams
    async def open_stream(self, peer_id: str, spec: ProtocolSpec, *, timeout: float = 10.0) -> Stream:
        hm = load_hivemind()
        if self.penalties.is_banned(peer_id):
            raise PeerUnreachable(f"peer {peer_id} is banned")
        await self._after_hand_over(peer_id, timeout)
        try:
            _, reader, writer = await asyncio.wait_for(
                self.hivemind_p2p.call_binary_stream_handler(hm.PeerID.from_base58(peer_id), spec.id), timeout
            )
        except asyncio.TimeoutError:
            raise PeerUnreachable(f"opening {spec.id} to {peer_id} timed out") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise PeerUnreachable(f"opening {spec.id} to {peer_id} failed: {_short(e)}") from None
        self.stats.streams_out += 1
        return Stream(peer_id, spec, reader, writer, self.stats, budget=self.inbound)

    def set_standing(self, has_standing) -> None:
        self._runner.has_standing = has_standing

    async def serve(self, spec: ProtocolSpec, handler: StreamHandler) -> None:
        if spec.id in self._specs:
            raise ValueError(f"{spec.id} is already served")
        self._specs[spec.id] = spec

        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            addr = str(info.addr)
            stream = Stream(info.peer_id.to_base58(), spec, reader, writer, self.stats,
                            remote_addr=self._adopted.get(addr, addr), budget=self.inbound)
            task = asyncio.current_task()
            if task is not None:
                self._handler_tasks.add(task)
            try:
                await self._runner.run(handler, stream)
            except asyncio.CancelledError:
                pass  # we cancelled it (shutdown); this is the task's top level, so end it quietly
            finally:
                if task is not None:
                    self._handler_tasks.discard(task)

        await self.hivemind_p2p.add_binary_stream_handler(spec.id, on_stream)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]


def _check_ports_free(listen: list[str]) -> None:
    """Fail early, with a readable message, if a fixed listen port is taken."""
    for addr in listen:
        family, host, proto, port = parse_listen_addr(addr)
        if port == 0 or proto not in ("tcp", "udp"):
            continue
        kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
        with socket.socket(family, kind) as s:
            # SO_REUSEADDR as the daemon sets it: connections in TIME_WAIT (a NATed node dials from its listen port,
            # so a quick restart finds many) do not block the port, a listener still does
            if kind == socket.SOCK_STREAM:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DaemonStartError(f"listen address {addr}: {proto} port {port} is already in use") from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise DaemonStartError(f"listen address {addr}: {host} is not an address of this machine") from None
                raise DaemonStartError(f"listen address {addr}: {e.strerror}") from None


def _explain_daemon_error(message: str, listen: list[str]) -> str:
    if "address already in use" in message:
        return f"p2p daemon could not listen on {', '.join(listen)}: address already in use"
    if "cannot assign requested address" in message:
        return f"p2p daemon could not listen on {', '.join(listen)}: not an address of this machine"
    return f"p2p daemon failed to start: {message[:300]}"
