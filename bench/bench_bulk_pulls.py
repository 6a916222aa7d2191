"""Bulk pulls one after another from one source (a round's chunks of one peer): over a new TCP connection each (the
baseline), and over the kept connections of a ``ConnectionPool``, in the same run. The source is a
``BulkService`` in its own process (its real request checks: signature, membership, rate); the puller signs each
request as a node does. Reported per pull: wall time, the CPU of each end (the puller's process time, the source's
from /proc), and the new connections the source accepted.

    python bench/bench_bulk_pulls.py [--kb 200,2000] [--pulls 400]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCE = r"""
import asyncio, os, sys, types
sys.path.insert(0, sys.argv[1])
from swarmd.node.services import NodeContext
from swarmd.protocols.bulk import BulkService, content_hash
from swarmd.transport.identity import Identity
from swarmd.transport.penalties import TokenBuckets

member, size = sys.argv[2], int(sys.argv[3])

async def main():
    transport = types.SimpleNamespace(penalties=types.SimpleNamespace(is_banned=lambda peer: False))
    service = BulkService(gossip=None)
    service._ctx = NodeContext(Identity.generate(), transport, "/tmp", lambda: [member], None, lambda p: True)
    service._rate = TokenBuckets(rate=1e9, burst=1e9)  # the bench pulls faster than a peer may: not its subject
    service._server = await asyncio.start_server(service._serve, "127.0.0.1", 0)
    data = os.urandom(size)
    service.blobs[content_hash(data)] = bytearray(data)
    print(service._server.sockets[0].getsockname()[1], content_hash(data).hex(), flush=True)
    loop = asyncio.get_running_loop()
    while True:  # until the bench closes our stdin; each line: report the connections accepted so far
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        print(service.counters["connections"], flush=True)
    await service.close()

import uvloop
uvloop.run(main())
"""


async def pulls(size: int, count: int, kept: bool) -> dict:
    import msgpack

    from swarmd.protocols.bulk import REQUEST_DOMAIN, ConnectionPool, fetch
    from swarmd.transport.identity import Identity

    me = Identity.generate()
    proc = subprocess.Popen([sys.executable, "-c", SOURCE, str(ROOT), me.peer_id, str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port, blob = proc.stdout.readline().split()
        blob_hash = bytes.fromhex(blob)
        source = psutil.Process(proc.pid)
        pool = ConnectionPool() if kept else None

        def request() -> bytes:
            ts = int(time.time() * 1000)
            return msgpack.packb({"hash": blob_hash, "peer": me.peer_id, "ts": ts,
                                  "sig": me.sign(REQUEST_DOMAIN + blob_hash + str(ts).encode())}, use_bin_type=True)

        for _ in range(10):  # warm both ends (imports, first allocations)
            await fetch(f"127.0.0.1:{port}", blob_hash, size, request(), pool=pool)
        proc.stdin.write("\n")
        proc.stdin.flush()
        before = int(proc.stdout.readline())
        theirs, ours, wall = sum(source.cpu_times()[:2]), time.process_time(), time.perf_counter()
        for _ in range(count):
            body = await fetch(f"127.0.0.1:{port}", blob_hash, size, request(), pool=pool)
            assert len(body) == size
        wall, ours = time.perf_counter() - wall, time.process_time() - ours
        theirs = sum(source.cpu_times()[:2]) - theirs
        proc.stdin.write("\n")
        proc.stdin.flush()
        accepted = int(proc.stdout.readline()) - before
        if pool is not None:
            pool.close()
        return {"wall_ms": 1e3 * wall / count, "puller_ms": 1e3 * ours / count, "source_ms": 1e3 * theirs / count,
                "connections": accepted}
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb", default="200,2000", help="the blob's size in kB (several, comma-separated)")
    parser.add_argument("--pulls", type=int, default=400)
    args = parser.parse_args()
    import uvloop

    rows = []
    for kb in [int(x) for x in args.kb.split(",")]:
        fresh = uvloop.run(pulls(kb * 1000, args.pulls, kept=False))
        kept = uvloop.run(pulls(kb * 1000, args.pulls, kept=True))
        rows.append((kb, fresh, kept))
    print(f"{args.pulls} pulls of one blob from one source after another, loopback; per pull; CPU = user + system, "
          "the puller's process and the source's")
    print(f"{'kB':>6} | {'connections':<23} | {'wall ms':>7} | {'puller CPU ms':>13} | {'source CPU ms':>13} | "
          f"{'both, vs new':>12} | {'new connections':>15}")
    print("-" * 107)
    for kb, fresh, kept in rows:
        base = fresh["puller_ms"] + fresh["source_ms"]
        for name, r in (("a new one each (before)", fresh), ("kept (ConnectionPool)", kept)):
            both = r["puller_ms"] + r["source_ms"]
            print(f"{kb:>6} | {name:<23} | {r['wall_ms']:>7.3f} | {r['puller_ms']:>13.3f} | {r['source_ms']:>13.3f} "
                  f"| {both / base:>12.2f} | {r['connections']:>15}")


if __name__ == "__main__":
    main()
