"""TCP hole punching across a symmetric NAT on one side: many simultaneous flows at once ("birthday" probing).

A symmetric NAT gives each destination its own random public port, so the peer cannot aim one SYN at it. But if the
other side's NAT keeps its port (its SYNs leave from the listen port the peers already observed), both sides can open
many flows at once (measured in the NAT lab, ``docs/benchmarks/nat.md``):

- the *scattering* side (behind the symmetric NAT) opens N flows to the peer's kept port; its NAT maps them to N
  random public ports;
- the *keeping* side opens N flows from its listen port to N random ports of the scattering side's public address.

Each of the keeper's SYNs opens its own NAT for replies from that one port; where one of its guesses equals a port
the symmetric NAT picked, the two SYNs cross and a TCP simultaneous open completes on that flow (the birthday
estimate: 1 - exp(-N^2 / 64512) for the 1024-65535 range). Several flows may connect: the keeper takes the first and
writes one mark byte on it; the scatterer takes the flow on which the mark arrives. Every other socket is closed with
a reset at once, so no flow outlives the burst. What the caller does with the winner (the hand-over to the p2p
daemon, whose own handshake authenticates the peer) is as for an ordinary punch (``transport.punch``).
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import socket

from swarmd.transport.punch import _bound_socket, abort

# per side: 1 - exp(-N^2 / 64512) is 98.3% at 512 (the lab: 9 of 10) and 99.99% at 768, so a burst that fails is
# as rare as a lost handshake, not one pair in fifty (the lab: 6 of 10 at 256)
FLOWS = 768
PORTS = (1024, 65536)  # where a symmetric NAT picks its ports (Linux: --random-fully)
MARK = b"\x01"  # the keeper's choice among the flows that connected
FD_SPARE = 256  # descriptors left for everything else while a burst runs
KEEP, SCATTER = "keep", "scatter"


def roles(ours: str, theirs: str) -> str | None:
    """Our role in a burst from the two NATs' mappings as AutoNAT answers show them (see ``node.nat``): KEEP where our
    NAT keeps the port and the peer's changes it, SCATTER the reverse, None where a burst cannot help (both change
    it: nothing to aim at; both keep it: an ordinary punch suffices; or either is unknown)."""
    moved = ("changed", "varies")
    if ours == "kept" and theirs in moved:
        return KEEP
    if ours in moved and theirs == "kept":
        return SCATTER
    return None


def _room(flows: int) -> int:
    """How many flows fit the open-file limit (raising the soft limit toward the hard one where needed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 1024
    need = used + flows + FD_SPARE
    if soft != resource.RLIM_INFINITY and soft < need and (hard == resource.RLIM_INFINITY or soft < hard):
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return flows if soft == resource.RLIM_INFINITY else max(0, min(flows, soft - used - FD_SPARE))


async def burst_open(role: str, local_port: int, remote: tuple[str, int], timeout: float, flows: int = FLOWS,
                     rng: random.Random | None = None) -> socket.socket:
    """Open the flows of ``role`` (KEEP: from ``local_port`` to random ports of ``remote``'s IP; SCATTER: from as
    many local ports to ``remote``) and return the chosen connected socket (the MARK already written / read).
    Raises TimeoutError when no flow connects within ``timeout`` seconds, OSError when too few descriptors are free.
    Every other socket is closed before this returns (or raises, or is cancelled)."""
    loop = asyncio.get_running_loop()
    n = _room(flows)
    if n < flows // 2:
        raise OSError(f"too few file descriptors free for a burst of {flows} flows ({n})")
    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    if role == KEEP:
        targets = [(remote[0], p) for p in (rng or random.SystemRandom()).sample(range(*PORTS), n)]
    else:
        targets = [remote] * n
    socks: list[socket.socket] = []
    tasks: list[asyncio.Future] = []
    winner: socket.socket | None = None

    async def flow(s: socket.socket, target: tuple[str, int]) -> socket.socket:
        await loop.sock_connect(s, target)
        if role == SCATTER and await loop.sock_recv(s, 1) != MARK:
            raise ConnectionError("a flow without the keeper's mark")
        return s

    try:
        for target in targets:
            if role == KEEP:
                s = _bound_socket(family, local_port)  # the kept port: SO_REUSEPORT, one flow per remote port
            else:
                s = socket.socket(family, socket.SOCK_STREAM)  # connect() picks a free local port per flow
                s.setblocking(False)
            socks.append(s)
            tasks.append(asyncio.ensure_future(flow(s, target)))
        deadline = loop.time() + timeout
        pending = set(tasks)
        while pending and winner is None and (left := deadline - loop.time()) > 0:
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if winner is None and not task.cancelled() and task.exception() is None:
                    winner = task.result()
        if winner is None:
            raise TimeoutError(f"no flow of {n} connected with {remote[0]} within {timeout:.0f} s")
        if role == KEEP:
            await asyncio.wait_for(loop.sock_sendall(winner, MARK), timeout)
        return winner
    except BaseException:
        winner = None
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in socks:
            if s is not winner:
                abort(s)
