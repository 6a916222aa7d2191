"""Hole-punched connections handed to the p2p daemon (the hand-over), as a part of ``transport.p2pd``'s transport.

A socket that went through both NATs (``transport.punch``) becomes one of the daemon's connections: the dialer's
daemon dials a one-shot loopback port spliced to the socket, the other side splices it to its daemon's listener, and
the daemons run their ordinary handshake through the splices. While that happens no other dial to the peer may
race it (see ``HandOver.adopt``), and a hand-over that fails frees its ports at once, so the punch can be tried
again from the same ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from swarmd.transport.errors import PeerUnreachable, TransportError
from swarmd.transport.multiaddrs import parse_listen_addr
from swarmd.transport.punch import Splice, abort

logger = logging.getLogger(__name__)


class HandOver:
    """Mixed into ``P2PDaemonTransport``: uses its ``disconnect``, ``_connect``, ``hivemind_p2p``, ``config`` and
    ``_handler_tasks``; keeps ``_adopted`` (loopback address the daemon sees -> the real one), ``_splices`` and
    ``_handing_over`` (peer -> [holders, set when its hand-over ends])."""

    async def redial(self, peer_id: str, addrs: list[str], *, timeout: float = 10.0) -> None:
        """Replace our connections to the peer with a new one to ``addrs`` (e.g. a relayed connection with a
        direct one, once the peer is known to be reachable); streams and dials to it wait meanwhile."""
        with self.handing_over(peer_id):
            await self.disconnect(peer_id)
            await self._connect(peer_id, addrs, timeout)

    async def _after_hand_over(self, peer_id: str, timeout: float) -> None:
        """Wait while a hole-punched connection to the peer is being handed to the daemon: a dial now would race
        it (see ``adopt``)."""
        held = self._handing_over.get(peer_id)
        if held is not None:
            try:
                await asyncio.wait_for(held[1].wait(), timeout)
            except asyncio.TimeoutError:
                raise PeerUnreachable(f"{peer_id}: a hole-punched connection's hand-over took over {timeout:.0f} s") \
                    from None

    MAX_ADOPTED = 64  # each one's bytes pass through this process

    async def adopt(self, peer_id: str, sock: socket.socket, *, dialer: bool, timeout: float = 10.0) -> None:
        """Make ``sock`` (a TCP connection to the peer's machine, e.g. hole-punched by ``transport.punch``) the
        daemon's connection to ``peer_id``. The dialer's daemon drops its other connections to the peer (p2pd
        will not dial a connected peer) and dials a one-shot loopback port spliced to the socket; the other side
        splices the socket to its daemon's listener. The daemons' handshake runs end to end through the splice,
        so the dialer's daemon checks the peer id as on any dial. Both sides must call this, one as dialer; each
        returns once its daemon lists the punched connection.

        The hand-over is a race between dials: from the dialer's disconnect until its daemon has dialed the
        loopback port, any stream opened to the peer (by either side: a kept stream the disconnect broke is
        reopened at once) makes a daemon dial the peer through the relay. The dialer's daemon then joins that dial
        to ours, keeps the connection that completes first and cancels the other: the punched connection is
        closed right after its handshake. So both sides hold their own new streams to the peer (``open_stream``
        waits) until the punched connection is the daemon's."""
        if len(self._splices) >= self.MAX_ADOPTED:
            sock.close()
            raise TransportError(f"already {len(self._splices)} hole-punched connections")
        with self.handing_over(peer_id):
            await self._adopt(peer_id, sock, dialer, timeout)

    @contextlib.contextmanager
    def handing_over(self, peer_id: str):
        """While inside, new streams and dials to ``peer_id`` wait (see ``adopt``). Re-entrant."""
        held = self._handing_over.get(peer_id)
        if held is None:
            self._handing_over[peer_id] = held = [0, asyncio.Event()]
        held[0] += 1
        try:
            yield
        finally:
            held[0] -= 1
            if held[0] == 0:
                del self._handing_over[peer_id]
                held[1].set()

    async def _adopt(self, peer_id: str, sock: socket.socket, dialer: bool, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        ip, port = sock.getpeername()[:2]
        real = f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"
        local = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        local.setblocking(False)
        key = None
        try:
            if dialer:
                local.bind(("127.0.0.1", 0))
                local.listen(1)
                key = f"/ip4/127.0.0.1/tcp/{local.getsockname()[1]}"
                self._adopted[key] = real

                async def accept_and_splice() -> Splice:
                    conn, _ = await loop.sock_accept(local)
                    return await Splice.start(conn, sock, abortive=True)

                spliced = asyncio.ensure_future(accept_and_splice())
                try:
                    await self.disconnect(peer_id)
                    await self._connect(peer_id, [key], timeout)
                    if not spliced.done():
                        raise TransportError("the daemon connected to the peer another way")
                    splice = spliced.result()
                except BaseException:
                    spliced.cancel()
                    if spliced.done() and not spliced.cancelled() and spliced.exception() is None:
                        spliced.result().close()
                    raise
            else:
                host, listen_port = self._listen_tcp()
                local.bind((host, 0))
                key = f"/ip4/{host}/tcp/{local.getsockname()[1]}"
                self._adopted[key] = real
                await asyncio.wait_for(loop.sock_connect(local, (host, listen_port)), timeout)
                splice = await Splice.start(local, sock, abortive=True)
        except BaseException:
            self._adopted.pop(key, None)
            local.close()
            abort(sock)
            raise
        if dialer:
            local.close()  # the listening socket: one connection only
        self._splices[key] = splice
        task = asyncio.ensure_future(self._forget_when_closed(key, splice, peer_id))
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)
        try:
            await self._until_listed(peer_id, key, splice, loop.time() + timeout)
        except BaseException:
            splice.abort()  # the address pair is free again at once: a retry punches from the same ports
            raise
        splice.abortive = False  # the daemons' connection: closed as any other from now on

    async def _until_listed(self, peer_id: str, key: str, splice: Splice, deadline: float) -> None:
        """Wait until the daemon lists the connection at ``key`` (its handshake done); TransportError if the
        splice closes first or the deadline passes (then the splice is closed)."""
        loop = asyncio.get_running_loop()
        while True:
            if splice.closed.is_set():
                raise TransportError("the hole-punched connection closed during the hand-over "
                                     f"({splice.bytes['b']} bytes in, {splice.bytes['a']} out)")
            try:
                infos = await self.hivemind_p2p.list_peers()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise TransportError(f"listing peers failed: {str(e).strip()[:200] or type(e).__name__}") from None
            mine = [str(a) for info in infos if info.peer_id.to_base58() == peer_id for a in info.addrs]
            if key in mine:
                return
            if any("/p2p-circuit" not in a and a not in self._adopted for a in mine):
                raise TransportError("the peer connected directly another way")
            if loop.time() > deadline:
                raise TransportError("the daemon did not take the hole-punched connection in time")
            await asyncio.sleep(0.02)

    async def _forget_when_closed(self, key: str, splice: Splice, peer_id: str) -> None:
        try:
            await splice.closed.wait()
        finally:
            splice.close()
            self._splices.pop(key, None)
            self._adopted.pop(key, None)
            logger.info("hole-punched connection to %s closed (%d bytes in, %d out)", peer_id, splice.bytes["b"],
                        splice.bytes["a"])

    def _listen_tcp(self) -> tuple[str, int]:
        """Where our daemon accepts TCP on this machine (loopback for a wildcard listen address)."""
        for addr in self.config.listen:
            family, host, proto, port = parse_listen_addr(addr)
            if proto == "tcp" and port and family == socket.AF_INET:
                return ("127.0.0.1" if host == "0.0.0.0" else host), port
        raise TransportError("no fixed IPv4 TCP listen port to hand a hole-punched connection to")

