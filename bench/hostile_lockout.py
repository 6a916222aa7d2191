"""bench_hostile.py's lock-out part (issue 80): many admitted identities pushed at a small swarm, and a newcomer that
joins meanwhile and writes once; next to the same swarm unattacked, in the same run.

    python bench/bench_hostile.py --part lockout --identities 30000
    python bench/bench_hostile.py --part lockout --bits 22 --identities 100000 --mint-only   # mint, for later
    python bench/bench_hostile.py --part lockout --bits 22 --identities 20000

Each run: ``nodes`` honest nodes (configs/local.toml, its tickets of 12 bits replaced by ``--bits``); the identities
(each a fresh key with its ticketed op #1 for the swarm ``SWARM``, kept in /tmp for the next run: minted in Python
on every core below NATIVE_FROM bits, by the native miner bench/ticket_miner.c in one process from it) are pushed at
the first node over one connection, 1,000 a message, by a stranger (``stranger``) or by a member with standing that
introduces them (``member``: its own op #1 first, from its own key). Halfway through the push a newcomer node starts
and, once it is a member, writes one kv key: its latency is from its write's 200 to the key being in every honest
node's state. RSS: each honest node's Python process, before the run and its peak during it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import msgpack
import psutil
from swarmproc import LOCAL_CONFIG, Swarm, http_get, http_post, wait_for

from swarmd.crdt.admission import Admission
from swarmd.crdt.ops import make_op
from swarmd.node.crdt_wire import CRDT_SPEC, PUSH
from swarmd.transport.identity import Identity
from swarmd.transport.p2pd import P2PDaemonConfig, P2PDaemonTransport

MB = 1 << 20
BITS = 12  # configs/local.toml's, the demo's
SWARM = "swarmd"  # the swarm name of configs/local.toml's nodes (the default): the identities' tickets are bound to it
NATIVE_FROM = 17  # bits from which identities are minted by the native miner (bench/ticket_miner.c), one process
MINER = Path(__file__).with_name("ticket_miner.c")


def _mint(args: tuple[str, int, int, int]) -> list[bytes]:
    swarm, n, now, bits = args
    adm, out = Admission(swarm, bits), []
    for _ in range(n):
        k = Identity.generate()
        op = make_op(k.sign, k.peer_id, 1, (now, 0), [], "members", adm.payload(k.peer_id, adm.mint(k.peer_id)))
        out.append(msgpack.packb(op.wire(), use_bin_type=True))
    return out


def native_miner() -> Path:
    """bench/ticket_miner.c compiled (cc -O3 -march=native) into /tmp, once per version of its source."""
    src = MINER.read_bytes()
    exe = Path(f"/tmp/swarmd-bench-ticket-miner-{hashlib.blake2b(src, digest_size=6).hexdigest()}")
    if not exe.exists():
        cc = shutil.which("cc")
        if cc is None:
            raise RuntimeError(f"minting at {NATIVE_FROM}+ bits needs a C compiler (cc) for {MINER.name}")
        tmp = exe.with_suffix(f".{os.getpid()}")
        subprocess.run([cc, "-O3", "-march=native", "-o", str(tmp), str(MINER)], check=True)
        tmp.replace(exe)
    return exe


def native_tickets(swarm: str, authors: list[str], bits: int) -> tuple[dict[str, int], int, float]:
    """The op #1 tickets of ``authors``, found by the native miner (one process, one core), each checked with
    crdt/admission.py; (tickets, hashes, CPU seconds)."""
    out = subprocess.run([str(native_miner()), swarm, "-", str(bits), "0", "0"], check=True, capture_output=True,
                         text=True, input="".join(a + "\n" for a in authors)).stdout.split("\n")
    nonces = {line.split()[0]: int(line.split()[1]) for line in out if line and not line.startswith("total")}
    tries, seconds = next(line for line in out if line.startswith("total")).split()[1:]
    adm = Admission(swarm, bits)
    for author in authors:
        if not adm.ticket_ok(author, nonces.get(author)):
            raise RuntimeError(f"the native miner's ticket for {author} does not check")
    return nonces, int(tries), float(seconds)


def prepared(data_dir: Path, bits: int) -> Identity:
    """A node's data dir with its identity and, from NATIVE_FROM bits, its op #1 ticket minted natively (kept where
    the node looks for it, ``admission.ticket``): what the node would otherwise mint in Python as it starts (1.6 s
    of a core on average at 22 bits, a geometric draw), four of them at once on a shared machine."""
    data_dir.mkdir(parents=True, exist_ok=True)
    key, _ = Identity.load_or_create(data_dir / "identity.key")
    if bits >= NATIVE_FROM:
        ticket = native_tickets(SWARM, [key.peer_id], bits)[0][key.peer_id]
        (data_dir / "admission.ticket").write_text(json.dumps({"swarm": SWARM, "ticket": ticket}))
    return key


def _mint_native(swarm: str, n: int, now: int, bits: int) -> tuple[list[bytes], int, float]:
    """n identities whose tickets the native miner found (one process, one core); (wires, hashes, CPU seconds)."""
    keys = [Identity.generate() for _ in range(n)]
    nonces, tries, seconds = native_tickets(swarm, [k.peer_id for k in keys], bits)
    adm, wires = Admission(swarm, bits), []
    for k in keys:
        ticket = nonces[k.peer_id]
        op = make_op(k.sign, k.peer_id, 1, (now, 0), [], "members", adm.payload(k.peer_id, ticket))
        wires.append(msgpack.packb(op.wire(), use_bin_type=True))
    return wires, tries, seconds


def chunk_size(bits: int) -> int:
    """Identities per cache file: small where each costs seconds, so a stopped minting keeps nearly all it did."""
    return 10_000 if bits < NATIVE_FROM else 500


def cache_file(swarm: str, bits: int, chunk: int) -> Path:
    return Path(f"/tmp/swarmd-bench-identities-{swarm}-{bits}-{chunk}.msgpack")


def cached(swarm: str, bits: int) -> int:
    """How many identities the cache holds for (swarm, bits), in its leading complete files."""
    chunk = 0
    while cache_file(swarm, bits, chunk).exists():
        chunk += 1
    return chunk * chunk_size(bits)


def identities(swarm: str, n: int, bits: int = BITS, log=None) -> tuple[list[dict], float]:
    """n admitted identities' op #1s (wires), and the seconds minting took (0: all read from the cache, which holds
    them in files of chunk_size(bits), so a larger run mints only what the cache lacks). Below NATIVE_FROM bits
    they are minted in Python on every core; from it by the native miner, in one process. ``log``: called with a
    line per file minted."""
    t0, procs, minted, packed = time.monotonic(), max(1, os.cpu_count() or 1), False, []
    size = chunk_size(bits)
    for chunk in range((n + size - 1) // size):
        cache = cache_file(swarm, bits, chunk)
        if cache.exists():
            part = msgpack.unpackb(cache.read_bytes(), raw=False)
        else:
            now, minted = int(time.time() * 1000), True
            if bits >= NATIVE_FROM:
                part, tries, cpu = _mint_native(swarm, size, now, bits)
                if log:
                    log(f"{cache.name}: {size} identities at {bits} bits, {tries / cpu / 1e6:.1f} M tries/s, "
                        f"{cpu / size:.3f} CPU s each")
            else:
                with multiprocessing.Pool(procs) as pool:
                    parts = pool.map(_mint, [(swarm, size // procs + (i < size % procs), now, bits)
                                             for i in range(procs)])
                part = [w for p in parts for w in p]
            tmp = cache.with_suffix(f".{os.getpid()}")  # a minting stopped midway leaves no partial file
            tmp.write_bytes(msgpack.packb(part, use_bin_type=True))
            tmp.replace(cache)
        packed.extend(part)
    return [msgpack.unpackb(w, raw=False) for w in packed[:n]], time.monotonic() - t0 if minted else 0.0


async def push(target, wires: list, key: Identity, halfway: asyncio.Event, stop: asyncio.Event
               ) -> tuple[int, int, int]:
    """Push over one connection, all of ``wires`` and then again from the start until ``stop`` (so the newcomer
    writes while the flood goes on); (ops acked as applied, refused, passes). Sets ``halfway`` at half."""
    t = P2PDaemonTransport(key, P2PDaemonConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    await t.start()
    applied = refused = passes = 0
    try:
        await t.connect(target.tcp_addr)
        async with await t.open_stream(target.peer_id, CRDT_SPEC, timeout=10) as stream:
            while not (passes and stop.is_set()):
                for start in range(0, len(wires), 1000):
                    if start >= len(wires) // 2:
                        halfway.set()
                    if passes and stop.is_set():
                        break
                    await stream.send(PUSH, {"ops": wires[start:start + 1000]})
                    ack = (await asyncio.wait_for(stream.read_required(), 60)).body
                    applied, refused = applied + ack["applied"], refused + ack["rejected"]
                passes += 1
    finally:
        halfway.set()
        await t.close()
    return applied, refused, passes


class RssPeaks:
    def __init__(self, nodes):
        self.procs = [psutil.Process(n.pid) for n in nodes]
        self.before = [p.memory_info().rss for p in self.procs]
        self.peak = list(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, p in enumerate(self.procs):
                try:
                    self.peak[i] = max(self.peak[i], p.memory_info().rss)
                except psutil.Error:
                    pass
            self._stop.wait(0.1)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return [(pk - b) / MB for pk, b in zip(self.peak, self.before)]


def local_config(tmp: Path, bits: int) -> Path:
    """configs/local.toml with ``state.admission_bits`` = bits."""
    text = LOCAL_CONFIG.read_text()
    assert "\nadmission_bits = " in text, "configs/local.toml no longer sets admission_bits"
    path = tmp / f"local-{bits}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(re.sub(r"\nadmission_bits = \d+", f"\nadmission_bits = {bits}", text))
    return path


async def one_run(tmp: Path, mode: str, wires: list, nodes: int, bits: int = BITS) -> dict:
    swarm = Swarm(tmp / mode, config=local_config(tmp, bits))
    for name in [f"n{i}" for i in range(nodes)] + ["newcomer"]:
        await asyncio.to_thread(prepared, tmp / mode / name, bits)
    try:
        honest = await asyncio.to_thread(swarm.start_chain, nodes)
        a = honest[0]
        assert a.status()["swarm"] == SWARM, "the identities' tickets are bound to another swarm than the nodes'"
        await asyncio.sleep(3)  # start-up allocations settle
        rss = RssPeaks(honest)
        halfway, stop, t0 = asyncio.Event(), asyncio.Event(), time.monotonic()
        flood = None
        if mode == "stranger":
            flood = asyncio.create_task(push(a, wires, Identity.generate(), halfway, stop))
        elif mode == "member":
            boss = Identity.generate()
            adm = Admission(a.status()["swarm"], bits)
            ticket = (await asyncio.to_thread(native_tickets, SWARM, [boss.peer_id], bits))[0][boss.peer_id] \
                if bits >= NATIVE_FROM else await asyncio.to_thread(adm.mint, boss.peer_id)
            own = make_op(boss.sign, boss.peer_id, 1, (int(time.time() * 1000), 0), [], "members",
                          adm.payload(boss.peer_id, ticket)).wire()
            flood = asyncio.create_task(push(a, [own] + wires, boss, halfway, stop))
        else:
            halfway.set()
        await halfway.wait()
        newcomer = await asyncio.to_thread(swarm.start, "newcomer", bootstrap=[a.tcp_addr], wait=False)
        await asyncio.to_thread(newcomer.wait_ready, 120)  # its record ticket is minted as it starts, amid the flood
        await asyncio.to_thread(wait_for, lambda: all(newcomer.peer_id in n.member_ids() for n in honest), 120,
                                "the newcomer to be a member")
        key = f"{newcomer.peer_id}/hello"
        await asyncio.to_thread(http_post, newcomer.url + "/crdt",
                                json_body={"ops": [{"object": "kv", "payload": {"k": key, "v": 1}}]})
        w0 = time.monotonic()
        latency = None
        try:
            await asyncio.to_thread(
                wait_for, lambda: all(http_get(n.url + "/state")["objects"]["kv"].get(key) == 1 for n in honest),
                60, "the newcomer's write on every honest node", 0.02)
            latency = time.monotonic() - w0
        except Exception:  # noqa: BLE001 - LOST in the table
            pass
        during = flood is not None and not flood.done()  # the write was measured while the flood went on
        stop.set()
        pushed = await flood if flood is not None else (0, 0, 0)
        seconds = time.monotonic() - t0
        growth = rss.stop()
        crdt = [n.status()["crdt"] for n in honest]
        return {"mode": mode, "identities": len(wires) if flood else 0, "latency": latency, "growth": growth,
                "seconds": seconds, "acked": pushed, "during": during, "authors": [c["authors"] for c in crdt],
                "probation": [c["probation"] for c in crdt], "evicted": crdt[0].get("probation_evicted", 0),
                "refused": sum(crdt[0]["rejected"].values())}
    finally:
        await asyncio.to_thread(swarm.close)


async def part_lockout(tmp: Path, n: int, nodes: int = 4, bits: int = BITS) -> tuple[list[dict], float, int]:
    wires, minted = await asyncio.to_thread(identities, SWARM, n, bits)
    rows = []
    for mode in ("unattacked", "stranger", "member"):
        rows.append(await one_run(tmp, mode, wires, nodes, bits))
        print(f"  lock-out {mode}: done in {rows[-1]['seconds']:.0f} s", flush=True)
    return rows, minted, bits


def print_lockout(rows: list[dict], minted: float, bits: int = BITS) -> None:
    print(f"\nLock-out (issue 80): admitted identities (tickets of {bits} bits) pushed at node 0 of a "
          f"{len(rows[0]['growth'])}-node swarm; a newcomer joins halfway and writes once"
          + (f" (minting took {minted:.0f} s)" if minted else " (identities from the cache)"))
    print(f"{'run':10} | {'identities':>10} | {'acked/refused':>15} | {'newcomer write':>14} | "
          f"{'RSS growth MB per honest node':>30} | {'authors merged':>16} | {'on probation':>22} | {'evicted':>7}")
    for r in rows:
        lat = ("LOST" if r["latency"] is None else f"{r['latency'] * 1e3:.0f} ms") + ("*" if r["during"] else "")
        growth = "/".join(f"{g:.0f}" for g in r["growth"])
        acked = f"{r['acked'][0]}/{r['acked'][1]} x{r['acked'][2]}"
        print(f"{r['mode']:10} | {r['identities']:>10} | {acked:>15} | {lat:>14} | {growth:>30} | "
              f"{'/'.join(map(str, r['authors'])):>16} | {'/'.join(map(str, r['probation'])):>22} | "
              f"{r['evicted']:>7}")
    print("acked: ops the attacked node acked as applied / refused, x the passes over the identities (the flood "
          "starts again from the first until the newcomer's write is measured); newcomer write: from its POST "
          "/crdt's 200 to the key in every honest node's /state (*: while the flood went on); growth: each honest "
          "node's peak RSS during the run over its RSS before; stranger: pushed by a key with no standing (held on "
          "probation, the least recent evicted); member: by a key with standing, which introduces at most "
          "INTRO_BURST authors at once and INTRO_PER_S a second. Goals: the write within 10 s, growth <= 64 MB")
