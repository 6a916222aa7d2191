"""Hole-punching building blocks on loopback: the simultaneous-open dialer, the splice, and a punched socket handed
to two real p2p daemons (the whole punch through NATs runs in tests/test_nat.py)."""

import asyncio
import os
import socket

import pytest

from swarmd.transport import birthday
from swarmd.transport.base import PathType
from swarmd.transport.birthday import KEEP, SCATTER, burst_open, roles
from swarmd.transport.framing import ProtocolSpec
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport
from swarmd.transport.punch import Splice, simultaneous_open
from swarmproc import free_port

pytestmark = pytest.mark.timeout(60)

ECHO = ProtocolSpec("echo", "1.0.0", max_frame=1 << 20, kinds=frozenset({1}))


async def tcp_pair() -> tuple[socket.socket, socket.socket]:
    loop = asyncio.get_running_loop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        client = socket.socket()
        client.setblocking(False)
        accepting = asyncio.ensure_future(loop.sock_accept(listener))
        await loop.sock_connect(client, listener.getsockname())
        server, _ = await accepting
    server.setblocking(False)
    return client, server


async def test_splice_copies_both_ways_with_flow_control_and_passes_eof():
    loop = asyncio.get_running_loop()
    left, inner_a = await tcp_pair()
    inner_b, right = await tcp_pair()
    splice = await Splice.start(inner_a, inner_b)
    payload = bytes(range(256)) * 16384  # 4 MiB: more than any socket and write buffer hold

    async def read_all(sock, n):
        got = bytearray()
        while len(got) < n:
            chunk = await loop.sock_recv(sock, 1 << 16)
            assert chunk, "closed early"
            got += chunk
        return bytes(got)

    sender = asyncio.ensure_future(loop.sock_sendall(left, payload))
    assert await read_all(right, len(payload)) == payload
    await sender
    await loop.sock_sendall(right, b"pong")
    assert await read_all(left, 4) == b"pong"
    left.shutdown(socket.SHUT_WR)  # a half close reaches the far end, which can still answer
    assert await loop.sock_recv(right, 10) == b""
    await loop.sock_sendall(right, b"last")
    assert await read_all(left, 4) == b"last"
    assert splice.bytes == {"a": len(payload), "b": 8}
    right.close()
    await asyncio.wait_for(splice.closed.wait(), 5)
    assert await loop.sock_recv(left, 10) == b""
    left.close()


async def test_simultaneous_open_connects_or_gives_up_in_time():
    loop = asyncio.get_running_loop()
    with socket.socket() as listener:  # a plain listener answers the SYN: the simplest "open" path
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sock = await simultaneous_open(free_port(), [("127.0.0.1", 1), listener.getsockname()], timeout=3)
        assert sock.getpeername() == listener.getsockname()
        sock.close()
    started = loop.time()
    with pytest.raises(TimeoutError, match="no simultaneous open"):  # refused, retried until the deadline
        await simultaneous_open(free_port(), [("127.0.0.1", free_port())], timeout=0.5)
    assert loop.time() - started < 2


async def test_a_punched_socket_becomes_the_daemons_connection_on_both_sides():
    a = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"]))
    b = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"]))
    await a.start()
    await b.start()
    seen = []

    async def echo(stream):
        seen.append(stream.remote_addr)
        message = await stream.read_required()
        await stream.send(1, message.body)
        await stream.close(linger=2)

    try:
        await b.serve(ECHO, echo)
        sock_a, sock_b = await tcp_pair()
        real_a = "/ip4/%s/tcp/%d" % sock_a.getsockname()
        real_b = "/ip4/%s/tcp/%d" % sock_b.getsockname()
        await asyncio.gather(a.adopt(b.peer_id, sock_a, dialer=True, timeout=10),
                             b.adopt(a.peer_id, sock_b, dialer=False, timeout=10))
        (conn,) = [p for p in await a.peers() if p.peer_id == b.peer_id]
        assert conn.path is PathType.PUNCHED and conn.path.direct and conn.addrs == (real_b,)
        (back,) = [p for p in await b.peers() if p.peer_id == a.peer_id]
        assert back.path is PathType.PUNCHED and back.addrs == (real_a,)
        async with await a.open_stream(b.peer_id, ECHO) as stream:
            await stream.send(1, {"hello": "x" * 100_000})
            assert (await stream.read_required()).body == {"hello": "x" * 100_000}
        assert seen == [real_a]  # the handler sees the real remote address, not the loopback splice
        await a.disconnect(b.peer_id)
        for _ in range(100):
            if not a._adopted and not b._adopted:
                break
            await asyncio.sleep(0.05)
        assert not a._adopted and not b._adopted
    finally:
        await a.close()
        await b.close()


