"""TCP hole punching by simultaneous open, and the splice that hands a punched socket to the p2p daemon.

Why our own sockets (measured in the NAT lab, see ``docs/benchmarks/nat.md``): a Linux NAT with default (strict)
connection tracking only forwards the packets of a TCP handshake whose sequence numbers match the SYN that opened
the mapping. So the socket that sends the NAT-opening SYN must be the socket that completes the handshake. p2pd's
control API can neither do a simultaneous open nor decide which side acts as the secure-channel initiator, so:

1. both peers ``connect()`` from their listen port (SO_REUSEPORT, so the NAT maps the port peers already observed)
   to the other's predicted address, at the same moment (synchronised over the relayed connection). Each SYN opens
   its own NAT; a SYN that arrives before the other NAT is open is dropped and the kernel's retransmission (1 s)
   finds it open. The SYNs cross and the kernel completes a TCP simultaneous open (RFC 793): one connected socket
   on each side, with no listener involved;
2. the socket becomes one of the daemon's connections (:meth:`transport.p2pd.P2PDaemonTransport.adopt`): the side
   chosen as dialer lets its daemon dial a one-shot loopback port that is spliced to the socket; the other side
   splices the socket to its daemon's own listener. The daemons run their ordinary handshake through the splice
   (Noise/TLS, peer ids checked end to end), so the connection is as authenticated as any other.

The splice copies bytes in this process (asyncio protocols with flow control): the price of a direct path through
NATs that p2pd alone cannot punch. Nothing here knows about peers or training.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct

logger = logging.getLogger(__name__)

RETRY_AFTER = 0.1  # after a refused or reset attempt (a NAT that answers unsolicited SYNs with RST)
PAIR_TAKEN_FOR = 0.5  # the address pair held this long by another socket (our listener's): give up


class PairTaken(OSError):
    """Our port already holds a connection to the peer's address: its SYN reached our listener (a NAT that lets
    new connections in), so the peer can be dialed directly."""


def _bound_socket(family: int, local_port: int) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.setblocking(False)
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", local_port))
    except OSError:
        s.close()
        raise
    return s


def abort(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): no FIN_WAIT or TIME_WAIT holds the address pair, so a punch retried
    at once can connect from the same port to the same address again."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


async def _connect_until(local_port: int, remote: tuple[str, int], deadline: float) -> socket.socket:
    """Keep connecting from ``local_port`` to ``remote`` until it succeeds or ``deadline`` (loop time) passes. One
    socket per try: the kernel retransmits its SYN with the same sequence number, which the NATs have tracked."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    last: OSError | None = None
    taken = None  # since when the address pair has been in use by another socket of ours
    while (left := deadline - loop.time()) > 0:
        s = _bound_socket(family, local_port)
        try:
            await asyncio.wait_for(loop.sock_connect(s, remote), left)
            return s
        except asyncio.TimeoutError:
            s.close()
            break
        except OSError as e:
            s.close()
            last = e
            if e.errno not in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH,
                               errno.EADDRNOTAVAIL):
                raise
            if e.errno == errno.EADDRNOTAVAIL:
                taken = taken or loop.time()
                if loop.time() - taken > PAIR_TAKEN_FOR:
                    raise PairTaken(errno.EADDRNOTAVAIL, f"{remote[0]}:{remote[1]} is already connected to our port "
                                    "(the peer's connection came in to our listener: our NAT let it in)") from None
            await asyncio.sleep(min(RETRY_AFTER, max(0.0, deadline - loop.time())))
        except BaseException:
            s.close()
            raise
    raise TimeoutError(f"no simultaneous open with {remote[0]}:{remote[1]}"
                       + (f" (last error: {last.strerror})" if last else ""))


async def simultaneous_open(local_port: int, remotes: list[tuple[str, int]], timeout: float) -> socket.socket:
    """Connect from ``local_port`` to every candidate in ``remotes`` at once; the first connected socket wins, the
    other attempts are abandoned. Raises TimeoutError (or the last OSError) when none connects in time."""
    if not remotes:
        raise ValueError("no address to punch to")
    deadline = asyncio.get_running_loop().time() + timeout
    tasks = [asyncio.ensure_future(_connect_until(local_port, r, deadline)) for r in remotes]
    winner: socket.socket | None = None
    error: BaseException | None = None
    try:
        pending = set(tasks)
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    error = task.exception()
                elif winner is None:
                    winner = task.result()
        if winner is None:
            raise error
        return winner
    finally:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, socket.socket) and result is not winner:
                result.close()  # connected after the winner (another candidate address): not needed


class _Half(asyncio.Protocol):
    """One side of a splice: what it reads, the other side writes. Reading pauses while the other side's write
    buffer is full (so a slow end never makes us buffer without bound)."""

    def __init__(self, splice: "Splice", name: str):
        self.splice = splice
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.other: "_Half | None" = None
        self.eof = False
        self.early = bytearray()  # read before the other side existed (uvloop may read before pause_reading)

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.pause_reading()  # until both halves exist
        transport.set_write_buffer_limits(high=1 << 20)

    def data_received(self, data: bytes) -> None:
        self.splice.bytes[self.name] += len(data)
        if self.other.transport is None:
            self.early += data
        else:
            self.other.transport.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        if self.other.eof:  # both ends have finished sending: nothing more can pass
            self.splice.close()
            return False
        if self.other.transport is not None:
            self.other.transport.write_eof()  # else Splice.start passes it on
        return True  # keep our half open: the other end may still answer

    def pause_writing(self) -> None:
        self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        self.other.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        if self.other is not None and self.other.transport is not None:
            if self.splice.abortive:
                self.splice.abort()
            else:
                self.other.transport.close()
        self.splice._half_closed()


class Splice:
    """Copies bytes both ways between two connected sockets until either side closes; ``closed`` is set then."""

    def __init__(self) -> None:
        self.bytes = {"a": 0, "b": 0}  # bytes read from each side
        self.closed = asyncio.Event()
        self.abortive = False  # when one side closes, reset the other (see ``abort``) instead of closing it
        self._halves: list[_Half] = []

    @classmethod
    async def start(cls, a: socket.socket, b: socket.socket, *, abortive: bool = False) -> "Splice":
        loop = asyncio.get_running_loop()
        splice = cls()
        splice.abortive = abortive
        half_a, half_b = _Half(splice, "a"), _Half(splice, "b")
        half_a.other, half_b.other = half_b, half_a
        try:
            await loop.connect_accepted_socket(lambda: half_a, a)
            await loop.connect_accepted_socket(lambda: half_b, b)
        except BaseException:
            for half, sock in ((half_a, a), (half_b, b)):
                half.transport.close() if half.transport else sock.close()
            raise
        splice._halves = [half_a, half_b]
        for half in splice._halves:
            if half.early:
                half.other.transport.write(bytes(half.early))
                half.early.clear()
            if half.eof:
                half.other.transport.write_eof()
        for half in splice._halves:
            half.transport.resume_reading()
        return splice

    def _half_closed(self) -> None:
        self.closed.set()

    def close(self) -> None:
        for half in self._halves:
            if half.transport is not None:
                half.transport.close()

    def abort(self) -> None:
        """Close both sides with a reset (see ``abort``): for a hand-over that failed."""
        for half in self._halves:
            if half.transport is None or half.transport.is_closing():
                continue
            try:
                sock = half.transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (OSError, AttributeError, ValueError):  # already gone
                pass
            half.transport.abort()