async def test_a_socket_to_the_wrong_peer_is_not_adopted():
    """The dialer's daemon checks the peer id through the splice: a punched socket that reached someone else
    fails the handshake and leaves no connection behind."""
    a = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"]))
    b = P2PDaemonTransport(Identity.generate(), P2PDaemonConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"]))
    await a.start()
    await b.start()
    try:
        sock_a, sock_b = await tcp_pair()
        expected = Identity.generate().peer_id  # a takes the socket for this peer; b is at the other end
        results = await asyncio.gather(a.adopt(expected, sock_a, dialer=True, timeout=5),
                                       b.adopt(a.peer_id, sock_b, dialer=False, timeout=5), return_exceptions=True)
        assert isinstance(results[0], Exception)
        assert all(p.peer_id != expected for p in await a.peers())
        assert not a._adopted
    finally:
        await a.close()
        await b.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_burst_roles_follow_the_two_mappings():
    assert roles("kept", "varies") == KEEP and roles("kept", "changed") == KEEP
    assert roles("varies", "kept") == SCATTER and roles("changed", "kept") == SCATTER
    for ours, theirs in (("kept", "kept"), ("varies", "varies"), ("changed", "varies"), ("unknown", "kept"),
                         ("kept", "unknown")):
        assert roles(ours, theirs) is None  # nothing to aim at, or an ordinary punch suffices


async def test_the_keeper_takes_the_first_flow_that_connects_marks_it_and_resets_the_others():
    """Loopback stands in for the NATs: one of the keeper's guessed ports is a listener (where a symmetric NAT's
    port would be); that flow wins and carries the mark, every other socket is gone when the burst returns."""
    loop = asyncio.get_running_loop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        target = listener.getsockname()[1]
        guesses = [p for p in range(*birthday.PORTS) if p != target][:15] + [target]

        class Rng:  # the keeper's guesses: 15 closed ports and the listener's
            def sample(self, population, n):
                assert len(population) == 65536 - 1024 and n == 16
                return guesses

        before = open_fds()
        sock = await burst_open(KEEP, free_port(), ("127.0.0.1", target), 3.0, flows=16, rng=Rng())
        try:
            assert sock.getpeername()[1] == target
            assert open_fds() == before + 1  # the winner only
            server, _ = await loop.sock_accept(listener)
            with server:
                server.setblocking(False)
                assert await asyncio.wait_for(loop.sock_recv(server, 1), 3) == birthday.MARK
        finally:
            sock.close()


async def test_the_scatterer_takes_the_flow_that_carries_the_mark_and_closes_every_other():
    """Several of the scatterer's flows connect (the keeper's listener stands in for its guesses meeting more than
    one of the symmetric NAT's ports); the keeper marks the third one: that one wins, the others are reset."""
    loop = asyncio.get_running_loop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        before = open_fds()
        burst = asyncio.ensure_future(burst_open(SCATTER, 0, listener.getsockname(), 5.0, flows=8))
        accepted = [(await loop.sock_accept(listener))[0] for _ in range(3)]
        try:
            accepted[2].setblocking(False)
            await loop.sock_sendall(accepted[2], birthday.MARK)
            sock = await asyncio.wait_for(burst, 5)
            with sock:
                assert sock.getsockname() == accepted[2].getpeername()
                assert open_fds() == before + 3 + 1  # the accepted ones and the winner: the other flows are closed
                await loop.sock_sendall(sock, b"x")
                assert await loop.sock_recv(accepted[2], 1) == b"x"
            for other in accepted[:2]:  # reset, not left open
                other.setblocking(False)
                with pytest.raises(ConnectionResetError):
                    await asyncio.wait_for(loop.sock_recv(other, 1), 3)
        finally:
            for s in accepted:
                s.close()


async def test_a_burst_that_meets_nothing_gives_up_in_time_and_leaves_no_socket():
    before = open_fds()
    with socket.socket() as closed:  # a port nobody listens on: every flow is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(TimeoutError):
        await burst_open(SCATTER, 0, ("127.0.0.1", port), 2.0, flows=32)
    assert open_fds() == before
    with socket.socket() as listener:  # it never writes the mark: every flow waits, until the burst is cancelled
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        task = asyncio.ensure_future(burst_open(SCATTER, 0, listener.getsockname(), 30.0, flows=32))
        await asyncio.sleep(0.3)
        assert open_fds() == before + 1 + 32
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert open_fds() == before + 1
